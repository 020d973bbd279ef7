import os

from hypothesis import HealthCheck, settings

# "quick" runs in CI; "long" is for fuzzing by hand: HYPOTHESIS_PROFILE=long pytest tests/...
settings.register_profile("quick", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=20000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "quick"))

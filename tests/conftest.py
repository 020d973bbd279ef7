import os

from hypothesis import HealthCheck, settings

# "quick" runs in CI; "long" is for fuzzing by hand: HYPOTHESIS_PROFILE=long pytest tests/...
settings.register_profile("quick", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=20000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
# "fuzz" is what `make fuzz` runs over the decoder fuzz tests (many more examples; minutes, by hand).
settings.register_profile("fuzz", max_examples=5000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "quick"))

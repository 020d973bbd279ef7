import os

import pytest
from hypothesis import HealthCheck, settings

# "quick" runs in CI; "long" is for fuzzing by hand: HYPOTHESIS_PROFILE=long pytest tests/...
settings.register_profile("quick", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=20000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
# "fuzz" is what `make fuzz` runs over the decoder fuzz tests (many more examples; minutes, by hand).
settings.register_profile("fuzz", max_examples=5000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "quick"))


@pytest.fixture
def first_proposer():
    """`first_proposer(scenario, seed)`: the name of the validator that proposes round 0 of window 1 of a
    simulator scenario under `seed`. It is a hash of the genesis head, which the seed fixes (identities,
    manifest) whatever the validators then do, so a test can make that validator its adversary and see
    the attack on every seed instead of hoping a seed gives the adversary a turn."""
    from peerloom.core.validator import proposer_of
    from peerloom.sim.scenario import run_scenario

    def find(scenario: dict, seed: int) -> str:
        probe = dict(scenario, adversaries=[], stop_window=1, liveness={})
        result = run_scenario(probe, seed=seed, trace=False)
        genesis = result.checkers.final[1].parent
        names = {node.identity.peer_id: name for name, node in result.sim.nodes.items()}
        return names[proposer_of(genesis, 1, 0, result.sim.revision.manifest.validators)]

    return find

"""A Hypothesis property test of your own deployment's settings, built on `peerloom.testing`.

Question: with the aggregation rule and window length we plan to deploy, does safety hold - one final
head per window, consistent prefixes, valid leases, no double vote - under any schedule of partitions,
crashes and clogged links, with fewer than a third of the validators Byzantine? Hypothesis draws the
faults and the adversaries, runs the real engines in the deterministic simulator, and shrinks a failure to
a small reproducible schedule.

Run it: `python examples/property_test.py` (or collect it with pytest).
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from peerloom.testing import run_scenario, small_scenarios

OUR_SETTINGS = {"aggregation": "trimmed_mean", "window_s": 4.0, "min_updates": 2}


@settings(max_examples=5, deadline=None)
@given(drawn=small_scenarios(heal_at=12.0), seed=st.integers(0, 2**16))
def test_our_settings_stay_safe(drawn, seed):
    scenario = {**drawn, "manifest": {**drawn["manifest"], **OUR_SETTINGS}}
    result = run_scenario(scenario, seed=seed)
    for name in result.checkers.SAFETY:
        assert result.summary["invariants"][name]["ok"], (name, seed, result.summary["invariants"][name])


if __name__ == "__main__":
    test_our_settings_stay_safe()
    print("safety held for every drawn schedule")

"""The public `peerloom.testing` module (spec/simulator.md §8): shipped scenarios by name, overrides, and the
Hypothesis strategies a user builds property tests from."""

import pytest
from hypothesis import given, settings

from peerloom import testing


def test_scenario_by_name_with_overrides_runs():
    assert "happy" in testing.shipped() and "sybil-flood" in testing.shipped()
    scenario = testing.scenario("happy", stop_window=2)
    assert scenario["stop_window"] == 2 and scenario["name"] == "happy"
    result = testing.run_scenario(scenario, seed=3)
    assert result.ok and result.summary["windows"]["certified"] >= 2
    with pytest.raises(FileNotFoundError, match="no shipped scenario 'nope'"):
        testing.scenario("nope")


@settings(max_examples=10, deadline=None)
@given(drawn=testing.small_scenarios(heal_at=10.0))
def test_small_scenarios_are_valid_scenarios(drawn):
    assert drawn["faults"][-1] == {"at": 10.0, "kind": "heal"}
    assert drawn["roles"] == {"validators": 4, "reducers": 1, "trainers": 6}
    assert len(drawn["adversaries"]) <= 1 + 1 + 1  # at most 1 of 4 validators, 30% of 6 trainers, the reducer

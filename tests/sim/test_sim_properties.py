"""Hypothesis strategies for fault schedules and adversary mixes (spec/design.md §7, spec/simulator.md §8), and
the property they serve: safety holds for every drawn schedule with fewer than n/3 Byzantine validators.

The strategies draw plain scenario fragments (the dicts a TOML file would hold), built from small
integers and sampled names, so a failing schedule shrinks to few faults, early times and few
adversaries. They live in `peerloom.testing` (public, so a user can test their own settings), not in
the sim layer, which may not import hypothesis (tests/test_layers.py).
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from peerloom.testing import adversary_mixes, fault_schedules, run_scenario, small_scenarios


@settings(max_examples=6, deadline=None)
@given(scenario=small_scenarios(), seed=st.integers(0, 2**16))
def test_safety_holds_under_any_drawn_faults_and_adversaries(scenario, seed):
    result = run_scenario(scenario, seed=seed)
    for name in result.checkers.SAFETY:
        assert result.summary["invariants"][name]["ok"], (seed, scenario, result.summary["invariants"])


@settings(max_examples=30, deadline=None)
@given(faults=fault_schedules(validators=4, trainers=6, heal_at=15.0),
       mix=adversary_mixes(validators=7, trainers=10))
def test_strategies_respect_their_bounds(faults, mix):
    assert faults[-1] == {"at": 15.0, "kind": "heal"}
    assert all(1.0 <= f["at"] < 15.0 for f in faults[:-1])
    assert [f["at"] for f in faults] == sorted(f["at"] for f in faults)
    for f in faults:
        if f["kind"] == "crash" and f["nodes"][0].startswith("v"):
            assert f["keep_disk"]  # a validator without its disk would be a Byzantine fault
    bad_validators = [a for a in mix if a["behaviour"] in ("equivocation", "vote-withholding", "late-votes")]
    assert len(bad_validators) <= 2  # f < 7/3


def test_a_replaying_trainer_whose_disk_was_wiped_still_serves_what_it_replays():
    """Found by the property above: the replay adversary (sim/adversary.py) re-announced its first delta after a
    crash had wiped its disk, and its own host was asked to serve a chunk it no longer held. It keeps its own copy
    of what it replays; the run completes with every invariant holding."""
    scenario = {
        "name": "replay-after-wipe", "duration_s": 40.0, "workload": {"name": "synthetic", "dim": 8},
        "roles": {"validators": 4, "reducers": 1, "trainers": 6},
        "manifest": {"window_s": 3.0, "min_updates": 2, "shards": 6, "aggregation": "median"},
        "compute": {"train": 0.4, "jitter": 0.2},
        "network": {"default": {"latency": {"dist": "lognormal", "median_s": 0.01, "sigma": 0.5}, "loss": 0.01}},
        "faults": [{"at": 10.0, "kind": "crash", "nodes": ["t5"], "keep_disk": False, "restart_after_s": 1.0},
                   {"at": 17.0, "kind": "crash", "nodes": ["v0"], "keep_disk": True, "restart_after_s": 1.0},
                   {"at": 20.0, "kind": "heal"}],
        "adversaries": [{"behaviour": "replay", "count": 1}], "trace": {"level": "heads"},
    }
    report = run_scenario(scenario, seed=0)
    assert all(v["ok"] for v in report.summary["invariants"].values()), report.summary["invariants"]

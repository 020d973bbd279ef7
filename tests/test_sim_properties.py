"""Hypothesis strategies for fault schedules and adversary mixes (DESIGN §7, spec/simulator.md §8), and
the property they serve: safety holds for every drawn schedule with fewer than n/3 Byzantine validators.

The strategies draw plain scenario fragments (the dicts a TOML file would hold), built from small
integers and sampled names, so a failing schedule shrinks to few faults, early times and few
adversaries. They live here because the sim layer may not import hypothesis (tests/test_layers.py).
"""

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from peerloom.sim.adversary import REDUCER_BEHAVIOURS, VALIDATOR_BEHAVIOURS
from peerloom.sim.scenario import run_scenario

TRAINER_ATTACKS = ("sign-flip", "sign-flip-scale", "scaling", "gaussian-noise", "alie", "ipm", "free-rider",
                   "replay", "lease-squatting")


def _names(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


@st.composite
def fault_schedules(draw: Any, *, validators: int, trainers: int, reducers: int = 1,
                    heal_at: float = 20.0, max_faults: int = 4) -> list[dict[str, Any]]:
    """Faults at whole seconds in [1, heal_at), then one heal at `heal_at`: partitions (symmetric among
    validators, asymmetric anywhere), crashes with restarts (trainers with or without disk, validators
    always with theirs), clogging and swizzle-clogging."""
    vals, trs, reds = _names("v", validators), _names("t", trainers), _names("r", reducers)
    everyone = vals + trs + reds
    times = st.integers(1, max(1, int(heal_at) - 1)).map(float)
    partition = st.builds(
        lambda t, cut: {"at": t, "kind": "partition", "groups": [vals[:cut], vals[cut:]]},
        times, st.integers(1, max(1, validators - 1)))
    block = st.builds(lambda t, a, b: {"at": t, "kind": "block", "from": a, "to": b}, times,
                      st.lists(st.sampled_from(everyone), min_size=1, max_size=2, unique=True),
                      st.lists(st.sampled_from(everyone), min_size=1, max_size=2, unique=True))
    crash_trainer = st.builds(
        lambda t, n, keep, back: {"at": t, "kind": "crash", "nodes": [n], "keep_disk": keep, "restart_after_s": back},
        times, st.sampled_from(trs), st.booleans(), st.integers(1, 8).map(float))
    crash_validator = st.builds(
        lambda t, n, back: {"at": t, "kind": "crash", "nodes": [n], "keep_disk": True, "restart_after_s": back},
        times, st.sampled_from(vals), st.integers(1, 8).map(float))
    clog = st.builds(lambda t, n, d: {"at": t, "kind": "clog", "nodes": [n], "duration_s": d},
                     times, st.sampled_from(everyone), st.integers(1, 6).map(float))
    swizzle = st.builds(lambda t, d: {"at": t, "kind": "swizzle", "nodes": vals + reds, "duration_s": d},
                        times, st.integers(1, 6).map(float))
    faults = draw(st.lists(st.one_of(partition, block, crash_trainer, crash_validator, clog, swizzle),
                           max_size=max_faults))
    return [*sorted(faults, key=lambda f: f["at"]), {"at": heal_at, "kind": "heal"}]


@st.composite
def adversary_mixes(draw: Any, *, validators: int, trainers: int) -> list[dict[str, Any]]:
    """Named Byzantine behaviours: fewer than n/3 validators, at most 30% of trainers, maybe the reducer."""
    mix: list[dict[str, Any]] = []
    max_bad_validators = (validators - 1) // 3
    for behaviour in draw(st.lists(st.sampled_from(VALIDATOR_BEHAVIOURS), max_size=max_bad_validators)):
        mix.append({"behaviour": behaviour, "count": 1})
    for behaviour in draw(st.lists(st.sampled_from(TRAINER_ATTACKS), max_size=max(0, (3 * trainers) // 10))):
        mix.append({"behaviour": behaviour, "count": 1})
    if draw(st.booleans()):
        mix.append({"behaviour": draw(st.sampled_from(REDUCER_BEHAVIOURS)), "count": 1})
    return mix


@st.composite
def small_scenarios(draw: Any, *, heal_at: float = 20.0) -> dict[str, Any]:
    """A whole small scenario (4 validators, 1 reducer, 6 trainers, synthetic objective) with drawn faults
    and adversaries; the safety phase ends at `heal_at`."""
    validators, trainers = 4, 6
    return {
        "name": "hypothesis",
        "duration_s": heal_at + 20.0,
        "workload": {"name": "synthetic", "dim": 8},
        "roles": {"validators": validators, "reducers": 1, "trainers": trainers},
        "manifest": {"window_s": 3.0, "min_updates": 2, "shards": trainers, "aggregation": "median"},
        "compute": {"train": 0.4, "jitter": 0.2},
        "network": {"default": {"latency": {"dist": "lognormal", "median_s": 0.01, "sigma": 0.5},
                                "loss": draw(st.sampled_from([0.0, 0.0, 0.01]))}},
        "faults": draw(fault_schedules(validators=validators, trainers=trainers, heal_at=heal_at)),
        "adversaries": draw(adversary_mixes(validators=validators, trainers=trainers)),
        "trace": {"level": "heads"},
    }



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

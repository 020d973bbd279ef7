"""Public building blocks for testing a deployment's settings (issue 17 item 5): simulator scenarios,
adversaries, invariants, a deterministic cluster and Hypothesis strategies over fault schedules and
adversary mixes (spec/simulator.md §8).

    from hypothesis import given
    from peerloom.testing import run_scenario, scenario, small_scenarios

    @given(small_scenarios())
    def test_my_settings_stay_safe(drawn):
        result = run_scenario({**drawn, "manifest": {**drawn["manifest"], "aggregation": "krum"}}, seed=1)
        assert all(result.summary["invariants"][n]["ok"] for n in result.checkers.SAFETY)

The strategies draw plain scenario fragments (the dicts a scenario TOML file holds) from small integers and
sampled names, so a failing schedule shrinks to few faults, early times and few adversaries. They need
Hypothesis (`pip install hypothesis`); the rest of this module does not.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from peerloom.sim.adversary import BEHAVIOURS, REDUCER_BEHAVIOURS, VALIDATOR_BEHAVIOURS, make_behaviour
from peerloom.sim.cluster import Cluster
from peerloom.sim.invariants import Checkers
from peerloom.sim.kernel import Simulation
from peerloom.sim.scenario import Result, ScenarioError, load_scenario, run_scenario
from peerloom.simulate import shipped  # the names of the scenarios that ship with peerloom

try:
    from hypothesis import strategies as st
except ModuleNotFoundError:  # the strategies below need it; everything else works without
    st = None  # type: ignore[assignment]

__all__ = ["BEHAVIOURS", "Checkers", "Cluster", "Result", "ScenarioError", "Simulation", "adversary_mixes",
           "fault_schedules", "load_scenario", "make_behaviour", "run_scenario", "scenario", "shipped",
           "small_scenarios"]


def scenario(name: str, **overrides: Any) -> dict[str, Any]:
    """A shipped scenario as a dict, with top-level keys replaced by `overrides` (e.g. ``stop_window=3``).
    FileNotFoundError for an unknown name."""
    path = resources.files("peerloom.sim") / "scenarios" / f"{name}.toml"
    if not path.is_file():
        raise FileNotFoundError(2, f"no shipped scenario {name!r} ({', '.join(shipped())})", name)
    return {**load_scenario(path), **overrides}


def _strategy(fn: Any) -> Any:
    if st is None:
        def missing(*args: Any, **kwargs: Any) -> Any:
            raise ModuleNotFoundError("peerloom.testing strategies need hypothesis: pip install hypothesis",
                                      name="hypothesis")
        missing.__doc__ = fn.__doc__
        return missing
    return st.composite(fn)


TRAINER_ATTACKS = ("sign-flip", "sign-flip-scale", "scaling", "gaussian-noise", "alie", "ipm", "free-rider",
                   "replay", "lease-squatting")


def _names(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


@_strategy
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


@_strategy
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


@_strategy
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

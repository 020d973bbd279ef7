"""The cheating trainers (lazy, replayer, lazy-1-in-5, free-rider-noise) as simulator behaviours: they build
from a scenario, act in every window, and the run goes on."""

from __future__ import annotations

import io
import json

import pytest

from peerloom.backends.attacks import TRAINING_ATTACKS
from peerloom.backends.behaviours import ByzantineWorkload
from peerloom.sim.adversary import TRAINER_BEHAVIOURS, ModelAttack, TrainingAttack, make_behaviour, role_of_behaviour
from peerloom.sim.scenario import run_scenario

NEW = ("lazy", "replayer", "lazy-1-in-5", "free-rider-noise")


def tiny(behaviour: str, **params) -> dict:
    adversary = {"behaviour": behaviour, "count": 1, **({"params": params} if params else {})}
    return {
        "name": f"cheat-{behaviour}", "duration_s": 60.0, "stop_window": 6,
        "workload": {"name": "synthetic", "dim": 8},
        "roles": {"validators": 1, "reducers": 0, "trainers": 4},
        "manifest": {"window_s": 4.0, "min_updates": 1, "shards": 4, "inner_steps": 8},
        "adversaries": [adversary],
    }


def adversary_lines(out: io.StringIO) -> list[dict]:
    return [line for line in map(json.loads, out.getvalue().splitlines()) if line["kind"] == "adversary"]


def test_new_names_are_trainer_behaviours():
    for name in NEW:
        assert name in TRAINER_BEHAVIOURS and role_of_behaviour(name) == "trainer"
        behaviour = make_behaviour(name)
        assert behaviour.byzantine and behaviour.name == name
        assert isinstance(behaviour, TrainingAttack if name in TRAINING_ATTACKS else ModelAttack)
    with pytest.raises(TypeError):
        make_behaviour("replayer", divisor=2)


@pytest.mark.parametrize("name", ["lazy", "replayer", "lazy-1-in-5"])
def test_training_attacks_run_in_a_scenario(name):
    out = io.StringIO()
    params = {"age": 1} if name == "replayer" else {}
    result = run_scenario(tiny(name, **params), seed=2, trace_out=out)
    assert result.summary["windows"]["certified"] >= 3
    attacker = result.sim.nodes["t3"]
    assert isinstance(attacker.executor.workload, ByzantineWorkload) and not attacker.honest
    lines = adversary_lines(out)
    assert lines and all(line["node"] == "t3" and line["behaviour"] == name for line in lines)
    assert [line["call"] for line in lines] == list(range(len(lines)))
    actions = [line["action"] for line in lines]
    if name == "lazy":
        assert set(actions) == {"lazy"}
    elif name == "replayer":
        assert actions[0] == "honest" and set(actions[1:]) == {"replay"} and len(actions) >= 2
    else:
        assert actions == ["lazy" if k % 5 == 0 else "honest" for k in range(len(actions))]
        assert len(actions) >= 6  # a lazy call, four honest ones, a lazy one again
    assert result.ok, result.summary["invariants"]
    # every announcement of the attacker names a delta no other announcement named (replays are perturbed)
    digests = [ann.delta_digest for signer, ann in result.sim.updates.values() if signer == attacker.peer_id]
    assert len(digests) == len(lines) and len(set(digests)) == len(digests)


def test_free_rider_noise_runs_in_a_scenario():
    result = run_scenario(tiny("free-rider-noise"), seed=2)
    assert result.summary["windows"]["certified"] >= 3
    assert result.ok, result.summary["invariants"]
    assert result.sim.keep_honest_deltas  # it reads the window's honest deltas as references

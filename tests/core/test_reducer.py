"""Reducers are accelerators, never an authority (spec/protocol.md §7): a silent reducer costs at most one
timeout, and validators certify their own reduction whatever a reducer proposes."""

import pytest

from peerloom.backends.registry import build_workload
from tests.engine_cluster import N_SHARDS, SEED, build, head_window


@pytest.fixture(scope="module")
def workload():
    return build_workload("digits-mlp", SEED, N_SHARDS)


def head_times(cluster, name="validator"):
    return [t for t, _, _ in cluster.nodes[name].heads]


def test_silent_reducer_costs_at_most_one_timeout(tmp_path, workload):
    normal = build(tmp_path / "a", workload, trainers=2, validators=4, quorum=3)
    assert normal.run_until(lambda c: head_window(c) >= 3, max_time=120.0)
    silent = build(tmp_path / "b", workload, trainers=2, validators=4, quorum=3)
    silent.crash("reducer")  # never proposes, never serves anything
    assert silent.run_until(lambda c: head_window(c) >= 3, max_time=120.0)
    timeout = 2.0  # EngineConfig.agreement_timeout_s
    a, b = head_times(normal)[:3], head_times(silent)[:3]
    assert all(tb <= ta + timeout for ta, tb in zip(a, b, strict=True)), (a, b)
    assert normal.nodes["validator"].engine.stats["proposals_confirmed"] >= 1
    assert silent.nodes["validator"].engine.stats["proposals_confirmed"] == 0
    heads = [h for _, h, _ in silent.nodes["validator"].heads][:3]
    assert all(not h.skipped for h in heads)

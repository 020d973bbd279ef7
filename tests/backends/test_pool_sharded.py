"""Sharded trainer pools (spec/pools.md §6-7): FSDP2 and pipeline pools of 2 and 4 gloo ranks compute the
single process's pseudo-gradient, stream it to a sink tensor by tensor from head params read from a file,
and fail a task without a partial update when a rank dies, before or during the closing gather. One pool
per test (one pool per process at a time)."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch
from torch import nn

from peerloom.adapters.pool import PoolError, TrainerPool, check_pool_table
from peerloom.backends.numpy.stored import open_stored
from peerloom.backends.numpy.tensors import to_safetensors
from peerloom.backends.torch.pool_sharded import shard_rows, stage_bounds
from peerloom.core.tasks import TrainTask
from tests import pool_workloads
from tests.backends.test_pool import ATOL, assert_close

LEASE = list(range(40))  # 5 global batches of 8: 7 inner steps cross a reshuffle; 8 splits 2 and 4 ways


def sharded_pool(parallel: str, ranks: int, **options) -> TrainerPool:
    pool = TrainerPool(pool_workloads.make_deep(), ranks=ranks, timeout_s=20.0, parallel=parallel,
                       argv=pool_workloads.worker_argv("deep"), **options)
    pool.start()
    return pool


def single(params, lease=LEASE, seed=11):
    return pool_workloads.make_deep().train(params, lease, seed)


# --- the layout ------------------------------------------------------------------------------------------------

def test_shard_rows_cover_dim_0_as_fsdp2_does():
    assert [shard_rows(3, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 3)]
    assert [shard_rows(16, 2, r) for r in range(2)] == [(0, 8), (8, 16)]
    assert [shard_rows(5, 2, r) for r in range(2)] == [(0, 3), (3, 5)]


def test_stage_bounds_split_a_sequential_at_named_or_balanced_children():
    model = pool_workloads.deep_mlp()
    assert stage_bounds(model, 2, ["4"]) == [(0, 4), (4, 7)]
    balanced = stage_bounds(model, 4)
    assert len(balanced) == 4 and balanced[0][0] == 0 and balanced[-1][1] == 7
    assert all(a < b for a, b in balanced) and all(balanced[i][1] == balanced[i + 1][0] for i in range(3))
    with pytest.raises(ValueError, match="split_points"):
        stage_bounds(model, 2, ["9"])
    with pytest.raises(ValueError, match="increasing"):
        stage_bounds(model, 3, ["4", "2"])
    with pytest.raises(ValueError, match=r"nn\.Sequential"):
        stage_bounds(nn.Linear(2, 2), 2)


@pytest.mark.parametrize(("table", "message"), [
    ({"parallel": "tp"}, "parallel"), ({"parallel": "fsdp", "schedule": "gpipe"}, "only apply"),
    ({"parallel": "pipeline", "schedule": "zb"}, "schedule"), ({"parallel": "pipeline", "microbatches": 0},
                                                                "microbatches"),
    ({"parallel": "pipeline", "split_points": "2"}, "split_points"),
])
def test_bad_sharding_options_are_refused(table, message):
    with pytest.raises(ValueError, match=message):
        check_pool_table(table)
    check_pool_table({"parallel": "pipeline", "split_points": ["2"], "schedule": "1f1b", "microbatches": 4})


# --- equivalence --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("parallel", "ranks"), [("fsdp", 2), ("fsdp", 4), ("pipeline", 2), ("pipeline", 4)])
def test_a_sharded_pool_computes_the_single_process_pseudo_gradient(parallel, ranks):
    """spec/pools.md §3's tolerance (1e-5 relative): FSDP2 reduce-scatters the mean of the ranks' gradients;
    a pipeline runs each global batch in N micro-batches and scales their gradients by 1/N. Clipping sees
    the whole model's gradient norm either way."""
    params = pool_workloads.make_deep().initial_params(1)
    expected, expected_metrics = single(params)
    pool = sharded_pool(parallel, ranks)
    try:
        delta, metrics = pool.train(params, LEASE, 11)
        other, _ = pool.train(params, LEASE, 12)
    finally:
        pool.close()
    assert_close(delta, expected)
    assert metrics["samples"] == len(LEASE)
    assert metrics["train_loss"] == pytest.approx(expected_metrics["train_loss"], rel=1e-5)
    # Not a tautology: another seed draws other batches, and the second task starts from the head again.
    assert max(float(np.abs(other[n] - expected[n]).max()) for n in expected) > 100 * ATOL
    assert_close(pool_workloads.make_deep().train(params, LEASE, 12)[0], other)


def test_a_pipeline_with_named_stages_and_1f1b_streams_its_delta_from_stored_head(tmp_path):
    """Split points named, the 1F1B schedule in 4 micro-batches, the head read tensor by tensor from a stored
    safetensors file and the pseudo-gradient handed to a sink tensor by tensor, in name order."""
    params = pool_workloads.make_deep().initial_params(2)
    expected, _ = single(params, seed=5)
    (tmp_path / "head.safetensors").write_bytes(to_safetensors(params))
    got: dict[str, np.ndarray] = {}
    pool = sharded_pool("pipeline", 2, split_points=["4"], schedule="1f1b", microbatches=4)
    try:
        with open_stored(tmp_path / "head.safetensors") as stored:
            delta, metrics = pool.train(stored, LEASE, 5, sink=got.__setitem__)
    finally:
        pool.close()
    assert delta is None and metrics["samples"] == len(LEASE)
    assert list(got) == sorted(expected)
    assert_close(got, expected)


# --- failure ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("parallel", ["fsdp", "pipeline"])
def test_a_dead_rank_fails_a_sharded_task_and_the_pool_reforms(parallel):
    params = pool_workloads.make_deep().initial_params(3)
    expected, _ = single(params, LEASE[:16], seed=3)
    pool = sharded_pool(parallel, 2)
    try:
        (pid,) = pool.rank_pids()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(PoolError, match="no update"):
            pool.train(params, LEASE[:16], 3)
        assert pool.failures == 1 and pool.rank_pids() != [pid]
        delta, _ = pool.train(params, LEASE[:16], 3)  # re-formed: a fresh rank 1, the sharded model rebuilt
    finally:
        pool.close()
    assert_close(delta, expected)


@pytest.mark.parametrize("parallel", ["fsdp", "pipeline"])
def test_a_rank_dying_in_the_closing_gather_leaves_no_update(parallel, tmp_path, monkeypatch):
    """Rank 1 exits after rank 0 received part of the pseudo-gradient: the task raises, so the partial delta
    the sink got is never returned (the node aborts the artifact it was writing); the next task is whole."""
    monkeypatch.setenv("PEERLOOM_TEST_POOL_DIE_IN_GATHER", str(tmp_path / "died"))
    params = pool_workloads.make_deep().initial_params(4)
    expected, _ = single(params, LEASE[:16], seed=4)
    got: dict[str, np.ndarray] = {}
    pool = sharded_pool(parallel, 2, **({"split_points": ["2"]} if parallel == "pipeline" else {}))
    try:
        with pytest.raises(PoolError, match="no update"):
            pool.train(params, LEASE[:16], 4, sink=got.__setitem__)
        assert (tmp_path / "died").exists()
        assert 0 < len(got) < len(expected)  # part of it had arrived: exactly what must not be published
        again: dict[str, np.ndarray] = {}
        assert pool.train(params, LEASE[:16], 4, sink=again.__setitem__)[0] is None
    finally:
        pool.close()
    assert_close(again, expected)


def test_a_sharded_pool_refuses_a_workload_it_cannot_build_sharded():
    with pytest.raises(ValueError, match="TorchWorkload"):
        TrainerPool(pool_workloads.AllReduceRegression(), ranks=2, parallel="fsdp", argv=["true"])
    assert torch.distributed.is_available()


def test_node_config_takes_the_parallel_mode(tmp_path):
    from peerloom.node import ConfigError, load_config
    from tests.helpers import node_config

    table = load_config(node_config(tmp_path, '[pool]\nranks = 4\nparallel = "pipeline"\nschedule = "1f1b"\n'))["pool"]
    assert (table["parallel"], table["schedule"]) == ("pipeline", "1f1b")
    with pytest.raises(ConfigError, match=r"pool\.parallel"):
        load_config(node_config(tmp_path, '[pool]\nranks = 2\nparallel = "zero3"\n'))


def test_a_node_streams_a_sharded_pools_update_into_its_store_and_stores_nothing_when_a_rank_dies(
        tmp_path, monkeypatch):
    """The node's train task on an fsdp pool (spec/pools.md §6): the head is read from the store tensor by
    tensor and the pseudo-gradient written into a new artifact as rank 0 gathers it. The artifact is the
    single process's delta; when rank 1 dies in the middle of the gather, the task raises and the store
    gains no artifact at all."""
    from peerloom.adapters.compute import ComputeExecutor
    from peerloom.adapters.pool import PoolWorkload
    from peerloom.adapters.storage import ArtifactStore
    from peerloom.backends.numpy.tensors import safetensors_views
    from tests.helpers import make_revision

    monkeypatch.setenv("PEERLOOM_TEST_POOL_DIE_IN_GATHER", str(tmp_path / "died"))
    workload = pool_workloads.make_deep()
    params = workload.initial_params(6)
    shards = [LEASE[:24], LEASE[24:]]
    manifest = make_revision(schema=workload.schema(), shards=(24, 16)).manifest
    store = ArtifactStore(tmp_path / "store", chunk_size=1 << 16)
    pool = TrainerPool(workload, ranks=2, timeout_s=20.0, parallel="fsdp", argv=pool_workloads.worker_argv("deep"))
    ex = ComputeExecutor(store, manifest, PoolWorkload(workload, pool), shards)
    head = store.put(to_safetensors(params))
    task = TrainTask(params=head, shards=(0,), seed=8, inner_steps=5)
    expected, _ = pool_workloads.make_deep().train(params, LEASE[:24], 8, inner_steps=5)
    stored_before = sorted((tmp_path / "store").rglob("*"))
    pool.start()
    try:
        assert ex._streams_train()
        with pytest.raises(PoolError, match="no update"):
            ex.run(task)  # rank 1 dies in the gather: nothing stored
        assert (tmp_path / "died").exists() and sorted((tmp_path / "store").rglob("*")) == stored_before
        out = ex.run(task)
    finally:
        pool.close()
    delta = safetensors_views(store.get(out.delta.digest))
    assert_close(dict(delta), expected)
    assert out.delta_digest == ex.digest(dict(delta))


@pytest.mark.slow
@pytest.mark.serial  # the healthy ranks must meet the group's 5 s timeout
@pytest.mark.parametrize("parallel", ["fsdp", "pipeline"])
def test_a_hung_rank_times_a_sharded_task_out(parallel, monkeypatch):
    """A rank alive but silent (SIGSTOP) is caught by the group's timeout, in FSDP2's collectives and in the
    pipeline's point-to-point exchanges alike; the pool re-forms and trains the next task."""
    # 5 s, not less: on a loaded 2-core machine an honest collective of the re-formed pool took over 3 s
    monkeypatch.setenv("PEERLOOM_TEST_POOL_TIMEOUT", "5")
    params = pool_workloads.make_deep().initial_params(0)
    pool = TrainerPool(pool_workloads.make_deep(), ranks=2, timeout_s=5.0, parallel=parallel,
                       argv=pool_workloads.worker_argv("deep"))
    try:
        pool.start()
        (pid,) = pool.rank_pids()
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(PoolError, match="no update"):
            pool.train(params, LEASE[:16], 1)
        assert pool.train(params, LEASE[:16], 1)[1]["samples"] == 16
    finally:
        pool.close()


def test_a_pipeline_takes_the_workloads_own_split_points_unless_the_config_names_some():
    workload = pool_workloads.make_deep()
    workload.split_points = ["4"]
    named = TrainerPool(workload, ranks=2, parallel="pipeline", argv=["true"])
    assert named.options["split_points"] == ["4"]
    assert TrainerPool(workload, ranks=2, parallel="pipeline", split_points=["2"],
                       argv=["true"]).options["split_points"] == ["2"]
    assert TrainerPool(pool_workloads.make_deep(), ranks=2, parallel="pipeline",
                       argv=["true"]).options["split_points"] is None  # balanced by parameter count


def test_a_sharded_pool_that_lost_a_torchrun_rank_fails_every_later_task():
    """Under torchrun a pool that failed shrinks to rank 0 (spec/pools.md §4), but a sharded model may not fit
    rank 0 alone: every later task fails loudly (no update) until torchrun is restarted."""
    pool = TrainerPool(pool_workloads.make_deep(), ranks=2, parallel="fsdp", argv=["true"])
    pool.shrunk = True
    params = pool_workloads.make_deep().initial_params(0)
    with pytest.raises(PoolError, match="cannot shrink"):
        pool.train(params, LEASE[:8], 1)
    with pytest.raises(ValueError, match="sink"):
        TrainerPool(pool_workloads.make(), ranks=2, argv=["true"]).train(params, LEASE[:8], 1, sink=print)

"""Trainer pools (spec/pools.md): the deterministic split, equivalence of a 2-rank gloo pool with
one process, the collectives, failure semantics (a dead or hung rank fails the task, the pool re-forms),
the node's ``[pool]`` config, and a pool as a trainer in a real fleet (slow)."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from peerloom.adapters.pool import PoolError, RankEnv, TrainerPool, check_pool_table
from peerloom.backends.torch.pool import rank_batch, rank_share
from peerloom.node import ConfigError, load_config
from peerloom.workloads import all_gather, all_reduce, broadcast, pool_rank, pool_size
from tests import pool_workloads
from tests.helpers import NODE_AUTHORITY, NODE_CONFIG, node_config

ROOT = Path(__file__).resolve().parents[2]
# Equivalence tolerance (spec/pools.md "Equivalence"): float32 rounding of DDP's mean of the ranks'
# gradients against one backward over the global batch, compounded over a few inner steps.
RTOL, ATOL = 1e-5, 1e-6


def assert_close(pool: dict[str, np.ndarray], single: dict[str, np.ndarray]) -> None:
    assert pool.keys() == single.keys()
    for name in single:
        np.testing.assert_allclose(pool[name], single[name], rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.fixture(scope="module")
def ddp_pool():
    pool = TrainerPool(pool_workloads.make(), ranks=2, timeout_s=20.0, argv=pool_workloads.worker_argv("ddp"))
    pool.start()
    yield pool
    pool.close()


# --- the split ---------------------------------------------------------------------------------------------

def test_rank_batch_splits_every_nth_sample_and_pads_by_wrapping():
    batch = torch.tensor([10, 11, 12, 13, 14, 15])
    assert rank_batch(batch, 0, 2).tolist() == [10, 12, 14]
    assert rank_batch(batch, 1, 2).tolist() == [11, 13, 15]
    # 5 samples on 2 ranks: padded to 6 with the batch's first sample (DistributedSampler's rule).
    odd = torch.tensor([10, 11, 12, 13, 14])
    assert rank_batch(odd, 0, 2).tolist() == [10, 12, 14]
    assert rank_batch(odd, 1, 2).tolist() == [11, 13, 10]
    # A batch smaller than the pool wraps around more than once; every rank gets one sample.
    assert [rank_batch(torch.tensor([7]), r, 3).tolist() for r in range(3)] == [[7], [7], [7]]
    with pytest.raises(ValueError):
        rank_batch(batch, 2, 2)
    with pytest.raises(ValueError):
        rank_batch(torch.tensor([], dtype=torch.int64), 0, 2)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rank_shares_cover_the_lease_whatever_its_order(world):
    lease = [9, 3, 27, 1, 14, 8, 5]
    shares = [rank_share(lease, r, world) for r in range(world)]
    assert len({len(s) for s in shares}) == 1
    assert sorted(set().union(*shares)) == sorted(lease)
    assert shares == [rank_share(list(reversed(lease)), r, world) for r in range(world)]


# --- config and environment -------------------------------------------------------------------------------

def test_rank_env_reads_torchrun_variables():
    assert RankEnv.from_environ({}) is None
    assert RankEnv.from_environ({"WORLD_SIZE": "1", "RANK": "0"}) is None
    env = RankEnv.from_environ({"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "2", "MASTER_ADDR": "127.0.0.1",
                                "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert (env.rank, env.world, env.local_rank, env.master_port, env.agent_store) == (2, 4, 2, 29500, True)
    for bad in ({"WORLD_SIZE": "2"}, {"WORLD_SIZE": "2", "RANK": "2", "MASTER_PORT": "1"},
                {"WORLD_SIZE": "2", "RANK": "x", "MASTER_PORT": "1"}):
        with pytest.raises(ValueError):
            RankEnv.from_environ(bad)


@pytest.mark.parametrize(("table", "message"), [
    ({"ranks": 0}, r"pool\.ranks"), ({"ranks": True}, r"pool\.ranks"), ({"timeout_s": 0}, "timeout_s"),
    ({"backend": "mpi"}, "backend"), ({"rank": 2}, "unknown keys"),
])
def test_bad_pool_tables_are_refused(table, message):
    with pytest.raises(ValueError, match=message):
        check_pool_table(table)


def test_node_config_checks_the_pool(tmp_path):
    assert load_config(node_config(tmp_path, "[pool]\nranks = 2\ntimeout_s = 5.0\n"))["pool"]["ranks"] == 2
    with pytest.raises(ConfigError, match=r"pool\.ranks"):
        load_config(node_config(tmp_path, "[pool]\nranks = -1\n"))
    with pytest.raises(ConfigError, match="behaviour"):
        load_config(node_config(tmp_path, 'behaviour = "alie"\n[pool]\nranks = 2\n'))
    validator = NODE_CONFIG.replace('roles=["trainer"]', 'roles=["validator"]')
    (tmp_path / "v.toml").write_text(validator + "[pool]\nranks = 2\n")
    with pytest.raises(ConfigError, match="trainer role"):
        load_config(tmp_path / "v.toml")
    assert NODE_AUTHORITY in NODE_CONFIG


# --- collectives --------------------------------------------------------------------------------------------

def test_collectives_act_on_a_group_of_one_outside_a_pool():
    t = torch.tensor([1.0, 2.0])
    assert all_reduce(t, op="avg") is t and t.tolist() == [1.0, 2.0]
    assert broadcast(t) is t
    gathered = all_gather(t)
    assert len(gathered) == 1 and gathered[0].tolist() == [1.0, 2.0] and gathered[0] is not t
    assert (pool_rank(), pool_size()) == (0, 1)
    with pytest.raises(ValueError, match="op must be"):
        all_reduce(t, op="mean")
    with pytest.raises(ValueError, match="src"):
        broadcast(t, src=1)


# --- equivalence ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lease", [list(range(40)), [3, 60, 17, 22, 41, 8, 9, 55, 30, 12, 1, 44, 63, 27, 35, 19]])
def test_two_gloo_ranks_compute_the_single_process_pseudo_gradient(ddp_pool, lease):
    """DDP over the split global batches (8 samples -> 4 per rank, no padding) equals one process training
    the whole lease, within float32 rounding (RTOL, ATOL), for 7 inner steps that cross a reshuffle."""
    single = pool_workloads.make()
    params = single.initial_params(1)
    expected, expected_metrics = single.train(params, lease, seed=11)
    delta, metrics = ddp_pool.train(params, lease, 11)
    assert_close(delta, expected)
    assert metrics["samples"] == len(lease)
    assert metrics["train_loss"] == pytest.approx(expected_metrics["train_loss"], rel=1e-5)
    # Not a tautology: another seed draws other batches and gives another pseudo-gradient.
    other, _ = ddp_pool.train(params, lease, 12)
    assert max(float(np.abs(other[n] - expected[n]).max()) for n in expected) > 100 * ATOL


def test_rank_0_refuses_a_bad_task_before_the_ranks_hear_of_it(ddp_pool):
    params = pool_workloads.make().initial_params(0)
    with pytest.raises(ValueError, match="indices"):
        ddp_pool.train(params, [0, 64], 1)
    with pytest.raises(ValueError, match="schema"):
        ddp_pool.train({"x": np.zeros(1, np.float32)}, [0, 1], 1)
    assert ddp_pool.train(params, [0, 1, 2, 3], 1)[0].keys() == params.keys()  # the pool is still whole


# --- failure ----------------------------------------------------------------------------------------------------

def test_a_dead_rank_fails_the_task_and_the_pool_reforms(ddp_pool):
    params = pool_workloads.make().initial_params(2)
    lease = list(range(16))
    expected, _ = pool_workloads.make().train(params, lease, seed=3)
    failures, generation = ddp_pool.failures, ddp_pool.generation
    (pid,) = ddp_pool.rank_pids()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(PoolError, match="no update"):
        ddp_pool.train(params, lease, 3)
    assert (ddp_pool.failures, ddp_pool.generation) == (failures + 1, generation + 1)
    assert ddp_pool.rank_pids() != [pid]
    delta, _ = ddp_pool.train(params, lease, 3)  # the re-formed pool trains again, as before
    assert_close(delta, expected)


def test_a_rank_killed_during_a_task_fails_it(ddp_pool):
    """Killed before or during the long task: either way the task fails and no delta comes back."""
    params = pool_workloads.make().initial_params(2)
    (pid,) = ddp_pool.rank_pids()
    threading.Timer(0.2, os.kill, (pid, signal.SIGKILL)).start()
    with pytest.raises(PoolError):
        ddp_pool.train(params, list(range(64)), 3, inner_steps=100_000)
    assert ddp_pool.train(params, list(range(8)), 3)[1]["samples"] == 8

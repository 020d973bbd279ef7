"""Trainer pools formed per test (spec/pools.md): a custom workload on the pool's generic path, syncing its
replicas with `all_reduce`, and a hung rank caught by the group's timeout. (Apart from tests/backends/test_pool.py,
whose module-wide pool holds this process's default group while its tests run: one pool per process.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from peerloom.adapters.pool import PoolError, TrainerPool
from tests import pool_workloads
from tests.backends.test_pool import assert_close

ROOT = Path(__file__).resolve().parents[2]


def test_the_generic_path_runs_a_custom_workload_that_all_reduces():
    """A workload of its own (not a TorchWorkload) syncs its replicas with `all_reduce`: each rank gets
    half of the sorted lease, and the pool matches one process over the whole lease."""
    workload = pool_workloads.AllReduceRegression()
    params = workload.initial_params(0)
    lease = list(range(0, 64, 2))
    # The reference without all_reduce: another test's pool may hold this process's default group.
    expected, _ = pool_workloads.AllReduceRegression(sync=False).train(params, lease, 0)
    pool = TrainerPool(workload, ranks=2, timeout_s=20.0, argv=pool_workloads.worker_argv("regression"))
    try:
        pool.start()
        delta, metrics = pool.train(params, lease, 0)
    finally:
        pool.close()
    assert metrics["samples"] == len(lease)
    assert_close(delta, expected)
    assert float(np.abs(expected["w"]).max()) > 0.1



@pytest.mark.slow
@pytest.mark.serial  # the healthy ranks must meet the group's timeout
def test_a_hung_rank_times_the_task_out():
    # 10 s: long enough that the re-formed pool's healthy ranks always meet it (3 s failed once in CI's serial
    # pass, the respawned rank's first collective late), short enough to keep the test quick
    os.environ["PEERLOOM_TEST_POOL_TIMEOUT"] = "10"
    pool = TrainerPool(pool_workloads.make(), ranks=2, timeout_s=10.0, argv=pool_workloads.worker_argv("ddp"))
    try:
        pool.start()
        params = pool_workloads.make().initial_params(0)
        (pid,) = pool.rank_pids()
        os.kill(pid, signal.SIGSTOP)  # alive but silent: only the group's timeout can tell
        with pytest.raises(PoolError, match="no update"):
            pool.train(params, list(range(16)), 1)
        assert pool.train(params, list(range(16)), 1)[1]["samples"] == 16
    finally:
        os.environ.pop("PEERLOOM_TEST_POOL_TIMEOUT", None)
        pool.close()


@pytest.mark.slow
def test_a_torchrun_pool_trains_then_shrinks_to_rank_0_when_a_rank_leaves():
    """Under torchrun (its agent's TCPStore, its variables) the pool forms, computes the single process's
    pseudo-gradient, and after losing rank 1 fails that task and trains on alone (spec/pools.md §4)."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "-m", "tests.pool_workloads"], cwd=ROOT, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    seen = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    assert seen["diff"] <= 1e-6
    assert seen == {"diff": seen["diff"], "failed": True, "shrunk": True, "alone_equal": True}

"""A trainer pool's LR schedule spans windows (spec/protocol.md §5.1, spec/pools.md): every rank starts the
schedule at the run's global step that the node passes. Its own module: one pool per process, and
tests/backends/test_pool.py keeps one open for all its tests."""

from __future__ import annotations

import numpy as np

from peerloom.adapters.pool import TrainerPool
from tests import pool_workloads
from tests.backends.test_pool import ATOL, assert_close


def test_a_pool_starts_the_lr_schedule_at_the_runs_global_step():
    """Every rank steps the schedule to the global step the node passes (spec/protocol.md §5.1), so a pooled
    trainer's update equals one process's at that step, which is what an audit replays."""
    pool = TrainerPool(pool_workloads.make_scheduled(), ranks=2, timeout_s=20.0,
                       argv=pool_workloads.worker_argv("ddp-scheduled"))
    pool.start()
    try:
        single = pool_workloads.make_scheduled()
        params, lease = single.initial_params(1), list(range(40))
        expected, _ = single.train(params, lease, 11, step=21)
        delta, _ = pool.train(params, lease, 11, step=21)
        assert_close(delta, expected)
        at_zero, _ = pool_workloads.make_scheduled().train(params, lease, 11)
        assert max(float(np.abs(at_zero[n] - expected[n]).max()) for n in expected) > 100 * ATOL
    finally:
        pool.close()

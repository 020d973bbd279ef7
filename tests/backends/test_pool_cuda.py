"""A trainer pool on CUDA with nccl (spec/pools.md): one rank per GPU (at most 2) computes the pseudo-gradient of
one process training the whole lease on cuda:0. Skipped without CUDA; imports no node dependency, so it
runs on a bare GPU machine with torch."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from peerloom.adapters.pool import TrainerPool
from tests import pool_workloads

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: torch.cuda.is_available() "
                                                                      "is False on this machine")


def _single_and_pool(make, argv: str, ranks: int, **pool_options):
    """(single-GPU delta, the pool's delta, the pool's delta of the same task again, its metrics) of one lease."""
    single = make().to_device("cuda:0")
    params = single.initial_params(1)
    lease = list(range(40))
    expected, _ = single.train(params, lease, seed=11)
    pool = TrainerPool(make().to_device("cuda:0"), ranks=ranks, timeout_s=60.0,
                       argv=pool_workloads.worker_argv(argv), **pool_options)
    assert pool.backend == "nccl"
    try:
        pool.start()
        delta, metrics = pool.train(params, lease, 11)
        again, _ = pool.train(params, lease, 11)
    finally:
        pool.close()
    assert metrics["samples"] == len(lease)
    for name in expected:  # spec/pools.md §3's tolerance
        assert delta[name].dtype == np.float32
        np.testing.assert_allclose(delta[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
    return expected, delta, again, metrics


def test_an_nccl_pool_computes_the_single_gpu_pseudo_gradient(monkeypatch):
    monkeypatch.setenv("PEERLOOM_TEST_POOL_DEVICE", "cuda")
    expected, delta, again, _ = _single_and_pool(pool_workloads.make, "ddp", min(2, torch.cuda.device_count()))
    for name in expected:  # one rank adds nothing to round: the same task twice gives the same bytes
        assert np.array_equal(delta[name], again[name])
    assert os.environ["PEERLOOM_TEST_POOL_DEVICE"] == "cuda"


@pytest.mark.parametrize("parallel", ["fsdp", "pipeline"])
def test_a_sharded_nccl_pool_computes_the_single_gpu_pseudo_gradient(monkeypatch, parallel):
    """spec/pools.md §6-7 on CUDA: an FSDP2 pool (one rank per GPU, at most 4) and a pipeline (needs 2 GPUs)
    over nccl compute what one GPU computes, within §3's tolerance; the second task repeats the first."""
    ranks = min(4, torch.cuda.device_count())
    if parallel == "pipeline" and ranks < 2:
        pytest.skip("a pipeline of nccl ranks needs 2 GPUs (nccl puts one rank on each)")
    monkeypatch.setenv("PEERLOOM_TEST_POOL_DEVICE", "cuda")
    expected, delta, again, _ = _single_and_pool(pool_workloads.make_deep, "deep", ranks, parallel=parallel)
    for name in expected:
        np.testing.assert_allclose(again[name], delta[name], rtol=1e-6, atol=1e-7, err_msg=name)

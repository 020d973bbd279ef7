"""Outer optimizers: FedAvg SGD and DiLoCo Nesterov, numpy ≡ torch ≡ torch.optim.SGD (spec/design.md §5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from peerloom.backends.numpy import reduce as npr
from peerloom.backends.numpy.aggregate import outer_step as np_outer
from peerloom.backends.torch.aggregate import outer_step as torch_outer


def tt(d: dict) -> dict:
    return {k: torch.from_numpy(v.copy()) for k, v in d.items()}


@pytest.mark.parametrize("name", ["fedavg", "diloco"])
def test_numpy_equals_torch_over_steps(name: str) -> None:
    rng = np.random.default_rng(0)
    p = {"w": rng.standard_normal(40_000).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}
    pn, sn, pt, st = p, None, tt(p), None
    for _ in range(4):
        g = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in p.items()}
        pn, sn = np_outer(name, pn, g, sn)
        pt, st = torch_outer(name, pt, tt(g), st)
        assert all(pn[k].tobytes() == pt[k].numpy().tobytes() for k in p)
        assert (sn is None) == (st is None) == (name == "fedavg")
        if sn is not None:
            assert all(sn[k].tobytes() == st[k].numpy().tobytes() for k in p)


def test_fedavg_lr1_is_reference_step() -> None:
    rng = np.random.default_rng(1)
    p = {"w": rng.standard_normal(100).astype(np.float32)}
    g = {"w": rng.standard_normal(100).astype(np.float32)}
    assert np_outer("fedavg", p, g, None)[0]["w"].tobytes() == npr.outer_sgd_step(p, g, 1.0)["w"].tobytes()


def test_diloco_matches_torch_sgd_nesterov() -> None:
    rng = np.random.default_rng(2)
    p0 = rng.standard_normal(50).astype(np.float32)
    param = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    p, state = {"w": p0}, None
    for _ in range(5):
        g = rng.standard_normal(50).astype(np.float32)
        param.grad = torch.from_numpy(g.copy())
        opt.step()
        p, state = np_outer("diloco", p, {"w": g}, state)
        np.testing.assert_allclose(p["w"], param.detach().numpy(), rtol=1e-5, atol=1e-6)

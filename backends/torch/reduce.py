"""FedAvg weighted mean and SGD outer step on torch CPU tensors, bit-identical to the numpy reference
(`peerloom.backends.numpy.reduce`, whose module docstring fixes the recipe; spec/design.md §4, §5).

Both backends run the same code, `peerloom.backends._reduce`, each with its own elementwise `Ops`: widen
to float64 with ``copy_`` (exact), multiply by a Python-float coefficient in place (one IEEE double
multiply), add or subtract in place (``add_`` with the default alpha of 1 — torch may evaluate it as
``fma(b, 1, a)``, which rounds exactly like ``a + b``; no other alpha is ever used), and round once to the
input dtype with ``copy_`` (round to nearest even). The tests check the bytes against numpy on random
cohorts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from peerloom.backends import _reduce
from peerloom.backends._reduce import SUPPORTED_DTYPES, check_weights

from .aggregate import TORCH_OPS, workspace
from .tensors import TorchTensorDict, check_schema

__all__ = ["SUPPORTED_DTYPES", "check_weights", "outer_sgd_step", "weighted_mean"]


@torch.no_grad()
def weighted_mean(deltas: Sequence[TorchTensorDict], weights: Sequence[int], *,
                  out: TorchTensorDict | None = None, threads: int = 1) -> TorchTensorDict:
    """Sample-weighted mean of same-schema dicts of CPU tensors (FedAvg, McMahan et al. 2017,
    arXiv 1602.05629). Same contract, errors and bytes as the numpy reference: float32/float64 in,
    float64 accumulation in the given order, one rounding to the input dtype at the end (into `out` if
    given). ValueError as the reference, and for a tensor off the CPU.
    """
    return _reduce.weighted_mean(TORCH_OPS, workspace(threads), check_schema, deltas, weights, out)


@torch.no_grad()
def outer_sgd_step(params: TorchTensorDict, pseudo_gradient: TorchTensorDict, lr: float, *,
                   out: TorchTensorDict | None = None, threads: int = 1) -> TorchTensorDict:
    """``params - lr * pseudo_gradient`` in float64, rounded once to the params dtype; bit-identical
    to the numpy reference (FedAvg outer SGD, lr 1; DiLoCo sign convention, arXiv 2311.08105).
    ValueError as the reference, and for a tensor off the CPU.
    """
    return _reduce.outer_sgd_step(TORCH_OPS, workspace(threads), check_schema, params, pseudo_gradient, lr, out)


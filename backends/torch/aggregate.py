"""Robust aggregation rules on torch CPU tensor dicts, byte-identical to the numpy reference.

Same entry point, rules, parameters, defaults, errors and bytes as
`peerloom.backends.numpy.aggregate.aggregate` (see its docstring for the table of rules, sources,
breakdown points and costs); both run `peerloom.backends._robust` with their own elementwise `Ops`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from peerloom.backends import _reduce, _robust
from peerloom.backends._reduce import OUTER_DEFAULTS
from peerloom.backends._robust import DEFAULT_RULE, RULES

from .tensors import TorchTensorDict, check_schema

__all__ = ["DEFAULT_RULE", "OUTER_DEFAULTS", "RULES", "TORCH_OPS", "aggregate", "outer_step", "screening_stats",
           "workspace"]


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


# This class mirrors its twin in the other backend line for line on purpose: each primitive calls its own
# library (torch here); everything above the primitives is shared (`_robust`, `_reduce`).
class TorchOps:
    """`peerloom.backends._robust.Ops` for torch CPU tensors (each call one ATen kernel, no fusion)."""

    def empty(self, n: int, dtype: str) -> torch.Tensor:
        return torch.empty(n, dtype=_dtype(dtype))

    def empty2(self, rows: int, n: int, dtype: str) -> torch.Tensor:
        return torch.empty((rows, n), dtype=_dtype(dtype))

    def zeros(self, n: int, dtype: str) -> torch.Tensor:
        return torch.zeros(n, dtype=_dtype(dtype))

    def flat(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1)

    def new(self, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        return torch.empty(shape, dtype=_dtype(dtype))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def fill(self, a: torch.Tensor, value: float) -> None:
        a.fill_(value)

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        a.add_(b)

    def sub(self, a: torch.Tensor, b: torch.Tensor) -> None:
        a.sub_(b)

    def mul(self, a: torch.Tensor, b: torch.Tensor) -> None:
        a.mul_(b)

    def scale(self, a: torch.Tensor, c: float) -> None:
        a.mul_(c)

    def add_scalar(self, a: torch.Tensor, c: float) -> None:
        a.add_(c)

    def div_scalar(self, a: torch.Tensor, c: float) -> None:
        a.div_(c)

    def scale_into(self, out: torch.Tensor, x: torch.Tensor, c: float) -> None:
        # Widen exactly, then one float64 multiply by the Python float (faster than a promoting torch.mul).
        out.copy_(x)
        out.mul_(c)

    def mul_into(self, out: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
        if x.dtype == torch.float64 or y.dtype == torch.float64:
            torch.mul(x, y, out=out)  # computed in float64 (type promotion), x widened exactly
        else:
            out.copy_(x)
            out.mul_(y)

    def product(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        torch.mul(a, b, out=out)

    def minimum(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        torch.minimum(a, b, out=out)

    def maximum(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        torch.maximum(a, b, out=out)

    def gram(self, x: torch.Tensor, out: torch.Tensor) -> None:
        # numpy's BLAS on the same memory: torch.mm on these [n, BLOCK] float64 blocks was 5-10x slower on
        # the 2-core target. The Gram's rounding never decides Krum's selection (`_robust.krum_select`).
        xn = x.numpy()
        np.matmul(xn, xn.T, out=out.numpy())

    def sort0(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sort(x, dim=0).values

    def item(self, a: torch.Tensor, i: int) -> float:
        return float(a[i])

    def column(self, values: Sequence[float]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.float64).reshape(-1, 1)

    def reshape(self, a: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return a.view(shape)

    # The next three serve centered clipping's quantized Gram (`_robust.quantized_gram`). They are exact
    # operations (copies, |x|, max, scaling by powers of two, rounding to integers), so running numpy's
    # kernels on the tensors' memory (zero-copy) changes no bit. torch's versions of these [n, CC_BLOCK]
    # broadcasting/casting kernels ran 10x slower with 2 intra-op threads on the shared 2-core target
    # (centered clipping at 22-44x the baseline instead of ~4x); with 1 thread they were on par.

    def stack(self, out: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
        np.stack([p.numpy() for p in parts], out=out.numpy())

    def absmax_rows(self, x: torch.Tensor, scratch: torch.Tensor) -> list[float]:
        s = scratch.numpy()
        np.abs(x.numpy(), out=s)
        return [float(v) for v in s.max(axis=1)]

    def quantize_rows(self, out: torch.Tensor, x: torch.Tensor, scales: Sequence[float]) -> None:
        o = out.numpy()
        np.multiply(x.numpy(), np.array(scales, dtype=np.float64).reshape(-1, 1), out=o, dtype=np.float64)
        np.rint(o, out=o)

    def errstate(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()


TORCH_OPS = TorchOps()


def workspace(threads: int = 1) -> _robust.Workspace:
    """This thread's reusable buffers for kernels on `threads` threads (`peerloom.backends._robust.thread_workspace`).
    ValueError unless ``1 <= threads <= _robust.MAX_THREADS``."""
    return _robust.thread_workspace(TORCH_OPS, threads)


@torch.no_grad()
def aggregate(
    rule: str, deltas: Sequence[TorchTensorDict], weights: Sequence[int], *, threads: int = 1, **params: Any
) -> TorchTensorDict:
    """Aggregate a cohort of same-schema deltas (float32/float64 CPU tensors, canonical cohort order)
    with `rule`; the contract of `peerloom.backends.numpy.aggregate.aggregate`, byte for byte."""
    return _reduce.aggregate(TORCH_OPS, workspace(threads), check_schema, rule, deltas, weights, params)


@torch.no_grad()
def outer_step(
    name: str,
    params: TorchTensorDict,
    pseudo_gradient: TorchTensorDict,
    state: TorchTensorDict | None,
    *,
    lr: float | None = None,
    momentum: float | None = None,
    threads: int = 1,
) -> tuple[TorchTensorDict, TorchTensorDict | None]:
    """`peerloom.backends.numpy.aggregate.outer_step` on torch CPU tensors, byte for byte."""
    return _reduce.outer_step(TORCH_OPS, workspace(threads), check_schema, name, params, pseudo_gradient, state, lr,
                              momentum)


@torch.no_grad()
def screening_stats(
    delta: TorchTensorDict, *, reference: TorchTensorDict | None = None, centre: TorchTensorDict | None = None,
    threads: int = 1,
) -> dict[str, Any]:
    """`peerloom.backends.numpy.aggregate.screening_stats` on torch CPU tensors (equal floats)."""
    return _reduce.screening_stats(TORCH_OPS, workspace(threads), check_schema, _all_finite, delta, reference,
                                  centre)


def _all_finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())

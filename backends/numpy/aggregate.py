"""Robust aggregation rules on numpy tensor dicts — the reference backend (spec/design.md §5).

`aggregate(rule, deltas, weights, **params)` is the one entry point; `peerloom.backends.torch.aggregate`
has the same signature on torch tensors and returns the same bytes (both run the kernels of
`peerloom.backends._robust`, whose docstring fixes the arithmetic: float64 blocks, fixed order, lanes for
sums, one rounding at the end).

=============== ===================================================== ============== =====================
rule            definition (source)                                   breakdown      cost (n members, K
                                                                      point          coordinates)
=============== ===================================================== ============== =====================
mean            ``sum_i w_i x_i / sum w`` (FedAvg, arXiv 1602.05629)  0              O(nK)
median          coordinate-wise median, even n: mean of the two       1/2            O(n log^2 n K) min/max
                middle values (Yin et al. 2018, arXiv 1803.01498)                    (Batcher network)
trimmed_mean    coordinate-wise mean after dropping                   trim_fraction  O(n log^2 n K)
                ``floor(trim_fraction * n)`` values at each end
                (Yin et al. 2018)
krum            the member with the smallest sum of squared           (n - 2) / 2n   O(n^2 K) flops (one
                distances to its ``n - f - 2`` nearest (Blanchard     (n >= 2f + 3)  BLAS Gram per block)
                et al. 2017, NeurIPS)
multi_krum      weighted mean of the `m` best Krum scores             as krum        as krum + O(mK)
                (default ``m = n - f``; Blanchard et al. 2017)
centered_clip   ``v += sum_i a_i (x_i - v) min(1, tau/|x_i - v|)``,   ~0.1 - 0.2     O(n^2 K) flops (one
                `iterations` times (Karimireddy et al. 2021,          (paper's       exact quantized BLAS
                arXiv 2012.10333)                                     analysis)      Gram) + O(nK), any
                                                                                     iteration count
norm_clip       weighted mean of ``x_i min(1, tau / |x_i|)``           0 (bounds      O(nK)
                (clipping as in DP-FedAvg, arXiv 1710.06963)          influence)
=============== ===================================================== ============== =====================

Parameters (keyword-only, all optional):

* ``trimmed_mean``: ``trim_fraction`` in [0, 0.5), default 0.2.
* ``krum``: ``f`` (Byzantine members tolerated), default ``max(0, (n - 3) // 2)``.
* ``multi_krum``: ``f`` as Krum; ``m`` members kept, default ``n - f``.
* ``centered_clip``: ``tau`` clipping radius (> 0), default ``None`` = the median distance to the centre
  at each iteration; ``iterations`` default 3; ``center`` a tensor dict of the cohort's schema to start
  from (e.g. the previous window's aggregate), default zeros.
* ``norm_clip``: ``tau`` (> 0), default ``None`` = the median member norm.

Weights (positive ints, sample counts) weight `mean`, `multi_krum`/`krum` (among the selected),
`centered_clip` and `norm_clip`; `median` and `trimmed_mean` count every member once (a weight does not
buy a Byzantine member more votes), but the weights are still validated.

All rules return new tensors of the input dtype (float32 or float64) and shapes. Raises ValueError for an
empty cohort, mismatched schemas, bad weights or bad parameter values, TypeError for unknown parameters.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from peerloom.backends import _reduce, _robust
from peerloom.backends._reduce import OUTER_DEFAULTS
from peerloom.backends._robust import DEFAULT_RULE, RULES, Schema

from .stored import FileTensor
from .stored import all_finite as stored_all_finite
from .tensors import TensorDict, schema_of

__all__ = ["DEFAULT_RULE", "NUMPY_OPS", "OUTER_DEFAULTS", "RULES", "aggregate", "outer_step", "screening_stats",
           "workspace"]


# This class mirrors its twin in the other backend line for line on purpose: each primitive calls its own
# library (numpy here); everything above the primitives is shared (`_robust`, `_reduce`).
class NumpyOps:
    """`peerloom.backends._robust.Ops` for numpy arrays."""

    def empty(self, n: int, dtype: str) -> np.ndarray:
        return np.empty(n, dtype=dtype)

    def empty2(self, rows: int, n: int, dtype: str) -> np.ndarray:
        return np.empty((rows, n), dtype=dtype)

    def zeros(self, n: int, dtype: str) -> np.ndarray:
        return np.zeros(n, dtype=dtype)

    def flat(self, t: np.ndarray) -> np.ndarray:
        return np.reshape(t, -1)

    def new(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.empty(shape, dtype=dtype)

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src, casting="same_kind")

    def fill(self, a: np.ndarray, value: float) -> None:
        a.fill(value)

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        np.add(a, b, out=a)

    def sub(self, a: np.ndarray, b: np.ndarray) -> None:
        np.subtract(a, b, out=a)

    def mul(self, a: np.ndarray, b: np.ndarray) -> None:
        np.multiply(a, b, out=a)

    def scale(self, a: np.ndarray, c: float) -> None:
        np.multiply(a, c, out=a)

    def add_scalar(self, a: np.ndarray, c: float) -> None:
        np.add(a, c, out=a)

    def div_scalar(self, a: np.ndarray, c: float) -> None:
        np.divide(a, c, out=a)

    def scale_into(self, out: np.ndarray, x: np.ndarray, c: float) -> None:
        np.multiply(x, c, out=out, dtype=np.float64)

    def mul_into(self, out: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
        np.multiply(x, y, out=out, dtype=np.float64)

    def product(self, out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        np.multiply(a, b, out=out)

    def minimum(self, out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        np.minimum(a, b, out=out)

    def maximum(self, out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        np.maximum(a, b, out=out)

    def gram(self, x: np.ndarray, out: np.ndarray) -> None:
        np.matmul(x, x.T, out=out)

    def sort0(self, x: np.ndarray) -> np.ndarray:
        return np.sort(x, axis=0)

    def item(self, a: np.ndarray, i: int) -> float:
        return float(a[i])

    def column(self, values: Sequence[float]) -> np.ndarray:
        return np.array(values, dtype=np.float64).reshape(-1, 1)

    def reshape(self, a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return a.reshape(shape)

    def stack(self, out: np.ndarray, parts: Sequence[np.ndarray]) -> None:
        np.stack(parts, out=out)

    def absmax_rows(self, x: np.ndarray, scratch: np.ndarray) -> list[float]:
        np.abs(x, out=scratch)
        return [float(v) for v in scratch.max(axis=1)]

    def quantize_rows(self, out: np.ndarray, x: np.ndarray, scales: Sequence[float]) -> None:
        np.multiply(x, np.array(scales, dtype=np.float64).reshape(-1, 1), out=out, dtype=np.float64)
        np.rint(out, out=out)

    def errstate(self) -> contextlib.AbstractContextManager[Any]:
        return np.errstate(over="ignore", invalid="ignore")


NUMPY_OPS = NumpyOps()
_local = threading.local()


def check_schema(members: Sequence[TensorDict], what: str) -> Schema:
    """`peerloom.backends._reduce.check_schema` for numpy tensor dicts (ValueError on a mismatch)."""
    return _reduce.check_schema(members, what, schema_of)


def workspace(threads: int = 1) -> _robust.Workspace:
    """This thread's reusable buffers for kernels on `threads` threads (`peerloom.backends._robust.thread_workspace`).
    ValueError unless ``1 <= threads <= _robust.MAX_THREADS``."""
    return _robust.thread_workspace(NUMPY_OPS, threads)


def aggregate(rule: str, deltas: Sequence[TensorDict], weights: Sequence[int], *, threads: int = 1,
              **params: Any) -> TensorDict:
    """Aggregate a cohort of same-schema deltas (float32/float64 numpy arrays, canonical cohort order)
    with `rule` (one of `RULES`; parameters in the module docstring) on `threads` threads (the same bytes on
    any count: spec/design.md §5). Returns new arrays, same schema."""
    return _reduce.aggregate(NUMPY_OPS, workspace(threads), check_schema, rule, deltas, weights, params)


def outer_step(
    name: str,
    params: TensorDict,
    pseudo_gradient: TensorDict,
    state: TensorDict | None,
    *,
    lr: float | None = None,
    momentum: float | None = None,
    out: TensorDict | None = None,
    out_state: TensorDict | None = None,
    threads: int = 1,
) -> tuple[TensorDict, TensorDict | None]:
    """One outer-optimizer step; returns ``(new_params, new_state)``.

    ``"fedavg"``: SGD (lr 1 = plain FedAvg), heavy-ball momentum (FedAvgM) if `momentum` > 0.
    ``"diloco"``: SGD with Nesterov momentum. Formulas and rounding: `peerloom.backends._robust.outer_momentum`
    (PyTorch's SGD formulation). `state` is the momentum buffer, a tensor dict of the params' schema (None =
    zeros); the returned state is None when momentum is 0. `out` / `out_state` receive the results when given
    (e.g. `peerloom.backends.numpy.stored.TensorFileWriter` tensors, written block by block). Any input may be
    a `peerloom.backends.numpy.stored.FileTensor` dict. Runs on `threads` threads (same bytes on any count).
    Raises ValueError on schema mismatch/unknown name or a thread count outside [1, `_robust.MAX_THREADS`].
    """
    return _reduce.outer_step(NUMPY_OPS, workspace(threads), check_schema, name, params, pseudo_gradient, state, lr,
                              momentum, out, out_state)


def screening_stats(
    delta: TensorDict, *, reference: TensorDict | None = None, centre: TensorDict | None = None, threads: int = 1
) -> dict[str, Any]:
    """Screening statistics of one delta (spec/design.md §4): ``{"finite": bool, "norms": {name: float},
    "global_norm": float, "cosine": float (to `reference`; NaN if none/zero), "distance": float (L2 to the
    robust `centre`; NaN if none)}``. Sums in float64 lanes (`peerloom.backends._robust`), so the numpy and
    torch backends return equal floats, on any number of `threads`. Non-finite deltas return ``finite=False``
    and NaN statistics."""
    return _reduce.screening_stats(NUMPY_OPS, workspace(threads), check_schema, _all_finite, delta, reference,
                                  centre)


FINITE_BLOCK = 1 << 20
"""Elements per `np.isfinite` call: its boolean result goes to a reused buffer, not a fresh model-sized one."""


def _all_finite(t: np.ndarray | FileTensor) -> bool:
    if isinstance(t, FileTensor):
        return stored_all_finite(t)
    flat = np.reshape(t, -1)
    if flat.size <= FINITE_BLOCK:
        return bool(np.isfinite(flat).all())
    scratch = getattr(_local, "finite", None)
    if scratch is None:
        scratch = _local.finite = np.empty(FINITE_BLOCK, dtype=bool)
    for start in range(0, flat.size, FINITE_BLOCK):
        block = flat[start:start + FINITE_BLOCK]
        if not np.isfinite(block, out=scratch[:block.size]).all():
            return False
    return True

"""Reference reductions: FedAvg weighted mean and the SGD outer step (spec/design.md §4 "Reduction must be
bit-reproducible", §5).

`peerloom.backends.torch.reduce` runs the same code on torch tensors and must produce the same bytes.
The recipe, fixed here:

* Inputs are float32 (or float64) tensors. Every tensor is widened to float64 (exact), all arithmetic
  runs in float64 with one IEEE operation per step (no fused multiply-add, no pairwise sums, no BLAS),
  and the result is rounded once to the input dtype (round to nearest, ties to even).
* `weighted_mean`: normalized weights ``a_i = w_i / sum(w)`` are computed once as Python floats
  (``sum(w)`` of Python ints is exact). Then, for each member *in the given order*:
  ``scratch = float64(delta_i)``; ``scratch = scratch * a_i``; ``acc = acc + scratch`` with ``acc``
  starting at +0.0. Floating-point addition is not associative, so a different member order can give
  different bits; the protocol fixes a canonical cohort order for that reason.
* Inputs should be finite (screening rejects the rest first): non-finite values propagate, but the payload
  bits of a NaN are not part of the cross-backend guarantee.
* `outer_sgd_step`: ``scratch = float64(g)``; ``scratch = scratch * lr``; ``acc = float64(params)``;
  ``acc = acc - scratch``; result = ``acc`` rounded to the params dtype. With ``lr = 1`` this equals the
  float32 difference ``params - g`` bit for bit (float64 carries more than 2*24+2 bits, so rounding
  twice is innocuous for one subtraction; tested).

Both functions run the backend-neutral code of `peerloom.backends._reduce` (the blocked kernels of
`peerloom.backends._robust`) with numpy's `Ops`, in this thread's reusable float64 workspace (writing fresh
memory is far slower than reusing it on the target machines); only the returned tensors are new, unless
`out` is given.
"""

from __future__ import annotations

from collections.abc import Sequence

from peerloom.backends import _reduce
from peerloom.backends._reduce import SUPPORTED_DTYPES, check_weights

from .aggregate import NUMPY_OPS, check_schema, workspace
from .tensors import TensorDict

__all__ = ["SUPPORTED_DTYPES", "check_weights", "outer_sgd_step", "weighted_mean"]


def weighted_mean(deltas: Sequence[TensorDict], weights: Sequence[int], *, out: TensorDict | None = None,
                  threads: int = 1) -> TensorDict:
    """Sample-weighted mean ``sum_i (w_i / sum w) * delta_i`` of same-schema tensor dicts (FedAvg,
    McMahan et al. 2017, arXiv 1602.05629, Algorithm 1).

    `deltas`: tensor dicts with identical names, shapes and dtypes (float32 or float64), in the
    canonical cohort order. `weights`: positive ints (sample counts), one per delta. Accumulates in
    float64 as documented in the module docstring, on `threads` threads (the same bytes on any count);
    returns tensors of the input dtype and shapes (written into `out` if given). Raises ValueError for an
    empty cohort, mismatched schemas or weight counts, non-integer or non-positive weights.
    """
    return _reduce.weighted_mean(NUMPY_OPS, workspace(threads), check_schema, deltas, weights, out)


def outer_sgd_step(params: TensorDict, pseudo_gradient: TensorDict, lr: float, *, out: TensorDict | None = None,
                   threads: int = 1) -> TensorDict:
    """One outer SGD step ``params - lr * pseudo_gradient`` (FedAvg's outer optimizer is SGD with lr 1;
    DiLoCo, arXiv 2311.08105, uses the same sign convention: pseudo-gradient = before - after).

    Both dicts share one schema (float32 or float64); computed in float64, rounded once to the
    params dtype. Returns new tensors (or writes `out`). Raises ValueError on schema mismatch.
    """
    return _reduce.outer_sgd_step(NUMPY_OPS, workspace(threads), check_schema, params, pseudo_gradient, lr, out)

"""Reference reductions: FedAvg weighted mean and the SGD outer step (DESIGN §4 "Reduction must be
bit-reproducible", §5).

`peerloom.backends.torch.reduce` implements the same arithmetic, operation for operation, and must
produce the same bytes. The recipe, fixed here and mirrored there:

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

Scratch and accumulator buffers are preallocated per schema and reused (writing fresh memory is far
slower than reusing it on the target machines); only the returned tensors are new, unless `out` is given.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Sequence

import numpy as np

from .tensors import Schema, TensorDict, schema_of

ACCUMULATION_DTYPE = np.float64
SUPPORTED_DTYPES = ("float32", "float64")


def check_weights(weights: Sequence[int], count: int) -> list[int]:
    """Weights as Python ints: one per member, each a positive integer (sample count). Else ValueError."""
    if count == 0:
        raise ValueError("empty cohort")
    if len(weights) != count:
        raise ValueError(f"{len(weights)} weights for {count} members")
    out: list[int] = []
    for w in weights:
        if isinstance(w, bool):
            raise ValueError("weights must be integers, not bool")
        try:
            value = operator.index(w)
        except TypeError as exc:
            raise ValueError(f"weights must be integers, got {type(w).__name__}") from exc
        if value <= 0:
            raise ValueError(f"weights must be positive, got {value}")
        out.append(value)
    return out


def check_schema(members: Sequence[TensorDict], what: str) -> Schema:
    """The common schema of `members`; ValueError if they differ or hold a non-float dtype."""
    if not members:
        raise ValueError("empty cohort")
    schema = schema_of(members[0])
    for i, member in enumerate(members[1:], start=1):
        other = schema_of(member)
        if other != schema:
            raise ValueError(f"{what} {i} has schema {other}, expected {schema}")
    for name, dtype, _shape in schema:
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {dtype}; reductions take {SUPPORTED_DTYPES}")
    return schema


class Reducer:
    """Reductions with float64 scratch and accumulator buffers kept between calls.

    Buffers are keyed by the schema of the last call; a call with another schema replaces them. Not
    thread-safe: use one `Reducer` per thread (the module functions do).
    """

    def __init__(self) -> None:
        self._schema: Schema | None = None
        self._scratch: dict[str, np.ndarray] = {}
        self._acc: dict[str, np.ndarray] = {}

    def _buffers(self, schema: Schema) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(scratch, acc): float64 views per tensor; scratch views share one flat buffer."""
        if schema != self._schema:
            largest = max((int(np.prod(shape)) for _, _, shape in schema), default=0)
            flat = np.empty(largest, dtype=ACCUMULATION_DTYPE)
            self._scratch = {n: flat[: int(np.prod(shape))].reshape(shape) for n, _, shape in schema}
            self._acc = {n: np.empty(shape, dtype=ACCUMULATION_DTYPE) for n, _, shape in schema}
            self._schema = schema
        return self._scratch, self._acc

    @staticmethod
    def _result(schema: Schema, acc: dict[str, np.ndarray], out: TensorDict | None) -> TensorDict:
        # Overflow on the final rounding gives ±inf, as in IEEE arithmetic and in torch; no warning.
        with np.errstate(over="ignore"):
            if out is None:
                return {n: acc[n].astype(dtype) for n, dtype, _ in schema}
            if schema_of(out) != schema:
                raise ValueError(f"out has schema {schema_of(out)}, expected {schema}")
            for n, _, _ in schema:
                np.copyto(out[n], acc[n], casting="same_kind")
            return out

    def weighted_mean(
        self, deltas: Sequence[TensorDict], weights: Sequence[int], *, out: TensorDict | None = None
    ) -> TensorDict:
        """Sample-weighted mean ``sum_i (w_i / sum w) * delta_i`` of same-schema tensor dicts (FedAvg,
        McMahan et al. 2017, arXiv 1602.05629, Algorithm 1).

        `deltas`: tensor dicts with identical names, shapes and dtypes (float32 or float64), in the
        canonical cohort order. `weights`: positive ints (sample counts), one per delta. Accumulates in
        float64 as documented in the module docstring; returns tensors of the input dtype and shapes
        (written into `out` if given). Raises ValueError for an empty cohort, mismatched schemas or
        weight counts, non-integer or non-positive weights.
        """
        ws = check_weights(weights, len(deltas))
        schema = check_schema(deltas, "delta")
        total = sum(ws)
        coeffs = [w / total for w in ws]
        scratch, acc = self._buffers(schema)
        for name, _, _ in schema:
            a, s = acc[name], scratch[name]
            a.fill(0.0)
            for delta, c in zip(deltas, coeffs, strict=True):
                np.copyto(s, delta[name], casting="safe")
                np.multiply(s, c, out=s)
                np.add(a, s, out=a)
        return self._result(schema, acc, out)

    def outer_sgd_step(
        self, params: TensorDict, pseudo_gradient: TensorDict, lr: float, *, out: TensorDict | None = None
    ) -> TensorDict:
        """One outer SGD step ``params - lr * pseudo_gradient`` (FedAvg's outer optimizer is SGD with lr 1;
        DiLoCo, arXiv 2311.08105, uses the same sign convention: pseudo-gradient = before - after).

        Both dicts share one schema (float32 or float64); computed in float64, rounded once to the
        params dtype. Returns new tensors (or writes `out`). Raises ValueError on schema mismatch.
        """
        schema = check_schema([params, pseudo_gradient], "pseudo-gradient")
        lr = float(lr)
        scratch, acc = self._buffers(schema)
        for name, _, _ in schema:
            a, s = acc[name], scratch[name]
            np.copyto(s, pseudo_gradient[name], casting="safe")
            np.multiply(s, lr, out=s)
            np.copyto(a, params[name], casting="safe")
            np.subtract(a, s, out=a)
        return self._result(schema, acc, out)


_local = threading.local()


def _reducer() -> Reducer:
    reducer = getattr(_local, "reducer", None)
    if reducer is None:
        reducer = _local.reducer = Reducer()
    return reducer


def weighted_mean(deltas: Sequence[TensorDict], weights: Sequence[int]) -> TensorDict:
    """`Reducer.weighted_mean` with this thread's reusable buffers."""
    return _reducer().weighted_mean(deltas, weights)


def outer_sgd_step(params: TensorDict, pseudo_gradient: TensorDict, lr: float) -> TensorDict:
    """`Reducer.outer_sgd_step` with this thread's reusable buffers."""
    return _reducer().outer_sgd_step(params, pseudo_gradient, lr)

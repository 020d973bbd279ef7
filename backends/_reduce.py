"""Backend-neutral bodies of the backends' reduction entry points: input checks, FedAvg's weighted mean and
SGD outer step, and the `aggregate` / `outer_step` / `screening_stats` wrappers (spec/design.md §4 "Reduction must be
bit-reproducible", §5).

`peerloom.backends.numpy.reduce` / `.aggregate` and `peerloom.backends.torch.reduce` / `.aggregate` are thin
wrappers that call *this* code with their own `peerloom.backends._robust.Ops`, their thread's reusable
float64 `_robust.Workspace` and their `check_schema`, so both run the same IEEE operations in the same order
and return the same bytes. The FedAvg recipe (fixed in `peerloom.backends.numpy.reduce`'s docstring) is the
one the blocked kernels of `peerloom.backends._robust` implement: `weighted_mean` is `_robust.weighted_sum`
with normalized weights, `outer_sgd_step` is `_robust.outer_momentum` with momentum 0.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

from . import _robust
from ._robust import Ops, Schema, Workspace

SUPPORTED_DTYPES = ("float32", "float64")
"""Input dtypes the reductions accept; they accumulate in float64 and round once to the input dtype."""

TensorDict = dict[str, Any]
SchemaOf = Callable[[TensorDict], Schema]
CheckSchema = Callable[[Sequence[TensorDict], str], Schema]
"""A backend's `check_schema(members, what)`: this module's `check_schema` with its own `schema_of`."""


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


def check_schema(members: Sequence[TensorDict], what: str, schema_of: SchemaOf) -> Schema:
    """The common schema of `members` (``schema_of`` is the backend's ``((name, dtype, shape), ...)``);
    ValueError if they differ or hold a dtype outside `SUPPORTED_DTYPES`. `what` names a member in errors."""
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


def _output(ops: Ops, schema: Schema, out: TensorDict | None, check: CheckSchema) -> TensorDict:
    if out is None:
        return {name: ops.new(shape, dtype) for name, dtype, shape in schema}
    if (got := check([out], "out")) != schema:
        raise ValueError(f"out has schema {got}, expected {schema}")
    return out


def weighted_mean(ops: Ops, ws: Workspace, check: CheckSchema, deltas: Sequence[TensorDict],
                  weights: Sequence[int], out: TensorDict | None = None) -> TensorDict:
    """``sum_i (w_i / sum w) * delta_i`` in the given member order (FedAvg, McMahan et al. 2017,
    arXiv 1602.05629, Algorithm 1). Returns tensors of the input dtype and shapes, written into `out` if
    given. ValueError for an empty cohort, mismatched schemas or weight counts, bad weights, a bad `out`."""
    coeffs = _robust.normalized(check_weights(weights, len(deltas)))
    schema = check(deltas, "delta")
    result = _output(ops, schema, out, check)
    return _robust.weighted_sum(ops, ws, schema, _robust.flats(ops, deltas, schema), coeffs, result)


def outer_sgd_step(ops: Ops, ws: Workspace, check: CheckSchema, params: TensorDict, pseudo_gradient: TensorDict,
                   lr: float, out: TensorDict | None = None) -> TensorDict:
    """``params - lr * pseudo_gradient`` in float64, rounded once to the params dtype (FedAvg's outer SGD
    with lr 1; DiLoCo's sign convention, arXiv 2311.08105: pseudo-gradient = before - after). ValueError on
    a schema mismatch or a bad `out`."""
    schema = check([params, pseudo_gradient], "pseudo-gradient")
    result = _output(ops, schema, out, check)
    _robust.outer_momentum(ops, ws, schema, params, pseudo_gradient, None, float(lr), 0.0, False, result, None)
    return result


# ---------------------------------------------------------------- the backends' entry points


def _flat(ops: Ops, tensors: TensorDict) -> dict[str, list[Any]]:
    return {name: [ops.flat(t)] for name, t in tensors.items()}


def aggregate(ops: Ops, ws: Workspace, check: CheckSchema, rule: str, deltas: Sequence[TensorDict],
              weights: Sequence[int], params: dict[str, Any]) -> TensorDict:
    """The body of both backends' ``aggregate(rule, deltas, weights, **params)`` (contract, rules and
    parameters in `peerloom.backends.numpy.aggregate`'s docstring): validate, then `_robust.run_rule`."""
    checked = check_weights(weights, len(deltas))
    schema = check(deltas, "delta")
    if params.get("center") is not None and check([deltas[0], params["center"]], "center") != schema:
        raise ValueError("center has another schema")

    def new() -> TensorDict:
        return _output(ops, schema, None, check)

    return _robust.run_rule(ops, ws, schema, deltas, checked, rule, params, new, lambda d: _flat(ops, d))


OUTER_DEFAULTS = {"fedavg": (1.0, 0.0), "diloco": (0.7, 0.9)}
"""name -> (lr, momentum). DiLoCo: Nesterov momentum, lr 0.7, momentum 0.9 (Douillard et al., arXiv 2311.08105)."""


def outer_step(ops: Ops, ws: Workspace, check: CheckSchema, name: str, params: TensorDict,
               pseudo_gradient: TensorDict, state: TensorDict | None, lr: float | None, momentum: float | None,
               out: TensorDict | None = None, out_state: TensorDict | None = None
               ) -> tuple[TensorDict, TensorDict | None]:
    """The body of both backends' ``outer_step`` (contract in `peerloom.backends.numpy.aggregate.outer_step`):
    `name` picks the defaults of `OUTER_DEFAULTS`, then `_robust.outer_momentum`, writing into `out` and
    `out_state` when given. ValueError for an unknown name or a schema mismatch."""
    if name not in OUTER_DEFAULTS:
        raise ValueError(f"unknown outer optimizer {name!r}; known: {', '.join(OUTER_DEFAULTS)}")
    lr = OUTER_DEFAULTS[name][0] if lr is None else float(lr)
    momentum = OUTER_DEFAULTS[name][1] if momentum is None else float(momentum)
    schema = check([params, pseudo_gradient] + ([state] if state is not None else []), "outer input")
    out = _output(ops, schema, out, check)
    out_buf = _output(ops, schema, out_state, check) if momentum else None
    _robust.outer_momentum(ops, ws, schema, params, pseudo_gradient, state, lr, momentum, name == "diloco", out,
                           out_buf)
    return out, out_buf


def screening_stats(ops: Ops, ws: Workspace, check: CheckSchema, all_finite: Callable[[Any], bool],
                    delta: TensorDict, reference: TensorDict | None, centre: TensorDict | None) -> dict[str, Any]:
    """The body of both backends' ``screening_stats`` (contract in
    `peerloom.backends.numpy.aggregate.screening_stats`); `all_finite(tensor)` is the backend's test."""
    schema = check([delta] + [d for d in (reference, centre) if d is not None], "screened tensor")
    if not all(all_finite(t) for t in delta.values()):
        return {"finite": False, "norms": {n: float("nan") for n in delta}, "global_norm": float("nan"),
                "cosine": float("nan"), "distance": float("nan")}
    return {"finite": True, **_robust.screening_stats(ops, ws, schema, delta, reference, centre)}

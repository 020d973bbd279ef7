"""Screening statistics on real tensors (spec/design.md §4: screen on the tensors, never on self-reports).

This slice checks what every later rule depends on: the schema (names, dtypes, shapes exactly as the
manifest says), that every value is finite, and the global L2 norm (accumulated in float64).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TensorSpec = tuple[str, str, tuple[int, ...]]


def schema_matches(tensors: dict[str, np.ndarray], schema: Sequence[TensorSpec]) -> bool:
    """True iff `tensors` has exactly the names, dtypes and shapes of `schema`."""
    if set(tensors) != {name for name, _, _ in schema}:
        return False
    return all(str(tensors[name].dtype) == dtype and tuple(tensors[name].shape) == tuple(shape)
               for name, dtype, shape in schema)


def global_norm(tensors: dict[str, np.ndarray]) -> float:
    """L2 norm over all tensors, accumulated in float64 in sorted-name order."""
    total = 0.0
    for name in sorted(tensors):
        flat = tensors[name].reshape(-1).astype(np.float64)
        total += float(np.dot(flat, flat))
    return float(np.sqrt(total))


def screen_delta(tensors: dict[str, np.ndarray], schema: Sequence[TensorSpec]) -> tuple[bool, str, float]:
    """(ok, reason, norm): reasons ``schema`` and ``non-finite``; ``""`` when ok. Norm is NaN if unknown."""
    if not schema_matches(tensors, schema):
        return False, "schema", float("nan")
    if not all(bool(np.isfinite(t).all()) for t in tensors.values()):
        return False, "non-finite", float("nan")
    return True, "", global_norm(tensors)

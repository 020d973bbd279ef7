"""Screening statistics on real tensors (spec/design.md §4: screen on the tensors, never on self-reports).

This slice checks what every later rule depends on: the schema (names, dtypes, shapes exactly as the
manifest says), that every value is finite, and the global L2 norm (accumulated in float64). `screen_stored`
gives a validator's screen of a stored update all it reads of the file in one pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from peerloom.backends import _robust
from peerloom.core.encoding import SHA256_MULTIHASH_PREFIX

from .aggregate import NUMPY_OPS, workspace
from .stored import StoredTensors, digest_hasher

TensorSpec = tuple[str, str, tuple[int, ...]]

READ_BLOCK = 1 << 20
"""Elements per read of a stored update in `screen_stored` (a multiple of `peerloom.backends._robust.BLOCK`)."""


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


def screen_stored(delta: StoredTensors, *, base: dict[str, np.ndarray] | None = None,
                  applied: dict[str, np.ndarray] | None = None) -> tuple[dict[str, Any], bytes]:
    """What a validator's screen needs of a stored float32 update, from one read of its file: ``({"finite":
    bool, "global_norm": float (NaN unless finite)}, tensor digest)``, the same values as
    `peerloom.backends.numpy.aggregate.screening_stats` and `peerloom.backends.numpy.tensors.tensor_digest` (the
    norm's float64 lanes fed the same blocks in the same order). With `base` and `applied` (float32 buffers of
    its names and shapes) it also writes ``base - delta`` into `applied`, the loss check's update applied
    (spec/protocol.md §6.1). Each block is read once and used while it is in cache, instead of one read of the
    file per check (five of 400 MB at 100M parameters). DecodeError when the file ends early."""
    names = sorted(delta)
    hasher = digest_hasher(delta)
    ws = workspace()
    finite_scratch = ws.get("finite", 0, READ_BLOCK, "bool")
    norms = _robust.SquaredNorms(NUMPY_OPS, ws)
    finite = True
    for name in names:
        flat = delta[name].reshape(-1)
        size = flat.size
        out = None if applied is None or base is None else (np.reshape(base[name], -1), np.reshape(applied[name], -1))
        norms.start()
        for start in range(0, size, READ_BLOCK):
            stop = min(start + READ_BLOCK, size)
            block = flat[start:stop]
            hasher.update(memoryview(block).cast("B"))
            finite = finite and bool(np.isfinite(block, out=finite_scratch[:stop - start]).all())
            if finite:
                norms.add(block)
            if out is not None:
                np.subtract(out[0][start:stop], block, out=out[1][start:stop], dtype=np.float32)
        norms.end(name)
    stats = {"finite": finite, "global_norm": math.sqrt(norms.total()) if finite else float("nan")}
    return stats, SHA256_MULTIHASH_PREFIX + hasher.digest()

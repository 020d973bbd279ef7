"""Update codecs on numpy tensor dicts — the reference backend (spec/design.md §5).

``encode(codec, tensors, state=None) -> (encoded, new_state)`` and ``decode(codec, encoded) -> tensors``;
`peerloom.backends.torch.codecs` is the twin on torch CPU tensors and produces the same bytes, encoded
and decoded. Codecs (`CODECS`; the encoded layout is fixed in `peerloom.backends._codecs`):

========= ============================== ================================= ===============================
codec     what it keeps                  round-trip error (per element)    size vs float32
========= ============================== ================================= ===============================
none      everything                     0                                 1
fp16      IEEE half, nearest even        ``<= 2^-11 |x|`` (normal range)   1/2
bf16      bfloat16, nearest even         ``<= 2^-8 |x|``                   1/2
int8      per 256-block absmax scale     ``<= scale / 2`` (+ rounding;     ~1/4
                                         ``+2^-142`` if scale subnormal)
topk      the k largest ``|x|`` (ties:   dropped values exactly            ``k (4 + 4) / 4n`` (uint32
          lower index), k = ceil(f n)                                      indices), 2% at f = 1%
sign      sign bits and mean ``|x|``     ``||x - d||^2 = ||x||^2 - n s^2``  1/32
========= ============================== ================================= ===============================

Error feedback (Karimireddy et al. 2019, "Error Feedback Fixes SignSGD", arXiv 1901.09847): pass an
`ErrorFeedback` (``ErrorFeedback.zeros_like(tensors)`` to start) and the codec encodes ``c = x + residual``
(one float32 add) and returns the new residual ``c - decode(encoded)``; the trainer keeps it for its next
window. For top-k the kept and dropped coordinates are disjoint, so ``decode + residual == c`` exactly.

Inputs are float32 arrays with finite values (ValueError otherwise). Decoded tensors are new float32
arrays. Encoded input is hostile: see `decode`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from peerloom.backends import _codecs
from peerloom.backends._codecs import CODECS, DEFAULT_MAX_ELEMENTS, DEFAULT_TOPK_FRACTION, INT8_BLOCK, LANES
from peerloom.core.errors import DecodeError

from .tensors import Schema, TensorDict, schema_of

__all__ = ["CODECS", "ErrorFeedback", "decode", "encode", "zeros_state"]

ErrorFeedback = _codecs.ErrorFeedback


def zeros_state(tensors: TensorDict) -> ErrorFeedback:
    """A zero residual of the schema of `tensors` (float32)."""
    return ErrorFeedback({name: np.zeros(np.shape(t), dtype=np.float32) for name, t in tensors.items()})


def _check_input(tensors: TensorDict) -> Schema:
    for name, t in tensors.items():
        if not isinstance(t, np.ndarray) or t.dtype != np.float32:
            raise ValueError(f"tensor {name!r} must be a float32 numpy array")
        if not np.isfinite(t).all():
            raise ValueError(f"tensor {name!r} has non-finite values")
    return schema_of(tensors)


def _mean_abs(x: np.ndarray) -> np.float32:
    """mean |x| as the layout fixes it: float64 lanes, rows added in order, folded by halving."""
    n = x.size
    if n == 0:
        return np.float32(0.0)
    rows = -(-n // LANES)
    a = np.zeros(rows * LANES, dtype=np.float64)
    np.abs(x.reshape(-1), out=a[:n], dtype=np.float64)
    grid = a.reshape(rows, LANES)
    acc = np.zeros(LANES, dtype=np.float64)
    for r in range(rows):
        np.add(acc, grid[r], out=acc)
    h = LANES
    while h > 1:
        h //= 2
        np.add(acc[:h], acc[h : 2 * h], out=acc[:h])
    return np.float32(float(acc[0]) / n)


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest even (finite input)."""
    u = x.view(np.uint32)
    bias = ((u >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
    return ((u + bias) >> np.uint32(16)).astype(np.uint16)


def _topk_indices(c: np.ndarray, k: int) -> np.ndarray:
    """Ascending flat positions of the k largest |c|; among equal |c| at the threshold, the lowest."""
    n = c.size
    if k == n:
        return np.arange(n, dtype=np.int64)
    a = np.abs(c)
    thr = np.partition(a, n - k)[n - k]
    above = np.flatnonzero(a > thr)
    ties = np.flatnonzero(a == thr)[: k - above.size]
    return np.sort(np.concatenate([above, ties]))


def _encode_one(codec: str, name: str, c: np.ndarray, fraction: float) -> dict[str, np.ndarray]:
    flat = c.reshape(-1)
    n = flat.size
    if codec == "none":
        return {name: c.copy()}
    if codec == "fp16":
        return {f"{name}/values": np.clip(c, -_codecs.FP16_MAX, _codecs.FP16_MAX).astype(np.float16)}
    if codec == "bf16":
        return {f"{name}/values": _bf16_bits(c)}
    if codec == "int8":
        nb = _codecs.int8_blocks(n)
        padded = np.zeros(nb * INT8_BLOCK, dtype=np.float32)
        padded[:n] = flat
        blocks = padded.reshape(nb, INT8_BLOCK)
        scale = np.abs(blocks).max(axis=1) / np.float32(127.0) if nb else np.zeros(0, np.float32)
        safe = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
        q = np.rint(blocks / safe[:, None])
        np.clip(q, -127, 127, out=q)
        return {f"{name}/q": q.reshape(-1)[:n].astype(np.int8).reshape(c.shape), f"{name}/scale": scale}
    shape = np.array(c.shape, dtype=np.int64)
    if codec == "topk":
        idx = _topk_indices(flat, _codecs.topk_count(n, fraction))
        return {f"{name}/shape": shape, f"{name}/indices": idx.astype(_codecs.index_dtype(n)),
                f"{name}/values": flat[idx]}
    # sign
    bits = np.zeros(-(-n // 8) * 8, dtype=np.uint8)
    bits[:n] = flat < 0
    return {f"{name}/shape": shape, f"{name}/signs": np.packbits(bits, bitorder="little"),
            f"{name}/scale": np.array([_mean_abs(flat)], dtype=np.float32)}


def encode(
    codec: str, tensors: TensorDict, state: ErrorFeedback | None = None, *, fraction: float = DEFAULT_TOPK_FRACTION
) -> tuple[TensorDict, ErrorFeedback | None]:
    """Encode float32 `tensors` with `codec`; returns ``(encoded, new_state)``.

    `state`: None (no error feedback; `new_state` is None) or the trainer's `ErrorFeedback` of the same
    schema (see the module docstring). `fraction`: top-k's kept share (``k = ceil(fraction * n)`` per tensor,
    at least 1). Raises ValueError for an unknown codec, non-float32 or non-finite input, a bad fraction or a
    residual of another schema.
    """
    _codecs.check_codec(codec)
    schema = _check_input(tensors)
    if state is not None:
        _codecs.check_state_schema(state, schema, schema_of(state.residual))
    encoded: TensorDict = {}
    residual: TensorDict = {}
    for name in sorted(tensors):
        x = tensors[name]
        # ufuncs turn 0-d arrays into scalars: np.asarray keeps every value an array
        c = x if state is None else np.asarray(np.add(x, state.residual[name], dtype=np.float32))
        enc = {k: np.asarray(v) for k, v in _encode_one(codec, name, c, fraction).items()}
        encoded.update(enc)
        if state is not None:
            if codec == "topk":
                r = c.copy()
                r.reshape(-1)[enc[f"{name}/indices"].astype(np.int64)] = 0.0
            else:
                r = np.asarray(np.subtract(c, _decode_one(codec, name, enc, c.shape), dtype=np.float32))
            residual[name] = r
    return encoded, (None if state is None else ErrorFeedback(residual))


def _decode_one(codec: str, name: str, enc: TensorDict, shape: tuple[int, ...]) -> np.ndarray:
    n = _codecs.numel(shape)
    if codec == "none":
        return np.array(enc[name], dtype=np.float32, copy=True)
    if codec == "fp16":
        return enc[f"{name}/values"].astype(np.float32)
    if codec == "bf16":
        return (enc[f"{name}/values"].astype(np.uint32) << np.uint32(16)).view(np.float32)
    if codec == "int8":
        q, scale = enc[f"{name}/q"], enc[f"{name}/scale"]
        if np.any(q == -128):
            raise DecodeError("bad-codec-value", f"{name}/q holds -128")
        if not (np.isfinite(scale).all() and (scale >= 0).all()):
            raise DecodeError("bad-codec-value", f"{name}/scale must be finite and >= 0")
        nb = scale.size
        padded = np.zeros(nb * INT8_BLOCK, dtype=np.float32)
        padded[:n] = q.reshape(-1)
        blocks = padded.reshape(nb, INT8_BLOCK)
        np.multiply(blocks, scale[:, None], out=blocks)
        return padded[:n].reshape(shape)
    if codec == "topk":
        idx, values = enc[f"{name}/indices"].astype(np.int64), enc[f"{name}/values"]
        if idx.size and (int(idx[0]) < 0 or int(idx[-1]) >= n or not bool(np.all(idx[1:] > idx[:-1]))):
            raise DecodeError("bad-codec-value", f"{name}/indices must be strictly increasing in [0, {n})")
        out = np.zeros(n, dtype=np.float32)
        out[idx] = values
        return out.reshape(shape)
    # sign
    signs, scale = enc[f"{name}/signs"], enc[f"{name}/scale"]
    s = scale[0]
    if not (np.isfinite(s) and s >= 0):
        raise DecodeError("bad-codec-value", f"{name}/scale must be finite and >= 0")
    if n % 8 and int(signs[-1]) >> (n % 8):
        raise DecodeError("bad-codec-value", f"{name}/signs has padding bits set")
    # one 8-value row per byte value: a gather instead of unpacking bits
    table = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
                     -s, s).astype(np.float32)
    out = table[signs].reshape(-1)[:n]
    return out.reshape(shape)


def decode(
    codec: str, encoded: Any, *, schema: Schema | None = None, max_elements: int = DEFAULT_MAX_ELEMENTS
) -> TensorDict:
    """Decode an encoded dict (e.g. from `peerloom.backends.numpy.tensors.from_safetensors`) into float32
    tensors, one per name.

    Hostile input: the layout, dtypes and shapes are checked (`peerloom.backends._codecs.plan`) before any
    allocation; `schema` (``((name, "float32", shape), ...)``, the manifest's model schema) pins the names
    and shapes, otherwise no tensor may exceed `max_elements` elements. Values are checked too (index
    ranges and order, int8 -128, scales, padding bits) and every decoded value must be finite. Anything
    wrong raises `DecodeError`; nothing else escapes. Output is bit-identical to the torch backend's.
    """
    if not isinstance(encoded, dict):
        raise DecodeError("bad-codec-layout", "encoded form must be a dict of arrays")
    meta: dict[str, tuple[str, tuple[int, ...]]] = {}
    for key, t in encoded.items():
        if not isinstance(t, np.ndarray):
            raise DecodeError("bad-codec-layout", f"{key!r} is not an array")
        meta[key] = (t.dtype.name if t.dtype.byteorder in "=|<" or t.dtype.itemsize == 1 else "non-native",
                     tuple(int(d) for d in t.shape))

    def read_shape(key: str) -> list[int]:
        return [int(v) for v in encoded[key]]

    shapes = _codecs.plan(codec, meta, read_shape, schema, max_elements)
    out: TensorDict = {}
    with np.errstate(over="ignore", invalid="ignore"):
        for name, shape in shapes.items():
            t = np.asarray(_decode_one(codec, name, encoded, shape))
            if not np.isfinite(t).all():
                raise DecodeError("bad-codec-value", f"{name} decodes to non-finite values")
            out[name] = t
    return out

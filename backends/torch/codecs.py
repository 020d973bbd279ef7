"""Update codecs on torch CPU tensor dicts, byte-identical to the numpy reference.

Same functions, codecs, layout, errors and bytes as `peerloom.backends.numpy.codecs` (see its docstring
for the table of codecs and error bounds, and `peerloom.backends._codecs` for the encoded layout).
Every step is the same IEEE operation as the reference: float32 divides and multiplies, round half to
even (``torch.round`` / ``np.rint``), float64 lane sums in the same order, bit patterns for bfloat16.
"""

from __future__ import annotations

from typing import Any

import torch

from peerloom.backends import _codecs
from peerloom.backends._codecs import CODECS, DEFAULT_MAX_ELEMENTS, DEFAULT_TOPK_FRACTION, INT8_BLOCK, LANES
from peerloom.core.errors import DecodeError

from .tensors import Schema, TorchTensorDict, dtype_name, schema_of

__all__ = ["CODECS", "ErrorFeedback", "decode", "encode", "zeros_state"]

ErrorFeedback = _codecs.ErrorFeedback

_BIT_WEIGHTS = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8)
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()
"""[256, 8]: bit j (LSB first) of each byte value."""


def zeros_state(tensors: TorchTensorDict) -> ErrorFeedback:
    """A zero residual of the schema of `tensors` (float32)."""
    return ErrorFeedback({name: torch.zeros(t.shape, dtype=torch.float32) for name, t in tensors.items()})


def _check_input(tensors: TorchTensorDict) -> Schema:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"tensor {name!r} must be a float32 CPU tensor")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"tensor {name!r} has non-finite values")
    return schema_of(tensors)


def _mean_abs(x: torch.Tensor) -> float:
    n = x.numel()
    if n == 0:
        return 0.0
    rows = -(-n // LANES)
    a = torch.zeros(rows * LANES, dtype=torch.float64)
    a[:n].copy_(x.reshape(-1))
    a[:n].abs_()
    a = a.reshape(rows, LANES)
    acc = torch.zeros(LANES, dtype=torch.float64)
    for r in range(rows):
        acc.add_(a[r])
    h = LANES
    while h > 1:
        h //= 2
        acc[:h].add_(acc[h : 2 * h])
    return float(acc[0]) / n


def _topk_indices(c: torch.Tensor, k: int) -> torch.Tensor:
    n = c.numel()
    if k == n:
        return torch.arange(n, dtype=torch.int64)
    a = c.abs()
    thr = torch.kthvalue(a, n - k + 1).values
    above = torch.nonzero(a > thr).reshape(-1)
    ties = torch.nonzero(a == thr).reshape(-1)[: k - above.numel()]
    return torch.sort(torch.cat([above, ties])).values


def _encode_one(codec: str, name: str, c: torch.Tensor, fraction: float) -> dict[str, torch.Tensor]:
    flat = c.reshape(-1)
    n = flat.numel()
    if codec == "none":
        return {name: c.clone()}
    if codec == "fp16":
        return {f"{name}/values": c.clamp(-_codecs.FP16_MAX, _codecs.FP16_MAX).to(torch.float16)}
    if codec == "bf16":
        return {f"{name}/values": c.to(torch.bfloat16).view(torch.uint16)}
    if codec == "int8":
        nb = _codecs.int8_blocks(n)
        padded = torch.zeros(nb * INT8_BLOCK, dtype=torch.float32)
        padded[:n] = flat
        blocks = padded.reshape(nb, INT8_BLOCK)
        if nb:
            scale = blocks.abs().amax(dim=1) / torch.tensor(127.0, dtype=torch.float32)
        else:
            scale = torch.zeros(0, dtype=torch.float32)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(blocks / safe[:, None]).clamp_(-127, 127)
        return {f"{name}/q": q.reshape(-1)[:n].to(torch.int8).reshape(c.shape), f"{name}/scale": scale}
    shape = torch.tensor(list(c.shape), dtype=torch.int64)
    if codec == "topk":
        idx = _topk_indices(flat, _codecs.topk_count(n, fraction))
        return {f"{name}/shape": shape, f"{name}/indices": idx.to(getattr(torch, _codecs.index_dtype(n))),
                f"{name}/values": flat[idx]}
    # sign
    bits = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8)
    bits[:n] = flat < 0
    packed = (bits.reshape(-1, 8) * _BIT_WEIGHTS).sum(dim=1, dtype=torch.uint8)
    return {f"{name}/shape": shape, f"{name}/signs": packed,
            f"{name}/scale": torch.tensor([_mean_abs(flat)], dtype=torch.float64).to(torch.float32)}


@torch.no_grad()
def encode(
    codec: str,
    tensors: TorchTensorDict,
    state: ErrorFeedback | None = None,
    *,
    fraction: float = DEFAULT_TOPK_FRACTION,
) -> tuple[TorchTensorDict, ErrorFeedback | None]:
    """`peerloom.backends.numpy.codecs.encode` on float32 CPU tensors, byte for byte."""
    _codecs.check_codec(codec)
    schema = _check_input(tensors)
    if state is not None:
        _codecs.check_state_schema(state, schema, schema_of(state.residual))
    encoded: TorchTensorDict = {}
    residual: TorchTensorDict = {}
    for name in sorted(tensors):
        x = tensors[name]
        c = x if state is None else x + state.residual[name]
        enc = _encode_one(codec, name, c, fraction)
        encoded.update(enc)
        if state is not None:
            if codec == "topk":
                r = c.clone()
                r.reshape(-1)[enc[f"{name}/indices"].to(torch.int64)] = 0.0
            else:
                r = c - _decode_one(codec, name, enc, tuple(c.shape))
            residual[name] = r
    return encoded, (None if state is None else ErrorFeedback(residual))


def _decode_one(codec: str, name: str, enc: TorchTensorDict, shape: tuple[int, ...]) -> torch.Tensor:
    n = _codecs.numel(shape)
    if codec == "none":
        return enc[name].clone()
    if codec == "fp16":
        return enc[f"{name}/values"].to(torch.float32)
    if codec == "bf16":
        return enc[f"{name}/values"].view(torch.bfloat16).to(torch.float32)
    if codec == "int8":
        q, scale = enc[f"{name}/q"], enc[f"{name}/scale"]
        if bool((q == -128).any()):
            raise DecodeError("bad-codec-value", f"{name}/q holds -128")
        if not bool((torch.isfinite(scale) & (scale >= 0)).all()):
            raise DecodeError("bad-codec-value", f"{name}/scale must be finite and >= 0")
        nb = scale.numel()
        padded = torch.zeros(nb * INT8_BLOCK, dtype=torch.float32)
        padded[:n] = q.reshape(-1)
        padded.reshape(nb, INT8_BLOCK).mul_(scale[:, None])
        return padded[:n].reshape(shape)
    if codec == "topk":
        idx, values = enc[f"{name}/indices"].to(torch.int64), enc[f"{name}/values"]
        if idx.numel() and (int(idx[0]) < 0 or int(idx[-1]) >= n or not bool((idx[1:] > idx[:-1]).all())):
            raise DecodeError("bad-codec-value", f"{name}/indices must be strictly increasing in [0, {n})")
        out = torch.zeros(n, dtype=torch.float32)
        out[idx] = values
        return out.reshape(shape)
    # sign
    signs, scale = enc[f"{name}/signs"], enc[f"{name}/scale"]
    s = scale[0]
    if not bool(torch.isfinite(s) & (s >= 0)):
        raise DecodeError("bad-codec-value", f"{name}/scale must be finite and >= 0")
    if n % 8 and int(signs[-1]) >> (n % 8):
        raise DecodeError("bad-codec-value", f"{name}/signs has padding bits set")
    table = torch.where(_BYTE_BITS, -s, s)
    out = table[signs.to(torch.int64)].reshape(-1)[:n]
    return out.reshape(shape)


@torch.no_grad()
def decode(
    codec: str, encoded: Any, *, schema: Schema | None = None, max_elements: int = DEFAULT_MAX_ELEMENTS
) -> TorchTensorDict:
    """`peerloom.backends.numpy.codecs.decode` on torch CPU tensors (e.g. from ``safetensors.torch.load``):
    the same checks, the same DecodeErrors, the same output bytes."""
    if not isinstance(encoded, dict):
        raise DecodeError("bad-codec-layout", "encoded form must be a dict of tensors")
    meta: dict[str, tuple[str, tuple[int, ...]]] = {}
    for key, t in encoded.items():
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.layout != torch.strided:
            raise DecodeError("bad-codec-layout", f"{key!r} is not a dense CPU tensor")
        meta[key] = (dtype_name(t.dtype), tuple(int(d) for d in t.shape))

    def read_shape(key: str) -> list[int]:
        return [int(v) for v in encoded[key].tolist()]

    shapes = _codecs.plan(codec, meta, read_shape, schema, max_elements)
    out: TorchTensorDict = {}
    for name, shape in shapes.items():
        t = _decode_one(codec, name, encoded, shape)
        if not bool(torch.isfinite(t).all()):
            raise DecodeError("bad-codec-value", f"{name} decodes to non-finite values")
        out[name] = t
    return out

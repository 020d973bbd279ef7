"""Backend-neutral layout of the update codecs (spec/design.md §5).

`peerloom.backends.numpy.codecs` and `peerloom.backends.torch.codecs` encode and decode the same way; this
module holds what does not touch tensor data: the codec names, the encoded layout (key names, dtypes,
shapes) and its validation, and the small integer rules (top-k's k, block counts). Both backends validate
hostile encoded input through `plan`, so they accept and reject exactly the same dicts.

Encoded layout per tensor ``name`` (float32 input of shape S with ``n`` elements; all little-endian, as
safetensors stores them). Keys are ``name + "/" + field`` (split on the *last* ``/``, so names may hold
``/`` and ``.``), except the ``none`` codec, which is the tensor dict itself:

========= ================================================================================================
codec     fields
========= ================================================================================================
none      ``name``: float32 S (the input, unchanged)
fp16      ``values``: float16 S (round to nearest even, saturated to +-65504)
bf16      ``values``: uint16 S, the bfloat16 bit patterns (numpy has no bfloat16), round to nearest even
int8      ``q``: int8 S in [-127, 127]; ``scale``: float32 [ceil(n / INT8_BLOCK)]; block b of the flat
          tensor decodes to ``float32(q) * scale[b]`` (one float32 multiply); scale = max|x| / 127
topk      ``shape``: int64 [ndim]; ``indices``: uint32 [k] when ``n <= 2**32`` else int64 [k], strictly
          increasing flat (row-major) positions; ``values``: float32 [k]; the rest decodes to +0.0
sign      ``shape``: int64 [ndim]; ``signs``: uint8 [ceil(n / 8)], bit ``j % 8`` (LSB first) of byte
          ``j // 8`` set when x_j < 0, padding bits 0; ``scale``: float32 [1] = mean |x| (float64 lane sum,
          `LANES` lanes folded by halving, divided by n, rounded once); decodes to ``+-scale``
========= ================================================================================================

Decoders raise `peerloom.core.errors.DecodeError` for anything else: unknown or missing keys, wrong
dtypes or shapes, shapes over ``max_elements``, out-of-range or unsorted indices, int8 -128, negative or
non-finite scales, set padding bits, non-finite decoded values, a mismatch with the expected schema.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from peerloom.core.errors import DecodeError

CODECS = ("none", "fp16", "bf16", "int8", "topk", "sign")
"""Codec names as they appear in a revision manifest."""

INT8_BLOCK = 256
"""Elements per int8 block (one float32 scale each: 1.6% overhead)."""

LANES = 4096
"""float64 lanes of the sign codec's mean |x| (a power of two)."""

DEFAULT_TOPK_FRACTION = 0.01
MAX_NDIM = 8
DEFAULT_MAX_ELEMENTS = 1 << 28
"""Largest tensor (elements) a decoder allocates when no schema is given (1 GiB of float32)."""

FP16_MAX = 65504.0

_FIELDS: dict[str, tuple[str, ...]] = {
    "none": (),
    "fp16": ("values",),
    "bf16": ("values",),
    "int8": ("q", "scale"),
    "topk": ("indices", "shape", "values"),
    "sign": ("scale", "shape", "signs"),
}

Schema = tuple[tuple[str, str, tuple[int, ...]], ...]
Meta = Mapping[str, tuple[str, tuple[int, ...]]]


@dataclass(frozen=True)
class ErrorFeedback:
    """Error-feedback state a trainer owns between windows: the float32 residual per tensor (what earlier
    encodings dropped), in the caller's backend type. Seifert et al. / Karimireddy et al. 2019
    (arXiv 1901.09847): encode ``x + residual``, keep ``(x + residual) - decode(encoded)``."""

    residual: dict[str, Any]


def check_codec(codec: str) -> None:
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; known: {', '.join(CODECS)}")


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def topk_count(n: int, fraction: float) -> int:
    """k for a tensor of `n` elements: ``min(n, max(1, ceil(fraction * n)))`` (0 for an empty tensor)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"top-k fraction must be in (0, 1], got {fraction}")
    return 0 if n == 0 else min(n, max(1, math.ceil(fraction * n)))


def index_dtype(n: int) -> str:
    """uint32 when every flat position of an `n`-element tensor fits (``n <= 2**32``), else int64."""
    return "uint32" if n <= 1 << 32 else "int64"


def int8_blocks(n: int) -> int:
    return -(-n // INT8_BLOCK)


def split_key(key: object) -> tuple[str, str]:
    if not isinstance(key, str) or "/" not in key:
        raise DecodeError("bad-codec-layout", f"key {key!r} is not 'name/field'")
    name, field = key.rsplit("/", 1)
    if not name:
        raise DecodeError("bad-codec-layout", f"key {key!r} has an empty tensor name")
    return name, field


def plan(
    codec: str,
    meta: Meta,
    read_shape: Callable[[str], list[int]],
    schema: Schema | None,
    max_elements: int,
) -> dict[str, tuple[int, ...]]:
    """Validate the layout of an encoded dict; return ``{name: decoded shape}`` (sorted by name).

    `meta` maps each key to ``(dtype name, shape)``; `read_shape(key)` returns the values of a ``shape``
    field (called only once it is known to be int64 of at most `MAX_NDIM` entries). Raises DecodeError.
    """
    if codec not in CODECS:
        raise DecodeError("unknown-codec", repr(codec))
    groups: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
    if codec == "none":
        for key, m in meta.items():
            if not isinstance(key, str) or not key:
                raise DecodeError("bad-codec-layout", f"bad tensor name {key!r}")
            groups[key] = {"": m}
    else:
        for key, m in meta.items():
            name, field = split_key(key)
            groups.setdefault(name, {})[field] = m
    shapes: dict[str, tuple[int, ...]] = {}
    for name in sorted(groups):
        fields = groups[name]
        want = _FIELDS[codec]
        if codec != "none" and tuple(sorted(fields)) != want:
            raise DecodeError("bad-codec-layout", f"{name!r} has fields {sorted(fields)}, {codec} needs {list(want)}")

        def need(field: str, dtype: str, shape: tuple[int, ...] | None = None,
                 fields: dict[str, tuple[str, tuple[int, ...]]] = fields, name: str = name) -> tuple[int, ...]:
            return _need(fields, name, field, dtype, shape)

        if codec in ("topk", "sign"):
            shape_field = need("shape", "int64")
            if len(shape_field) != 1 or shape_field[0] > MAX_NDIM:
                raise DecodeError("bad-codec-shape", f"{name}/shape must be int64 [<= {MAX_NDIM}]")
            dims = read_shape(f"{name}/shape")
            if any(d < 0 for d in dims):
                raise DecodeError("bad-codec-shape", f"{name}/shape has a negative dimension")
            shape = tuple(int(d) for d in dims)
        else:
            shape = need({"none": "", "fp16": "values", "bf16": "values", "int8": "q"}[codec],
                         {"none": "float32", "fp16": "float16", "bf16": "uint16", "int8": "int8"}[codec])
        n = numel(shape)
        if schema is None and n > max_elements:
            raise DecodeError("too-large", f"{name} has {n} elements > {max_elements}")
        if codec == "int8":
            need("scale", "float32", (int8_blocks(n),))
        elif codec == "topk":
            k = need("values", "float32")
            if len(k) != 1 or k[0] > n:
                raise DecodeError("bad-codec-shape", f"{name}/values must be float32 [k], k <= {n}")
            need("indices", index_dtype(n), k)
        elif codec == "sign":
            need("signs", "uint8", (-(-n // 8),))
            need("scale", "float32", (1,))
        shapes[name] = shape
    if schema is not None:
        expected = {name: tuple(shape) for name, _, shape in schema}
        if shapes != expected:
            raise DecodeError("schema-mismatch", f"decoded {shapes}, expected {expected}")
    return shapes


def _need(
    fields: dict[str, tuple[str, tuple[int, ...]]], name: str, field: str, dtype: str, shape: tuple[int, ...] | None
) -> tuple[int, ...]:
    got_dtype, got_shape = fields[field]
    if got_dtype != dtype:
        raise DecodeError("bad-codec-dtype", f"{name}/{field} is {got_dtype}, expected {dtype}")
    if shape is not None and tuple(got_shape) != shape:
        raise DecodeError("bad-codec-shape", f"{name}/{field} has shape {tuple(got_shape)}, expected {shape}")
    return tuple(got_shape)


def check_state_schema(state: ErrorFeedback, schema: Schema, state_schema: Schema) -> None:
    if state_schema != schema:
        raise ValueError(f"error-feedback residual has schema {state_schema}, tensors have {schema}")

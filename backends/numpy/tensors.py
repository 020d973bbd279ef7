"""Tensor dictionaries, their safetensors container and their canonical digest (spec/design.md §3 "Tensor artifacts").

A `TensorDict` maps tensor names (text) to numpy arrays. On the wire it travels as safetensors bytes
(https://github.com/huggingface/safetensors: 8-byte little-endian header length, a JSON header, then the
raw little-endian tensor bytes) — never pickle. A head commits to `tensor_digest`, which depends only on
names, dtypes, shapes and values, not on the container or on dict order.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import sys

import numpy as np
import safetensors.numpy

from peerloom.core.encoding import SHA256_MULTIHASH_PREFIX, encode
from peerloom.core.errors import DecodeError

TensorDict = dict[str, np.ndarray]
Schema = tuple[tuple[str, str, tuple[int, ...]], ...]

MAX_HEADER_BYTES = 16 * 1024 * 1024
"""Largest safetensors JSON header `from_safetensors` accepts (checked before parsing)."""

DEFAULT_MAX_TENSORS = 4096

_LITTLE = sys.byteorder == "little"


def _little_endian_c(array: np.ndarray) -> np.ndarray:
    """`array` as a C-contiguous, little-endian array (a copy only when needed)."""
    array = np.asarray(array)
    dtype = array.dtype
    if dtype.byteorder == ">" or (dtype.byteorder == "=" and not _LITTLE):
        dtype = dtype.newbyteorder("<")
    return np.asarray(array, dtype=dtype, order="C")  # unlike ascontiguousarray, keeps 0-d arrays 0-d


def to_safetensors(tensors: TensorDict) -> bytes:
    """Serialize `tensors` to safetensors bytes (no metadata).

    Arrays are written C-contiguous and little-endian whatever their layout in memory. The library orders
    tensors in the file by (dtype alignment, name), so the bytes do not depend on dict order. Raises
    `ValueError`/`TypeError` for names that are not text or dtypes safetensors cannot carry.
    """
    flat: TensorDict = {}
    for name, array in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {type(name).__name__}")
        flat[name] = _little_endian_c(array)
    return safetensors.numpy.save(flat)



_SAFE_NAME = frozenset(chr(c) for c in range(0x20, 0x7F)) - {'"', "\\"}


def safetensors_parts(tensors: TensorDict) -> list[bytes | memoryview] | None:
    """`to_safetensors(tensors)` as a list of pieces whose concatenation is the same bytes, the arrays' own
    memory, not copied (a 400 MB artifact is written and hashed from the array itself). None
    when the fast path does not apply: tensors of more than one dtype (the library orders those by its
    dtype ranking), a name that is not printable ASCII without quotes or backslashes (JSON escaping) or is
    ``__metadata__``, or a dtype other than float32, int8, uint8, int32 or int64; the caller then uses
    `to_safetensors`.
    tests/backends/test_safetensors_views.py checks that the bytes are the library's."""
    names = sorted(tensors)  # one dtype: the library orders by name
    arrays = [_little_endian_c(tensors[n]) for n in names]
    if "__metadata__" in tensors:
        return None
    header = safetensors_header(tuple((n, a.dtype.name, a.shape) for n, a in zip(names, arrays, strict=True)))
    if header is None:
        return None
    parts: list[bytes | memoryview] = [header]
    parts += [a.reshape(-1).data.cast("B") for a in arrays if a.nbytes]
    return parts


_HEADER_CODES = {"float32": "F32", "int8": "I8", "uint8": "U8", "int32": "I32", "int64": "I64"}


def safetensors_header(schema: Schema) -> bytes | None:
    """The 8-byte length and JSON header the safetensors library writes for tensors of `schema` (``(name,
    numpy dtype name, shape)`` sorted by name, one dtype: the data then holds the tensors in that order).
    None where the library's bytes could differ (`safetensors_parts` lists the cases)."""
    if len({dtype for _, dtype, _ in schema}) > 1 or any(
            dtype not in _HEADER_CODES or not (isinstance(name, str) and name and set(name) <= _SAFE_NAME)
            or name == "__metadata__" for name, dtype, _ in schema):
        return None
    entries, offset = [], 0
    for name, dtype, shape in schema:
        count = 1
        for d in shape:
            count *= int(d)
        end = offset + count * np.dtype(dtype).itemsize
        dims = ",".join(str(int(d)) for d in shape)
        entries.append(f'"{name}":{{"dtype":"{_HEADER_CODES[dtype]}","shape":[{dims}],"data_offsets":[{offset},{end}]}}')
        offset = end
    header = ("{" + ",".join(entries) + "}").encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header

def _reject_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate header key {key!r}")
        out[key] = value
    return out


def from_safetensors(data: bytes | bytearray | memoryview, *, max_tensors: int = DEFAULT_MAX_TENSORS) -> TensorDict:
    """Parse safetensors bytes from an untrusted peer into a `TensorDict`.

    Checked before the library parses anything: ``len(data) >= 8``; the little-endian u64 header length
    is at most ``len(data) - 8`` and at most `MAX_HEADER_BYTES` (16 MiB); the header is UTF-8 JSON whose
    top level is an object with no duplicate keys and at most `max_tensors` tensor entries. The library
    then checks dtypes, shapes and that offsets tile the buffer exactly. The returned arrays are
    read-only (backed by the parsed bytes), little-endian and C-contiguous; copy before writing.

    Any failure raises `DecodeError("bad-safetensors", detail)`; nothing else escapes. Never unpickles.
    """
    try:
        data = bytes(data)
    except Exception as exc:
        raise DecodeError("bad-safetensors", f"not bytes: {type(exc).__name__}") from exc
    if len(data) < 8:
        raise DecodeError("bad-safetensors", f"{len(data)} bytes is shorter than the 8-byte length prefix")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > len(data) - 8:
        raise DecodeError("bad-safetensors", f"header length {header_len} exceeds {len(data) - 8} bytes")
    if header_len > MAX_HEADER_BYTES:
        raise DecodeError("bad-safetensors", f"header length {header_len} > {MAX_HEADER_BYTES}")
    try:
        header = json.loads(data[8 : 8 + header_len].decode("utf-8"), object_pairs_hook=_reject_duplicates)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise DecodeError("bad-safetensors", f"header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise DecodeError("bad-safetensors", "header is not a JSON object")
    count = sum(1 for key in header if key != "__metadata__")
    if count > max_tensors:
        raise DecodeError("bad-safetensors", f"{count} tensors > {max_tensors}")
    try:
        tensors = safetensors.numpy.load(data)
    except Exception as exc:  # the Rust parser raises SafetensorError; unknown dtypes raise KeyError
        raise DecodeError("bad-safetensors", f"{type(exc).__name__}: {exc}") from exc
    if len(tensors) != count:
        raise DecodeError("bad-safetensors", f"parsed {len(tensors)} tensors, header names {count}")
    return tensors



# safetensors dtype names -> little-endian numpy dtypes that `safetensors_views` maps without a copy.
_VIEW_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
                "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?"}


def safetensors_views(data: bytes | mmap.mmap, *, max_tensors: int = DEFAULT_MAX_TENSORS) -> TensorDict:
    """`from_safetensors` without copying: each array is a read-only view into `data` (a 400 MB
    artifact loads in one read, not a read plus a copy; from a read-only ``mmap`` of its file, in none:
    pages are read from the page cache as the arrays are used).

    Same checks as `from_safetensors` on the prefix and header, and then, in place of the library's: every
    entry (but ``__metadata__``) is ``{"dtype", "shape", "data_offsets"}`` with a known dtype, a shape of
    non-negative ints, and offsets ``[begin, end]`` with ``end - begin`` = elements x item size; sorted by
    offset, the entries tile the data after the header exactly (no gap, no overlap, nothing after).
    A dtype numpy cannot view (e.g. BF16) falls back to `from_safetensors`. Raises `DecodeError(
    "bad-safetensors", detail)` and nothing else; never unpickles.
    """
    if not isinstance(data, (bytes, mmap.mmap)):
        return from_safetensors(data, max_tensors=max_tensors)
    if len(data) < 8:
        raise DecodeError("bad-safetensors", f"{len(data)} bytes is shorter than the 8-byte length prefix")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > len(data) - 8 or header_len > MAX_HEADER_BYTES:
        raise DecodeError("bad-safetensors", f"header length {header_len} does not fit {len(data)} bytes")
    spans = safetensors_layout(data[8 : 8 + header_len], len(data), max_tensors=max_tensors)
    if spans is None:
        return from_safetensors(data if isinstance(data, bytes) else memoryview(data), max_tensors=max_tensors)
    base = 8 + header_len
    tensors: TensorDict = {}
    for begin, _, name, dtype, shape, count in spans:
        tensors[name] = np.frombuffer(data, dtype=dtype, count=count, offset=base + begin).reshape(shape)
    return tensors


Span = tuple[int, int, str, np.dtype, tuple[int, ...], int]
"""``(begin, end, name, dtype, shape, elements)`` of one tensor, offsets relative to the data after the header."""


def safetensors_layout(header: bytes, total: int, *, max_tensors: int = DEFAULT_MAX_TENSORS) -> list[Span] | None:
    """The tensors of a safetensors file of `total` bytes whose JSON header is `header` (the bytes after the
    8-byte length), checked as `safetensors_views` documents, sorted by offset. None when a dtype numpy
    cannot view (the caller falls back to the library). Raises `DecodeError("bad-safetensors", detail)`."""
    try:
        parsed = json.loads(header.decode("utf-8"), object_pairs_hook=_reject_duplicates)
    except (ValueError, RecursionError) as exc:
        raise DecodeError("bad-safetensors", f"header is not JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise DecodeError("bad-safetensors", "header is not a JSON object")
    entries = [(k, v) for k, v in parsed.items() if k != "__metadata__"]
    if len(entries) > max_tensors:
        raise DecodeError("bad-safetensors", f"{len(entries)} tensors > {max_tensors}")
    spans: list[Span] = []
    for name, entry in entries:
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise DecodeError("bad-safetensors", f"tensor {name!r}: bad entry")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in _VIEW_DTYPES:
            if isinstance(dtype, str):
                return None
            raise DecodeError("bad-safetensors", f"tensor {name!r}: bad dtype")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise DecodeError("bad-safetensors", f"tensor {name!r}: bad shape or offsets")
        count = 1
        for d in shape:
            count *= d
        item = np.dtype(_VIEW_DTYPES[dtype]).itemsize
        if not 0 <= offsets[0] <= offsets[1] or offsets[1] - offsets[0] != count * item:
            raise DecodeError("bad-safetensors", f"tensor {name!r}: offsets do not hold its shape")
        spans.append((offsets[0], offsets[1], name, np.dtype(_VIEW_DTYPES[dtype]), tuple(shape), count))
    spans.sort(key=lambda s: (s[0], s[1]))
    end = 0
    for begin, stop, name, _, _, _ in spans:
        if begin != end:
            raise DecodeError("bad-safetensors", f"tensor {name!r}: data does not tile the buffer")
        end = stop
    base = 8 + len(header)
    if base + end != total:
        raise DecodeError("bad-safetensors", f"{total - base - end} bytes after the last tensor")
    return spans


def schema_of(tensors: TensorDict) -> Schema:
    """``((name, dtype, shape), ...)`` sorted by name; dtype is numpy's name (``"float32"``, ``"int64"``)."""
    return tuple(
        (name, np.dtype(tensors[name].dtype).name, tuple(int(d) for d in np.shape(tensors[name])))
        for name in sorted(tensors)
    )


def tensor_digest(tensors: TensorDict) -> bytes:
    """Canonical, container-independent digest of a tensor dict: a 34-byte content id.

    Definition (what a head commits to, spec/design.md §3)::

        schema  = [[name, dtype, [d0, d1, ...]] for name in sorted(names)]   # dtype e.g. "float32"
        digest  = SHA-256( encode(schema) || raw(t[n0]) || raw(t[n1]) || ... )  # names in sorted order
        content id = 0x12 0x20 || digest                                       # multihash sha2-256

    ``encode`` is peerloom's canonical CBOR (RFC 8949 §4.2.1); names sort by Python string order (code
    points); ``raw`` is the tensor's bytes in C (row-major) order, little-endian. The schema prefix
    fixes every tensor's length, so the concatenation is unambiguous. The bytes are streamed into the
    hash tensor by tensor, never concatenated.
    """
    names = sorted(tensors)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {type(name).__name__}")
    hasher = hashlib.sha256(encode([[n, dt, list(shape)] for n, dt, shape in schema_of(tensors)]))
    for name in names:
        array = _little_endian_c(tensors[name])
        if array.size:
            hasher.update(array.reshape(-1).view(np.uint8).data)
    return SHA256_MULTIHASH_PREFIX + hasher.digest()

"""Canonical CBOR encoding and content ids.

Every protocol object is encoded as deterministic CBOR (RFC 8949 §4.2.1, "core deterministic encoding":
shortest integer and length forms, definite lengths, map keys sorted by their encoded bytes). Decoding is
strict: the bytes must re-encode to exactly themselves, so one object has exactly one encoding and one id.
Only these data items are admitted: unsigned/negative integers within 64 bits, byte strings, text strings,
arrays, maps with text keys, false/true/null and floats. Tags are refused.

A content id is a multihash: ``0x12 0x20`` (sha2-256, 32 bytes) followed by SHA-256 of the bytes, so the
hash function can change later without ambiguity.
"""

from __future__ import annotations

import hashlib
from typing import Any, TypeGuard

import cbor2

from .errors import DecodeError

SHA256_MULTIHASH_PREFIX = b"\x12\x20"
CONTENT_ID_BYTES = 34
MAX_DEPTH = 32
_INT_LIMIT = 1 << 64


def encode(obj: Any) -> bytes:
    """Deterministic CBOR bytes of `obj` (RFC 8949 §4.2.1)."""
    _check(obj, 0)
    return cbor2.dumps(obj, canonical=True)


def decode(data: bytes | bytearray | memoryview, *, max_bytes: int) -> Any:
    """Decode canonical CBOR, refusing anything else.

    `max_bytes` is checked before any parsing. Raises `DecodeError` with reasons ``too-large``,
    ``malformed``, ``bad-type``, ``too-deep`` or ``non-canonical``; nothing else escapes.
    """
    if len(data) > max_bytes:
        raise DecodeError("too-large", f"{len(data)} > {max_bytes} bytes")
    data = bytes(data)
    try:
        obj = cbor2.loads(data)
    except RecursionError as exc:
        raise DecodeError("too-deep") from exc
    except Exception as exc:  # cbor2 raises several types for malformed input
        raise DecodeError("malformed", type(exc).__name__) from exc
    _check(obj, 0)
    if cbor2.dumps(obj, canonical=True) != data:
        raise DecodeError("non-canonical")
    return obj


def _check(obj: Any, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise DecodeError("too-deep")
    if obj is None or isinstance(obj, (bool, str, bytes, float)):
        return
    if isinstance(obj, int):
        if not -_INT_LIMIT <= obj < _INT_LIMIT:
            raise DecodeError("bad-type", "integer outside 64 bits")
        return
    if isinstance(obj, (list, tuple)):
        for item in obj:
            _check(item, depth + 1)
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not isinstance(key, str):
                raise DecodeError("bad-type", "map keys must be text")
            _check(value, depth + 1)
        return
    raise DecodeError("bad-type", type(obj).__name__)


def sha256(data: bytes | bytearray | memoryview) -> bytes:
    """Raw 32-byte SHA-256 digest."""
    return hashlib.sha256(data).digest()


def content_id(data: bytes | bytearray | memoryview) -> bytes:
    """Multihash content id (34 bytes) of `data`: sha2-256 prefix + SHA-256."""
    return SHA256_MULTIHASH_PREFIX + hashlib.sha256(data).digest()


def is_content_id(value: object) -> TypeGuard[bytes]:
    return isinstance(value, bytes) and len(value) == CONTENT_ID_BYTES and value[:2] == SHA256_MULTIHASH_PREFIX


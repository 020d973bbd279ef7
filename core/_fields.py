"""Strict readers for fields of decoded CBOR maps: wrong or missing fields raise DecodeError."""

from __future__ import annotations

from typing import Any

from .encoding import is_content_id
from .errors import DecodeError
from .identity import PeerId


def _field(body: dict[str, Any], key: str) -> Any:
    if key not in body:
        raise DecodeError("missing-field", key)
    return body[key]


def exact_keys(body: Any, keys: frozenset[str], what: str) -> dict[str, Any]:
    """`body` must be a map with exactly `keys` (unknown fields are refused, not ignored)."""
    if not isinstance(body, dict):
        raise DecodeError("bad-type", f"{what} must be a map")
    if set(body) != keys:
        extra, missing = sorted(set(body) - keys), sorted(keys - set(body))
        raise DecodeError("bad-fields", f"{what}: extra {extra} missing {missing}")
    return body


def uint(body: dict[str, Any], key: str, *, maximum: int = (1 << 63) - 1) -> int:
    value = _field(body, key)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= maximum:
        raise DecodeError("bad-field", f"{key} must be an integer in 0..{maximum}")
    return value


def number(body: dict[str, Any], key: str) -> float:
    value = _field(body, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DecodeError("bad-field", f"{key} must be a number")
    return float(value)


def text(body: dict[str, Any], key: str, *, max_len: int = 256) -> str:
    value = _field(body, key)
    if not isinstance(value, str) or len(value) > max_len:
        raise DecodeError("bad-field", f"{key} must be text of at most {max_len} characters")
    return value


def raw(body: dict[str, Any], key: str, *, size: int | None = None, max_len: int = 1 << 24) -> bytes:
    value = _field(body, key)
    if not isinstance(value, bytes) or len(value) > max_len or (size is not None and len(value) != size):
        raise DecodeError("bad-field", f"{key} must be bytes" + (f" of length {size}" if size else ""))
    return value


def cid(body: dict[str, Any], key: str) -> bytes:
    value = _field(body, key)
    if not is_content_id(value):
        raise DecodeError("bad-field", f"{key} must be a content id")
    return value


def optional_cid(body: dict[str, Any], key: str) -> bytes | None:
    return None if _field(body, key) is None else cid(body, key)


def peer(body: dict[str, Any], key: str) -> PeerId:
    return PeerId.from_bytes(raw(body, key, max_len=64))


def array(body: dict[str, Any], key: str, *, max_len: int) -> list[Any]:
    value = _field(body, key)
    if not isinstance(value, list) or len(value) > max_len:
        raise DecodeError("bad-field", f"{key} must be an array of at most {max_len} items")
    return value


def boolean(body: dict[str, Any], key: str) -> bool:
    value = _field(body, key)
    if not isinstance(value, bool):
        raise DecodeError("bad-field", f"{key} must be a boolean")
    return value

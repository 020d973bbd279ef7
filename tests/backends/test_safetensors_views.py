"""`safetensors_views` (spec/design.md §5, Memory): the same tensors as `from_safetensors`, as views without a
copy, and the same refusals of malformed (hostile) containers."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from peerloom.backends.numpy.tensors import from_safetensors, safetensors_views, to_safetensors
from peerloom.core.errors import DecodeError


def _container(header: dict, payload: bytes) -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + payload


def test_views_equal_the_copying_parser_and_share_the_buffer() -> None:
    rng = np.random.default_rng(0)
    tensors = {"w": rng.standard_normal((3, 5), dtype=np.float32), "b": np.arange(7, dtype=np.int64),
               "q": rng.integers(-128, 127, 9, dtype=np.int8), "e": np.zeros((0, 4), np.float32)}
    data = to_safetensors(tensors)
    views = safetensors_views(data)
    copies = from_safetensors(data)
    assert set(views) == set(copies) == set(tensors)
    for name, array in tensors.items():
        assert views[name].dtype == copies[name].dtype and views[name].shape == array.shape
        np.testing.assert_array_equal(views[name], array)
        assert not views[name].flags.writeable
    assert np.shares_memory(views["w"], np.frombuffer(data, np.uint8))


@pytest.mark.parametrize("header, payload", [
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),  # offsets too short
    ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),  # a gap before it
    ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8),  # bytes after the last
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),  # overlap
    ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
    ({"w": {"dtype": 7, "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
    ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4.0]}}, b"\0" * 4),
    ({"w": [1, 2]}, b""),
    ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}}, b"\0" * 4),  # truncated
])
def test_malformed_containers_are_refused_like_the_library(header: dict, payload: bytes) -> None:
    data = _container(header, payload)
    with pytest.raises(DecodeError):
        safetensors_views(data)
    with pytest.raises(DecodeError):
        from_safetensors(data)


def test_an_entry_with_unknown_keys_is_refused() -> None:  # stricter than the library, which ignores them
    with pytest.raises(DecodeError):
        safetensors_views(_container({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}}, b"\0" * 4))


def test_short_and_oversized_prefixes_are_refused() -> None:
    for data in (b"", b"\1" * 7, (1 << 40).to_bytes(8, "little") + b"{}", (5).to_bytes(8, "little") + b"[1]xx"):
        with pytest.raises(DecodeError):
            safetensors_views(data)


@given(st.binary(max_size=200))
def test_arbitrary_bytes_raise_only_decode_error(data: bytes) -> None:
    with contextlib.suppress(DecodeError):  # anything else fails the test
        safetensors_views(data)


@given(st.binary(min_size=0, max_size=64), st.integers(0, 3))
def test_views_accept_what_the_library_accepts(raw: bytes, cut: int) -> None:
    n = len(raw) // 4
    data = to_safetensors({"x": np.frombuffer(raw[:4 * n], np.float32), "y": np.frombuffer(raw[:n], np.uint8)})
    data = data[:len(data) - cut] if cut else data
    try:
        expected = from_safetensors(data)
    except DecodeError:
        with pytest.raises(DecodeError):
            safetensors_views(data)
        return
    got = safetensors_views(data)
    assert set(got) == set(expected)
    for name in got:
        np.testing.assert_array_equal(got[name], expected[name])


_NAMES = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=8)


@given(st.sampled_from(["float32", "int8", "uint8", "int32", "int64"]),
       st.dictionaries(_NAMES, st.lists(st.integers(0, 4), min_size=0, max_size=3), max_size=4))
def test_parts_are_the_library_bytes_without_a_copy(dtype: str, shapes: dict) -> None:
    """`safetensors_parts` joins to exactly `to_safetensors` (or declines), and its pieces are the arrays."""
    from peerloom.backends.numpy.tensors import safetensors_parts

    tensors = {n: np.arange(int(np.prod(s)), dtype=dtype).reshape(s) for n, s in shapes.items()}
    parts = safetensors_parts(tensors)
    if any('"' in n or "\\" in n for n in tensors):
        assert parts is None
        return
    assert parts is not None
    assert b"".join(bytes(p) for p in parts) == to_safetensors(tensors)


def test_parts_decline_mixed_dtypes_and_share_memory() -> None:
    from peerloom.backends.numpy.tensors import safetensors_parts

    assert safetensors_parts({"a": np.zeros(2, np.float32), "b": np.zeros(2, np.int8)}) is None
    w = np.ones(1000, np.float32)
    parts = safetensors_parts({"w": w})
    assert parts is not None and np.shares_memory(np.frombuffer(parts[1], np.float32), w)

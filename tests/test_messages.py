"""Wire messages: round-trips, strict parsing, and fuzzing that only DecodeError escapes."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from peerloom.core.encoding import encode
from peerloom.core.errors import DecodeError
from peerloom.core.messages import Chunk, ChunkRequest, Hello, decode_message, encode_message

MAX = 16 << 20
CID = b"\x12\x20" + b"\x07" * 32


@pytest.mark.parametrize("message", [
    Hello(revision=CID, roles=("trainer",), head_window=3),
    ChunkRequest(artifact=CID, index=2),
    Chunk(artifact=CID, index=0, data=b"abc"),
])
def test_round_trip(message):
    assert decode_message(encode_message(message), max_bytes=MAX) == message


@pytest.mark.parametrize("obj,reason", [
    (["hello", {"revision": CID, "roles": ["king"], "head_window": 0}], "bad-field"),
    (["hello", {"revision": CID, "roles": [], "head_window": 0, "x": 1}], "bad-fields"),
    (["chunk-get", {"artifact": b"short", "index": 0}], "bad-field"),
    (["chunk-get", {"artifact": CID, "index": -1}], "bad-field"),
    (["nope", {}], "unknown-message"),
    ({"kind": "hello"}, "bad-message"),
])
def test_strict_parsing(obj, reason):
    with pytest.raises(DecodeError) as err:
        decode_message(encode(obj), max_bytes=MAX)
    assert err.value.reason == reason


def test_control_messages_are_capped_below_chunks():
    big = encode(["hello", {"revision": CID, "roles": [], "head_window": 0, "pad": b"x" * (2 << 20)}])
    with pytest.raises(DecodeError):
        decode_message(big, max_bytes=MAX)


@given(st.binary(max_size=300))
def test_random_bytes_only_raise_decode_error(data):
    try:
        decode_message(data, max_bytes=MAX)
    except DecodeError:
        pass


kinds = st.sampled_from(["hello", "head", "signed", "chunk-get", "chunk", "chunk-missing"])
leaf = st.integers(-5, 5) | st.binary(max_size=40) | st.text(max_size=5) | st.none() | st.just(CID)
body = st.recursive(leaf, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(
    st.sampled_from(["revision", "roles", "head_window", "head", "certificate", "artifact", "index", "data",
                     "window", "votes", "params"]), inner, max_size=6), max_leaves=25)


@given(kinds, body)
def test_structured_garbage_only_raises_decode_error(kind, value):
    try:
        decode_message(encode([kind, value]), max_bytes=MAX)
    except DecodeError:
        pass

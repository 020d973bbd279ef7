"""Wire messages: round-trips, strict parsing, and fuzzing that only DecodeError escapes."""

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from peerloom.core.encoding import encode
from peerloom.core.errors import DecodeError
from peerloom.core.messages import (
    MAX_PEER_ENTRIES,
    Chunk,
    ChunkRequest,
    DecodeMemo,
    Hello,
    PeerExchange,
    _cbor_head,
    _decode_chunk,
    decode_message,
    encode_message,
    parse_address,
)
from peerloom.core.objects import QuorumCertificate
from tests.helpers import ident

MAX = 16 << 20
CID = b"\x12\x20" + b"\x07" * 32
P1, P2 = ident(1).peer_id.to_bytes(), ident(2).peer_id.to_bytes()
QC3 = QuorumCertificate(head=CID, window=3, round=1, votes=((ident(1).peer_id, b"\x01" * 64),
                                                           (ident(2).peer_id, b"\x02" * 64)))


@pytest.mark.parametrize("message", [
    Hello(revision=CID, roles=("trainer",), head_window=3),
    Hello(revision=CID, roles=("trainer",), head_window=3, listen="127.0.0.1:4001"),
    Hello(revision=CID, roles=("validator",), head_window=3, certificate=QC3),
    Hello(revision=CID, roles=("trainer",), head_window=3, listen="127.0.0.1:4001", certificate=QC3),
    PeerExchange(peers=((ident(1).peer_id, "127.0.0.1:4001"), (ident(2).peer_id, "[::1]:9"))),
    PeerExchange(peers=()),
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
    (["hello", {"revision": CID, "roles": [], "head_window": 0, "listen": "0.0.0.0:1"}], "bad-field"),
    (["hello", {"revision": CID, "roles": [], "head_window": 0, "listen": None}], "bad-field"),
    (["hello", {"revision": CID, "roles": [], "head_window": 4, "certificate": QC3.to_cbor()}], "bad-field"),
    (["hello", {"revision": CID, "roles": [], "head_window": 3, "certificate": None}], "bad-type"),
    (["hello", {"revision": CID, "roles": [], "head_window": 3,
                "certificate": {**QC3.to_cbor(), "votes": [[P1, b"short"]]}}], "bad-field"),
    (["peers", {"peers": [[P1, "127.0.0.1:1"]] * (MAX_PEER_ENTRIES + 1)}], "bad-field"),
    (["peers", {"peers": [[P1, "127.0.0.1:1"], [P1, "127.0.0.1:2"]]}], "bad-field"),  # duplicate peer
    (["peers", {"peers": [[P1, "127.0.0.1:1"], [P2, "127.0.0.1:1"]]}], "bad-field"),  # duplicate address
    (["peers", {"peers": [[P1, "127.0.0.1:1", 3]]}], "bad-field"),
    (["peers", {"peers": [[b"\0" * 38, "127.0.0.1:1"]]}], "bad-peer-id"),
    (["peers", {"peers": [], "x": 1}], "bad-fields"),
    (["updates-get", {"window": 1, "ids": []}], "bad-field"),
    (["updates-get", {"window": 1, "ids": [CID, CID]}], "bad-field"),
    (["updates-get", {"window": 1, "ids": [CID] * 33}], "bad-field"),
    (["updates-get", {"window": -1, "ids": [CID]}], "bad-field"),
    (["updates-get", {"window": 1, "ids": [b"short"]}], "bad-field"),
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
    with contextlib.suppress(DecodeError):  # anything else fails the test
        decode_message(data, max_bytes=MAX)


kinds = st.sampled_from(["hello", "head", "signed", "chunk-get", "chunk", "chunk-missing", "peers", "updates-get"])
leaf = (st.integers(-5, 5) | st.binary(max_size=40) | st.text(max_size=5) | st.none() | st.just(CID)
        | st.just(P1) | st.sampled_from(["127.0.0.1:1", "[::1]:80", "1.2.3.4:0", "::1:5", "127.0.0.1:01"]))
body = st.recursive(leaf, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(
    st.sampled_from(["revision", "roles", "head_window", "head", "certificate", "artifact", "index", "data",
                     "window", "votes", "params", "listen", "peers", "ids"]), inner, max_size=6), max_leaves=25)


@given(kinds, body)
def test_structured_garbage_only_raises_decode_error(kind, value):
    with contextlib.suppress(DecodeError):  # anything else fails the test
        decode_message(encode([kind, value]), max_bytes=MAX)


certificates = st.fixed_dictionaries({"head": st.just(CID) | leaf, "window": st.integers(-1, 4),
                                      "round": st.integers(-1, 2), "votes": st.lists(
                                          st.lists(st.just(P1) | st.binary(max_size=70), max_size=3), max_size=3)},
                                     optional={"x": leaf}) | body


@given(certificates, st.integers(0, 4))
def test_a_hello_certificate_only_raises_decode_error(certificate, head_window):
    """A hello that is valid but for its `certificate` (spec/wire.md `message-hello`)."""
    data = encode(["hello", {"revision": CID, "roles": ["trainer"], "head_window": head_window,
                             "certificate": certificate}])
    try:
        hello = decode_message(data, max_bytes=MAX)
    except DecodeError:
        return
    assert hello.certificate is not None and hello.certificate.window == head_window


@pytest.mark.parametrize("text,expected", [
    ("127.0.0.1:4001", ("127.0.0.1", 4001)),
    ("[::1]:65535", ("::1", 65535)),
    ("10.0.0.7:1", ("10.0.0.7", 1)),
])
def test_parse_address_accepts_canonical_ip_literals(text, expected):
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", [
    "127.0.0.1", "127.0.0.1:0", "127.0.0.1:65536", "127.0.0.1:01", "127.0.0.1:+1", "127.0.0.1: 1",
    "localhost:80", "0.0.0.0:80", "[::]:80", "224.0.0.251:5353", "::1:80", "[127.0.0.1]:80", "127.000.0.1:80",
    "[::0001]:80", "1" * 60 + ".0.0.1:80", "127.0.0.١:80", "",
])
def test_parse_address_refuses_anything_else(text):
    with pytest.raises(DecodeError) as err:
        parse_address(text)
    assert err.value.reason == "bad-field"


@given(st.lists(st.tuples(st.integers(1, 60), st.integers(1, 65535)), max_size=MAX_PEER_ENTRIES,
                unique_by=lambda t: t[0]))
def test_peer_exchange_round_trips(entries):
    message = PeerExchange(peers=tuple((ident(i).peer_id, f"127.0.0.{i}:{port}") for i, port in entries))
    assert decode_message(encode_message(message), max_bytes=MAX) == message


def test_decode_memo_shares_one_decode_per_bytes_and_forgets_nothing_it_should_not_keep():
    memo = DecodeMemo(max_entries=2)
    data = encode_message(Hello(revision=CID, roles=("trainer",), head_window=3))
    first = memo.decode(data, max_bytes=MAX)
    assert first == decode_message(data, max_bytes=MAX)
    assert memo.decode(bytes(data), max_bytes=MAX) is first and memo.hits == 1  # equal bytes, one decode
    # failures are not kept: every receiver gets (and charges) its own DecodeError
    bad = encode(["nope", {}])
    for _ in range(2):
        with pytest.raises(DecodeError):
            memo.decode(bad, max_bytes=MAX)
    # chunks are never kept; other messages are, least recently used dropped first
    chunk = encode_message(Chunk(artifact=CID, index=0, data=b"abc"))
    assert memo.decode(chunk, max_bytes=MAX) is not memo.decode(chunk, max_bytes=MAX)
    other = [encode_message(ChunkRequest(artifact=CID, index=i)) for i in range(2)]
    memo.decode(other[0], max_bytes=MAX)
    memo.decode(data, max_bytes=MAX)  # refreshes the Hello
    memo.decode(other[1], max_bytes=MAX)  # evicts ChunkRequest 0, not the Hello
    hits = memo.hits
    assert memo.decode(data, max_bytes=MAX) is first and memo.hits == hits + 1
    assert memo.decode(other[0], max_bytes=MAX) == ChunkRequest(artifact=CID, index=0) and memo.hits == hits + 1
    # a smaller max_bytes is its own key: the size limit still applies to each caller
    with pytest.raises(DecodeError):
        memo.decode(data, max_bytes=8)
    # the bytes kept are bounded too, not only the entries
    small = DecodeMemo(max_entries=100, max_total_bytes=2 * len(other[0]))
    for message in [*other, encode_message(ChunkRequest(artifact=CID, index=9))]:
        small.decode(message, max_bytes=MAX)
    assert small.total_bytes <= 2 * len(other[0]) and len(small._decoded) == 2


def _outcome(data: bytes | bytearray) -> object:
    """decode_message's answer for `data`: the message, or the DecodeError's reason. A bytearray takes the
    generic path (the chunk fast path looks only at bytes)."""
    try:
        return decode_message(data, max_bytes=MAX)
    except DecodeError as exc:
        return exc.reason


chunks = st.builds(Chunk, artifact=st.just(CID) | st.binary(min_size=32, max_size=32).map(lambda b: b"\x12\x20" + b),
                   index=st.integers(0, 1 << 24) | st.sampled_from([23, 24, 255, 256, 65535, 65536]),
                   data=st.binary(max_size=300) | st.sampled_from([b"x" * 23, b"x" * 24, b"x" * 255, b"x" * 256,
                                                                    b"x" * 65536]))


@given(chunks)
def test_a_chunk_encodes_as_the_generic_encoder_does_and_decodes_to_a_view_of_the_message(chunk):
    """The chunk fast path (core/messages.py `_decode_chunk`) is the generic canonical CBOR, byte for byte,
    and decoding it shares the message's bytes instead of copying the payload."""
    wire = encode_message(chunk)
    assert wire == encode([Chunk.KIND, chunk.body()])
    decoded = decode_message(wire, max_bytes=MAX)
    assert decoded == chunk == _outcome(bytearray(wire))
    assert isinstance(decoded, Chunk) and isinstance(decoded.data, memoryview) and decoded.data.obj is wire


# and some the decoder refuses: an index beyond 2^24
edited_chunks = chunks | st.builds(Chunk, artifact=st.just(CID), index=st.integers((1 << 24) + 1, 1 << 40),
                                   data=st.binary(max_size=30))


@given(edited_chunks, st.data())
def test_the_chunk_fast_path_never_accepts_what_the_generic_decoder_would_not(chunk, data):
    """Any edit of a chunk's encoding (a byte changed, bytes cut or added, a head widened to a longer form
    than its value needs): decode_message answers exactly what the generic decoder does,
    the same chunk or the same refusal."""
    length_head, index_head = _cbor_head(2, len(chunk.data)), _cbor_head(0, chunk.index)
    wire = bytearray(encode_message(chunk))
    edit = data.draw(st.sampled_from(["none", "byte", "cut", "add", "widen-length", "widen-index"]))
    if edit == "none":
        pass
    elif edit == "byte":
        wire[data.draw(st.integers(0, len(wire) - 1))] = data.draw(st.integers(0, 255))
    elif edit == "cut":
        del wire[data.draw(st.integers(0, len(wire) - 1)):]
    elif edit == "add":
        wire[data.draw(st.integers(0, len(wire))):0] = data.draw(st.binary(min_size=1, max_size=4))
    elif edit == "widen-length":
        wire[13:13 + len(length_head)] = b"\x5a" + len(chunk.data).to_bytes(4, "big")
    else:
        at = 13 + len(length_head) + len(chunk.data) + 6
        wire[at:at + len(index_head)] = b"\x1b" + chunk.index.to_bytes(8, "big")  # canonical only >= 2^32
    assert _outcome(bytes(wire)) == _outcome(wire)


def test_a_chunk_with_a_non_shortest_length_is_refused_as_non_canonical():
    wire = encode_message(Chunk(artifact=CID, index=1, data=b"abc"))
    widened = wire[:13] + b"\x5a" + (3).to_bytes(4, "big") + wire[14:]
    assert _decode_chunk(widened) is None
    assert _outcome(widened) == "non-canonical"


def test_a_chunk_over_a_view_of_wider_items_is_encoded_by_its_bytes():
    """A chunk's payload given as a view of 4-byte floats is 8 bytes long, not 2 items."""
    import array

    floats = array.array("f", [1.5, -2.0])
    wire = encode_message(Chunk(artifact=CID, index=3, data=memoryview(floats)))
    assert wire == encode_message(Chunk(artifact=CID, index=3, data=floats.tobytes()))
    assert decode_message(wire, max_bytes=MAX) == Chunk(artifact=CID, index=3, data=floats.tobytes())

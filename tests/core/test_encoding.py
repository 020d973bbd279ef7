"""Canonical CBOR, content ids and signed envelopes: round-trips, strictness and tamper detection."""

import contextlib

import cbor2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from peerloom.core.encoding import content_id, decode, encode
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.errors import DecodeError, VerificationError
from peerloom.core.identity import Identity, PeerId

MAX = 1 << 20

scalars = (st.integers(min_value=-(2**64), max_value=2**64 - 1) | st.text(max_size=20) | st.binary(max_size=20)
           | st.booleans() | st.none() | st.floats(allow_nan=False))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)


@given(values)
def test_round_trip_is_exact(value):
    data = encode(value)
    assert decode(data, max_bytes=MAX) == value or value != value
    assert encode(decode(data, max_bytes=MAX)) == data


@given(st.dictionaries(st.text(min_size=1, max_size=30), st.integers(-1000, 1000), min_size=2, max_size=8))
def test_map_keys_sorted_bytewise_and_unsorted_refused(mapping):
    data = encode(mapping)
    keys = list(cbor2.loads(data))
    encoded_keys = [cbor2.dumps(k) for k in keys]
    assert encoded_keys == sorted(encoded_keys)  # RFC 8949 §4.2.1: bytewise lexicographic order
    reordered = dict(reversed(list(mapping.items())))
    raw = cbor2.dumps(reordered)  # insertion order, not canonical
    if raw != data:
        with pytest.raises(DecodeError) as err:
            decode(raw, max_bytes=MAX)
        assert err.value.reason == "non-canonical"


@pytest.mark.parametrize("data,reason", [
    (bytes.fromhex("1817"), "non-canonical"),        # 23 in two bytes instead of one
    (bytes.fromhex("5f41614162ff"), "non-canonical"),  # indefinite-length byte string
    (bytes.fromhex("c11a514b67b0"), "bad-type"),      # tag 1 (epoch time)
    (bytes.fromhex("a1016161"), "bad-type"),          # integer map key
    (bytes.fromhex("1b"), "malformed"),               # truncated
    (b"\x81" * 5000, None),                            # deep nesting
])
def test_refuses_non_canonical_or_unsupported(data, reason):
    with pytest.raises(DecodeError) as err:
        decode(data, max_bytes=MAX)
    if reason:
        assert err.value.reason == reason


def test_size_checked_before_parsing():
    with pytest.raises(DecodeError) as err:
        decode(b"\x00" * 101, max_bytes=100)
    assert err.value.reason == "too-large"


@given(st.binary(max_size=200))
def test_decode_random_bytes_only_raises_decode_error(data):
    with contextlib.suppress(DecodeError):  # anything else fails the test
        decode(data, max_bytes=MAX)


def test_content_id_is_sha256_multihash():
    cid = content_id(b"abc")
    assert cid[:2] == b"\x12\x20" and len(cid) == 34
    assert cid[2:].hex().startswith("ba7816bf")


def test_peer_id_text_round_trip_and_libp2p_prefix():
    identity = Identity(bytes(range(32)))
    text = identity.peer_id.to_text()
    assert text.startswith("12D3KooW")
    assert PeerId.from_text(text) == identity.peer_id
    with pytest.raises(DecodeError):
        PeerId.from_text(text[:-1] + "0")  # '0' is not base58


@given(st.dictionaries(st.text(max_size=5), st.integers(-1000, 1000), max_size=5), st.integers(min_value=0))
def test_envelope_round_trip_and_every_byte_tamper_detected(body, index):
    identity = Identity(b"\x07" * 32)
    envelope = SignedEnvelope.seal(identity, "update", 1, body)
    data = envelope.to_bytes()
    again = SignedEnvelope.from_bytes(data)
    assert again == envelope and again.open("update", 1) == body
    tampered = bytearray(data)
    tampered[index % len(data)] ^= 0x01
    with pytest.raises((DecodeError, VerificationError)):
        SignedEnvelope.from_bytes(bytes(tampered)).open("update", 1)


def test_envelope_domain_separation():
    identity = Identity(b"\x01" * 32)
    vote = SignedEnvelope.seal(identity, "vote", 1, {"x": 1})
    relabelled = SignedEnvelope(kind="update", version=1, body=vote.body, signer=vote.signer,
                                signature=vote.signature)
    with pytest.raises(VerificationError) as err:
        relabelled.open("update", 1)
    assert err.value.reason == "bad-signature"
    with pytest.raises(VerificationError) as err:
        vote.open("vote", 2)
    assert err.value.reason == "unknown-version"


def test_envelope_from_other_signer_fails():
    a, b = Identity(b"\x01" * 32), Identity(b"\x02" * 32)
    env = SignedEnvelope.seal(a, "join", 1, {"capacity": 1})
    forged = SignedEnvelope(kind="join", version=1, body=env.body, signer=b.peer_id, signature=env.signature)
    with pytest.raises(VerificationError):
        forged.open("join", 1)


def test_a_checked_signature_is_remembered_and_nothing_else_passes(monkeypatch):
    """`PeerId.verify` checks each (key, signature, message) that passes once per process; a message, signature
    or key that differs in any way is checked again (and fails), and a full cache is forgotten at once."""
    from peerloom.core import identity as identity_module

    monkeypatch.setattr(identity_module, "_verified", set())
    signer, other = Identity(b"\x05" * 32), Identity(b"\x06" * 32)
    message = b"window 7 head"
    signature = signer.sign(message)
    checks = []
    real = identity_module.nacl.signing.VerifyKey

    class Counting(real):  # PyNaCl's class, subclassed to count checks
        def verify(self, *args, **kwargs):
            checks.append(1)
            return super().verify(*args, **kwargs)

    monkeypatch.setattr(identity_module.nacl.signing, "VerifyKey", Counting)
    assert signer.peer_id.verify(message, signature) and signer.peer_id.verify(message, signature)
    assert len(checks) == 1  # the second time from the cache
    flipped = bytes([signature[0] ^ 1]) + signature[1:]
    assert not signer.peer_id.verify(message + b"!", signature)
    assert not signer.peer_id.verify(message, flipped)
    assert not other.peer_id.verify(message, signature)
    assert not other.peer_id.verify(message, signature)  # a failure is never remembered
    assert len(checks) == 5
    monkeypatch.setattr(identity_module, "VERIFIED_CACHE_ENTRIES", 2)
    sizes = []
    for text in (b"a", b"b", b"c"):
        assert signer.peer_id.verify(text, signer.sign(text))
        sizes.append(len(identity_module._verified))
    assert sizes == [2, 1, 2]  # it held `message` already: full at "b", so cleared before "b" was added

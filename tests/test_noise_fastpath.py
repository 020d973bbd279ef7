"""The transport fast path (OpenSSL ChaCha20-Poly1305 via `cryptography`, in place) produces exactly the
Noise transport messages of the reference path (libsodium, `CipherState.encrypt_with_ad`), and back."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from peerloom.adapters.noise import MAX_TRANSPORT_PLAINTEXT, TAGLEN, CipherState, NoiseError, NoiseTransport

KEY_A, KEY_B = bytes(range(32)), bytes(range(32, 64))


def pair() -> tuple[NoiseTransport, NoiseTransport]:
    return (NoiseTransport(send=CipherState(KEY_A), receive=CipherState(KEY_B)),
            NoiseTransport(send=CipherState(KEY_B), receive=CipherState(KEY_A)))


@given(st.lists(st.binary(max_size=3000), max_size=6), st.integers(0, 40))
def test_in_place_encryption_equals_the_reference_and_decrypts(messages: list[bytes], offset: int) -> None:
    fast, _ = pair()
    reference = CipherState(KEY_A)
    _, receiver = pair()
    for message in messages:
        buffer = bytearray(offset + len(message) + TAGLEN + 5)
        buffer[offset:offset + len(message)] = message
        n = fast.encrypt_in_place(buffer, offset, len(message))
        ciphertext = bytes(buffer[offset:offset + n])
        assert ciphertext == reference.encrypt_with_ad(b"", message)
        out = bytearray(len(message) + 7)
        assert receiver.decrypt_into(ciphertext, out) == len(message)
        assert bytes(out[:len(message)]) == message


@pytest.mark.parametrize("size", [0, 1, MAX_TRANSPORT_PLAINTEXT])
def test_boundary_sizes(size: int) -> None:
    fast, receiver = pair()
    buffer = bytearray(size + TAGLEN)
    buffer[:size] = bytes(i % 251 for i in range(size))
    plain = bytes(buffer[:size])
    assert fast.encrypt_in_place(buffer, 0, size) == size + TAGLEN
    out = bytearray(size)
    assert receiver.decrypt_into(buffer, out) == size and out == plain
    with pytest.raises(NoiseError):
        fast.encrypt_in_place(bytearray(MAX_TRANSPORT_PLAINTEXT + TAGLEN + 1), 0, MAX_TRANSPORT_PLAINTEXT + 1)


def test_tampered_message_is_refused_and_the_nonce_does_not_advance() -> None:
    fast, receiver = pair()
    good = fast.encrypt(b"hello")
    bad = bytes([good[0] ^ 1]) + good[1:]
    with pytest.raises(NoiseError) as info:
        receiver.decrypt_into(bad, bytearray(5))
    assert info.value.reason == "decrypt-failed"
    out = bytearray(5)
    assert receiver.decrypt_into(good, out) == 5 and out == b"hello"  # nonce 0 still expected


@given(st.binary(max_size=3000), st.integers(0, 40), st.integers(0, 9))
def test_memoryview_buffers_give_the_same_messages(message: bytes, offset: int, slack: int) -> None:
    """The bulk path passes memoryviews (a send buffer, a window of the reassembly buffer, possibly longer
    than the plaintext): same ciphertext as the reference, and only the plaintext's bytes are written."""
    fast, receiver = pair()
    buffer = memoryview(bytearray(offset + len(message) + TAGLEN + slack))
    buffer[offset:offset + len(message)] = message
    n = fast.encrypt_in_place(buffer, offset, len(message))
    ciphertext = bytes(buffer[offset:offset + n])
    assert ciphertext == CipherState(KEY_A).encrypt_with_ad(b"", message)
    out = memoryview(bytearray(b"\xaa" * (len(message) + slack)))
    assert receiver.decrypt_into(ciphertext, out) == len(message)
    assert bytes(out[:len(message)]) == message and bytes(out[len(message):]) == b"\xaa" * slack


def test_exhausted_nonce_is_refused_by_the_fast_path() -> None:
    fast, receiver = pair()
    fast.send.set_nonce(2**64 - 1)
    receiver.receive.set_nonce(2**64 - 1)
    with pytest.raises(NoiseError) as info:
        fast.encrypt_in_place(bytearray(5 + TAGLEN), 0, 5)
    assert info.value.reason == "nonce-exhausted"
    with pytest.raises(NoiseError) as info:
        receiver.decrypt_into(bytes(5 + TAGLEN), bytearray(5))
    assert info.value.reason == "nonce-exhausted"

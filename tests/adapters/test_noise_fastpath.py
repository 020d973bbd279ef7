"""The transport fast path (OpenSSL's AEAD via `cryptography`, in place) produces exactly the Noise transport
messages of the reference path (`CipherState.encrypt_with_ad`: libsodium for ChaChaPoly, the AESGCM
CipherState that the cacophony vectors check), and back, for both ciphers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from peerloom.adapters.noise import MAX_TRANSPORT_PLAINTEXT, TAGLEN, CipherState, NoiseError, NoiseTransport

KEY_A, KEY_B = bytes(range(32)), bytes(range(32, 64))
CIPHERS = ["ChaChaPoly", "AESGCM"]


@pytest.fixture(params=CIPHERS)
def cipher(request: pytest.FixtureRequest) -> str:
    return request.param


def pair(cipher: str) -> tuple[NoiseTransport, NoiseTransport]:
    return (NoiseTransport(send=CipherState(KEY_A, cipher), receive=CipherState(KEY_B, cipher)),
            NoiseTransport(send=CipherState(KEY_B, cipher), receive=CipherState(KEY_A, cipher)))


@pytest.mark.parametrize("name", CIPHERS)
@given(st.lists(st.binary(max_size=3000), max_size=6), st.integers(0, 40))
def test_in_place_encryption_equals_the_reference_and_decrypts(name: str, messages: list[bytes],
                                                               offset: int) -> None:
    fast, _ = pair(name)
    reference = CipherState(KEY_A, name)
    _, receiver = pair(name)
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
def test_boundary_sizes(size: int, cipher: str) -> None:
    fast, receiver = pair(cipher)
    buffer = bytearray(size + TAGLEN)
    buffer[:size] = bytes(i % 251 for i in range(size))
    plain = bytes(buffer[:size])
    assert fast.encrypt_in_place(buffer, 0, size) == size + TAGLEN
    out = bytearray(size)
    assert receiver.decrypt_into(buffer, out) == size and out == plain
    with pytest.raises(NoiseError):
        fast.encrypt_in_place(bytearray(MAX_TRANSPORT_PLAINTEXT + TAGLEN + 1), 0, MAX_TRANSPORT_PLAINTEXT + 1)


def test_tampered_message_is_refused_and_the_nonce_does_not_advance(cipher: str) -> None:
    fast, receiver = pair(cipher)
    good = fast.encrypt(b"hello")
    bad = bytes([good[0] ^ 1]) + good[1:]
    with pytest.raises(NoiseError) as info:
        receiver.decrypt_into(bad, bytearray(5))
    assert info.value.reason == "decrypt-failed"
    out = bytearray(5)
    assert receiver.decrypt_into(good, out) == 5 and out == b"hello"  # nonce 0 still expected


@pytest.mark.parametrize("name", CIPHERS)
@given(st.binary(max_size=3000), st.integers(0, 40), st.integers(0, 9))
def test_memoryview_buffers_give_the_same_messages(name: str, message: bytes, offset: int, slack: int) -> None:
    """The bulk path passes memoryviews (a send buffer, a window of the reassembly buffer, possibly longer
    than the plaintext): same ciphertext as the reference, and only the plaintext's bytes are written."""
    fast, receiver = pair(name)
    buffer = memoryview(bytearray(offset + len(message) + TAGLEN + slack))
    buffer[offset:offset + len(message)] = message
    n = fast.encrypt_in_place(buffer, offset, len(message))
    ciphertext = bytes(buffer[offset:offset + n])
    assert ciphertext == CipherState(KEY_A, name).encrypt_with_ad(b"", message)
    out = memoryview(bytearray(b"\xaa" * (len(message) + slack)))
    assert receiver.decrypt_into(ciphertext, out) == len(message)
    assert bytes(out[:len(message)]) == message and bytes(out[len(message):]) == b"\xaa" * slack


def test_exhausted_nonce_is_refused_by_the_fast_path(cipher: str) -> None:
    fast, receiver = pair(cipher)
    fast.send.set_nonce(2**64 - 1)
    receiver.receive.set_nonce(2**64 - 1)
    with pytest.raises(NoiseError) as info:
        fast.encrypt_in_place(bytearray(5 + TAGLEN), 0, 5)
    assert info.value.reason == "nonce-exhausted"
    with pytest.raises(NoiseError) as info:
        receiver.decrypt_into(bytes(5 + TAGLEN), bytearray(5))
    assert info.value.reason == "nonce-exhausted"


def test_the_two_ciphers_give_different_messages_and_do_not_cross() -> None:
    """A transport keyed alike but with the other cipher refuses the message: the cipher really switches."""
    chacha, _ = pair("ChaChaPoly")
    aes, _ = pair("AESGCM")
    a, b = chacha.encrypt(b"same plaintext"), aes.encrypt(b"same plaintext")
    assert a != b
    _, chacha_receiver = pair("ChaChaPoly")
    with pytest.raises(NoiseError) as info:
        chacha_receiver.decrypt(b)
    assert info.value.reason == "decrypt-failed"


def test_mixed_cipher_states_are_refused() -> None:
    with pytest.raises(NoiseError) as info:
        NoiseTransport(send=CipherState(KEY_A, "AESGCM"), receive=CipherState(KEY_B, "ChaChaPoly"))
    assert info.value.reason == "unsupported-protocol"

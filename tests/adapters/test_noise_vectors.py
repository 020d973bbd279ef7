"""Noise (rev. 34) against the cacophony and snow test vectors in tests/data/noise-vectors/.

Vector format (github.com/noiseprotocol/noise_wiki, "Test vectors"): messages alternate direction by index,
initiator first - the handshake messages of the pattern, then transport messages continuing the
alternation (for XX: I, R, I handshake, then R, I, ...). Each is checked byte for byte both ways.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peerloom.adapters.noise import PATTERNS, CipherState, HandshakeState, NoiseError, x25519_public

VECTOR_DIR = Path(__file__).parents[1] / "data" / "noise-vectors"
VECTOR_FILES = sorted(VECTOR_DIR.glob("*.json"))


def _load() -> list[tuple[str, dict]]:
    cases = []
    for path in VECTOR_FILES:
        vectors = json.loads(path.read_text())["vectors"]
        for i, vector in enumerate(vectors):
            cases.append((f"{path.stem}[{i}]", vector))
    return cases


CASES = _load()


def test_vector_files_present_and_nonempty() -> None:
    assert len(VECTOR_FILES) == 8, VECTOR_FILES
    for path in VECTOR_FILES:
        assert json.loads(path.read_text())["vectors"], f"{path.name} yields zero vectors"
    assert len(CASES) == 8
    assert sum("_AESGCM_" in case_id for case_id, _ in CASES) == 2


def _key(vector: dict, name: str) -> bytes | None:
    value = vector.get(name)
    return bytes.fromhex(value) if value else None


@pytest.mark.parametrize(("case_id", "vector"), CASES, ids=[c[0] for c in CASES])
def test_vector(case_id: str, vector: dict) -> None:
    assert not vector.get("init_psks") and not vector.get("resp_psks"), "psk vectors are not supported"
    name = vector["protocol_name"]
    init = HandshakeState(name, initiator=True, prologue=bytes.fromhex(vector["init_prologue"]),
                          s=_key(vector, "init_static"), e=_key(vector, "init_ephemeral"),
                          rs=_key(vector, "init_remote_static"), random=_no_random)
    resp = HandshakeState(name, initiator=False, prologue=bytes.fromhex(vector["resp_prologue"]),
                          s=_key(vector, "resp_static"), e=_key(vector, "resp_ephemeral"),
                          rs=_key(vector, "resp_remote_static"), random=_no_random)
    n_handshake = len(PATTERNS[name.split("_")[1]].messages)
    messages = vector["messages"]
    assert len(messages) > n_handshake
    init_send = init_recv = resp_send = resp_recv = None
    for i, message in enumerate(messages):
        payload = bytes.fromhex(message["payload"])
        expected = bytes.fromhex(message["ciphertext"])
        initiator_sends = i % 2 == 0
        if i < n_handshake:
            writer, reader = (init, resp) if initiator_sends else (resp, init)
            assert writer.wants_write and not reader.wants_write
            ciphertext = writer.write_message(payload)
            assert ciphertext == expected, f"{case_id}: handshake message {i}"
            assert reader.read_message(ciphertext) == payload
            if i == n_handshake - 1:
                assert init.is_finished and resp.is_finished
                assert init.handshake_hash == resp.handshake_hash
                if "handshake_hash" in vector:
                    assert init.handshake_hash.hex() == vector["handshake_hash"]
                init_send, init_recv = init.split()
                resp_recv, resp_send = resp.split()
        else:
            assert init_send is not None and init_recv is not None
            assert resp_send is not None and resp_recv is not None
            sender, receiver = (init_send, resp_recv) if initiator_sends else (resp_send, init_recv)
            ciphertext = sender.encrypt_with_ad(b"", payload)
            assert ciphertext == expected, f"{case_id}: transport message {i}"
            assert receiver.decrypt_with_ad(b"", ciphertext) == payload
    if "init_remote_static" not in vector and vector.get("resp_static"):
        assert init.rs == bytes.fromhex(_public_hex(vector["resp_static"]))


def _no_random(n: int) -> bytes:
    raise AssertionError("a test vector must not need randomness")


def _public_hex(private_hex: str) -> str:
    return x25519_public(bytes.fromhex(private_hex)).hex()


# --- the parts the vectors do not reach ------------------------------------------------------------------


def _seeded(seed: int):
    counter = [seed]

    def random(n: int) -> bytes:
        counter[0] += 1
        return bytes([counter[0] % 256]) * n

    return random


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("hash_name", ["SHA256", "SHA512", "BLAKE2s", "BLAKE2b"])
def test_every_pattern_round_trips(pattern: str, hash_name: str) -> None:
    """Self-consistency only (no external vectors for these): both sides agree on h and the keys."""
    name = f"Noise_{pattern}_25519_ChaChaPoly_{hash_name}"
    i_s, r_s = bytes([1]) * 32, bytes([2]) * 32
    init = HandshakeState(name, initiator=True, s=i_s, rs=x25519_public(r_s), random=_seeded(10))
    resp = HandshakeState(name, initiator=False, s=r_s, rs=x25519_public(i_s), random=_seeded(90))
    i = 0
    while not init.is_finished:
        writer, reader = (init, resp) if init.wants_write else (resp, init)
        assert reader.read_message(writer.write_message(b"payload %d" % i)) == b"payload %d" % i
        i += 1
    assert resp.is_finished and init.handshake_hash == resp.handshake_hash
    c1, c2 = init.split()
    d1, d2 = resp.split()
    assert d1.decrypt_with_ad(b"ad", c1.encrypt_with_ad(b"ad", b"hello")) == b"hello"
    if not PATTERNS[pattern].one_way:
        assert c2.decrypt_with_ad(b"", d2.encrypt_with_ad(b"", b"back")) == b"back"


def test_out_of_order_use_raises() -> None:
    init = HandshakeState("Noise_NN_25519_ChaChaPoly_SHA256", initiator=True, random=_seeded(1))
    with pytest.raises(NoiseError) as info:
        init.read_message(b"\x00" * 48)
    assert info.value.reason == "out-of-order"
    with pytest.raises(NoiseError) as info:
        init.split()
    assert info.value.reason == "out-of-order"
    resp = HandshakeState("Noise_NN_25519_ChaChaPoly_SHA256", initiator=False, random=_seeded(2))
    resp.read_message(init.write_message(b""))
    init.read_message(resp.write_message(b""))
    init.split()
    with pytest.raises(NoiseError) as info:
        init.split()
    assert info.value.reason == "out-of-order"
    with pytest.raises(NoiseError) as info:
        init.write_message(b"")
    assert info.value.reason == "out-of-order"


def test_short_and_tampered_handshake_messages_fail_stickily() -> None:
    name = "Noise_XX_25519_ChaChaPoly_SHA256"
    init = HandshakeState(name, initiator=True, s=bytes([1]) * 32, random=_seeded(1))
    resp = HandshakeState(name, initiator=False, s=bytes([2]) * 32, random=_seeded(2))
    with pytest.raises(NoiseError) as info:
        resp.read_message(b"\x01" * 31)
    assert info.value.reason == "bad-message-length"
    with pytest.raises(NoiseError) as info:
        resp.read_message(init.write_message(b""))
    assert info.value.reason == "handshake-failed"

    init = HandshakeState(name, initiator=True, s=bytes([1]) * 32, random=_seeded(1))
    resp = HandshakeState(name, initiator=False, s=bytes([2]) * 32, random=_seeded(2))
    resp.read_message(init.write_message(b""))
    message2 = bytearray(resp.write_message(b""))
    message2[40] ^= 1
    with pytest.raises(NoiseError) as info:
        init.read_message(bytes(message2))
    assert info.value.reason == "decrypt-failed"


def test_oversized_payload_is_refused_without_changing_state() -> None:
    init = HandshakeState("Noise_NN_25519_ChaChaPoly_SHA256", initiator=True, random=_seeded(1))
    with pytest.raises(NoiseError) as info:
        init.write_message(b"\x00" * (65535 - 32 + 1))
    assert info.value.reason == "message-too-long"
    assert len(init.write_message(b"\x00" * (65535 - 32))) == 65535


CIPHERS = ["ChaChaPoly", "AESGCM"]


@pytest.mark.parametrize("name", CIPHERS)
def test_nonce_exhaustion(name: str) -> None:
    """§5.1: n = 2^64-1 is reserved; once reached, encryption and decryption signal an error."""
    cipher = CipherState(bytes(32), name)
    cipher.set_nonce(2**64 - 2)
    cipher.encrypt_with_ad(b"", b"last")
    for op in (cipher.encrypt_with_ad, cipher.decrypt_with_ad):
        with pytest.raises(NoiseError) as info:
            op(b"", b"\x00" * 16)
        assert info.value.reason == "nonce-exhausted"


@pytest.mark.parametrize("name", CIPHERS)
def test_decrypt_failure_leaves_nonce_unchanged(name: str) -> None:
    send, receive = CipherState(bytes(32), name), CipherState(bytes(32), name)
    ciphertext = send.encrypt_with_ad(b"", b"hi")
    with pytest.raises(NoiseError) as info:
        receive.decrypt_with_ad(b"", ciphertext[:-1] + bytes([ciphertext[-1] ^ 1]))
    assert info.value.reason == "decrypt-failed"
    assert receive.n == 0
    assert receive.decrypt_with_ad(b"", ciphertext) == b"hi"


@pytest.mark.parametrize("name", CIPHERS)
def test_rekey_changes_key_on_both_sides_alike(name: str) -> None:
    a, b = CipherState(bytes(32), name), CipherState(bytes(32), name)
    a.encrypt_with_ad(b"", b"first")
    b.decrypt_with_ad(b"", CipherState(bytes(32), name).encrypt_with_ad(b"", b"first"))
    a.rekey()
    b.rekey()
    assert a.k == b.k != bytes(32)
    assert a.n == b.n == 1  # Rekey keeps the nonce (§5.1)
    assert b.decrypt_with_ad(b"", a.encrypt_with_ad(b"", b"x")) == b"x"


def test_aesgcm_rekey_and_nonce_follow_section_12_4() -> None:
    """§12.4 and §4.2, computed independently with `cryptography`: the nonce is 32 zero bits then n
    big-endian, and REKEY(k) is the first 32 bytes of ENCRYPT(k, 2^64-1, empty, 32 zero bytes)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    key = bytes(range(32))
    state = CipherState(key, "AESGCM")
    state.set_nonce(0x0102030405060708)
    expected = AESGCM(key).encrypt(bytes(4) + bytes([1, 2, 3, 4, 5, 6, 7, 8]), b"msg", b"ad")
    assert state.encrypt_with_ad(b"ad", b"msg") == expected
    state.rekey()
    assert state.k == AESGCM(key).encrypt(bytes(4) + b"\xff" * 8, bytes(32), b"")[:32]


def test_unknown_cipher_is_refused() -> None:
    with pytest.raises(NoiseError) as info:
        CipherState(bytes(32), "AESSIV")
    assert info.value.reason == "unsupported-protocol"


def test_unsupported_protocol_names() -> None:
    for name in ("Noise_XXpsk3_25519_ChaChaPoly_SHA256", "Noise_XX_448_ChaChaPoly_SHA256",
                 "Noise_XX_25519_AESSIV_SHA256", "Noise_ZZ_25519_ChaChaPoly_SHA256", "garbage"):
        with pytest.raises(NoiseError) as info:
            HandshakeState(name, initiator=True, s=bytes(32))
        assert info.value.reason == "unsupported-protocol"
    with pytest.raises(NoiseError) as info:
        HandshakeState("Noise_XX_25519_ChaChaPoly_SHA256", initiator=True)
    assert info.value.reason == "missing-key"
    with pytest.raises(NoiseError) as info:
        HandshakeState("Noise_NK_25519_ChaChaPoly_SHA256", initiator=True)
    assert info.value.reason == "missing-key"

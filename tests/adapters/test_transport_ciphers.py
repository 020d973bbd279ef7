"""Transport-cipher negotiation (spec/transport.md §1.1): two peerloom nodes that both offer AESGCM in their
handshake payloads use AES-256-GCM for the transport phase; anyone else, libp2p nodes included, gets
ChaChaPoly, and a node that offers nothing sends libp2p's payload byte for byte."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from peerloom.adapters import tcp
from peerloom.adapters.noise import (
    EXTENSION_TRANSPORT_CIPHERS,
    CipherState,
    Libp2pNoiseHandshake,
    NoiseError,
    _encode_field,
    choose_transport_cipher,
    decode_handshake_payload,
    decode_transport_ciphers,
    encode_transport_ciphers,
)
from peerloom.core.identity import Identity
from tests.helpers import CLIENT, HOST, SERVER, run_with_server

# --- the offer's encoding --------------------------------------------------------------------------------


def _entry(name: bytes) -> bytes:
    return _encode_field(EXTENSION_TRANSPORT_CIPHERS, name)


def test_offer_round_trips_in_order_and_sits_beside_libp2p_extensions() -> None:
    muxers = b"\x12\x07/yamux1"  # NoiseExtensions.stream_muxers = ["/yamux1"]
    encoded = encode_transport_ciphers(("AESGCM", "ChaChaPoly"))
    assert decode_transport_ciphers(muxers + encoded + muxers) == ("AESGCM", "ChaChaPoly")
    assert decode_transport_ciphers(muxers) == () and decode_transport_ciphers(None) == ()
    assert encode_transport_ciphers(()) == b""


def test_unknown_names_are_kept_for_the_choice_to_skip() -> None:
    offer = decode_transport_ciphers(_entry(b"AEGIS256") + _entry(b"AESGCM"))
    assert offer == ("AEGIS256", "AESGCM")
    assert choose_transport_cipher(offer, ("AEGIS256", "AESGCM")) == "AESGCM"


@pytest.mark.parametrize(("extensions", "why"), [
    (b"".join(_entry(b"AESGCM") for _ in range(9)), "more than 8"),
    (_entry(b"A" * 33), "printable"),
    (_entry(b"AES GCM"), "printable"),
    (_entry("AESGCMé".encode()), "printable"),
    (bytes([0xE0, 0x84, 0x0A, 1]), "wire type 0"),  # field 20556 as a varint
    (bytes([0xE2, 0x84, 0x0A, 9]) + b"AESGCM", "runs past the end"),
])
def test_malformed_offers_are_bad_payload(extensions: bytes, why: str) -> None:
    with pytest.raises(NoiseError) as info:
        decode_transport_ciphers(extensions)
    assert info.value.reason == "bad-payload" and why in str(info.value)


def test_we_cannot_offer_what_we_do_not_implement() -> None:
    for offer in (("AESSIV",), ("AESGCM",) * 9):
        with pytest.raises(NoiseError) as info:
            Libp2pNoiseHandshake(CLIENT, True, transport_ciphers=offer)
        assert info.value.reason == "unsupported-protocol"


@pytest.mark.parametrize(("initiator", "responder", "chosen"), [
    ((), (), "ChaChaPoly"),
    (("AESGCM",), (), "ChaChaPoly"),
    ((), ("AESGCM",), "ChaChaPoly"),
    (("AESGCM",), ("AESGCM",), "AESGCM"),
    (("ChaChaPoly", "AESGCM"), ("AESGCM", "ChaChaPoly"), "ChaChaPoly"),  # the initiator's order decides
    (("AESGCM", "ChaChaPoly"), ("ChaChaPoly", "AESGCM"), "AESGCM"),
])
def test_choice_rule(initiator: tuple[str, ...], responder: tuple[str, ...], chosen: str) -> None:
    assert choose_transport_cipher(initiator, responder) == chosen


# --- negotiation in the handshake (sans-IO) --------------------------------------------------------------


def _handshake(init_offer: tuple[str, ...], resp_offer: tuple[str, ...]) -> tuple[
        Libp2pNoiseHandshake, Libp2pNoiseHandshake]:
    init = Libp2pNoiseHandshake(CLIENT, True, transport_ciphers=init_offer)
    resp = Libp2pNoiseHandshake(SERVER, False, transport_ciphers=resp_offer)
    while not (init.is_finished and resp.is_finished):
        writer, reader = (init, resp) if init.wants_write else (resp, init)
        reader.read_message(writer.write_message())
    return init, resp


@pytest.mark.parametrize(("init_offer", "resp_offer", "chosen"), [
    ((), (), "ChaChaPoly"),
    (("AESGCM",), (), "ChaChaPoly"),
    ((), ("AESGCM",), "ChaChaPoly"),
    (("AESGCM",), ("AESGCM",), "AESGCM"),
])
def test_both_sides_agree_and_talk(init_offer: tuple[str, ...], resp_offer: tuple[str, ...],
                                   chosen: str) -> None:
    init, resp = _handshake(init_offer, resp_offer)
    assert init.transport_cipher == resp.transport_cipher == chosen
    assert init.remote_transport_ciphers == resp_offer and resp.remote_transport_ciphers == init_offer
    a, b = init.transport(), resp.transport()
    assert a.cipher == b.cipher == chosen
    assert b.decrypt(a.encrypt(b"ping")) == b"ping" and a.decrypt(b.encrypt(b"pong")) == b"pong"


def test_aesgcm_transport_uses_splits_keys_with_the_section_12_4_nonce() -> None:
    """Checked with `cryptography` directly: the initiator's first two messages are AES-256-GCM under the
    key ChaChaPoly would have used (Split's first key), nonces 0 and 1 big-endian."""
    init, _ = _handshake(("AESGCM",), ("AESGCM",))
    a = init.transport()
    key = a.send.k
    assert key is not None
    for n, message in enumerate((b"first", b"second")):
        nonce = bytes(4) + n.to_bytes(8, "big")
        assert AESGCM(key).decrypt(nonce, a.encrypt(message), b"") == message
    with pytest.raises(NoiseError):  # not ChaChaPoly under the same key
        CipherState(key).decrypt_with_ad(b"", a.encrypt(b"third"))


def test_no_offer_means_libp2ps_payload_byte_for_byte() -> None:
    init, resp = _handshake((), ())
    assert init.remote_extensions is None and resp.remote_extensions is None
    offering = Libp2pNoiseHandshake(CLIENT, True, transport_ciphers=("AESGCM",),
                                    extensions=b"\x12\x07/yamux1")
    decoded = decode_handshake_payload(offering._payload)
    assert decoded.extensions == b"\x12\x07/yamux1" + encode_transport_ciphers(("AESGCM",))


def test_a_malformed_offer_fails_the_handshake_for_good() -> None:
    init = Libp2pNoiseHandshake(CLIENT, True)
    resp = Libp2pNoiseHandshake(SERVER, False, extensions=b"".join(_entry(b"AESGCM") for _ in range(9)))
    init_msg = init.write_message()
    resp.read_message(init_msg)
    with pytest.raises(NoiseError) as info:
        init.read_message(resp.write_message())
    assert info.value.reason == "bad-payload"
    with pytest.raises(NoiseError) as info:
        init.write_message()
    assert info.value.reason == "handshake-failed"


# --- over TCP --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("client_offer", "server_offer", "chosen"), [
    (("AESGCM",), ("AESGCM",), "AESGCM"),
    ((), ("AESGCM",), "ChaChaPoly"),
    (("AESGCM",), (), "ChaChaPoly"),
])
def test_tcp_connections_negotiate_and_carry_bulk(client_offer: tuple[str, ...], server_offer: tuple[str, ...],
                                                  chosen: str) -> None:
    message = bytes(i % 251 for i in range(3_000_000))
    seen: list[str] = []

    async def handler(conn: tcp.SecureConnection) -> None:
        seen.append(conn.transport_cipher)
        await conn.send_message(await conn.receive_message())

    async def body(port: int) -> None:
        conn = await tcp.connect(HOST, port, CLIENT, transport_ciphers=client_offer)
        assert conn.transport_cipher == chosen
        await conn.send_message(message)
        assert await conn.receive_message() == message
        await conn.aclose()

    run_with_server(body, handler, transport_ciphers=server_offer)
    assert seen == [chosen]


def test_default_offer_follows_the_measured_speedup(monkeypatch: pytest.MonkeyPatch) -> None:
    """AESGCM is offered only where it measures `AESGCM_MIN_SPEEDUP` times faster than ChaCha20-Poly1305."""
    tcp.default_transport_ciphers.cache_clear()
    try:
        monkeypatch.setattr(tcp, "AESGCM_MIN_SPEEDUP", 1e6)
        assert tcp.default_transport_ciphers() == ()
        tcp.default_transport_ciphers.cache_clear()
        monkeypatch.setattr(tcp, "AESGCM_MIN_SPEEDUP", 1e-6)
        assert tcp.default_transport_ciphers() == ("AESGCM",)
    finally:
        tcp.default_transport_ciphers.cache_clear()


def test_default_connections_use_what_both_defaults_offer() -> None:
    expected = "AESGCM" if tcp.default_transport_ciphers() else "ChaChaPoly"

    async def body(port: int) -> None:
        conn = await tcp.connect(HOST, port, Identity(bytes([9]) * 32))
        assert conn.transport_cipher == expected
        await conn.send_message(b"hello")
        assert await conn.receive_message() == b"hello"
        await conn.aclose()

    run_with_server(body)

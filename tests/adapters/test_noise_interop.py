"""Interop: our TCP+Noise transport against an independent Noise implementation on a real socket.

The other end is `noiseprotocol` (github.com/plizonczyk/noiseprotocol, on `cryptography`), a test-only
dependency; its libp2p layer is written here from the libp2p noise spec, independently of
peerloom.adapters.noise: the NoiseHandshakePayload protobuf is built and parsed by hand and the identity is
an Ed25519 key of `cryptography`. Messages above the handshake are framed by hand per spec/transport.md §3.
Covered both ways: our `serve` as responder with noiseprotocol initiating, and our `connect` as initiator
against a noiseprotocol responder; each completes the handshake, checks the other side's identity, and
exchanges transport messages in both directions (single- and multi-frame). Each test runs twice: with
libp2p's payload on their side (so ChaChaPoly, whatever we offer), and with their payload offering AESGCM in
peerloom's NoiseExtensions field (spec/transport.md §1.1), after which their CipherStates switch to
noiseprotocol's own AESGCM cipher functions, keyed as Split left them.
"""

from __future__ import annotations

import functools

import pytest
import trio

noise_connection = pytest.importorskip("noise.connection")
noise_ciphers = pytest.importorskip("noise.backends.default.ciphers")
ed25519 = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.ed25519")
serialization = pytest.importorskip("cryptography.hazmat.primitives.serialization")

from peerloom.adapters.tcp import SecureConnection, connect, serve  # noqa: E402
from peerloom.core.identity import Identity  # noqa: E402

HOST = "127.0.0.1"
NAME = b"Noise_XX_25519_ChaChaPoly_SHA256"
PREFIX = b"noise-libp2p-static-key:"
OURS = Identity(bytes([11]) * 32)
THEIR_SEED = bytes([12]) * 32
THEIR_STATIC = bytes([13]) * 32


# --- the independent libp2p layer ------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = b""
    while n >= 0x80:
        out += bytes([n & 0x7F | 0x80])
        n >>= 7
    return out + bytes([n])


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _their_payload(static_public: bytes, offer_aesgcm: bool = False) -> bytes:
    key = ed25519.Ed25519PrivateKey.from_private_bytes(THEIR_SEED)
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    public_key_pb = b"\x08\x01" + b"\x12" + _varint(len(raw)) + raw  # PublicKey{Type: Ed25519=1, Data}
    sig = key.sign(PREFIX + static_public)
    out = b"\x0a" + _varint(len(public_key_pb)) + public_key_pb + b"\x12" + _varint(len(sig)) + sig
    if offer_aesgcm:  # NoiseExtensions { field 20556 (length-delimited) = "AESGCM" } as field 4
        extensions = _varint(20556 << 3 | 2) + _varint(6) + b"AESGCM"
        out += b"\x22" + _varint(len(extensions)) + extensions
    return out


def _switch_to_aesgcm(conn) -> None:
    """Re-key noiseprotocol's transport CipherStates with its AESGCM cipher functions (Noise §12.4)."""
    for state in (conn.noise_protocol.cipher_state_encrypt, conn.noise_protocol.cipher_state_decrypt):
        state.cipher = noise_ciphers.AESGCMCipher()
        state.cipher.initialize(state.k)


def _check_our_payload(payload: bytes, remote_static: bytes) -> bytes:
    """Parse fields 1 and 2, check the key type and the signature; the raw Ed25519 key. (Field 4, our
    cipher offer when there is one, is left alone, as libp2p leaves it.)"""
    fields: dict[int, bytes] = {}
    pos = 0
    while pos < len(payload):
        tag, pos = _read_varint(payload, pos)
        assert tag & 7 == 2, tag
        length, pos = _read_varint(payload, pos)
        fields[tag >> 3] = payload[pos:pos + length]
        pos += length
    key_pb = fields[1]
    assert key_pb[:4] == b"\x08\x01\x12\x20", key_pb  # Ed25519, 32 bytes
    raw = key_pb[4:]
    ed25519.Ed25519PublicKey.from_public_bytes(raw).verify(fields[2], PREFIX + remote_static)  # raises
    return raw


def _our_raw_key() -> bytes:
    return ed25519.Ed25519PrivateKey.from_private_bytes(bytes([11]) * 32).public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw)


class _Framed:
    """2-byte-length-prefixed Noise messages on a trio stream."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = b""

    async def send(self, message: bytes) -> None:
        await self.stream.send_all(len(message).to_bytes(2, "big") + message)

    async def receive(self) -> bytes:
        while len(self.buffer) < 2 or len(self.buffer) < 2 + int.from_bytes(self.buffer[:2], "big"):
            chunk = await self.stream.receive_some(65537)
            assert chunk, "EOF"
            self.buffer += chunk
        length = int.from_bytes(self.buffer[:2], "big")
        message, self.buffer = self.buffer[2:2 + length], self.buffer[2 + length:]
        return message


def _new(initiator: bool):
    conn = noise_connection.NoiseConnection.from_name(NAME)
    conn.set_as_initiator() if initiator else conn.set_as_responder()
    conn.set_keypair_from_private_bytes(noise_connection.Keypair.STATIC, THEIR_STATIC)
    conn.start_handshake()
    return conn


def _static_public() -> bytes:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    return X25519PrivateKey.from_private_bytes(THEIR_STATIC).public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw)


# spec/transport.md §3, written out independently of adapters.tcp
def _frames_of(message: bytes, lane: int) -> list[bytes]:
    first = 65519 - 5
    out = [bytes([0x10 | lane]) + len(message).to_bytes(4, "big") + message[:first]]
    out += [bytes([0x20 | lane]) + message[i:i + 65518] for i in range(first, len(message), 65518)]
    return out


async def _send_app(framed: _Framed, conn, message: bytes, lane: int) -> None:
    for plaintext in _frames_of(message, lane):
        await framed.send(conn.encrypt(plaintext))


async def _receive_app(framed: _Framed, conn) -> tuple[int, bytes]:
    first = bytes(conn.decrypt(await framed.receive()))
    assert first[0] >> 4 == 1, first[:1]
    lane, length, body = first[0] & 0x0F, int.from_bytes(first[1:5], "big"), first[5:]
    while len(body) < length:
        more = bytes(conn.decrypt(await framed.receive()))
        assert more[0] == 0x20 | lane
        body += more[1:]
    return lane, body


MESSAGES = [b"hello from the other side", bytes(range(256)) * 800]  # 25 bytes; 204 800 bytes (4 frames)


async def _echo(conn: SecureConnection) -> None:
    for _ in MESSAGES:
        await conn.send_message(await conn.receive_message())


OFFERS = pytest.mark.parametrize("their_offer", [False, True], ids=["libp2p-payload", "aesgcm-offer"])


@OFFERS
def test_our_responder_with_noiseprotocol_initiator(their_offer: bool) -> None:
    seen: list[object] = []

    async def handler(conn: SecureConnection) -> None:
        seen.append((conn.remote_peer, conn.transport_cipher))
        await _echo(conn)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(functools.partial(serve, HOST, 0, OURS, handler,
                                                         transport_ciphers=("AESGCM",)))
            with trio.fail_after(20):
                framed = _Framed(await trio.open_tcp_stream(HOST, port))
                them = _new(initiator=True)
                await framed.send(bytes(them.write_message(b"")))
                state = them.noise_protocol.handshake_state  # noiseprotocol drops it when finished
                payload = bytes(them.read_message(await framed.receive()))
                assert _check_our_payload(payload, state.rs.public_bytes) == _our_raw_key()
                await framed.send(bytes(them.write_message(_their_payload(_static_public(), their_offer))))
                assert them.handshake_finished
                if their_offer:
                    _switch_to_aesgcm(them)
                for i, message in enumerate(MESSAGES):
                    await _send_app(framed, them, message, lane=i)
                    lane, echoed = await _receive_app(framed, them)
                    assert echoed == message
                    assert lane == (0 if len(message) <= 65536 else 1)
                assert seen == [(Identity(THEIR_SEED).peer_id, "AESGCM" if their_offer else "ChaChaPoly")]
                await framed.stream.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)


@OFFERS
def test_our_initiator_with_noiseprotocol_responder(their_offer: bool) -> None:
    done: list[bool] = []

    async def responder(stream: trio.SocketStream) -> None:
        framed = _Framed(stream)
        them = _new(initiator=False)
        them.read_message(await framed.receive())
        await framed.send(bytes(them.write_message(_their_payload(_static_public(), their_offer))))
        state = them.noise_protocol.handshake_state
        payload = bytes(them.read_message(await framed.receive()))
        assert them.handshake_finished
        assert _check_our_payload(payload, state.rs.public_bytes) == _our_raw_key()
        if their_offer:
            _switch_to_aesgcm(them)
        for message in MESSAGES:  # echo, as the peer that does the framing by hand
            lane, received = await _receive_app(framed, them)
            assert received == message
            await _send_app(framed, them, received, lane)
        done.append(True)

    async def main() -> None:
        listeners = await trio.open_tcp_listeners(0, host=HOST)
        port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, responder, listeners)
            with trio.fail_after(20):
                conn = await connect(HOST, port, OURS, expected_peer=Identity(THEIR_SEED).peer_id,
                                     transport_ciphers=("AESGCM",))
                assert conn.transport_cipher == ("AESGCM" if their_offer else "ChaChaPoly")
                for message in MESSAGES:
                    await conn.send_message(message)
                    assert await conn.receive_message() == message
                while not done:
                    await trio.sleep(0.01)
                await conn.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)

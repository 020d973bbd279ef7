"""The libp2p noise handshake (sans-IO) and the trio TCP transport on 127.0.0.1."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from peerloom.adapters.noise import (
    LIBP2P_PROTOCOL_NAME,
    LIBP2P_SIGNATURE_PREFIX,
    HandshakePayload,
    HandshakeState,
    Libp2pNoiseHandshake,
    NoiseError,
    decode_handshake_payload,
    encode_handshake_payload,
    frame,
    x25519_public,
)
from peerloom.adapters.tcp import ConnectionClosed, SecureConnection, TransportError, connect, serve
from peerloom.core.identity import Identity, public_key_protobuf

HOST = "127.0.0.1"
SERVER = Identity(bytes([1]) * 32)
CLIENT = Identity(bytes([2]) * 32)
OTHER = Identity(bytes([3]) * 32)


# --- sans-IO handshake -----------------------------------------------------------------------------------


def _run_handshake(init: Libp2pNoiseHandshake, resp: Libp2pNoiseHandshake) -> None:
    while not (init.is_finished and resp.is_finished):
        writer, reader = (init, resp) if init.wants_write else (resp, init)
        reader.read_message(writer.write_message())


def test_handshake_sans_io_binds_identities_and_keys() -> None:
    init = Libp2pNoiseHandshake(CLIENT, True, extensions=b"\x12\x07/yamux1")
    resp = Libp2pNoiseHandshake(SERVER, False, expected_peer=None)
    _run_handshake(init, resp)
    assert init.remote_peer == SERVER.peer_id and resp.remote_peer == CLIENT.peer_id
    assert resp.remote_extensions == b"\x12\x07/yamux1" and init.remote_extensions is None
    assert init.handshake_hash == resp.handshake_hash
    a, b = init.transport(), resp.transport()
    assert b.decrypt(a.encrypt(b"ping")) == b"ping"
    assert a.decrypt(b.encrypt(b"pong")) == b"pong"
    with pytest.raises(NoiseError) as info:
        a.encrypt(b"\x00" * 65520)
    assert info.value.reason == "message-too-long"


def _fake_responder_message2(payload: bytes, *, static: bytes = bytes([7]) * 32) -> tuple[
        Libp2pNoiseHandshake, bytes]:
    """An honest initiator and message 2 from a hand-driven responder that sends `payload`."""
    init = Libp2pNoiseHandshake(CLIENT, True)
    fake = HandshakeState(LIBP2P_PROTOCOL_NAME, initiator=False, s=static)
    fake.read_message(init.write_message())
    return init, fake.write_message(payload)


def _signed(identity: Identity, static_public: bytes, *, key_of: Identity | None = None) -> bytes:
    return encode_handshake_payload(HandshakePayload(
        identity_key=public_key_protobuf((key_of or identity).public_key),
        identity_sig=identity.sign(LIBP2P_SIGNATURE_PREFIX + static_public)))


STATIC = bytes([7]) * 32
STATIC_PUB = x25519_public(STATIC)


@pytest.mark.parametrize(("payload", "reason"), [
    (encode_handshake_payload(HandshakePayload(identity_key=public_key_protobuf(SERVER.public_key))),
     "bad-identity-signature"),  # unsigned
    (_signed(OTHER, STATIC_PUB, key_of=SERVER), "bad-identity-signature"),  # signed by someone else
    (_signed(SERVER, x25519_public(bytes([8]) * 32)), "bad-identity-signature"),  # over another static key
    (encode_handshake_payload(HandshakePayload(identity_sig=b"\x00" * 64)), "bad-identity-key"),
    (encode_handshake_payload(HandshakePayload(identity_key=b"\x08\x00\x12\x01x", identity_sig=b"s")),
     "bad-identity-key"),  # an RSA-typed PublicKey
    (b"\x0a\xff", "bad-payload"),
    (b"", "bad-identity-key"),
], ids=["unsigned", "wrong-signer", "wrong-static", "no-key", "rsa-key", "garbage", "empty"])
def test_initiator_refuses_bad_responder_payload(payload: bytes, reason: str) -> None:
    init, message2 = _fake_responder_message2(payload)
    with pytest.raises(NoiseError) as info:
        init.read_message(message2)
    assert info.value.reason == reason
    assert init.remote_peer is None
    with pytest.raises(NoiseError) as info:  # sticky: message 3 is never sent
        init.write_message()
    assert info.value.reason == "handshake-failed"


def test_initiator_accepts_correct_hand_made_payload() -> None:
    init, message2 = _fake_responder_message2(_signed(SERVER, STATIC_PUB))
    init.read_message(message2)
    assert init.remote_peer == SERVER.peer_id


def test_responder_refuses_bad_initiator_signature() -> None:
    fake = HandshakeState(LIBP2P_PROTOCOL_NAME, initiator=True, s=STATIC)
    resp = Libp2pNoiseHandshake(SERVER, False)
    resp.read_message(fake.write_message(b""))
    fake.read_message(resp.write_message())
    resp_payload = _signed(OTHER, STATIC_PUB, key_of=CLIENT)
    with pytest.raises(NoiseError) as info:
        resp.read_message(fake.write_message(resp_payload))
    assert info.value.reason == "bad-identity-signature"
    with pytest.raises(NoiseError) as info:
        resp.transport()
    assert info.value.reason == "handshake-failed"


def test_expected_peer_mismatch_sans_io() -> None:
    init = Libp2pNoiseHandshake(CLIENT, True, expected_peer=OTHER.peer_id)
    resp = Libp2pNoiseHandshake(SERVER, False)
    resp.read_message(init.write_message())
    with pytest.raises(NoiseError) as info:
        init.read_message(resp.write_message())
    assert info.value.reason == "peer-mismatch"


def test_payload_codec_round_trip_and_unknown_fields() -> None:
    payload = HandshakePayload(identity_key=b"k" * 36, identity_sig=b"s" * 64, extensions=b"\x0a\x01x")
    data = encode_handshake_payload(payload)
    assert decode_handshake_payload(data) == payload
    # unknown varint, fixed64, fixed32 and bytes fields (incl. the retired field 3) are skipped
    extra = b"\x28\x96\x01" + b"\x31" + b"\x00" * 8 + b"\x3d" + b"\x00" * 4 + b"\x1a\x02hi"
    assert decode_handshake_payload(extra + data) == payload


@given(st.binary(max_size=300))
def test_payload_decoder_only_raises_noise_error(data: bytes) -> None:
    try:
        decoded = decode_handshake_payload(data)
    except NoiseError as exc:
        assert exc.reason == "bad-payload"
    else:
        assert isinstance(decoded, HandshakePayload)


@given(st.lists(st.tuples(st.integers(0, 40), st.sampled_from([0, 1, 2, 5]), st.binary(max_size=40)),
                max_size=8))
def test_payload_decoder_on_well_formed_fields(fields: list[tuple[int, int, bytes]]) -> None:
    """Structured fuzz: a stream of real protobuf fields decodes or raises NoiseError only."""
    data = b""
    for number, wire, value in fields:
        data += bytes([number << 3 | wire]) if number < 16 else bytes([(number << 3 | wire) & 0x7F | 0x80, 1])
        data += {0: b"\x05", 1: b"\x00" * 8, 5: b"\x00" * 4, 2: bytes([len(value)]) + value}[wire]
    try:
        decode_handshake_payload(data)
    except NoiseError as exc:
        assert exc.reason == "bad-payload"


@given(st.binary(max_size=400))
def test_initiator_reading_random_message2_raises_only_noise_error(data: bytes) -> None:
    init = Libp2pNoiseHandshake(CLIENT, True, static_seed=bytes([5]) * 32, ephemeral_seed=bytes([6]) * 32)
    init.write_message()
    with pytest.raises(NoiseError):
        init.read_message(data)


# --- TCP -------------------------------------------------------------------------------------------------


async def echo(conn: SecureConnection) -> None:
    while True:
        try:
            message = await conn.receive_message()
        except ConnectionClosed:
            return
        await conn.send_message(message)


def run_with_server(body: Callable[[int], Awaitable[None]], handler=echo, **server_kwargs) -> None:
    """Serve on 127.0.0.1:0 with `handler`, run `body(port)` (30 s limit), then stop the server."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(functools.partial(serve, HOST, 0, SERVER, handler, **server_kwargs))
            with trio.fail_after(30):
                await body(port)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_handshake_gives_each_side_the_other_peer_id() -> None:
    seen = []

    async def handler(conn: SecureConnection) -> None:
        seen.append(conn.remote_peer)
        await conn.send_message(b"hi")

    async def body(port: int) -> None:
        conn = await connect(HOST, port, CLIENT, expected_peer=SERVER.peer_id)
        assert conn.remote_peer == SERVER.peer_id
        assert await conn.receive_message() == b"hi"
        assert seen == [CLIENT.peer_id]
        await conn.aclose()

    run_with_server(body, handler)


@pytest.mark.parametrize("size", [0, 1, 65519, 65520, 3_000_000])
def test_messages_round_trip(size: int) -> None:
    message = bytes(i % 251 for i in range(size))

    async def body(port: int) -> None:
        conn = await connect(HOST, port, CLIENT)
        await conn.send_message(message)
        assert await conn.receive_message() == message
        await conn.send_message(b"after")
        assert await conn.receive_message() == b"after"
        await conn.aclose()

    run_with_server(body)


def test_wire_byte_counts_match() -> None:
    server_conns: list[SecureConnection] = []
    done = trio.Event()

    async def handler(conn: SecureConnection) -> None:
        server_conns.append(conn)
        await conn.send_message(await conn.receive_message())
        await done.wait()

    async def body(port: int) -> None:
        conn = await connect(HOST, port, CLIENT)
        await conn.send_message(b"x" * 100_000)
        await conn.receive_message()
        (server,) = server_conns
        assert conn.bytes_sent == server.bytes_received
        assert conn.bytes_received == server.bytes_sent
        # handshake 32 + 96+payload + 64+payload; 100 004 plaintext bytes in two Noise messages
        assert conn.bytes_sent > 100_004 + 2 * (16 + 2)
        done.set()
        await conn.aclose()

    run_with_server(body, handler)


def test_concurrent_senders_do_not_interleave() -> None:
    received: list[bytes] = []

    async def handler(conn: SecureConnection) -> None:
        for _ in range(4):
            received.append(await conn.receive_message())
        await conn.send_message(b"done")

    async def body(port: int) -> None:
        conn = await connect(HOST, port, CLIENT)
        async with trio.open_nursery() as nursery:
            for value in range(4):
                nursery.start_soon(conn.send_message, bytes([value]) * 1_000_000)
        assert await conn.receive_message() == b"done"
        assert sorted(received) == [bytes([v]) * 1_000_000 for v in range(4)]
        await conn.aclose()

    run_with_server(body, handler)


def test_expected_peer_mismatch_fails_and_server_survives() -> None:
    async def body(port: int) -> None:
        with pytest.raises(TransportError) as info:
            await connect(HOST, port, CLIENT, expected_peer=OTHER.peer_id)
        assert info.value.reason == "peer-mismatch"
        conn = await connect(HOST, port, CLIENT, expected_peer=SERVER.peer_id)
        await conn.send_message(b"still up")
        assert await conn.receive_message() == b"still up"
        await conn.aclose()

    run_with_server(body)


def test_garbage_and_silent_clients_do_not_crash_the_server() -> None:
    async def body(port: int) -> None:
        raw = await trio.open_tcp_stream(HOST, port)
        await raw.send_all(b"\x00\x05hello" + b"\xff" * 100)
        assert await raw.receive_some(100) == b""  # the server hung up
        await raw.aclose()
        silent = await trio.open_tcp_stream(HOST, port)
        with trio.fail_after(5):
            assert await silent.receive_some(100) == b""  # handshake timeout closes it
        await silent.aclose()
        conn = await connect(HOST, port, CLIENT)
        await conn.send_message(b"ok")
        assert await conn.receive_message() == b"ok"
        await conn.aclose()

    run_with_server(body, handshake_timeout=0.3)


def test_clean_close_is_connection_closed() -> None:
    outcome: list[BaseException] = []

    async def handler(conn: SecureConnection) -> None:
        for _ in range(2):
            try:
                await conn.receive_message()
            except TransportError as exc:
                outcome.append(exc)

    async def body(port: int) -> None:
        conn = await connect(HOST, port, CLIENT)
        await conn.aclose()
        with pytest.raises(ConnectionClosed) as info:
            await conn.send_message(b"x")
        assert info.value.reason == "closed"
        with trio.fail_after(5):
            while len(outcome) < 2:
                await trio.sleep(0.01)
        assert all(isinstance(e, ConnectionClosed) and e.reason == "eof" for e in outcome)

    run_with_server(body, handler)


async def _proxy(listen_port_out: list[int], target_port: int, flip_at: list[int | None],
                 *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A TCP relay to `target_port` that XORs 1 into the client→server byte at offset flip_at[0]."""

    async def pump(src: trio.SocketStream, dst: trio.SocketStream, flip: bool) -> None:
        offset = 0
        try:
            while data := await src.receive_some(65536):
                target = flip_at[0]
                if flip and target is not None and offset <= target < offset + len(data):
                    data = bytearray(data)
                    data[target - offset] ^= 1
                offset += len(data)
                await dst.send_all(bytes(data))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await dst.aclose()

    async def relay(client: trio.SocketStream) -> None:
        server = await trio.open_tcp_stream(HOST, target_port)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump, client, server, True)
            nursery.start_soon(pump, server, client, False)

    listeners = await trio.open_tcp_listeners(0, host=HOST)
    listen_port_out.append(listeners[0].socket.getsockname()[1])
    task_status.started()
    await trio.serve_listeners(relay, listeners)


def test_tampered_ciphertext_byte_raises_transport_error() -> None:
    errors: list[TransportError] = []

    async def handler(conn: SecureConnection) -> None:
        try:
            await conn.receive_message()
        except TransportError as exc:
            errors.append(exc)

    async def body(port: int) -> None:
        proxy_port: list[int] = []
        flip_at: list[int | None] = [None]
        async with trio.open_nursery() as nursery:
            await nursery.start(_proxy, proxy_port, port, flip_at)
            conn = await connect(HOST, proxy_port[0], CLIENT)
            flip_at[0] = conn.bytes_sent + 2 + 10  # inside the first transport message's ciphertext
            await conn.send_message(b"secret" * 10)
            with trio.fail_after(5):
                while not errors:
                    await trio.sleep(0.01)
            assert errors[0].reason == "decrypt-failed"
            await conn.aclose()
            nursery.cancel_scope.cancel()

    run_with_server(body, handler)


def test_length_over_limit_is_refused_before_the_body() -> None:
    """Only the 4-byte header is ever sent; the receiver must refuse without waiting for 4 GiB."""
    errors: list[TransportError] = []

    async def handler(conn: SecureConnection) -> None:
        try:
            await conn.receive_message()
        except TransportError as exc:
            errors.append(exc)

    async def body(port: int) -> None:
        conn = await connect(HOST, port, CLIENT)
        header = (2**32 - 1).to_bytes(4, "big")
        await conn._stream.send_all(frame(conn._transport.encrypt(header)))  # a lying client
        with trio.fail_after(5):
            while not errors:
                await trio.sleep(0.01)
        assert errors[0].reason == "message-too-large"
        await conn.aclose()

    run_with_server(body, handler, max_message_bytes=1000)


def test_sender_limit_is_its_own() -> None:
    async def body(port: int) -> None:
        conn = await connect(HOST, port, CLIENT, max_message_bytes=10)
        with pytest.raises(TransportError) as info:
            await conn.send_message(b"x" * 11)
        assert info.value.reason == "message-too-large"
        await conn.aclose()

    run_with_server(body)


def test_connect_refused_is_transport_error() -> None:
    async def main() -> None:
        listeners = await trio.open_tcp_listeners(0, host=HOST)
        port = listeners[0].socket.getsockname()[1]
        await listeners[0].aclose()
        with pytest.raises(TransportError) as info:
            await connect(HOST, port, CLIENT)
        assert info.value.reason == "connect-failed"

    trio.run(main)


def test_cancelled_receive_resumes_without_loss() -> None:
    """A receive cancelled half-way through a message keeps what arrived; the next call completes it."""
    results: list[object] = []
    first_timed_out = trio.Event()

    async def handler(conn: SecureConnection) -> None:
        with trio.move_on_after(0.2) as scope:
            await conn.receive_message()
        results.append(scope.cancelled_caught)
        first_timed_out.set()
        results.append(await conn.receive_message())
        results.append(await conn.receive_message())

    async def body(port: int) -> None:
        conn = await connect(HOST, port, CLIENT)
        message = bytes(range(256)) * 1000  # 256 000 bytes: four Noise messages
        plain = len(message).to_bytes(4, "big") + message
        chunks = [plain[i:i + 65519] for i in range(0, len(plain), 65519)]
        wire = b"".join(frame(conn._transport.encrypt(chunk)) for chunk in chunks)
        await conn._stream.send_all(wire[:100_000])  # the header and part of the body
        await first_timed_out.wait()
        await conn._stream.send_all(wire[100_000:])
        await conn.send_message(b"next")
        with trio.fail_after(5):
            while len(results) < 3:
                await trio.sleep(0.01)
        assert results == [True, message, b"next"]
        await conn.aclose()

    run_with_server(body, handler)

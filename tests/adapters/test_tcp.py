"""The libp2p noise handshake (sans-IO) and the trio TCP transport on 127.0.0.1."""

from __future__ import annotations

import functools

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from peerloom.adapters import tcp
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
from peerloom.adapters.tcp import (
    KIND_CONTINUE,
    KIND_CREDIT,
    KIND_PING,
    KIND_START,
    SecureConnection,
    connect,
    encode_frames,
)
from peerloom.adapters.transport import LANE_BULK, ConnectionClosed, TransportError
from peerloom.core.identity import Identity, public_key_protobuf
from tests.helpers import CLIENT, HOST, OTHER, SERVER, collect_errors, raw_send, run_with_server, wait_for

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


def test_handshake_gives_each_side_the_other_peer_id() -> None:
    seen = []

    async def handler(conn: SecureConnection) -> None:
        seen.append(conn.remote_peer)
        seen.append(conn.remote_address)
        await conn.send_message(b"hi")

    async def body(port: int) -> None:
        conn = await connect(HOST, port, CLIENT, expected_peer=SERVER.peer_id)
        assert conn.remote_peer == SERVER.peer_id and conn.remote_address == (HOST, port)
        assert await conn.receive_message() == b"hi"
        assert seen[0] == CLIENT.peer_id and seen[1][0] == HOST and seen[1][1] != port
        await conn.aclose()
        assert conn.remote_address is None

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
        # The server's counter moves when its send returns, which can be after we have read the echo.
        with trio.move_on_after(2.0):
            while (conn.bytes_sent, conn.bytes_received) != (server.bytes_received, server.bytes_sent):
                await trio.sleep(0.005)
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
    """Only the START header is ever sent; the receiver must refuse without waiting for 4 GiB."""
    errors: list[TransportError] = []

    async def body(port: int) -> None:
        conn = await connect(HOST, port, CLIENT)
        await raw_send(conn, [bytes([KIND_START << 4 | LANE_BULK]) + (2**32 - 1).to_bytes(4, "big")])
        await wait_for(errors, 5)
        assert errors[0].reason == "message-too-large"
        await conn.aclose()

    run_with_server(body, collect_errors(errors), max_message_bytes=1000)


@pytest.mark.parametrize(("plaintexts", "reason"), [
    ([b""], "bad-frame"),  # an empty frame
    ([bytes([KIND_CONTINUE << 4]) + b"x"], "bad-frame"),  # CONTINUE without START
    ([bytes([KIND_START << 4]) + (10).to_bytes(4, "big") + b"x", bytes([KIND_START << 4]) + b"\0\0\0\0"],
     "bad-frame"),  # START inside an open message
    ([bytes([KIND_START << 4]) + (2).to_bytes(4, "big") + b"xyz"], "bad-frame"),  # fragment too long
    ([bytes([KIND_START << 4]) + (2).to_bytes(4, "big") + b"x", bytes([KIND_CONTINUE << 4]) + b"yz"],
     "bad-frame"),  # continuation overruns the message
    ([bytes([KIND_START << 4 | 2]) + b"\0\0\0\0"], "bad-frame"),  # lane 2
    ([bytes([0x70])], "bad-frame"),  # unknown kind
    ([bytes([KIND_PING << 4]) + b"123"], "bad-frame"),  # short ping
    ([bytes([KIND_START << 4]) + b"\0\0"], "bad-frame"),  # truncated 4-byte length
    ([bytes([KIND_START << 4]) + (5).to_bytes(4, "big") + b"ab"], "truncated"),  # EOF inside a message
    ([bytes([KIND_CREDIT << 4 | 1]) + b"\xff\xff\xff\xff"], "bad-frame"),  # credit past 2^32 - 1
    ([bytes([KIND_CREDIT << 4 | 1]) + b"\0\0\0\0"], "bad-frame"),  # zero credit
    ([bytes([KIND_CREDIT << 4 | 2]) + b"\0\0\0\1"], "bad-frame"),  # credit for lane 2
], ids=["empty", "orphan-continue", "nested-start", "long-fragment", "overrun", "bad-lane", "bad-kind",
        "short-ping", "short-length", "eof-in-message", "credit-overflow", "credit-zero", "credit-lane"])
def test_malformed_frames_are_refused(plaintexts: list[bytes], reason: str) -> None:
    errors: list[TransportError] = []

    async def body(port: int) -> None:
        conn = await connect(HOST, port, CLIENT)
        await raw_send(conn, plaintexts)
        await conn._stream.send_eof()
        await wait_for(errors, 5)
        assert errors[0].reason == reason
        await conn.aclose()

    run_with_server(body, collect_errors(errors))


@pytest.mark.parametrize(("raw", "reason"), [
    (b"\x00", "truncated"),  # EOF inside the 2-byte Noise length
    (b"\x00\x05hello", "decrypt-failed"),  # shorter than a tag
    (b"\xff\xff" + b"\x00" * 100, "truncated"),  # a 65535-byte message that never comes
    (b"\x00\x20" + b"\xaa" * 32, "decrypt-failed"),  # garbage ciphertext
], ids=["half-prefix", "short", "oversize-prefix", "garbage"])
def test_bad_noise_length_prefixes(raw: bytes, reason: str) -> None:
    errors: list[TransportError] = []

    async def body(port: int) -> None:
        conn = await connect(HOST, port, CLIENT)
        await conn._stream.send_all(raw)
        await conn._stream.send_eof()
        await wait_for(errors, 5)
        assert errors[0].reason == reason
        await conn.aclose()

    run_with_server(body, collect_errors(errors))


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
        wire = b"".join(frame(conn._transport.encrypt(f)) for f in encode_frames(message, LANE_BULK))
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


# --- lanes: control messages are not stuck behind a bulk message -----------------------------------------


def test_control_message_overtakes_a_bulk_message_in_flight() -> None:
    """A FIFO transport delivers the 12 MB message first; here the later small message arrives first."""
    received: list[bytes] = []

    async def handler(conn: SecureConnection) -> None:
        for _ in range(3):
            received.append(await conn.receive_message())

    big = bytes(range(256)) * (12_000_000 // 256)

    async def body(port: int) -> None:
        conn = await connect(HOST, port, CLIENT, max_message_bytes=len(big))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn.send_message, big)
            while conn.bytes_sent < 1_000_000:  # the bulk message is on the wire
                await trio.sleep(0)
            await conn.send_message(b"vote")
            await conn.send_message(b"head")
        with trio.fail_after(10):
            while len(received) < 3:
                await trio.sleep(0.01)
        assert received[:2] == [b"vote", b"head"]  # in order within the control lane
        assert received[2] == big
        await conn.aclose()

    run_with_server(body, handler, max_message_bytes=len(big))


class _WriteLog:
    """Wraps a connection's stream and records the Noise messages of each socket write (their sizes)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream
        self.writes: list[list[int]] = []
        self.writing = False

    async def send_all(self, data: bytes | memoryview) -> None:
        view, sizes = memoryview(data), []
        while view:  # a write holds whole Noise messages: walk their length prefixes
            length = int.from_bytes(view[:2], "big")
            sizes.append(length)
            view = view[2 + length:]
        self.writes.append(sizes)
        self.writing = True
        await self._stream.send_all(data)
        self.writing = False

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


def test_control_message_waits_for_at_most_one_bulk_turn() -> None:
    """A control message sent while a bulk turn is blocked in the socket goes out right after that turn:
    at most `_BULK_BATCH_FRAMES` = 16 bulk Noise messages (≈ 1 MiB, spec/transport.md §4) are written
    between `send_message(control)` and the control frame. A transport that wrote a bulk message in one
    go, or as far as its 4 MiB credit reaches, would put 64 or more there."""
    import socket

    received: list[bytes] = []
    release = trio.Event()

    async def handler(conn: SecureConnection) -> None:
        await release.wait()  # not reading yet: the client's socket fills up mid-turn
        for _ in range(2):
            received.append(await conn.receive_message())

    big = bytes(range(256)) * (12_000_000 // 256)

    async def body(port: int) -> None:
        conn = await connect(HOST, port, CLIENT, max_message_bytes=len(big))
        conn._stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        log = _WriteLog(conn._stream)
        conn._stream = log  # type: ignore[assignment]  # a logging stand-in
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn.send_message, big)
            while not log.writing:
                await trio.sleep(0)
            await trio.sleep(0.1)
            assert log.writing  # the first bulk turn is stuck in the socket
            mark = len(log.writes) - 1  # the turn in progress counts
            nursery.start_soon(functools.partial(conn.send_message, b"vote"))
            await trio.sleep(0.05)
            release.set()
        after = log.writes[mark:]
        control = next(i for i, sizes in enumerate(after) if sizes and max(sizes) < 100)
        assert 0 < sum(len(sizes) for sizes in after[:control]) <= 16 == tcp._BULK_BATCH_FRAMES
        assert all(len(sizes) <= tcp._BULK_BATCH_FRAMES for sizes in log.writes)  # every turn is bounded
        with trio.fail_after(10):
            while len(received) < 2:
                await trio.sleep(0.01)
        assert received == [b"vote", big]
        await conn.aclose()

    run_with_server(body, handler, max_message_bytes=len(big))


def test_send_buffer_grows_to_a_bulk_turn_only_when_bulk_is_sent() -> None:
    """Connections that only carry control messages keep a two-message send buffer (~128 KiB, not ~1 MiB)."""
    frame_bytes = 2 + 65535

    async def body(port: int) -> None:
        conn = await connect(HOST, port, CLIENT)
        for size in (10, 65536):
            await conn.send_message(bytes(size))
            assert len(await conn.receive_message()) == size
        assert len(conn._send_view) == tcp._CONTROL_BATCH_FRAMES * frame_bytes
        await conn.send_message(bytes(300_000))
        assert len(await conn.receive_message()) == 300_000
        assert len(conn._send_view) == tcp._BULK_BATCH_FRAMES * frame_bytes
        await conn.aclose()

    run_with_server(body)


def test_explicit_lanes_keep_order_per_lane() -> None:
    received: list[bytes] = []

    async def handler(conn: SecureConnection) -> None:
        for _ in range(6):
            received.append(await conn.receive_message())

    async def body(port: int) -> None:
        conn = await connect(HOST, port, CLIENT)
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(conn.send_message, bytes([i]) * 300_000)  # auto: bulk
                await trio.sleep(0)
        for i in range(3):
            await conn.send_message(bytes([10 + i]) * 10, lane=LANE_BULK)
        with trio.fail_after(10):
            while len(received) < 6:
                await trio.sleep(0.01)
        assert [m[0] for m in received] == [0, 1, 2, 10, 11, 12]
        await conn.aclose()

    run_with_server(body, handler)


# --- handshake attacks over a real socket ----------------------------------------------------------------


async def _raw_frame(stream: trio.SocketStream) -> bytes:
    buffer = b""
    while len(buffer) < 2 or len(buffer) < 2 + int.from_bytes(buffer[:2], "big"):
        chunk = await stream.receive_some(65537)
        if not chunk:
            raise EOFError
        buffer += chunk
    return buffer[2:]


def test_server_refuses_initiator_whose_signature_does_not_match_static_key(caplog) -> None:
    handled: list[SecureConnection] = []

    async def handler(conn: SecureConnection) -> None:
        handled.append(conn)

    async def body(port: int) -> None:
        raw = await trio.open_tcp_stream(HOST, port)
        fake = HandshakeState(LIBP2P_PROTOCOL_NAME, initiator=True, s=STATIC)
        await raw.send_all(frame(fake.write_message(b"")))
        fake.read_message(await _raw_frame(raw))
        # CLIENT's key, but the signature is over another static key than the one in the handshake
        payload = _signed(CLIENT, x25519_public(bytes([9]) * 32))
        await raw.send_all(frame(fake.write_message(payload)))
        with trio.fail_after(5):
            assert await raw.receive_some(100) == b""  # the server hung up
        await raw.aclose()

    with caplog.at_level("INFO", logger="peerloom.adapters.tcp"):
        run_with_server(body, handler)
    assert not handled
    assert "bad-identity-signature" in caplog.text


def test_client_refuses_responder_whose_signature_does_not_match_static_key() -> None:
    async def fake_responder(stream: trio.SocketStream) -> None:
        fake = HandshakeState(LIBP2P_PROTOCOL_NAME, initiator=False, s=STATIC)
        try:
            fake.read_message(await _raw_frame(stream))
            payload = _signed(OTHER, STATIC_PUB, key_of=SERVER)  # SERVER's key, OTHER's signature
            await stream.send_all(frame(fake.write_message(payload)))
            await stream.receive_some(100)
        except (EOFError, trio.BrokenResourceError):
            pass

    async def main() -> None:
        listeners = await trio.open_tcp_listeners(0, host=HOST)
        port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, fake_responder, listeners)
            with pytest.raises(TransportError) as info:
                await connect(HOST, port, CLIENT)
            assert info.value.reason == "bad-identity-signature"
            nursery.cancel_scope.cancel()

    trio.run(main)


async def _is_closed_soon(stream: trio.SocketStream, within: float) -> bool:
    with trio.move_on_after(within):
        try:
            return await stream.receive_some(100) == b""
        except trio.BrokenResourceError:
            return True
    return False


@pytest.mark.parametrize("cap", ["per-ip", "global"])
def test_silent_sockets_make_room_for_a_newcomer(cap: str) -> None:
    """Slowloris (spec/transport.md §13): when the pending cap is full of silent sockets, each newcomer closes
    the oldest silent one, so the count never passes the cap and an honest dial succeeds during the flood."""
    kwargs = {"max_handshakes_per_ip": 3} if cap == "per-ip" else {"max_handshakes": 3}

    async def body(port: int) -> None:
        silent = [await trio.open_tcp_stream(HOST, port) for _ in range(3)]
        await trio.sleep(0.1)
        extra = []
        for _ in range(5):
            extra.append(await trio.open_tcp_stream(HOST, port))
            await trio.sleep(0.02)
        for stream in silent + extra[:2]:  # the five oldest made room for the five newest
            assert await _is_closed_soon(stream, 1.0)
        for stream in extra[2:]:
            assert not await _is_closed_soon(stream, 0.05)
        conn = await connect(HOST, port, CLIENT)  # the flood is still there: a silent socket makes room again
        await conn.send_message(b"ok")
        assert await conn.receive_message() == b"ok"
        await conn.aclose()
        for stream in silent + extra:
            await stream.aclose()

    run_with_server(body, handshake_timeout=20, **kwargs)


def test_started_handshakes_are_not_evicted_and_the_newcomer_is_refused() -> None:
    """A socket that sent its first handshake message holds its pending slot until the handshake ends or times
    out; with every slot held so, a newcomer is closed at once (the cap holds)."""

    async def body(port: int) -> None:
        started = []
        for _ in range(3):
            stream = await trio.open_tcp_stream(HOST, port)
            await stream.send_all(frame(Libp2pNoiseHandshake(CLIENT, True).write_message()))
            started.append(stream)
        await trio.sleep(0.2)
        newcomer = await trio.open_tcp_stream(HOST, port)
        assert await _is_closed_soon(newcomer, 1.0)
        for stream in started:
            assert not await _is_closed_soon(stream, 0.05)
        with pytest.raises(TransportError):
            await connect(HOST, port, CLIENT)
        for stream in [*started, newcomer]:
            await stream.aclose()
        await trio.sleep(0.1)
        conn = await connect(HOST, port, CLIENT)
        await conn.aclose()

    run_with_server(body, handshake_timeout=20, max_handshakes_per_ip=3)


def test_a_silent_socket_is_closed_after_the_start_deadline() -> None:
    """The first handshake message is due `Limits.handshake_start_s` after the accept (spec/transport.md §13)."""
    from peerloom.adapters.limits import ConnectionLimiter, Limits

    limiter = ConnectionLimiter(Limits(handshake_start_s=0.2))

    async def body(port: int) -> None:
        silent = await trio.open_tcp_stream(HOST, port)
        assert await _is_closed_soon(silent, 3.0)
        await silent.aclose()
        assert limiter.refusals["start-timeout"] == 1 and limiter.sockets == 0

    run_with_server(body, limiter=limiter)


def test_the_handshake_rate_per_address_is_refused_before_public_key_work() -> None:
    """Per-address token bucket (spec/transport.md §13): past the burst, a handshake is refused right after
    message 1, before the responder computes anything; the refusal is counted and not a handshake failure."""
    from peerloom.adapters.limits import ConnectionLimiter, Limits

    limiter = ConnectionLimiter(Limits(handshake_rate=0.01, handshake_burst=2))
    failures: list[str] = []

    async def body(port: int) -> None:
        for _ in range(2):
            conn = await connect(HOST, port, CLIENT)
            await conn.aclose()
        with pytest.raises(TransportError):
            await connect(HOST, port, CLIENT)
        assert limiter.refusals["handshake-rate"] == 1

    run_with_server(body, limiter=limiter, on_handshake_failed=lambda ip, exc: failures.append(exc.reason))
    assert failures == []


@pytest.mark.parametrize("cap", ["per-ip", "global", "admit"])
def test_established_connections_are_capped_and_recover(cap: str) -> None:
    """Authenticated connections count too: over the cap (or refused by `admit`) a dial is closed at once."""
    held: list[SecureConnection] = []
    kwargs = {"per-ip": {"max_connections_per_ip": 2}, "global": {"max_connections": 2},
              "admit": {"admit": lambda ip: ip == HOST and len(held) < 2}}[cap]

    async def body(port: int) -> None:
        for _ in range(2):
            conn = await connect(HOST, port, CLIENT)
            await conn.send_message(b"hi")
            assert await conn.receive_message() == b"hi"  # the handler is running: the slot is taken
            held.append(conn)
        with pytest.raises(TransportError):
            await connect(HOST, port, CLIENT)
        await held.pop().aclose()
        await trio.sleep(0.1)
        conn = await connect(HOST, port, CLIENT)
        await conn.send_message(b"ok")
        assert await conn.receive_message() == b"ok"
        for c in (conn, *held):
            await c.aclose()

    run_with_server(body, **kwargs)


def test_failed_inbound_handshakes_are_reported_with_the_address() -> None:
    failures: list[tuple[str, str]] = []

    async def body(port: int) -> None:
        silent = await trio.open_tcp_stream(HOST, port)
        await silent.send_all(b"\x00\x05hello")  # a message 1 shorter than an ephemeral key
        await silent.send_eof()
        with trio.fail_after(5):
            while not failures:
                await trio.sleep(0.01)
        await silent.aclose()

    run_with_server(body, on_handshake_failed=lambda ip, exc: failures.append((ip, exc.reason)))
    assert failures == [(HOST, "bad-message-length")]


def test_handshake_timeout_frees_the_slot() -> None:
    async def body(port: int) -> None:
        silent = await trio.open_tcp_stream(HOST, port)
        assert await _is_closed_soon(silent, 3.0)  # timed out after 0.3 s
        conn = await connect(HOST, port, CLIENT)
        await conn.aclose()
        await silent.aclose()

    run_with_server(body, handshake_timeout=0.3, max_handshakes=1)


# --- keep-alive and idle timeout -------------------------------------------------------------------------


def test_keepalive_keeps_a_quiet_connection_open() -> None:
    async def body(port: int) -> None:
        conn = await connect(HOST, port, CLIENT, keepalive_interval=0.1, idle_timeout=0.4)
        with trio.move_on_after(1.2):
            await conn.receive_message()  # nothing to receive; pings are answered by the echo server
        assert conn.pings_sent >= 5 and conn.pongs_received >= 5
        await conn.send_message(b"still")
        assert await conn.receive_message() == b"still"
        await conn.aclose()

    run_with_server(body)


def test_idle_timeout_drops_a_peer_that_stopped_answering() -> None:
    async def mute(conn: SecureConnection) -> None:
        await trio.sleep(30)  # never reads, so never answers a ping

    async def body(port: int) -> None:
        conn = await connect(HOST, port, CLIENT, keepalive_interval=0.1, idle_timeout=0.5)
        with trio.fail_after(3), pytest.raises(TransportError) as info:
            await conn.receive_message()
        assert info.value.reason == "idle-timeout"
        assert conn.pings_sent >= 1 and conn.pongs_received == 0

    run_with_server(body, mute)


def test_ping_frame_is_answered_with_pong() -> None:
    async def body(port: int) -> None:
        conn = await connect(HOST, port, CLIENT)
        await raw_send(conn, [bytes([KIND_PING << 4]) + b"12345678"])
        await conn.send_message(b"after")
        assert await conn.receive_message() == b"after"
        await conn.aclose()

    run_with_server(body)

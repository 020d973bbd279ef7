"""One conformance suite for every `adapters.transport.Transport` (spec/transport.md §9-§11): TCP+Noise,
the HTTP (WebSocket) transport and the in-memory transport must behave the same for identities, whole
ordered messages per lane, per-lane backpressure, a peer closing mid-frame, oversize and bad frames, and a
listener surviving its handler."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

import pytest
import trio

from peerloom.adapters.http_transport import HttpTransport
from peerloom.adapters.memory import MemoryNetwork, MemoryNetworkTransport
from peerloom.adapters.tcp import (
    KIND_START,
    LANE_WINDOW,
    SecureConnection,
    TcpTransport,
)
from peerloom.adapters.transport import (
    LANE_BULK,
    LANE_CONTROL,
    PEER_FAULTS,
    Connection,
    ConnectionClosed,
    Transport,
    TransportError,
)
from tests.helpers import CLIENT, OTHER, SERVER, StalledBulk, collect_errors, echo, raw_send, wait_for

KINDS = ("tcp", "http", "memory")


def make_transport(kind: str, network: MemoryNetwork) -> tuple[Transport, str]:
    """A transport of `kind` and the address its listener should bind."""
    if kind == "tcp":
        return TcpTransport(), "/ip4/127.0.0.1/tcp/0"
    if kind == "http":
        return HttpTransport(), "http://127.0.0.1:0"
    return MemoryNetworkTransport(network), "memory://server"


Body = Callable[[Transport, str], Awaitable[None]]


def run_with_listener(kind: str, body: Body, handler: Callable[[SecureConnection], Awaitable[object]], *,
                      max_message_bytes: int = 16 * 2**20) -> None:
    """Listen with `handler` on a fresh transport of `kind`, run `body(transport, bound address)` within
    30 s, then stop the listener."""

    async def main() -> None:
        transport, address = make_transport(kind, MemoryNetwork())
        assert isinstance(transport, Transport) and transport.kind == kind
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(functools.partial(transport.listen, address, SERVER, handler,
                                                          max_message_bytes=max_message_bytes))
            assert transport.handles(bound)
            with trio.fail_after(30):
                await body(transport, bound)
            nursery.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.parametrize("kind", KINDS)
def test_handshake_proves_both_identities_and_refuses_the_wrong_peer(kind: str) -> None:
    seen = []

    async def handler(conn: SecureConnection) -> None:
        seen.append(conn.remote_peer)
        await echo(conn)

    async def body(transport: Transport, address: str) -> None:
        with pytest.raises(TransportError) as info:
            await transport.dial(address, CLIENT, expected_peer=OTHER.peer_id, max_message_bytes=1000)
        assert info.value.reason == "peer-mismatch"
        conn = await transport.dial(address, CLIENT, expected_peer=SERVER.peer_id, max_message_bytes=1000)
        assert isinstance(conn, Connection)
        assert conn.remote_peer == SERVER.peer_id
        await conn.send_message(b"ping")
        assert await conn.receive_message() == b"ping"
        assert seen[-1] == CLIENT.peer_id
        assert conn.bytes_sent > 0 and conn.bytes_received > 0
        await conn.aclose()

    run_with_listener(kind, body, handler)


@pytest.mark.parametrize("kind", KINDS)
def test_messages_arrive_whole_and_in_order_per_lane(kind: str) -> None:
    sizes = [0, 1, 65535, 70_000, 3 * 2**20 + 7, 5]
    messages = [bytes([i + 1]) * size for i, size in enumerate(sizes)]

    async def body(transport: Transport, address: str) -> None:
        conn = await transport.dial(address, CLIENT, max_message_bytes=16 * 2**20)
        async with trio.open_nursery() as nursery:
            for i, message in enumerate(messages):
                nursery.start_soon(functools.partial(conn.send_message, message, lane=i % 2))
                await trio.sleep(0)  # start order = call order per lane
            got = {LANE_CONTROL: [], LANE_BULK: []}
            for _ in messages:
                for lane in (LANE_CONTROL, LANE_BULK):
                    if len(got[lane]) < len(messages[lane::2]):
                        got[lane].append(await conn.receive_message(lane))
        assert got[LANE_CONTROL] == messages[0::2]
        assert got[LANE_BULK] == messages[1::2]
        await conn.aclose()

    run_with_listener(kind, body, echo)


@pytest.mark.parametrize("kind", KINDS)
def test_a_stalled_bulk_lane_stalls_only_its_sender(kind: str) -> None:
    stalled = StalledBulk(2**20, 12, measure_queue=True)  # 12 MiB of bulk: three lane windows

    async def body(transport: Transport, address: str) -> None:
        conn = await transport.dial(address, CLIENT, max_message_bytes=16 * 2**20)
        await stalled.stall(conn, lambda: conn.send_credit(LANE_BULK), rounds=20)
        assert stalled.peak_queued <= LANE_WINDOW + stalled.size  # what the stalled receiver buffered stays bounded
        await conn.aclose()

    run_with_listener(kind, body, stalled.handler)


@pytest.mark.parametrize("kind", KINDS)
def test_a_peer_closing_mid_frame_gives_a_typed_error(kind: str) -> None:
    errors: list[TransportError] = []

    async def body(transport: Transport, address: str) -> None:
        conn = await transport.dial(address, CLIENT, max_message_bytes=1000)
        await raw_send(conn, [bytes([KIND_START << 4 | LANE_BULK]) + (500).to_bytes(4, "big") + b"half"])
        await conn._stream.aclose()  # gone with 4 of 500 bytes sent
        await wait_for(errors)
        assert errors[0].reason in ("truncated", "reset")  # a typed error, and the listener lives on
        # the other direction: the listener side hangs up on us mid-message
        conn = await transport.dial(address, CLIENT, max_message_bytes=1000)
        await conn.send_message(b"cut")
        with pytest.raises(TransportError) as info:
            await conn.receive_message()
        assert info.value.reason in ("truncated", "reset")
        await conn.aclose()

    async def handler(conn: SecureConnection) -> None:
        try:
            if await conn.receive_message() == b"cut":
                await raw_send(conn, [bytes([KIND_START << 4]) + (100).to_bytes(4, "big") + b"x"])
                await conn._stream.aclose()
                return
        except TransportError as exc:
            errors.append(exc)

    run_with_listener(kind, body, handler)


@pytest.mark.parametrize("kind", KINDS)
def test_oversize_messages_are_refused_before_allocation(kind: str) -> None:
    errors: list[TransportError] = []

    async def body(transport: Transport, address: str) -> None:
        conn = await transport.dial(address, CLIENT, max_message_bytes=10)
        with pytest.raises(TransportError) as info:  # the sender's own limit, before any byte goes out
            await conn.send_message(b"x" * 11)
        assert info.value.reason == "message-too-large"
        await raw_send(conn, [bytes([KIND_START << 4 | LANE_BULK]) + (2**32 - 1).to_bytes(4, "big")])
        await wait_for(errors)  # only the 5-byte header was sent: refused without waiting for 4 GiB
        assert errors[0].reason == "message-too-large" and errors[0].reason in PEER_FAULTS
        await conn.aclose()

    run_with_listener(kind, body, collect_errors(errors), max_message_bytes=1000)


@pytest.mark.parametrize(("plaintexts", "raw", "reason"), [
    ([b""], b"", "bad-frame"),  # an empty frame
    ([bytes([KIND_START << 4 | 2]) + b"\0\0\0\0"], b"", "bad-frame"),  # lane 2
    ([bytes([0x70])], b"", "bad-frame"),  # unknown kind
    ([], b"\x00\x20" + b"\xaa" * 32, "decrypt-failed"),  # garbage ciphertext
], ids=["empty", "bad-lane", "bad-kind", "garbage"])
@pytest.mark.parametrize("kind", KINDS)
def test_bad_frames_are_refused(kind: str, plaintexts: list[bytes], raw: bytes, reason: str) -> None:
    errors: list[TransportError] = []

    async def body(transport: Transport, address: str) -> None:
        conn = await transport.dial(address, CLIENT, max_message_bytes=1000)
        if plaintexts:
            await raw_send(conn, plaintexts)
        else:
            await conn._stream.send_all(raw)
        await wait_for(errors)
        assert errors[0].reason == reason and reason in PEER_FAULTS
        await conn.aclose()

    run_with_listener(kind, body, collect_errors(errors))


@pytest.mark.parametrize("kind", KINDS)
def test_the_listener_survives_a_handler_exception(kind: str) -> None:
    calls = [0]

    async def handler(conn: SecureConnection) -> None:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("a bug in the handler")
        await echo(conn)

    async def body(transport: Transport, address: str) -> None:
        first = await transport.dial(address, CLIENT, max_message_bytes=1000)
        with pytest.raises(TransportError):  # the listener closed it
            await first.receive_message()
        await first.aclose()
        second = await transport.dial(address, CLIENT, max_message_bytes=1000)
        await second.send_message(b"still here")
        assert await second.receive_message() == b"still here"
        await second.aclose()

    run_with_listener(kind, body, handler)


@pytest.mark.parametrize("kind", KINDS)
def test_a_connection_error_beside_the_listeners_cancellation_stays_contained(kind: str) -> None:
    """The listener is cancelled just as a connection ends (its peer left: a handler task's eof comes beside
    the others' Cancelled, in one exception group). The connection's error ends that connection only: the
    listener's owner sees a clean cancellation, not the eof (tests/web/test_web_interop.py hit this under load
    when the node client's exit raced the test's cancellation)."""
    started: list[bool] = []

    async def eof_on_cancel() -> None:
        try:
            await trio.sleep_forever()
        finally:
            raise ConnectionClosed("eof")  # the peer's eof lands as the cancellation does

    async def handler(conn: SecureConnection) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(eof_on_cancel)
            nursery.start_soon(trio.sleep_forever)
            started.append(True)

    async def body(transport: Transport, address: str) -> None:
        await transport.dial(address, CLIENT, max_message_bytes=1000)
        await wait_for(started)

    run_with_listener(kind, body, handler)  # raised ExceptionGroup([ConnectionClosed('eof')]) before


@pytest.mark.parametrize("kind", KINDS)
def test_dialing_nothing_is_connect_failed(kind: str) -> None:
    async def main() -> None:
        transport, _ = make_transport(kind, MemoryNetwork())
        address = {"tcp": "/ip4/127.0.0.1/tcp/1", "http": "http://127.0.0.1:1", "memory": "memory://nobody"}[kind]
        with pytest.raises(TransportError) as info:
            await transport.dial(address, CLIENT, max_message_bytes=1000)
        assert info.value.reason == "connect-failed"
        assert not transport.handles("memory://x" if kind != "memory" else "http://127.0.0.1:1")

    trio.run(main)

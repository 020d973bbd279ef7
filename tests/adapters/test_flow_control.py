"""Per-lane credit flow control (spec/transport.md §4) over real sockets on 127.0.0.1.

A receiver that stops reading its bulk lane must stall only that lane of that connection: control messages
to it keep flowing, other peers are untouched, and what it buffers stays bounded.
"""

from __future__ import annotations

import functools

import pytest
import trio

from peerloom.adapters.noise import frame
from peerloom.adapters.tcp import (
    KIND_CREDIT,
    KIND_START,
    LANE_WINDOW,
    MessageAssembler,
    SecureConnection,
    connect,
    encode_frames,
    serve,
)
from peerloom.adapters.transport import LANE_BULK, LANE_CONTROL, TransportError
from tests.helpers import CLIENT, HOST, OTHER, SERVER

SERVER_A, SERVER_B = SERVER, OTHER
MESSAGE = 2 * 2**20  # bytes per bulk message
COUNT = 10  # bulk messages per peer: 20 MiB, five times a lane window


def _bulk(i: int) -> bytes:
    return bytes([i]) * MESSAGE


def test_stalled_bulk_lane_delays_neither_control_nor_other_peers() -> None:
    control_latency: list[float] = []
    bulk_a: list[bytes] = []
    bulk_b: list[int] = []
    peak_queued_a = [0]
    release = trio.Event()
    b_done = trio.Event()

    async def handler_a(conn: SecureConnection) -> None:
        async def control() -> None:
            while True:
                sent_at = float(await conn.receive_message(LANE_CONTROL))
                if sent_at < 0:
                    return
                control_latency.append(trio.current_time() - sent_at)

        async def bulk() -> None:
            bulk_a.append(await conn.receive_message(LANE_BULK))
            await release.wait()  # the application stops reading bulk for a while
            while len(bulk_a) < COUNT:
                bulk_a.append(await conn.receive_message(LANE_BULK))

        async def watch() -> None:
            while True:
                peak_queued_a[0] = max(peak_queued_a[0], conn.queued_bytes(LANE_BULK))
                await trio.sleep(0.005)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            async with trio.open_nursery() as inner:
                inner.start_soon(control)
                inner.start_soon(bulk)
            nursery.cancel_scope.cancel()
        await conn.send_message(b"done")

    async def handler_b(conn: SecureConnection) -> None:
        while len(bulk_b) < COUNT:
            bulk_b.append(len(await conn.receive_message()))
        b_done.set()
        await conn.send_message(b"done")

    async def main() -> None:
        async with trio.open_nursery() as servers:
            port_a = await servers.start(functools.partial(serve, HOST, 0, SERVER_A, handler_a))
            port_b = await servers.start(functools.partial(serve, HOST, 0, SERVER_B, handler_b))
            a = await connect(HOST, port_a, CLIENT, expected_peer=SERVER_A.peer_id)
            b = await connect(HOST, port_b, CLIENT, expected_peer=SERVER_B.peer_id)
            sent_a = [0]

            async def send_bulk_a() -> None:
                for i in range(COUNT):
                    await a.send_message(_bulk(i))
                    sent_a[0] += 1

            async def send_bulk_b() -> None:
                for i in range(COUNT):
                    await b.send_message(_bulk(i))

            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(send_bulk_a)
                    nursery.start_soon(send_bulk_b)
                    # While A's bulk lane is stalled: control messages to A, one every 20 ms.
                    for _ in range(20):
                        await a.send_message(repr(trio.current_time()).encode(), lane=LANE_CONTROL)
                        await trio.sleep(0.02)
                    await b_done.wait()  # B got all 20 MiB while A was stalled
                    assert len(control_latency) == 20
                    assert sent_a[0] < COUNT and a.send_credit(LANE_BULK) == 0  # A's bulk sender is held
                    assert peak_queued_a[0] <= LANE_WINDOW + MESSAGE  # A buffers a bounded amount
                    release.set()
                    await a.send_message(b"-1", lane=LANE_CONTROL)
                assert await a.receive_message() == b"done" and await b.receive_message() == b"done"
            await a.aclose()
            await b.aclose()
            servers.cancel_scope.cancel()

    trio.run(main)
    assert max(control_latency) < 1.0, control_latency  # not stuck behind 20 MiB of bulk
    assert bulk_a == [_bulk(i) for i in range(COUNT)]  # whole and in order after the stall
    assert bulk_b == [MESSAGE] * COUNT


def test_a_sender_that_never_receives_still_gets_credit() -> None:
    """Credits arrive on the socket the sender writes to; a send-only peer reads them while it waits."""
    got: list[int] = []
    total = 3 * LANE_WINDOW

    async def handler(conn: SecureConnection) -> None:
        while sum(got) < total:
            got.append(len(await conn.receive_message()))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(functools.partial(serve, HOST, 0, SERVER_A, handler))
            conn = await connect(HOST, port, CLIENT)
            with trio.fail_after(20):
                for _ in range(total // MESSAGE):
                    await conn.send_message(b"x" * MESSAGE)
                while sum(got) < total:
                    await trio.sleep(0.01)
            await conn.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert sum(got) == total


def test_peer_that_overruns_its_credit_is_dropped() -> None:
    """A hostile sender ignores flow control while the receiver does not read bulk: refused, not buffered."""
    errors: list[TransportError] = []

    async def handler(conn: SecureConnection) -> None:
        try:
            await conn.receive_message(LANE_CONTROL)  # never reads bulk, so never credits it back
        except TransportError as exc:
            errors.append(exc)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(functools.partial(serve, HOST, 0, SERVER_A, handler))
            conn = await connect(HOST, port, CLIENT)
            # Whole messages written by hand, past the window and without waiting for any credit.
            plaintexts = [f for i in range(LANE_WINDOW // MESSAGE + 2) for f in encode_frames(_bulk(i), LANE_BULK)]
            with trio.fail_after(10):
                try:
                    for p in plaintexts:
                        await conn._stream.send_all(frame(conn._transport.encrypt(p)))
                except trio.BrokenResourceError:
                    pass  # the receiver hung up on us
                while not errors:
                    await trio.sleep(0.01)
            await conn.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert errors[0].reason == "flow-control"


def test_assembler_enforces_the_window_and_grants() -> None:
    assembler = MessageAssembler(100, window=10)
    start = bytes([KIND_START << 4 | LANE_BULK]) + (20).to_bytes(4, "big")
    assert assembler.handle(start + b"a" * 10) is None  # exactly the window
    assert assembler.received[LANE_BULK] == 10
    with pytest.raises(TransportError) as info:
        assembler.handle(bytes([2 << 4 | LANE_BULK]) + b"b")
    assert info.value.reason == "flow-control"
    assembler = MessageAssembler(100, window=10)
    assembler.handle(start + b"a" * 10)
    assembler.grant(LANE_BULK, 10)
    event = assembler.handle(bytes([2 << 4 | LANE_BULK]) + b"b" * 10)
    assert event is not None and event.data == b"a" * 10 + b"b" * 10
    # The control lane has its own window.
    assert assembler.handle(bytes([KIND_START << 4]) + (10).to_bytes(4, "big") + b"c" * 10).data == b"c" * 10


@pytest.mark.parametrize(("body", "ok"), [((1).to_bytes(4, "big"), True), (b"\0\0\0\0", False),
                                          (b"\0\0\1", False), (b"\0\0\0\0\1", False)])
def test_credit_frame_parsing(body: bytes, ok: bool) -> None:
    assembler = MessageAssembler(100)
    plaintext = bytes([KIND_CREDIT << 4 | LANE_BULK]) + body
    if ok:
        event = assembler.handle(plaintext)
        assert (event.lane, event.increment) == (LANE_BULK, 1)
    else:
        with pytest.raises(TransportError) as info:
            assembler.handle(plaintext)
        assert info.value.reason == "bad-frame"


def test_cancelled_receives_never_cut_a_control_frame() -> None:
    """Receives cancelled at random moments while PONGs and credits are owed; the wire stays intact."""
    echoed: list[int] = []

    async def handler(conn: SecureConnection) -> None:
        from peerloom.adapters.tcp import KIND_PING
        for i in range(300):  # PINGs written by hand: each one makes the client owe a PONG
            await conn._stream.send_all(frame(conn._transport.encrypt(bytes([KIND_PING << 4]) + bytes(8))))
            if i % 30 == 0:
                await conn.send_message(b"x" * (LANE_WINDOW // 2 + 1), lane=LANE_BULK)  # credit owed too
        await conn.send_message(b"end", lane=LANE_CONTROL)
        while True:
            echoed.append(len(await conn.receive_message()))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(functools.partial(serve, HOST, 0, SERVER_A, handler))
            conn = await connect(HOST, port, CLIENT)
            got = []
            with trio.fail_after(20):
                while not got or got[-1] != b"end":
                    with trio.move_on_after(0.0005):
                        got.append(await conn.receive_message())
                await conn.send_message(b"y" * 100_000)
                while not echoed:
                    await trio.sleep(0.01)
            assert echoed == [100_000] and conn.pongs_received == 0
            await conn.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_send_cancelled_while_waiting_for_credit_keeps_the_connection() -> None:
    """Nothing of the message was written, so cancelling it must not cost the connection."""
    control: list[bytes] = []

    async def handler(conn: SecureConnection) -> None:
        while True:  # reads only the control lane: bulk credit is never returned
            message = await conn.receive_message(LANE_CONTROL)
            control.append(message)
            await conn.send_message(message, lane=LANE_CONTROL)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(functools.partial(serve, HOST, 0, SERVER_A, handler))
            conn = await connect(HOST, port, CLIENT)
            with trio.fail_after(10):
                for _ in range(2):  # exactly one window: credit ends at a message boundary
                    await conn.send_message(b"b" * (LANE_WINDOW // 2), lane=LANE_BULK)
                assert conn.send_credit(LANE_BULK) == 0
                with trio.move_on_after(0.3) as scope:
                    await conn.send_message(b"c" * 10, lane=LANE_BULK)
                assert scope.cancelled_caught
                await conn.send_message(b"ping", lane=LANE_CONTROL)
                assert await conn.receive_message(LANE_CONTROL) == b"ping"
            await conn.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert control == [b"ping"]

"""NodeRuntime admission over real sockets on 127.0.0.1: inbound connections go through the address book
(per-IP cap, bans), a peer the engine hangs up on for penalties is not re-admitted, and a peer whose
outbox grows past the per-lane byte cap is hung up on while a peer that keeps reading stays connected."""

from __future__ import annotations

import functools
from contextlib import asynccontextmanager

import pytest
import trio

from peerloom.adapters import tcp
from peerloom.adapters.runtime import NodeRuntime, RuntimeOptions
from peerloom.adapters.storage import ArtifactStore
from peerloom.adapters.transport import LANE_BULK, TransportError
from peerloom.core.messages import Hello, decode_message
from tests.helpers import ident, make_revision

TRAINER = ident(3)  # not on the roster: it never gets a lease, so nothing runs on the executor


class _NoCompute:
    def run(self, task):  # pragma: no cover - a test that reaches it is broken
        raise AssertionError(f"unexpected compute task {task}")


@asynccontextmanager
async def running_node(tmp_path, *, revision=None, admission=None, **options):
    """A trainer NodeRuntime with no peers; it never holds params, so it never computes."""
    runtime = NodeRuntime(name="n", identity=TRAINER, revision=revision or make_revision(), roles={"trainer"},
                          # the ignore: _NoCompute stands in for the executor
                          store=ArtifactStore(tmp_path / "store"), executor=_NoCompute(),  # type: ignore[arg-type]
                          options=RuntimeOptions(**options), admission=admission)
    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.run)
        try:
            yield runtime
        finally:
            nursery.cancel_scope.cancel()
    runtime.close()


def trio_test(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return trio.run(functools.partial(fn, *args, **kwargs))
    return wrapper


async def wait_for(cond, timeout_s=5.0):
    with trio.fail_after(timeout_s):
        while not cond():
            await trio.sleep(0.01)


async def connect(runtime, n):
    return await tcp.connect("127.0.0.1", runtime.port, ident(n), expected_peer=TRAINER.peer_id)


async def first_message(conn, timeout_s=5.0):
    with trio.fail_after(timeout_s):
        return decode_message(await conn.receive_message(), max_bytes=1 << 20)


@trio_test
async def test_per_ip_cap_refuses_before_handshake_and_frees_the_slot(tmp_path):
    async with running_node(tmp_path, max_connections_per_ip=2) as runtime:
        a, b = await connect(runtime, 10), await connect(runtime, 11)
        assert isinstance(await first_message(a), Hello) and isinstance(await first_message(b), Hello)
        await wait_for(lambda: runtime.book.connections == 2)
        with pytest.raises(TransportError):  # refused before any byte: the handshake cannot finish
            await connect(runtime, 12)
        await a.aclose()
        await wait_for(lambda: runtime.book.connections == 1)
        c = await connect(runtime, 12)  # the closed connection's slot is free again
        assert isinstance(await first_message(c), Hello)
        await wait_for(lambda: runtime.book.connections == 2)
        await b.aclose()
        await c.aclose()
        await wait_for(lambda: runtime.book.connections == 0)


@trio_test
async def test_peer_hung_up_for_penalties_is_not_readmitted(tmp_path):
    async with running_node(tmp_path) as runtime:
        bad = await connect(runtime, 20)
        assert isinstance(await first_message(bad), Hello)
        limit = runtime.engine.config.penalty_limit
        with pytest.raises(TransportError):  # garbage until the engine hangs up (penalty-limit)
            with trio.fail_after(10):
                for _ in range(limit):
                    await bad.send_message(b"\xff not cbor")
                while True:
                    await bad.receive_message()
        assert runtime.book.is_banned(ident(20).peer_id, now=trio.current_time())
        await wait_for(lambda: runtime.book.connections == 0)

        again = await connect(runtime, 20)  # the handshake names the peer; the runtime then hangs up
        with pytest.raises(TransportError):
            await first_message(again)
        assert ident(20).peer_id not in runtime._conns
        honest = await connect(runtime, 21)  # from the same IP: only the peer is banned
        assert isinstance(await first_message(honest), Hello)
        await honest.aclose()


@trio_test
async def test_dialed_peer_hung_up_for_penalties_is_not_redialed(tmp_path):
    accepted = []

    async def garbage(conn):
        accepted.append(conn.remote_peer)
        for _ in range(100):
            await conn.send_message(b"\xff not cbor")
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        port = await nursery.start(functools.partial(tcp.serve, "127.0.0.1", 0, ident(40), garbage))
        async with running_node(tmp_path, bootstrap=(f"/ip4/127.0.0.1/tcp/{port}",), redial_s=0.05,
                                max_redial_s=0.1) as runtime:
            await wait_for(lambda: runtime.book.is_banned(ident(40).peer_id, now=trio.current_time()))
            await wait_for(lambda: ident(40).peer_id not in runtime._conns)
            await trio.sleep(1.0)  # ten redial periods: a peer that was not banned would be dialed again
            assert accepted == [TRAINER.peer_id]
        nursery.cancel_scope.cancel()


@trio_test
async def test_outbox_over_its_byte_cap_hangs_up_a_slow_peer_only(tmp_path):
    cap = 1 << 20
    async with running_node(tmp_path, max_bulk_outbox_bytes=cap) as runtime:
        slow, fast = await connect(runtime, 30), await connect(runtime, 31)
        received = [0]

        async def read_all(conn):
            try:
                while True:
                    received[0] += len(await conn.receive_message())
            except TransportError:
                pass

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_all, fast)
            await wait_for(lambda: {ident(30).peer_id, ident(31).peer_id} <= set(runtime._conns))
            chunk = bytes(256 * 1024)  # bulk lane (over tcp.AUTO_CONTROL_MAX_BYTES)
            sent = 0
            with trio.fail_after(15):
                # The slow peer never reads: its credit (tcp.LANE_WINDOW) and the socket buffers fill, then
                # its outbox grows until the cap. The fast peer keeps up and stays.
                while ident(30).peer_id in runtime._conns:
                    for peer in (ident(30).peer_id, ident(31).peer_id):
                        runtime._enqueue(peer, chunk)
                    sent += len(chunk)
                    await trio.sleep(0.005)
            assert sent > cap  # it took more than the cap: credit and socket buffers absorbed the start
            assert ident(31).peer_id in runtime._conns
            assert runtime.outbox_hangups == 1
            await wait_for(lambda: received[0] >= sent, 10)
            nursery.cancel_scope.cancel()
        await fast.aclose()
        await slow.aclose()


@trio_test
async def test_a_peer_faster_than_the_engine_is_held_back_by_flow_control(tmp_path):
    """Messages received but not yet handled by the engine are bounded per peer (PEER_INBOX_BYTES): past
    that the reader stops taking messages, the lanes grant no credit, and the peer's sends wait - instead
    of queueing without bound in this process (spec/transport.md §13)."""
    from peerloom.adapters.runtime import PEER_INBOX_BYTES

    async with running_node(tmp_path) as runtime:
        conn = await connect(runtime, 40)
        await first_message(conn)
        peer = ident(40).peer_id
        runtime._inbox[peer] += PEER_INBOX_BYTES + 1  # as if the engine were that far behind this peer
        blob = b"\x00" * (1 << 20)
        sent = 0
        with trio.move_on_after(3):
            for _ in range(3 * tcp.LANE_WINDOW // len(blob)):
                await conn.send_message(blob, lane=LANE_BULK)
                sent += len(blob)
        # At most one message reached the engine, then the lane window, then nothing: the sender waits.
        assert sent <= tcp.LANE_WINDOW + 2 * len(blob), sent
        runtime._inbox_done(peer, PEER_INBOX_BYTES + 1)  # the engine caught up: reading resumes
        resumed = 0
        with trio.move_on_after(10):
            try:
                for _ in range(2 * tcp.LANE_WINDOW // len(blob)):
                    await conn.send_message(blob, lane=LANE_BULK)
                    resumed += len(blob)
            except TransportError:
                pass  # the engine may hang up on these meaningless messages once it reads them
        await wait_for(lambda: runtime._inbox[peer] == 0)  # everything read was handed to the engine
        assert resumed >= len(blob) or runtime.engine.rejected_by_reason, resumed
        await conn.aclose()


@trio_test
async def test_strangers_cannot_take_the_slots_of_known_peers(tmp_path):
    """spec/transport.md §13: with every stranger slot held by authenticated strangers, the manifest's
    validator (a known peer) still connects; a further stranger is refused and counted."""
    from peerloom.adapters.limits import Limits

    validator = ident(1)  # make_revision's validator
    async with running_node(tmp_path, limits=Limits(max_strangers=2)) as runtime:
        strangers = [await connect(runtime, n) for n in (30, 31)]
        for conn in strangers:
            assert isinstance(await first_message(conn), Hello)
        refused = await connect(runtime, 32)
        with pytest.raises(TransportError):
            await first_message(refused)
        assert runtime.limiter.refusals["stranger-cap"] == 1
        known = await tcp.connect("127.0.0.1", runtime.port, validator, expected_peer=TRAINER.peer_id)
        assert isinstance(await first_message(known), Hello)
        for conn in (*strangers, refused, known):
            await conn.aclose()

"""Embed the sans-IO engine in a trio program, with peerloom's own transport and host driver.

The engine is a pure state machine (spec/embedding.md): feed it events with `handle(event)`, carry out the
effects it returns, and call `handle(TimerDue(now))` at `next_deadline()`. Here `adapters.host.drain` pulls
the effects and hands each to the host method named after it (`send`, `persist`, `run_task`, ...): the
`Host` protocol, one method per effect. The transport is peerloom's in-process one (`memory://` addresses,
the same Noise handshake, frames and flow control as TCP); for real machines use `TcpTransport` and
``/ip4/127.0.0.1/tcp/0`` instead: nothing else changes. One validator and two trainers run in one trio
run, each with a store on disk and compute on a worker thread, until three windows are certified.
"""

import functools
import math
import random
from pathlib import Path

import trio
from _experiment import digits_experiment

from peerloom.adapters.compute import ComputeExecutor
from peerloom.adapters.host import chunk_message, drain, stored_event
from peerloom.adapters.memory import MemoryNetwork, MemoryNetworkTransport
from peerloom.adapters.storage import ArtifactStore
from peerloom.adapters.transport import Connection, TransportError
from peerloom.core import effects as fx
from peerloom.core import events as ev
from peerloom.core.engine import Engine, EngineConfig


class TrioHost:
    """One engine, its store, its compute and its connections. The methods under "Host" are
    `peerloom.adapters.host.Host`: `drain` calls the one named after each effect."""

    def __init__(self, name, roles, identity, revision, workload, shards, root: Path, nursery: trio.Nursery):
        self.identity, self.nursery = identity, nursery
        self.store = ArtifactStore(root / name, chunk_size=revision.manifest.chunk_size)
        self.executor = ComputeExecutor(self.store, revision.manifest, workload, shards)
        self.engine = Engine(EngineConfig(roles=frozenset(roles), revision=revision), identity,
                             random.Random(name), stored=self.store.refs(), records=self.store.records())
        self.outboxes: dict = {}  # peer -> the send side of its connection's queue
        self.compute_slot = trio.CapacityLimiter(1)  # one compute task at a time
        self.rearm = trio.Event()
        self.heads: list[tuple[int, float]] = []  # (window, test accuracy) of each certified head

    def feed(self, event) -> None:
        self.engine.handle(event)
        drain(self.engine, self)
        self.rearm.set()  # the next deadline may have moved

    # --- Host: one method per effect (feeding back with engine.handle: `drain` goes on with what it adds)

    def send(self, effect: fx.Send) -> None:
        if effect.peer in self.outboxes:
            self.outboxes[effect.peer].send_nowait(effect.data)

    def serve_chunk(self, effect: fx.ServeChunk) -> None:
        self.send(fx.Send(peer=effect.peer, data=chunk_message(self.store, effect)))

    def hang_up(self, effect: fx.HangUp) -> None:
        if effect.peer in self.outboxes:
            self.outboxes.pop(effect.peer).close()  # its writer closes the connection

    def persist(self, effect: fx.Persist) -> None:
        self.store.put_record(effect.key, effect.record)  # durable (SQLite, synchronous=FULL) when it returns
        self.engine.handle(ev.Persisted(now=trio.current_time(), token=effect.token))

    def store_chunk(self, effect: fx.StoreChunk) -> None:
        self.store.write_chunk(effect.ref, effect.index, effect.data)

    def commit_artifact(self, effect: fx.CommitArtifact) -> None:
        self.engine.handle(stored_event(self.store, effect, trio.current_time()))

    def run_task(self, effect: fx.RunTask) -> None:
        self.nursery.start_soon(self.compute, effect)

    def drop_artifacts(self, effect: fx.DropArtifacts) -> None:
        self.store.remove(effect.digests)

    def head_promoted(self, effect: fx.HeadPromoted) -> None:
        self.heads.append((effect.head.window, effect.head.metrics.get("test_accuracy", float("nan"))))

    def peers_discovered(self, effect: fx.PeersDiscovered) -> None:
        pass  # every trainer dials the validator at start; a longer-lived host would dial these

    def ban(self, effect: fx.Ban) -> None:
        pass  # refuse effect.peer until effect.until; the engine hangs up on it right after this effect

    def rejected(self, effect: fx.Rejected) -> None:
        print(f"rejected {effect.peer}: {effect.reason}")

    def submit_reply(self, effect: fx.SubmitReply) -> None:
        pass  # this host feeds no Submit

    def log(self, effect: fx.Log) -> None:
        pass

    # --- tasks

    async def compute(self, effect: fx.RunTask) -> None:
        try:
            result = await trio.to_thread.run_sync(self.executor.run, effect.kind, effect.args,
                                                   limiter=self.compute_slot)
            self.feed(ev.TaskFinished(now=trio.current_time(), task_id=effect.task_id, result=result))
        except Exception as exc:  # a failed task is an event for the engine, not a crash of the host
            self.feed(ev.TaskFailed(now=trio.current_time(), task_id=effect.task_id, reason=repr(exc)))

    async def timers(self) -> None:
        while True:
            self.rearm = trio.Event()
            deadline = self.engine.next_deadline()
            with trio.move_on_at(math.inf if deadline is None else deadline):
                await self.rearm.wait()
                continue  # something was fed: read the deadline again
            self.feed(ev.TimerDue(now=trio.current_time()))

    async def connection(self, conn: Connection) -> None:
        """Own one connection: a reader (this task) and a writer, until either side ends it."""
        peer = conn.remote_peer  # proven by the transport's handshake
        outbox, queue = trio.open_memory_channel(math.inf)
        self.outboxes[peer] = outbox
        self.feed(ev.PeerConnected(now=trio.current_time(), peer=peer))
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.write, conn, queue)
                while True:
                    data = await conn.receive_message()
                    self.feed(ev.MessageReceived(now=trio.current_time(), peer=peer, data=data))
        except* TransportError:
            pass  # closed by either side, or broken: the engine hears of it below
        finally:
            self.outboxes.pop(peer, None)
            self.feed(ev.PeerDisconnected(now=trio.current_time(), peer=peer))

    @staticmethod
    async def write(conn: Connection, queue: trio.MemoryReceiveChannel) -> None:
        async for data in queue:
            await conn.send_message(data)  # waits while the peer's flow-control window is spent
        await conn.aclose()  # hung up: the reader sees the end


async def main() -> None:
    root, revision, ids, workload, shards = digits_experiment("trio")  # examples/_experiment.py
    transport = MemoryNetworkTransport(MemoryNetwork())
    async with trio.open_nursery() as nursery:
        hosts = {name: TrioHost(name, {"validator" if name == "validator" else "trainer"}, ids[name], revision,
                                workload, shards, root, nursery) for name in ("validator", "trainer-1", "trainer-2")}
        limit = hosts["validator"].engine.config.max_message_bytes
        for host in hosts.values():
            host.feed(ev.Start(now=trio.current_time()))
            nursery.start_soon(host.timers)
        address = await nursery.start(functools.partial(
            transport.listen, "memory://validator", ids["validator"], hosts["validator"].connection,
            max_message_bytes=limit))
        for name in ("trainer-1", "trainer-2"):
            conn = await transport.dial(address, ids[name], max_message_bytes=limit)
            nursery.start_soon(hosts[name].connection, conn)
        with trio.fail_after(120):
            while len(hosts["validator"].heads) < 3:
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()  # every task ends: connections, timers, the listener
    for window, accuracy in hosts["validator"].heads[:3]:
        print(f"window {window} certified: test accuracy {accuracy:.3f}")


if __name__ == "__main__":
    trio.run(main)

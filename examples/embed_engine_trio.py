"""Embed the sans-IO engine in a trio program, with peerloom's own transport and driver.

The engine is a pure state machine (spec/embedding.md). A `Driver` (`peerloom.adapters.host`) feeds it events,
carries out its effects in order, feeds back what the contract needs and re-arms one timer; this host supplies
only the I/O (`send`, `run_task`, `arm_timer`, ..., and a store on disk through `StoreOnDisk`). The transport is
peerloom's in-process one (`memory://` addresses, the same Noise handshake, frames and flow control as TCP);
for real machines use `TcpTransport` and ``/ip4/127.0.0.1/tcp/0`` instead: nothing else changes. One validator
and two trainers run in one trio run, each with a store on disk and compute on a worker thread, until three
windows are certified.
"""

import functools
import math
import random
from pathlib import Path

import trio
from _experiment import digits_experiment

from peerloom.adapters.compute import ComputeExecutor
from peerloom.adapters.host import Driver, Observer, StoreOnDisk, outcome
from peerloom.adapters.memory import MemoryNetwork, MemoryNetworkTransport
from peerloom.adapters.storage import ArtifactStore
from peerloom.adapters.transport import Connection, TransportError
from peerloom.core import events as ev
from peerloom.core.engine import Engine, EngineConfig


class TrioHost(StoreOnDisk, Observer):
    """One engine's I/O (the driver's `Host` and `Observer`): its store, its compute and its connections."""

    def __init__(self, name, roles, identity, revision, workload, shards, root: Path, nursery: trio.Nursery):
        self.nursery = nursery
        self.store = ArtifactStore(root / name, chunk_size=revision.manifest.chunk_size)
        self.executor = ComputeExecutor(self.store, revision.manifest, workload, shards)
        engine = Engine(EngineConfig(roles=frozenset(roles), revision=revision), identity,
                        random.Random(name), stored=self.store.refs(), records=self.store.records())
        self.driver = Driver(engine, self, self)
        self.outboxes: dict = {}  # peer -> the send side of its connection's queue
        self.compute_slot = trio.CapacityLimiter(1)  # one compute task at a time
        self.deadline, self.rearm = math.inf, trio.Event()
        self.heads: list[tuple[int, float]] = []  # (window, test accuracy) of each certified head

    def clock(self):
        return trio.current_time()

    def arm_timer(self, deadline):
        self.deadline = math.inf if deadline is None else deadline
        self.rearm.set()  # `timers` waits for the new deadline

    def send(self, peer, data):
        if peer in self.outboxes:
            self.outboxes[peer].send_nowait(data)

    def hang_up(self, peer, reason):
        if peer in self.outboxes:
            self.outboxes.pop(peer).close()  # its writer closes the connection

    def ban(self, peer, until):
        pass  # a longer-lived host refuses peer until then; the engine hangs up on it right after this

    def run_task(self, task, done):
        async def compute():
            done(await trio.to_thread.run_sync(outcome, self.executor.run, task.task,
                                               limiter=self.compute_slot))
        self.nursery.start_soon(compute)

    def head_promoted(self, head, certificate):
        self.heads.append((head.window, head.metrics.get("test_accuracy", float("nan"))))

    def rejected(self, peer, reason, detail):
        print(f"rejected {peer}: {reason}")

    async def timers(self) -> None:
        while True:
            self.rearm = trio.Event()
            with trio.move_on_at(self.deadline):
                await self.rearm.wait()
                continue  # re-armed: wait for the new deadline
            self.driver.timer_due()

    async def connection(self, conn: Connection) -> None:
        """Own one connection: a reader (this task) and a writer, until either side ends it."""
        peer = conn.remote_peer  # proven by the transport's handshake
        outbox, queue = trio.open_memory_channel(math.inf)
        self.outboxes[peer] = outbox
        self.driver.handle(ev.PeerConnected(now=trio.current_time(), peer=peer))
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.write, conn, queue)
                while True:
                    data = await conn.receive_message()
                    self.driver.handle(ev.MessageReceived(now=trio.current_time(), peer=peer, data=data))
        except* TransportError:
            pass  # closed by either side, or broken: the engine hears of it below
        finally:
            self.outboxes.pop(peer, None)
            self.driver.handle(ev.PeerDisconnected(now=trio.current_time(), peer=peer))

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
        limit = hosts["validator"].driver.engine.config.max_message_bytes
        for host in hosts.values():
            host.driver.start()
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

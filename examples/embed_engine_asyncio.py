"""Embed the sans-IO engine in your own event loop: plain asyncio, its own sockets and timers.

The engine is a pure state machine (spec/embedding.md). A `Driver` (`peerloom.adapters.host`) feeds it events,
carries out its effects in order, feeds back what the contract needs and re-arms one timer; this host supplies
only the I/O: a clock, a timer task, sockets, a store on disk (`StoreOnDisk`) and compute on a worker thread.
It is a whole host in one asyncio process: one validator and two trainers, each with its own TCP server on
127.0.0.1; it runs until three windows are certified.

For brevity its wire is a 4-byte length prefix with the peer id sent first, unauthenticated: a real
deployment uses peerloom's TCP+Noise transport (`peerloom node`), which proves every peer's identity.
"""

import asyncio
import random
from pathlib import Path

from _experiment import digits_experiment

from peerloom.adapters.compute import ComputeExecutor
from peerloom.adapters.host import Driver, Observer, StoreOnDisk, outcome
from peerloom.adapters.storage import ArtifactStore
from peerloom.core import events as ev
from peerloom.core.engine import Engine, EngineConfig
from peerloom.core.identity import PeerId


class Host(StoreOnDisk, Observer):
    """One engine's I/O (the driver's `Host` and `Observer`): its store, compute, server socket and connections."""

    def __init__(self, name, roles, identity, revision, workload, shards, root: Path):
        self.identity, self.loop = identity, asyncio.get_running_loop()
        self.store = ArtifactStore(root / name, chunk_size=revision.manifest.chunk_size)
        self.executor = ComputeExecutor(self.store, revision.manifest, workload, shards)
        engine = Engine(EngineConfig(roles=frozenset(roles), revision=revision), identity,
                        random.Random(name), stored=self.store.refs(), records=self.store.records())
        self.driver = Driver(engine, self, self)
        self.writers: dict[PeerId, asyncio.StreamWriter] = {}
        self.banned: dict[PeerId, float] = {}  # peer -> loop time its ban ends
        self.heads: list[tuple[int, float]] = []  # (window, test accuracy) of each certified head
        self.tasks: set[asyncio.Task] = set()
        self.timer: asyncio.TimerHandle | None = None

    def clock(self):
        return self.loop.time()

    def arm_timer(self, deadline):
        if self.timer is not None:
            self.timer.cancel()
        self.timer = None if deadline is None else self.loop.call_at(deadline, self.driver.timer_due)

    def send(self, peer, data):
        if peer in self.writers:
            self.writers[peer].write(len(data).to_bytes(4, "big") + data)

    def hang_up(self, peer, reason):
        if peer in self.writers:
            self.writers.pop(peer).close()

    def ban(self, peer, until):
        self.banned[peer] = until  # `connection` refuses it until then

    def run_task(self, task, done):
        async def compute():
            done(await asyncio.to_thread(outcome, self.executor.run, task.task))
        self.tasks.add(future := asyncio.ensure_future(compute()))
        future.add_done_callback(self.tasks.discard)

    def head_promoted(self, head, certificate):
        self.heads.append((head.window, head.metrics.get("test_accuracy", float("nan"))))

    def rejected(self, peer, reason, detail):
        print(f"rejected {peer}: {reason}")

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(self.identity.peer_id.to_bytes())
        peer = PeerId.from_bytes(await reader.readexactly(38))
        if self.banned.get(peer, 0.0) > self.loop.time():
            writer.close()
            return
        self.writers[peer] = writer
        self.driver.handle(ev.PeerConnected(now=self.loop.time(), peer=peer))
        try:
            while True:
                size = int.from_bytes(await reader.readexactly(4), "big")
                data = await reader.readexactly(size)
                self.driver.handle(ev.MessageReceived(now=self.loop.time(), peer=peer, data=data))
        except (asyncio.IncompleteReadError, ConnectionError):
            self.writers.pop(peer, None)
            self.driver.handle(ev.PeerDisconnected(now=self.loop.time(), peer=peer))


async def main() -> None:
    root, revision, ids, workload, shards = digits_experiment("asyncio")  # examples/_experiment.py
    hosts = {name: Host(name, {"validator" if name == "validator" else "trainer"}, ids[name], revision, workload,
                        shards, root) for name in ("validator", "trainer-1", "trainer-2")}
    server = await asyncio.start_server(hosts["validator"].connection, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    tasks = []
    for host in hosts.values():
        host.driver.start()
    for name in ("trainer-1", "trainer-2"):
        tasks.append(asyncio.ensure_future(hosts[name].connection(*await asyncio.open_connection("127.0.0.1", port))))
    while len(hosts["validator"].heads) < 3:
        await asyncio.sleep(0.1)
    for window, accuracy in hosts["validator"].heads[:3]:
        print(f"window {window} certified: test accuracy {accuracy:.3f}")
    for host in hosts.values():  # hang up: every connection handler ends on its own
        for writer in list(host.writers.values()):
            writer.close()
    server.close()
    await asyncio.sleep(0.2)  # the handlers see the end of their streams and return
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


if __name__ == "__main__":
    asyncio.run(asyncio.wait_for(main(), timeout=120))

"""Embed the sans-IO engine in your own event loop: plain asyncio, its own sockets and timers.

The engine is a pure state machine (spec/embedding.md): feed it events with `handle(event)`,
carry out the effects `next_effect()` returns, and call `handle(TimerDue(now))` at `next_deadline()`.
`peerloom.adapters.host.drain` pulls the effects and calls the host's method for each one (`Host`). This
file is a whole host in one asyncio process: one validator and two trainers, each with its own TCP server
on 127.0.0.1, a store on disk, and compute on a worker thread; it runs until three windows are certified.

For brevity its wire is a 4-byte length prefix with the peer id sent first, unauthenticated: a real
deployment uses peerloom's TCP+Noise transport (`peerloom node`), which proves every peer's identity.
"""

import asyncio
import random
from pathlib import Path

from _experiment import digits_experiment

from peerloom.adapters.compute import ComputeExecutor
from peerloom.adapters.host import chunk_message, drain, stored_event
from peerloom.adapters.storage import ArtifactStore
from peerloom.core import effects as fx
from peerloom.core import events as ev
from peerloom.core.engine import Engine, EngineConfig
from peerloom.core.identity import PeerId


class Host:
    """One engine, its store, its compute, its server socket and its connections."""

    def __init__(self, name, roles, identity, revision, workload, shards, root: Path):
        self.name, self.identity, self.loop = name, identity, asyncio.get_running_loop()
        self.store = ArtifactStore(root / name, chunk_size=revision.manifest.chunk_size)
        self.executor = ComputeExecutor(self.store, revision.manifest, workload, shards)
        self.engine = Engine(EngineConfig(roles=frozenset(roles), revision=revision), identity,
                             random.Random(name), stored=self.store.refs(), records=self.store.records())
        self.writers: dict[PeerId, asyncio.StreamWriter] = {}
        self.banned: dict[PeerId, float] = {}  # peer -> loop time its ban ends (`Ban` effects)
        self.heads: list[tuple[int, float]] = []  # (window, test accuracy) of each certified head
        self.tasks: set[asyncio.Task] = set()
        self.wake = asyncio.Event()

    def feed(self, event) -> None:
        self.engine.handle(event)
        drain(self.engine, self)  # each effect goes to the method named after it, below
        self.wake.set()  # the next deadline may have moved

    # --- `peerloom.adapters.host.Host`: one method per effect (feeding back with engine.handle is fine:
    # `drain` goes on with the effects that adds)

    def send(self, effect: fx.Send) -> None:
        if effect.peer in self.writers:
            self.writers[effect.peer].write(len(effect.data).to_bytes(4, "big") + effect.data)

    def serve_chunk(self, effect: fx.ServeChunk) -> None:
        self.send(fx.Send(peer=effect.peer, data=chunk_message(self.store, effect)))

    def hang_up(self, effect: fx.HangUp) -> None:
        if effect.peer in self.writers:
            self.writers.pop(effect.peer).close()

    def persist(self, effect: fx.Persist) -> None:
        self.store.put_record(effect.key, effect.record)  # durable (SQLite, synchronous=FULL) when it returns
        self.engine.handle(ev.Persisted(now=self.loop.time(), token=effect.token))  # release what waited on it

    def store_chunk(self, effect: fx.StoreChunk) -> None:
        self.store.write_chunk(effect.ref, effect.index, effect.data)

    def commit_artifact(self, effect: fx.CommitArtifact) -> None:
        self.engine.handle(stored_event(self.store, effect, self.loop.time()))

    def run_task(self, effect: fx.RunTask) -> None:
        task = asyncio.ensure_future(self.compute(effect))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def drop_artifacts(self, effect: fx.DropArtifacts) -> None:
        self.store.remove(effect.digests)

    def head_promoted(self, effect: fx.HeadPromoted) -> None:
        self.heads.append((effect.head.window, effect.head.metrics.get("test_accuracy", float("nan"))))

    def peers_discovered(self, effect: fx.PeersDiscovered) -> None:
        pass  # every trainer dials the validator at start; a longer-lived host would dial these

    def ban(self, effect: fx.Ban) -> None:
        self.banned[effect.peer] = effect.until  # `connection` refuses it until then; the engine hangs up next

    def rejected(self, effect: fx.Rejected) -> None:
        print(f"rejected {effect.peer}: {effect.reason}")

    def submit_reply(self, effect: fx.SubmitReply) -> None:
        pass  # this host feeds no Submit

    def log(self, effect: fx.Log) -> None:
        pass

    async def compute(self, effect: fx.RunTask) -> None:
        try:
            result = await asyncio.to_thread(self.executor.run, effect.kind, effect.args)
            self.feed(ev.TaskFinished(now=self.loop.time(), task_id=effect.task_id, result=result))
        except Exception as exc:  # a failed task is an event for the engine, not a crash of the host
            self.feed(ev.TaskFailed(now=self.loop.time(), task_id=effect.task_id, reason=repr(exc)))

    async def timers(self) -> None:
        while True:
            deadline = self.engine.next_deadline()
            self.wake.clear()
            delay = None if deadline is None else max(0.0, deadline - self.loop.time())
            try:
                await asyncio.wait_for(self.wake.wait(), delay)
            except TimeoutError:
                self.feed(ev.TimerDue(now=self.loop.time()))

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(self.identity.peer_id.to_bytes())
        peer = PeerId.from_bytes(await reader.readexactly(38))
        if self.banned.get(peer, 0.0) > self.loop.time():
            writer.close()
            return
        self.writers[peer] = writer
        self.feed(ev.PeerConnected(now=self.loop.time(), peer=peer))
        try:
            while True:
                size = int.from_bytes(await reader.readexactly(4), "big")
                self.feed(ev.MessageReceived(now=self.loop.time(), peer=peer, data=await reader.readexactly(size)))
        except (asyncio.IncompleteReadError, ConnectionError):
            self.writers.pop(peer, None)
            self.feed(ev.PeerDisconnected(now=self.loop.time(), peer=peer))


async def main() -> None:
    root, revision, ids, workload, shards = digits_experiment("asyncio")  # examples/_experiment.py
    hosts = {name: Host(name, {"validator" if name == "validator" else "trainer"}, ids[name], revision, workload,
                        shards, root) for name in ("validator", "trainer-1", "trainer-2")}
    server = await asyncio.start_server(hosts["validator"].connection, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    tasks = [asyncio.ensure_future(host.timers()) for host in hosts.values()]
    for host in hosts.values():
        host.feed(ev.Start(now=host.loop.time()))
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

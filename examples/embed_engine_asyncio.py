"""Embed the sans-IO engine in your own event loop: plain asyncio, its own sockets and timers.

The engine is a pure state machine (README, "The engine contract"): feed it events with `handle(event)`,
carry out the effects `next_effect()` returns, and call `handle(TimerDue(now))` at `next_deadline()`. This
file is a whole host in one asyncio process: one validator and two trainers, each with its own TCP server
on 127.0.0.1, a store on disk, and compute on a worker thread; it runs until three windows are certified.

For brevity its wire is a 4-byte length prefix with the peer id sent first, unauthenticated: a real
deployment uses peerloom's TCP+Noise transport (`peerloom node`), which proves every peer's identity.
"""

import asyncio
import random
import tempfile
from pathlib import Path

from peerloom.adapters.compute import ComputeExecutor
from peerloom.adapters.host import apply_storage_effect, chunk_message, stored_event
from peerloom.adapters.keys import generate_identity
from peerloom.adapters.storage import ArtifactStore
from peerloom.backends.numpy.tensors import schema_of, tensor_digest, to_safetensors
from peerloom.backends.registry import build_workload
from peerloom.core import effects as fx
from peerloom.core import events as ev
from peerloom.core.engine import Engine, EngineConfig
from peerloom.core.identity import PeerId
from peerloom.core.objects import Manifest, Revision, make_artifact_ref


class Host:
    """One engine, its store, its compute, its server socket and its connections."""

    def __init__(self, name, roles, identity, revision, workload, shards, root: Path):
        self.name, self.identity, self.loop = name, identity, asyncio.get_running_loop()
        self.store = ArtifactStore(root / name, chunk_size=revision.manifest.chunk_size)
        self.executor = ComputeExecutor(self.store, revision.manifest, workload, shards)
        self.engine = Engine(EngineConfig(roles=frozenset(roles), revision=revision), identity,
                             random.Random(name), stored=self.store.refs(), records=self.store.records())
        self.writers: dict[PeerId, asyncio.StreamWriter] = {}
        self.heads: list[tuple[int, float]] = []  # (window, test accuracy) of each certified head
        self.tasks: set[asyncio.Task] = set()
        self.wake = asyncio.Event()

    def feed(self, event) -> None:
        self.engine.handle(event)
        while (effect := self.engine.next_effect()) is not None:
            if isinstance(effect, fx.CommitArtifact):
                self.engine.handle(stored_event(self.store, effect, self.loop.time()))
            elif apply_storage_effect(self.store, effect):
                if isinstance(effect, fx.Persist):  # durable now: release what waited on it
                    self.engine.handle(ev.Persisted(now=self.loop.time(), token=effect.token))
            elif isinstance(effect, fx.Send):
                self.send(effect.peer, effect.data)
            elif isinstance(effect, fx.ServeChunk):
                self.send(effect.peer, chunk_message(self.store, effect))
            elif isinstance(effect, fx.RunTask):
                task = asyncio.ensure_future(self.compute(effect))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            elif isinstance(effect, fx.HangUp) and effect.peer in self.writers:
                self.writers.pop(effect.peer).close()
            elif isinstance(effect, fx.HeadPromoted):
                self.heads.append((effect.head.window, effect.head.metrics.get("test_accuracy", float("nan"))))
        self.wake.set()  # the next deadline may have moved

    def send(self, peer: PeerId, data: bytes) -> None:
        if peer in self.writers:
            self.writers[peer].write(len(data).to_bytes(4, "big") + data)

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
    root = Path(tempfile.mkdtemp(prefix="peerloom-asyncio-"))
    workload, shards = build_workload("digits-numpy", 0, 4)
    params = workload.initial_params(0)
    genesis = to_safetensors(params)
    ids = {name: generate_identity() for name in ("validator", "trainer-1", "trainer-2", "authority")}
    manifest = Manifest(
        experiment="asyncio", workload="digits-numpy", workload_seed=0, schema=schema_of(params),
        shards=tuple(len(s) for s in shards), validators=(ids["validator"].peer_id,), quorum=1, window_s=2.0,
        min_updates=1, max_capacity=4, aggregation="mean", outer_optimizer="fedavg", outer_lr=1.0,
        chunk_size=1 << 16, genesis_params=make_artifact_ref(genesis, 1 << 16),
        genesis_params_digest=tensor_digest(params),
        roster=tuple(sorted((ids[t].peer_id, 1) for t in ("trainer-1", "trainer-2"))))
    revision = Revision.verify(manifest.seal(ids["authority"]), ids["authority"].peer_id)
    ArtifactStore(root / "validator", chunk_size=manifest.chunk_size).put(genesis)  # before its engine starts
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

"""The trio host loop that drives one engine with the TCP+Noise transport, a compute executor and the
on-disk store (DESIGN §6).

One main task owns the engine: it waits for the next event (or the engine's next deadline), feeds it to
`Engine.handle`, and executes the effects in order. Each connection has a reader task (messages become
events) and a writer task with its own queue, so a slow peer never blocks the engine. Compute tasks run
on a worker thread, one at a time per node. Persist effects are fsynced before `Persisted` is fed back.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from peerloom.core import effects as fx
from peerloom.core import events as ev
from peerloom.core.engine import Engine, EngineConfig
from peerloom.core.identity import Identity, PeerId
from peerloom.core.objects import Head, QuorumCertificate, Revision

from . import tcp
from .compute import ComputeExecutor
from .host import apply_storage_effect, chunk_message
from .metrics import NodeMetrics
from .storage import ArtifactStore

log = logging.getLogger("peerloom.runtime")
engine_log = logging.getLogger("peerloom.engine")


@attrs.frozen(kw_only=True)
class RuntimeOptions:
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    bootstrap: tuple[tuple[str, int], ...] = ()
    redial_s: float = 0.5
    max_message_bytes: int = 16 << 20
    http_listen: tuple[str, int] | None = None  # serve the HTTP edge here (None: no edge)
    mdns: bool = False  # advertise and browse `_peerloom._tcp.local.` on 127.0.0.1 (adapters.discovery)


class NodeRuntime:
    """Runs one node until cancelled. `events_path` receives one JSON line per engine Log effect."""

    def __init__(self, *, name: str, identity: Identity, revision: Revision, roles: set[str],
                 store: ArtifactStore, executor: ComputeExecutor, options: RuntimeOptions,
                 events_path: Path | None = None, capacity: int = 1, stop_after_window: int | None = None,
                 on_head: Callable[[Head, QuorumCertificate], None] | None = None) -> None:
        self.name = name
        self.identity = identity
        self.store = store
        self.executor = executor
        self.options = options
        self.on_head = on_head
        config = EngineConfig(roles=frozenset(roles), revision=revision, capacity=capacity,
                              max_message_bytes=options.max_message_bytes, stop_after_window=stop_after_window)
        self.engine = Engine(config, identity, random.Random(), stored=store.refs(), records=store.records())
        self._events_file = open(events_path, "a", buffering=1) if events_path else None
        self._send_events, self._receive_events = trio.open_memory_channel[ev.Event](math.inf)
        self._conns: dict[PeerId, tcp.SecureConnection] = {}
        # Two outboxes per peer (control, bulk), each with its own writer task, so a vote or a chunk request
        # never waits behind a large artifact message queued before it (the transport interleaves lanes).
        self._outboxes: dict[PeerId, tuple[trio.MemorySendChannel[bytes], trio.MemorySendChannel[bytes]]] = {}
        self._compute_limiter = trio.CapacityLimiter(1)
        self.bytes_sent = 0
        self.bytes_received = 0
        self._closed_bytes: dict[PeerId, tuple[int, int]] = {}  # wire bytes of closed connections, per peer
        self.metrics = NodeMetrics(peer_bytes=self._peer_bytes)
        self.port: int | None = None
        self._nursery: trio.Nursery | None = None

    def _emit_line(self, event: str, fields: dict[str, Any]) -> None:
        if self._events_file is not None:
            line = {"t": round(time.time(), 3), "node": self.name, "event": event, **fields}
            self._events_file.write(json.dumps(line, default=str) + "\n")

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.port = await nursery.start(tcp.serve, self.options.listen_host, self.options.listen_port,
                                            self.identity, self._adopt_connection)
            self.engine.handle(ev.Start(now=trio.current_time()))
            await self._drain()
            for host, port in self.options.bootstrap:
                nursery.start_soon(self._dial_loop, host, port)
            task_status.started(self.port)
            await self._main_loop()

    async def _main_loop(self) -> None:
        while True:
            deadline = self.engine.next_deadline()
            event: ev.Event
            with trio.move_on_at(deadline if deadline is not None else math.inf):
                event = await self._receive_events.receive()
                self.engine.handle(_with_now(event, trio.current_time()))
                await self._drain()
                continue
            self.engine.handle(ev.TimerDue(now=trio.current_time()))
            await self._drain()

    async def _drain(self) -> None:
        engine = self.engine
        while (effect := engine.next_effect()) is not None:
            if apply_storage_effect(self.store, effect):
                now = trio.current_time()
                if isinstance(effect, fx.Persist):
                    engine.handle(ev.Persisted(now=now, token=effect.token))
                elif isinstance(effect, fx.CommitArtifact):
                    engine.handle(ev.ArtifactStored(now=now, ref=effect.ref))
                continue
            match effect:
                case fx.Send():
                    self._enqueue(effect.peer, effect.data)
                case fx.ServeChunk():
                    self._enqueue(effect.peer, chunk_message(self.store, effect))
                case fx.RunTask():
                    assert self._nursery is not None
                    self._nursery.start_soon(self._run_task, effect)
                case fx.HangUp():
                    conn = self._conns.get(effect.peer)
                    if conn is not None:
                        await conn.aclose()
                case fx.HeadPromoted():
                    self.metrics.on_effect(effect)
                    if self.on_head is not None:
                        self.on_head(effect.head, effect.certificate)
                    sent, received = self.wire_bytes()
                    self._emit_line("wire", {"window": effect.head.window, "sent": sent, "received": received})
                case fx.Log():
                    self.metrics.on_effect(effect)
                    self._emit_line(effect.event, effect.fields)
                    engine_log.info(effect.event, extra={"fields": effect.fields})

    def _enqueue(self, peer: PeerId, data: bytes) -> None:
        outboxes = self._outboxes.get(peer)
        if outboxes is not None:
            outboxes[0 if len(data) <= tcp.AUTO_CONTROL_MAX_BYTES else 1].send_nowait(data)

    async def _run_task(self, effect: fx.RunTask) -> None:
        try:
            async with self._compute_limiter:
                result = await trio.to_thread.run_sync(self.executor.run, effect.kind, effect.args)
        except Exception as exc:
            log.exception("task %s failed", effect.task_id)
            await self._send_events.send(ev.TaskFailed(now=0.0, task_id=effect.task_id, reason=repr(exc)))
            return
        await self._send_events.send(ev.TaskFinished(now=0.0, task_id=effect.task_id, result=result))

    async def _dial_loop(self, host: str, port: int) -> None:
        while True:
            try:
                conn = await tcp.connect(host, port, self.identity,
                                         max_message_bytes=self.options.max_message_bytes)
            except (OSError, tcp.TransportError) as exc:
                log.debug("dial %s:%s failed: %s", host, port, exc)
                await trio.sleep(self.options.redial_s)
                continue
            await self._adopt_connection(conn)
            await trio.sleep(self.options.redial_s)

    async def _adopt_connection(self, conn: tcp.SecureConnection) -> None:
        """Own a connection until it closes: one reader loop here, one writer task."""
        peer = conn.remote_peer
        if peer in self._conns or peer == self.identity.peer_id:
            await conn.aclose()  # one connection per peer pair is enough
            return
        control_out, control_in = trio.open_memory_channel[bytes](math.inf)
        bulk_out, bulk_in = trio.open_memory_channel[bytes](math.inf)
        self._conns[peer], self._outboxes[peer] = conn, (control_out, bulk_out)
        await self._send_events.send(ev.PeerConnected(now=0.0, peer=peer))
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._writer, conn, control_in, tcp.LANE_CONTROL, nursery.cancel_scope)
                nursery.start_soon(self._writer, conn, bulk_in, tcp.LANE_BULK, nursery.cancel_scope)
                try:
                    while True:
                        data = await conn.receive_message()
                        await self._send_events.send(ev.MessageReceived(now=0.0, peer=peer, data=data))
                except (tcp.TransportError, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass
                nursery.cancel_scope.cancel()
        finally:
            self.bytes_sent += conn.bytes_sent
            self.bytes_received += conn.bytes_received
            old_sent, old_received = self._closed_bytes.get(peer, (0, 0))
            self._closed_bytes[peer] = (old_sent + conn.bytes_sent, old_received + conn.bytes_received)
            del self._conns[peer], self._outboxes[peer]
            with trio.CancelScope(shield=True):
                await conn.aclose()
                await self._send_events.send(ev.PeerDisconnected(now=0.0, peer=peer))

    async def _writer(self, conn: tcp.SecureConnection, outbox: trio.MemoryReceiveChannel[bytes], lane: int,
                      scope: trio.CancelScope) -> None:
        try:
            async for data in outbox:
                await conn.send_message(data, lane=lane)
        except (tcp.TransportError, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            scope.cancel()

    def _peer_bytes(self) -> list[tuple[str, int, int]]:
        """(peer id text, sent, received) wire bytes per peer ever connected; safe from any thread."""
        totals = dict(self._closed_bytes)
        for peer, conn in list(self._conns.items()):
            sent, received = totals.get(peer, (0, 0))
            totals[peer] = (sent + conn.bytes_sent, received + conn.bytes_received)
        return [(peer.to_text(), sent, received) for peer, (sent, received) in totals.items()]

    def close(self) -> None:
        """Release files after `run` returned (the store's database, the event log)."""
        if self._events_file is not None:
            self._events_file.close()
            self._events_file = None
        self.store.close()

    def wire_bytes(self) -> tuple[int, int]:
        """(sent, received) bytes on the wire over all connections so far, open ones included."""
        sent = self.bytes_sent + sum(c.bytes_sent for c in self._conns.values())
        received = self.bytes_received + sum(c.bytes_received for c in self._conns.values())
        return sent, received


def _with_now(event: ev.Event, now: float) -> ev.Event:
    """Events queued by I/O tasks are stamped when the engine takes them, so `now` never goes back."""
    return attrs.evolve(event, now=now)

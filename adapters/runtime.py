"""The trio host loop that drives one engine with its transports (`adapters.transport`: TCP+Noise, HTTP,
in-memory; dialed and listened on only through that interface), a compute executor and the on-disk store
(spec/design.md §6).

One main task owns the engine: it waits for the next event (or the engine's next deadline), feeds it to
the shared `Driver` (adapters/host.py), which executes the effects in order through this runtime's I/O
primitives (it is the driver's `Host` and `Observer`) and re-arms the one timer the main loop waits on.
Each connection has a reader task (messages become events) and a writer task per lane with its own queue,
so a slow peer never blocks the engine; a peer whose queue grows past `MAX_CONTROL_OUTBOX_BYTES` /
`MAX_BULK_OUTBOX_BYTES` is hung up on. Inbound connections
go through the `AddressBook` like dialed ones (limits, bans); a peer the engine bans (a `Ban` effect) is
refused, inbound and dialed, until the ban ends. Compute tasks run on a worker thread, one at a time per node
(sampled audits beside them on an audit executor of their own where the node has one: `ComputeSlot`). Persist
effects are fsynced before `Persisted` is fed back; a persisted certified head (promoted, or archived by
chain sync) is handed to `on_chain_entry` before that, so a chain directory kept from it never lags the
store by more than what a crash interrupts (`peerloom.node.fill_chain_dir` repairs that at start).

With `RuntimeOptions.http_listen` set, the node also serves the HTTP edge (`adapters.http_edge`, aiohttp on
its own thread and asyncio loop) over a `NodeEdgeView`: reads come from thread-safe snapshots, and a REST
client's signed submission (`adapters.http_client`) crosses into trio through the trio token and reaches the engine as
`events.Submit` (its artifact stored first); the engine's `SubmitReply` is the verdict the edge returns.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from peerloom.backends.privacy import privacy_accountant
from peerloom.core import effects as fx
from peerloom.core import events as ev
from peerloom.core.chain import decode_chain_entry
from peerloom.core.engine import Engine, EngineConfig
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.errors import PeerloomError
from peerloom.core.identity import Identity, PeerId
from peerloom.core.messages import Hello, decode_message
from peerloom.core.objects import ArtifactRef, Head, QuorumCertificate, Revision
from peerloom.core.records import ChainRecord, HeadRecord, Record

from . import disk, tcp
from .addressbook import HANDSHAKE_FAILURES, AddressBook
from .compute import ComputeExecutor
from .edge_view import SUBMIT_TIMEOUT_S, NodeEdgeView, PeerInfo, SubmitResult
from .eventqueue import EventQueue
from .host import Driver, Observer, TaskOutcome, durable_first
from .limits import ConnectionLimiter, Limits, LimitsCollector
from .logs import LineLimiter
from .metrics import NodeMetrics
from .peerstate import MAX_PEER_SERIES, MAX_SEEN_PEERS, BoundedLru, release_freed_memory, tune_allocator
from .relay import RelayServer, RelayTransport
from .storage import ArtifactStore
from .store_writer import CORRUPT, FAILED, STORED, Commit, Outcome, StoreWriter
from .transport import (
    LANE_BULK,
    LANE_CONTROL,
    PEER_FAULTS,
    Connection,
    Transport,
    TransportError,
    canonical_address,
    fault_reason,
    first_transport_error,
)

log = logging.getLogger("peerloom.runtime")
engine_log = logging.getLogger("peerloom.engine")

MAX_CONTROL_OUTBOX_BYTES = 4 << 20
"""Bytes queued for one peer on the control lane (not yet handed to the transport) past which the runtime
hangs up on it. Control messages are at most `tcp.AUTO_CONTROL_MAX_BYTES` each and the transport's lane
window is `tcp.LANE_WINDOW` (4 MiB), so a peer that keeps reading never comes near this."""
PEER_INBOX_BYTES = 32 << 20
"""Bytes of one peer's received messages that may wait for the engine; past this the connection's reader
stops reading, and flow control makes the peer wait (`NodeRuntime._inbox_room`)."""
MAX_BULK_OUTBOX_BYTES = 64 << 20
"""The same for the bulk lane (artifact chunks). Flow control makes a sender wait per lane, so without a
cap a peer that stops reading would make its outbox, and this node's memory, grow without limit. Above the
largest message (`RuntimeOptions.max_message_bytes`, 16 MiB by default), so one whole message always fits."""


LOG_BURST = 20
LOG_INTERVAL_S = 10.0
"""Lines about peers not admitted (connections, their errors, rejections): at most `LOG_BURST` of one kind
(event and reason) per `LOG_INTERVAL_S`, then one ``suppressed`` summary line with the count
(`adapters.logs.LineLimiter`, spec/transport.md §14). Admitted peers are always logged."""
OTHER_PEERS = "other"
"""The label, metrics series and reputation row that every peer not admitted shares."""

DISK_PROBE_S = 2.0
"""Seconds between probes of a full disk (`adapters.disk.space_available`) until the node resumes writing."""


DEFAULT_KEEP_WINDOWS = 0
"""A node keeps every artifact unless told to delete a window's this many heads later (node config
``keep_windows``; 2 is enough for the protocol, spec/protocol.md §8.1)."""


BACKGROUND_TASKS = frozenset({"audit", "audit-plan"})
"""Task kinds that yield the compute slot to every other waiting task (`ComputeSlot`)."""


class ComputeSlot:
    """Where a node's compute tasks run: one at a time on a worker thread, with sampled audits in the
    background (spec/protocol.md §6.3 "Scheduling"). A background task starts only while no other task
    waits for or holds the slot, one background task at a time.

    With ``audit_worker`` the background task then runs on a worker of its own (the node gave it an executor
    of its own, with its own workload instance: an executor is not thread-safe, since a workload trains,
    replays and evaluates in its own buffers), so a screen, reduce, evaluate or train task that arrives
    while an audit runs starts at once beside it. Without it, the background task holds the one slot until
    it ends: one already running is not interrupted."""

    def __init__(self, *, audit_worker: bool = False) -> None:
        self.audit_worker = audit_worker
        self._slot = trio.CapacityLimiter(1)
        self._background = trio.CapacityLimiter(1)
        self._waiting = 0  # foreground tasks waiting for or holding the slot
        self._idle = trio.Event()
        self._idle.set()

    async def run(self, background: bool, fn: Any, *args: Any) -> tuple[float, Any]:
        """Run ``fn(*args)`` on a worker thread once the slot is ours (the audit worker's for a background task
        with `audit_worker`); returns (monotonic start time, its result). Exceptions from `fn` propagate."""
        if background:
            async with self._background:
                while self._waiting:
                    await self._idle.wait()
                if self.audit_worker:
                    return await self._thread(fn, *args)
                async with self._slot:
                    return await self._thread(fn, *args)
        if self._waiting == 0:
            self._idle = trio.Event()
        self._waiting += 1
        try:
            async with self._slot:
                return await self._thread(fn, *args)
        finally:
            self._waiting -= 1
            if self._waiting == 0:
                self._idle.set()

    @staticmethod
    async def _thread(fn: Any, *args: Any) -> tuple[float, Any]:
        started = time.monotonic()
        return started, await trio.to_thread.run_sync(fn, *args)


@attrs.frozen(kw_only=True)
class RuntimeOptions:
    listen_host: str = "127.0.0.1"  # the tcp listener when `listen` is empty
    listen_port: int = 0
    # Transport addresses to listen on (spec/transport.md §9): "/ip4/H/tcp/P" or "H:P" (tcp), "http://H:P",
    # "memory://NAME" (needs `memory_network`); port 0 picks one. Empty: tcp on listen_host:listen_port.
    listen: tuple[str, ...] = ()
    dial_only: bool = False  # with `listen` empty: no listener at all; the node only dials (a light trainer)
    # Transport addresses to dial and keep dialing ("H:P" means tcp, as in `listen`).
    bootstrap: tuple[str, ...] = ()
    memory_network: Any = None  # an adapters.memory.MemoryNetwork: dial and listen on memory:// addresses
    redial_s: float = 0.5  # base dial backoff (AddressBook: doubles per failure, with jitter)
    max_redial_s: float = 5.0  # cap: a restarted seed is found again within seconds
    max_connections: int = 64
    max_connections_per_ip: int = 64  # a whole fleet on one machine shares 127.0.0.1
    max_message_bytes: int = 16 << 20
    http_listen: tuple[str, int] | None = None  # serve the HTTP edge here (None: no edge)
    # Relay for others (spec/transport.md §12): serve relay requests on this direct address with these
    # limits (an adapters.relay.RelayLimits; None: the defaults). A listen address "<relay>/p2p-circuit"
    # in `listen` instead makes a reservation at a relay (adapters.relay.RelayTransport).
    relay_listen: str | None = None
    relay_limits: Any = None
    relay_only: bool = False  # dial circuit addresses only (a network that lets nothing but relays through)
    mdns: bool = False  # advertise and browse `_peerloom._tcp.local.` on 127.0.0.1 (adapters.discovery)
    max_control_outbox_bytes: int = MAX_CONTROL_OUTBOX_BYTES  # per peer; over it: hang up ("outbox-full")
    max_bulk_outbox_bytes: int = MAX_BULK_OUTBOX_BYTES  # per peer; over it: hang up ("outbox-full")
    # Retention (`EngineConfig.keep_windows`, spec/protocol.md §8.1): stored artifacts are deleted this many
    # heads after the window they served, the current head's kept; 0 (the default) keeps every artifact.
    keep_windows: int = DEFAULT_KEEP_WINDOWS
    agreement_timeout_s: float = 2.0  # `EngineConfig.agreement_timeout_s`: Tendermint's base round timeout
    # Connection limits (an adapters.limits.Limits; spec/transport.md §13), shared by every listener and the
    # HTTP edge. None: the defaults, with max_connections / max_connections_per_ip as the peer caps.
    limits: Any = None
    # Private data (`EngineConfig.private_data`, spec/protocol.md §10): this node's trainer trains on data only
    # it holds and says so in its joins (node config key ``data``).
    private_data: bool = False


@attrs.define
class _Outbox:
    """What the runtime queues for one connected peer: one channel per lane (each drained by its own writer
    task), the bytes queued per lane (enqueued, not yet sent), and the connection's scope (cancel: hang up)."""

    channels: tuple[trio.MemorySendChannel[bytes], trio.MemorySendChannel[bytes]]
    scope: trio.CancelScope
    queued: list[int] = attrs.Factory(lambda: [0, 0])
    full: bool = False
    admitted: bool = False  # a validator or rostered peer when it connected (spec/transport.md §14)


@attrs.define
class _Submit:
    """A light peer's signed envelope from the HTTP edge, waiting for the main loop to feed it as
    `events.Submit` and for the engine's `SubmitReply` with the same `request_id`."""

    request_id: int
    envelope: SignedEnvelope
    artifact: bytes | None
    done: trio.Event = attrs.Factory(trio.Event)
    result: SubmitResult | None = None


class _DiskResumed:
    """Queued by the disk probe for the main loop: space is free again, write what waited (`_resume_writes`)."""


@attrs.frozen
class _Completion:
    """Queued for the main loop: a primitive's work is done (a task, a commit); `done` feeds the engine through
    the driver."""

    done: Callable[[], None]


class NodeRuntime(Observer):
    """Runs one node until cancelled. `events_path` receives one JSON line per engine Log effect.
    `audit_executor` (over the same store, with a workload instance of its own) runs the ``audit`` and
    ``audit-plan`` tasks beside `executor`'s (`ComputeSlot`); None runs them on `executor` between the others."""

    def __init__(self, *, name: str, identity: Identity, revision: Revision, roles: set[str],
                 store: ArtifactStore, executor: ComputeExecutor, options: RuntimeOptions,
                 audit_executor: ComputeExecutor | None = None, events_path: Path | None = None,
                 capacity: int = 1, stop_after_window: int | None = None,
                 on_head: Callable[[Head, QuorumCertificate], None] | None = None,
                 admission: SignedEnvelope | None = None,
                 on_chain_entry: Callable[[Head, QuorumCertificate], None] | None = None) -> None:
        self.name = name
        self.identity = identity
        self.store = store
        self.executor = executor
        # Sampled audits run on this one, beside the other tasks (`ComputeSlot`); None: on `executor`.
        self.audit_executor = audit_executor
        self.options = options
        self.on_head = on_head  # each head the engine promotes
        self.on_chain_entry = on_chain_entry  # each certified head once durable in the store (see module doc)
        config = EngineConfig(roles=frozenset(roles), revision=revision, capacity=capacity,
                              max_message_bytes=options.max_message_bytes, stop_after_window=stop_after_window,
                              admission=admission, keep_windows=options.keep_windows,
                              agreement_timeout_s=options.agreement_timeout_s, private_data=options.private_data,
                              accountant=privacy_accountant(revision.manifest))
        self.engine = Engine(config, identity, random.Random(), stored=store.refs(), records=store.records())
        self.driver = Driver(self.engine, self, self)
        self._deadline: float | None = None  # the driver's timer (`arm_timer`), waited on by `_main_loop`
        self._events_path = events_path
        self._events_file = open(events_path, "a", buffering=1) if events_path else None
        # A full disk (spec/transport.md §15): what could not be written waits here, in order, and is
        # written when the probe finds space again; meanwhile the engine holds what depends on it (votes).
        self.disk_full = False
        self._unwritten: list[tuple[Record, Callable[[], None]]] = []  # (record, done)
        # records waiting for a claim's artifacts to be made durable (`write_record`), in order
        self._syncing: collections.deque[tuple[Record, Callable[[], None]]] = collections.deque()
        self._unwritten_chain: list[tuple[Head, QuorumCertificate]] = []
        self._lost_fetches: set[bytes] = set()  # fetches with a chunk that never reached the disk
        # Chunk writes and artifact commits run on a worker thread, in order (spec/design.md §6, Storage).
        self._store_writer = StoreWriter(store, self._stored)
        # What the engine handles next: admitted peers' events and the node's own before strangers' (§14).
        self._events: EventQueue[ev.Event | _Submit | _DiskResumed | _Completion] = EventQueue()
        # Bytes of each peer's messages queued for the engine, bounded per peer (`_inbox_room`).
        self._inbox: Counter[PeerId] = Counter()
        self._inbox_room_events: dict[PeerId, trio.Event] = {}
        self._conns: dict[PeerId, Connection] = {}
        # Two outboxes per peer (control, bulk), each with its own writer task, so a vote or a chunk request
        # never waits behind a large artifact message queued before it (the transport interleaves lanes).
        # Each lane's queued bytes are capped (RuntimeOptions.max_*_outbox_bytes): a peer that stops reading
        # is hung up on rather than allowed to grow our memory.
        self._outboxes: dict[PeerId, _Outbox] = {}
        self.outbox_hangups = 0  # peers hung up on for a full outbox
        self._compute = ComputeSlot(audit_worker=audit_executor is not None)
        self.bytes_sent = 0
        self.bytes_received = 0
        # Per-peer state (spec/transport.md §14): admitted peers (manifest validators, the head's
        # roster) have their own wire-bytes series, reputation rows and `peers` rows, the most recent
        # MAX_PEER_SERIES of them once closed; every other peer is counted under OTHER_PEERS only.
        self._admitted: frozenset[PeerId] = frozenset()
        self._admitted_texts: frozenset[str] = frozenset()
        self._other_bytes = [0, 0]  # wire bytes of closed connections of peers not admitted (or evicted)
        self._closed_bytes: BoundedLru[PeerId, tuple[int, int]] = BoundedLru(
            MAX_PEER_SERIES, on_evict=lambda _, sent_received: self._add_other_bytes(*sent_received))
        self._seen: BoundedLru[PeerId, tuple[str | None, float]] = BoundedLru(MAX_SEEN_PEERS)  # peers rows
        self._log_limits = LineLimiter(burst=LOG_BURST, interval_s=LOG_INTERVAL_S)
        self._strangers_closed = 0  # since the last `release_freed_memory`
        self.metrics = NodeMetrics(peer_bytes=self._peer_bytes, engine_stats=lambda: self.engine.stats,
                                   connected=lambda: len(self._conns))
        self.port: int | None = None  # the first listener's port (0 for memory://; None: listens nowhere)
        self.listen_addresses: list[str] = []  # bound addresses, one per listener (transport-qualified)
        self.transports: list[Transport] = []  # made when `run` starts (`_make_transports`)
        self._nursery: trio.Nursery | None = None
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._rejected_in_window = 0
        # Rejections per (peer, reason), written to the database once per window in one transaction: an
        # attacker's flood of bad messages must not become a flood of fsyncs. Peers not admitted share the
        # OTHER_PEERS row, so the table's size does not grow with fresh identities.
        self._reputation: dict[tuple[str, str], int] = {}
        # What the dashboard shows per admitted peer (a stranger gets no row): (rejections, the last one).
        self._rejections: dict[PeerId, tuple[int, str]] = {}
        self._submits: dict[int, _Submit] = {}  # fed to the engine, awaiting its SubmitReply
        self._submit_ids = 0
        self.edge_view = NodeEdgeView(peer_id=identity.peer_id, roles=roles, revision=revision,
                                      registry=self.metrics.registry, artifact_path=self._artifact_path,
                                      relay=self._relay, peers=self.peer_infos, entries=self._stored_chain(),
                                      addresses=lambda: tuple(self.listen_addresses))
        self.edge: Any = None  # adapters.http_edge.EdgeServer while the edge runs
        self.discovery: Any = None  # adapters.discovery.MdnsDiscovery while it runs
        self.limits: Limits = options.limits or Limits(
            max_peers=options.max_connections,
            max_peers_per_ip=min(options.max_connections_per_ip, options.max_connections),
            max_strangers=min(Limits().max_strangers, options.max_connections))
        self.limiter = ConnectionLimiter(self.limits)  # every inbound socket of this node (§13)
        self.metrics.registry.register(LimitsCollector(self.limiter))
        self._protected = frozenset(PeerId.from_text(p) for p in self.limits.protected_peers)
        self.book = AddressBook(random.Random(), base_backoff_s=options.redial_s,
                                max_backoff_s=max(options.redial_s, options.max_redial_s),
                                max_connections=self.limits.max_peers,
                                max_connections_per_ip=self.limits.max_peers_per_ip)
        self._book_changed = trio.Event()
        self._head_changed = trio.Event()  # set on every promoted head (`wait_unrostered`)
        self.http_port: int | None = None
        self.relay: Any = None  # adapters.relay.RelayServer when `options.relay_listen` is set
        self.relay_address: str | None = None  # its bound address
        self._note_admitted()

    def _emit_line(self, event: str, fields: dict[str, Any]) -> None:
        if self._events_file is not None:
            line = {"t": round(time.time(), 3), "node": self.name, "event": event, **fields}
            try:
                disk.inject(self._events_path or "events")  # test-only seam (adapters/disk.py)
                self._events_file.write(json.dumps(line, default=str) + "\n")
            except OSError as exc:
                if not disk.is_disk_full(exc):
                    raise
                self._disk_is_full("event log", exc)

    # --- a full disk (spec/transport.md §15) --------------------------------------------------

    def _disk_is_full(self, where: str, exc: BaseException) -> None:
        """A write to `where` failed for want of space: enter the ``disk-full`` state (once), in one log line.
        The node then writes nothing (what must be written waits in order), so it casts no votes (the engine
        holds each until its record is durable) and refuses uploads, and it keeps serving reads. A probe
        every `DISK_PROBE_S` seconds resumes it once space is free (`_resume_writes`)."""
        if self._events_file is not None:
            try:
                self._events_file.close()
            except OSError:
                pass  # its buffered line could not be written either
            self._events_file = None
        if self.disk_full:
            return
        self.disk_full = True
        self.edge_view.set_health("disk-full")
        self.metrics.disk_full.set(1)
        log.error("disk full: not voting or accepting uploads, still serving reads; resuming once space is free",
                  extra={"fields": {"write": where, "error": str(exc), "store": str(self.store.root),
                                    "resume_free_bytes": disk.RESUME_FREE_BYTES}})
        if self._nursery is not None:
            try:
                self._nursery.start_soon(self._probe_disk)
            except RuntimeError:
                pass  # the node is shutting down (`close`)

    async def _probe_disk(self) -> None:
        while True:
            await trio.sleep(DISK_PROBE_S)
            try:
                free = await trio.to_thread.run_sync(disk.space_available, self.store.root)
            except OSError as exc:  # not a full disk (a removed directory...): say so and keep probing
                log.warning("disk probe failed: %s", exc)
                free = False
            if free:
                self._events.put(_DiskResumed())
                return

    def _resume_writes(self) -> None:
        """On the main loop: write what waited, in order (each record, then `Persisted` to the engine), the
        chain files, the head's pin and the reputation; reopen the event log. A write that fails for space
        again goes back to the ``disk-full`` state with the rest still waiting."""
        self.disk_full = False
        written = len(self._unwritten)
        try:
            while self._unwritten:
                record, done = self._unwritten[0]
                for digest in durable_first(record):
                    self.store.make_durable(digest)
                self.store.put_record(record.key, record.data)
                del self._unwritten[0]
                self._persisted(record, done)
            while self._unwritten_chain:
                entry = self._unwritten_chain[0]
                assert self.on_chain_entry is not None
                self.on_chain_entry(*entry)
                del self._unwritten_chain[0]
            self.store.pin("head", self.engine.head.params.digest)
            self._flush_reputation()
            if self._events_path is not None and self._events_file is None:
                self._events_file = open(self._events_path, "a", buffering=1)
        except OSError as exc:
            if not disk.is_disk_full(exc):
                raise
            self._disk_is_full("resume", exc)
            return
        if self.disk_full:  # a flush above found the disk full again (and said so)
            return
        self.edge_view.set_health("ok")
        self.metrics.disk_full.set(0)
        log.info("disk space available again: writing resumed", extra={"fields": {"records": written}})
        self._emit_line("disk-resumed", {"records": written})

    # --- peers not admitted (spec/transport.md §14) ---------------------------------------

    def _note_admitted(self) -> None:
        """Admitted peers: the manifest's validators and the current head's roster (refreshed per head)."""
        self._admitted = frozenset(self.engine.manifest.validators) | self.engine.head.roster_peers
        self._admitted_texts = frozenset(p.to_text() for p in self._admitted)
        for peer in [p for p in self._rejections if p not in self._admitted]:
            del self._rejections[peer]  # bounded by the roster (spec/transport.md §14)

    def _add_other_bytes(self, sent: int, received: int) -> None:
        self._other_bytes[0] += sent
        self._other_bytes[1] += received

    def _may_log(self, kind: str, peer: PeerId | str | None) -> bool:
        """Whether a line of `kind` about `peer` is written: always for an admitted peer, else within the
        stranger budget (`LOG_BURST` per `LOG_INTERVAL_S`, the rest summarised by `_summarize_logs`)."""
        if peer is not None and (peer in self._admitted if isinstance(peer, PeerId) else peer in self._admitted_texts):
            return True
        return self._log_limits.allow(kind, trio.current_time())

    async def _summarize_logs(self) -> None:
        """Every `LOG_INTERVAL_S`: one ``suppressed`` line per kind of line that went over its budget, and,
        after many strangers came and went, their freed memory back to the OS."""
        while True:
            await trio.sleep(LOG_INTERVAL_S)
            for kind, count in self._log_limits.summaries(trio.current_time()):
                fields = {"kind": kind, "count": count, "interval_s": LOG_INTERVAL_S}
                log.info("suppressed", extra={"fields": fields})
                self._emit_line("suppressed", fields)
            if self._strangers_closed:  # a flood, or its end: hand what its connections freed back
                self._strangers_closed = 0
                release_freed_memory()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self._trio_token = trio.lowlevel.current_trio_token()
        tune_allocator()  # connections' buffers go back to the OS when they close (spec/transport.md)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if not await trio.to_thread.run_sync(lambda: disk.space_available(self.store.root, need=0)):
                    self._disk_is_full("start", disk.DiskFullError(self.store.root))  # one line, then reads only
                nursery.start_soon(self._summarize_logs)
                nursery.start_soon(self._store_writer.run)
                self.transports = self._make_transports()
                for address in self._listen_addresses():
                    bound = await nursery.start(self._serve, address)
                    self.listen_addresses.append(bound)
                if self.options.relay_listen is not None:
                    await self._start_relay(nursery, self.options.relay_listen)
                self.port = _port_of(self.listen_addresses[0]) if self.listen_addresses else None
                self.engine.config = attrs.evolve(self.engine.config, listen_address=self._advertised())
                if self.options.http_listen is not None:
                    await trio.to_thread.run_sync(self._start_edge, *self.options.http_listen)
                self.driver.start()
                now = trio.current_time()
                for address in self.options.bootstrap:
                    if self._transport_for(address) is not None:
                        self.book.add(canonical_address(address), now=now)
                    else:
                        log.warning("no transport for bootstrap address %s", address)
                nursery.start_soon(self._dialer)
                if self.options.mdns:
                    await trio.to_thread.run_sync(self._start_discovery)
                task_status.started(self.port)
                await self._main_loop()
        finally:
            if self.discovery is not None:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(self.discovery.close)
                self.discovery = None
            if self.edge is not None:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(self.edge.stop)
                self.edge = None

    def request_leave(self) -> None:
        """Ask the engine to leave the roster (`ev.LeaveRequested`, spec/protocol.md §5 "Leave"): the main
        loop feeds it like any other event. Call on the trio thread while `run` is running; trainers only
        (the engine raises LocalProtocolError for a node without the trainer role)."""
        self._events.put(ev.LeaveRequested(now=0.0))

    def join_pending(self) -> bool:
        """True while this node (a trainer) has sent a join that no head has answered yet."""
        return any(getattr(role, "join_pending", False) for role in self.engine.roles)

    async def wait_head_change(self) -> None:
        """Return at the next head the engine promotes."""
        await self._head_changed.wait()

    async def wait_unrostered(self) -> None:
        """Return once the engine's head no longer lists this node in its roster (at once if it does not)."""
        while self.identity.peer_id in self.engine.head.roster_peers:
            await self.wait_head_change()

    def _advertised(self) -> str | None:
        """The address our Hello gives for peer exchange: the first bound listener whose host is a specific
        IP literal (a wildcard or a host name is not something a peer could dial), else None."""
        for address in self.listen_addresses:
            try:
                return canonical_address(address)
            except ValueError:
                continue
        return None

    def _make_transports(self) -> list[Transport]:
        """TCP and HTTP (dial and listen), memory when the options give a network, and relay (circuit
        addresses through any of those, spec/transport.md §12). Inbound connections of each go through the
        address book (bans, limits) before their handshake."""
        from .http_transport import HttpTransport
        from .memory import MemoryNetworkTransport

        book = self.book
        options = tcp.SecureOptions(
            max_connections=self.limits.max_peers,  # relayed inbound connections (spec/transport.md §12)
            max_connections_per_ip=self.limits.max_peers_per_ip,
            limiter=self.limiter, protected=self._is_known,
            admit=lambda ip: book.admit_inbound(ip, now=trio.current_time()),
            on_handshake_failed=lambda ip, exc: book.inbound_handshake_failed(ip, now=trio.current_time()))
        transports: list[Transport] = [tcp.TcpTransport(options), HttpTransport(options)]
        if self.options.memory_network is not None:
            transports.append(MemoryNetworkTransport(self.options.memory_network, options))
        transports.append(RelayTransport(list(transports), options))  # dials circuits through the others
        return transports

    def _is_known(self, peer: PeerId) -> bool:
        """Known peers have connection slots strangers cannot take (spec/transport.md §13): the current head's
        roster, the manifest's validators, peers admitted by certificate, and `Limits.protected_peers`."""
        engine = self.engine
        if peer in engine.head.roster_peers or peer in engine.revision.manifest.validators or peer in self._protected:
            return True
        return any(peer in getattr(getattr(role, "admission", None), "admitted", ()) for role in engine.roles)

    async def _start_relay(self, nursery: trio.Nursery, address: str) -> None:
        """Serve the relay role (adapters.relay.RelayServer, spec/transport.md §12) on the direct `address`,
        through the transport of its kind (so the address book's inbound admission applies)."""
        transport = self._transport_for(address, listening=True)
        if transport is None or transport.kind == "relay":
            raise ValueError(f"no transport listens on {address!r} for the relay")
        self.relay = RelayServer(self.options.relay_limits)
        self.relay_address = await nursery.start(self.relay.serve, transport, address, self.identity)
        log.info("relaying for others on %s", self.relay_address)
        self._emit_line("relay", {"address": self.relay_address})

    def _listen_addresses(self) -> tuple[str, ...]:
        if self.options.listen or self.options.dial_only:
            return self.options.listen
        return (_tcp_text((self.options.listen_host, self.options.listen_port)),)

    def _transport_for(self, address: str, *, listening: bool = False) -> Transport | None:
        """The transport that dials (or, `listening`, listens on) `address`, or None."""
        if listening:  # a listen address may have port 0 or a wildcard host, which `handles` refuses
            kind = "relay" if "/p2p-circuit" in address else "http" if address.startswith("http://") \
                else "memory" if address.startswith("memory://") \
                else "tcp"
            return next((t for t in self.transports if t.kind == kind), None)
        return next((t for t in self.transports if t.handles(address)
                     and (t.kind == "relay" or not self.options.relay_only)), None)

    def _start_discovery(self) -> None:
        from .discovery import MdnsDiscovery  # zeroconf only when discovery is on

        tcp_ports = [_port_of(a) for a in self.listen_addresses if a.startswith("/ip")]  # mDNS announces tcp
        if not tcp_ports:
            log.warning("mdns discovery needs a tcp listener; not started")
            return
        self.discovery = MdnsDiscovery(self.identity.peer_id, tcp_ports[0], self.engine.revision.id,
                                       self._on_discovered, interface=self.options.listen_host).start()

    def _on_discovered(self, peer: PeerId, address: tuple[str, int]) -> None:
        """From zeroconf's thread. Of two nodes that find each other, the smaller peer id dials, so they
        do not race two connections into one slot."""
        if self._trio_token is None or not self.identity.peer_id.to_bytes() < peer.to_bytes():
            return
        try:
            trio.from_thread.run_sync(self._learn_address, address, peer, trio_token=self._trio_token)
        except trio.RunFinishedError:
            pass

    def _learn_address(self, address: tuple[str, int], peer: PeerId | None = None) -> None:
        try:
            text = canonical_address(_tcp_text(address))
        except ValueError:
            return  # not a dialable IP literal and port: nothing to learn
        self.book.add(text, peer, now=trio.current_time(), learned=True)
        self._book_changed.set()

    def _start_edge(self, host: str, port: int) -> None:
        from .http_edge import EdgeServer  # aiohttp only when the edge is on

        # Upload bodies spool next to the artifacts (same disk; leftovers are cleaned when the store opens).
        self.edge = EdgeServer(self.edge_view, host=host, port=port, spool_dir=self.store.root / "artifacts",
                               limiter=self.limiter).start()
        self.http_port = self.edge.port
        from .edge_data import BrowserData

        workload, shards = getattr(self.executor, "workload", None), getattr(self.executor, "shards", None)
        if workload is not None and shards is not None:  # the browser peer's samples (spec/browser.md §2)
            self.edge.edge.browser_data = BrowserData.of(workload, shards, self.engine.manifest.workload)
        log.info("http edge listening", extra={"fields": {"url": self.edge.url}})

    async def _main_loop(self) -> None:
        while True:
            await self._store_writer.room()  # backpressure: chunks queued for the disk are bounded
            with trio.move_on_at(self._deadline if self._deadline is not None else math.inf):
                item = await self._events.get()
                if isinstance(item, _Submit):
                    self._submit(item)
                elif isinstance(item, _DiskResumed):
                    self._resume_writes()
                elif isinstance(item, _Completion):
                    item.done()
                else:
                    self.driver.handle(_with_now(item, trio.current_time()))
                    if isinstance(item, ev.MessageReceived):
                        self._inbox_done(item.peer, len(item.data))
                continue
            self.driver.timer_due()

    # --- I/O primitives (this runtime is the driver's `adapters.host.Host`) --------------------------

    def clock(self) -> float:
        return trio.current_time()

    def arm_timer(self, deadline: float | None) -> None:
        self._deadline = deadline

    def send(self, peer: PeerId, data: bytes) -> None:
        self._enqueue(peer, data)

    def hang_up(self, peer: PeerId, reason: str) -> None:
        """Cancel the connection's scope: its owner (`_adopt_connection`) closes it and feeds
        `PeerDisconnected`."""
        outbox = self._outboxes.get(peer)
        if outbox is not None:
            outbox.scope.cancel()

    def write_record(self, record: Record, done: Callable[[], None]) -> None:
        """Committed to the node database (SQLite WAL, synchronous=FULL) before `done`, so the messages the
        engine then releases follow a durable record. A conflicting vote raises DoubleVoteError: the node
        stops rather than equivocate.
        On a full disk the record waits (in order, with every later one) and `done` comes when it is
        written (`_resume_writes`)."""
        if self._syncing or durable_first(record):
            # A claim's delta, stored without fsync, is made durable first, on a thread (off this loop and the
            # trainer's critical path); records keep their order behind it.
            self._syncing.append((record, done))
            if len(self._syncing) == 1:
                assert self._nursery is not None
                self._nursery.start_soon(self._sync_artifacts, record)
            return
        self._write_now(record, done)

    def _write_now(self, record: Record, done: Callable[[], None]) -> None:
        if self.disk_full:
            self._unwritten.append((record, done))
            return
        try:
            self.store.put_record(record.key, record.data)
        except OSError as exc:
            if not disk.is_disk_full(exc):
                raise
            self._unwritten.append((record, done))
            self._disk_is_full("records", exc)
            return
        self._persisted(record, done)

    async def _sync_artifacts(self, record: Record) -> None:
        """Make the artifacts `record` names durable (`ArtifactStore.make_durable`, fsync) on a worker thread,
        then write it on the main loop (`_synced`). A disk too full for it leaves it to `_resume_writes`."""
        try:
            for digest in durable_first(record):
                await trio.to_thread.run_sync(self.store.make_durable, digest)
        except OSError as exc:
            if not disk.is_disk_full(exc):
                raise
            self._events.put(_Completion(functools.partial(self._sync_failed, exc)))
            return
        self._events.put(_Completion(self._synced))

    def _synced(self) -> None:
        """On the main loop: the first waiting record's artifacts are durable. Write it and the records behind
        it up to the next one with artifacts to sync, whose sync starts then."""
        record, done = self._syncing.popleft()
        self._write_now(record, done)
        while self._syncing and not durable_first(self._syncing[0][0]):
            self._write_now(*self._syncing.popleft())
        if self._syncing:
            assert self._nursery is not None
            self._nursery.start_soon(self._sync_artifacts, self._syncing[0][0])

    def _sync_failed(self, exc: OSError) -> None:
        """No space to make a claim's artifacts durable: it and every record behind it wait, in order, for
        `_resume_writes`."""
        self._unwritten.extend(self._syncing)
        self._syncing.clear()
        self._disk_is_full("artifact sync", exc)

    def _persisted(self, record: Record, done: Callable[[], None]) -> None:
        self._note_chain_record(record)
        done()

    def read_chunk(self, ref: ArtifactRef, index: int) -> bytes:
        return self.store.read_chunk(ref, index)

    def write_chunk(self, ref: ArtifactRef, index: int, data: bytes | memoryview) -> None:
        """Queued for the store writer's thread (`adapters.store_writer`), in order with the commit.
        A chunk that cannot be written (full disk) loses its whole fetch: the store drops the partial file
        and the fetch is never committed (`_stored`), so no artifact with a hole is ever trusted and no
        provider or author is charged for our disk."""
        if ref.digest not in self._lost_fetches:
            self._store_writer.write_chunk(ref, index, data)

    def commit_artifact(self, ref: ArtifactRef, durable: bool, done: Callable[[bool], None]) -> None:
        """Queued behind the artifact's chunks; `done` (the engine hears `ArtifactStored` or `ArtifactCorrupt`)
        once the commit is done (`_stored`)."""
        if ref.digest not in self._lost_fetches:  # else held for good: see `write_chunk`
            self._store_writer.commit(ref, durable, done)

    def _stored(self, outcome: Outcome) -> None:
        """On the trio thread, the outcome of a queued write or commit, in order: a commit's event goes to
        the engine's queue; a write or commit that failed for want of space loses its fetch (`store_chunk`);
        any other OSError stops the node, as it did when the writes ran on this thread."""
        op = outcome.op
        if outcome.status == FAILED:
            assert outcome.error is not None
            if not disk.is_disk_full(outcome.error):
                raise outcome.error
            self._lost_fetches.add(op.ref.digest)
            self._disk_is_full("artifact store", outcome.error)
        elif isinstance(op, Commit) and outcome.status in (STORED, CORRUPT):
            stored = outcome.status == STORED
            self._events.put(_Completion(lambda: op.done(stored)))

    def remove_artifacts(self, digests: tuple[bytes, ...]) -> None:
        self.store.remove(digests)

    def run_task(self, task: fx.RunTask, done: Callable[[TaskOutcome], None]) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._run_task, task, done)

    def ban(self, peer: PeerId, until: float) -> None:
        """Not re-admitted, inbound or dialed, until the ban ends (the engine's `HangUp` follows)."""
        now = trio.current_time()
        self.book.ban_peer(peer, now=now, seconds=max(0.0, until - now))
        log.info("banned %s for %.0f s", peer.short(), max(0.0, until - now))
        self._emit_line("peer-banned", {"peer": peer.to_text(), "reason": "penalties",
                                        "seconds": round(max(0.0, until - now), 3)})

    # --- notifications (this runtime is the driver's `adapters.host.Observer`) ------------------------

    def peers_discovered(self, peers: tuple[tuple[PeerId, str], ...]) -> None:
        """Learnt addresses go to the address book, which dials them within its limits and backoff."""
        now = trio.current_time()
        for peer, text in peers:
            if peer not in self._conns and self._transport_for(text) is not None:  # syntax checked by the engine
                self.book.add(canonical_address(text), peer, now=now, learned=True)
        self._book_changed.set()

    def rejected(self, peer: PeerId | None, reason: str, detail: str) -> None:
        """Metrics, the per-window count the edge reports, and the peer's reputation (flushed per window)."""
        self.metrics.on_rejected(reason)
        self._rejected_in_window += 1
        if peer is not None:
            key = (peer.to_text() if peer in self._admitted else OTHER_PEERS, reason)
            self._reputation[key] = self._reputation.get(key, 0) + 1
            if peer in self._admitted:
                count, _ = self._rejections.get(peer, (0, ""))
                detail = " ".join(detail.split())[:200]
                self._rejections[peer] = (count + 1, f"{reason} ({detail})" if detail else reason)

    def submit_reply(self, request_id: int, accepted: bool, reason: str) -> None:
        """Wake the HTTP edge's request waiting for this verdict (`_relay`)."""
        item = self._submits.pop(request_id, None)
        if item is not None:
            item.result = SubmitResult(accepted=accepted, reason=reason, envelope_id=item.envelope.id)
            item.done.set()

    def head_promoted(self, head: Head, certificate: QuorumCertificate) -> None:
        # windows archived by chain sync just before this head: the edge serves them too
        for window in range(self.edge_view.latest().head.window + 1, head.window):
            entry = self.engine.chain_entry(window)
            if entry is not None:
                self.edge_view.promote(*entry)
        self.metrics.on_head(head)
        self._note_admitted()
        self._head_changed.set()
        self._head_changed = trio.Event()
        if self.on_head is not None:
            self.on_head(head, certificate)
        sent, received = self.wire_bytes()
        self.edge_view.promote(head, certificate, accepted=len(head.cohort),
                               rejected=self._rejected_in_window, bytes_sent=sent,
                               bytes_received=received, time=time.time())
        self._rejected_in_window = 0
        self._flush_reputation()
        try:
            self.store.pin("head", head.params.digest)  # what `ArtifactStore.gc` must keep
        except OSError as exc:  # pinned again when writing resumes
            if not disk.is_disk_full(exc):
                raise
            self._disk_is_full("records", exc)
        self._emit_line("wire", {"window": head.window, "sent": sent, "received": received})

    def log(self, event: str, fields: dict[str, Any]) -> None:
        # A line about a peer (a rejection, mostly) is within the stranger budget unless the peer is admitted.
        if "peer" in fields and not self._may_log(f"{event}/{fields.get('reason', '')}", fields["peer"]):
            return
        self._emit_line(event, fields)
        engine_log.info(event, extra={"fields": fields})

    def _note_chain_record(self, record: Record) -> None:
        """Hand a certified head just made durable to `on_chain_entry`: every ``chain/<w>`` record, and the
        ``head`` record of an engine that archives no chain (one that does archived the head first)."""
        if self.on_chain_entry is None:
            return
        if isinstance(record, ChainRecord) or (isinstance(record, HeadRecord) and not self.engine.config.keeps_chain):
            entry = decode_chain_entry(record.data)
            if self._unwritten_chain:
                self._unwritten_chain.append(entry)
                return
            try:
                self.on_chain_entry(*entry)
            except OSError as exc:  # the record is durable; its chain file is written when space is back
                if not disk.is_disk_full(exc):
                    raise
                self._unwritten_chain.append(entry)
                self._disk_is_full("chain directory", exc)

    def _enqueue(self, peer: PeerId, data: bytes) -> None:
        outbox = self._outboxes.get(peer)
        if outbox is None or outbox.full:
            return
        lane = LANE_CONTROL if len(data) <= tcp.AUTO_CONTROL_MAX_BYTES else LANE_BULK
        cap = self.options.max_control_outbox_bytes if lane == LANE_CONTROL else self.options.max_bulk_outbox_bytes
        if outbox.queued[lane] + len(data) > cap:
            # The peer does not read fast enough (flow control holds our writer): drop it rather than queue more.
            outbox.full = True
            self.outbox_hangups += 1
            fields = {"peer": str(peer), "reason": "outbox-full", "lane": lane, "queued": outbox.queued[lane],
                      "cap": cap}
            log.warning("hanging up on %s: %s lane outbox over %d bytes (%d queued)", peer.short(),
                        "control" if lane == LANE_CONTROL else "bulk", cap, outbox.queued[lane])
            self._emit_line("hangup", fields)
            outbox.scope.cancel()
            return
        outbox.queued[lane] += len(data)
        outbox.channels[lane].send_nowait(data)

    async def _run_task(self, effect: fx.RunTask, done: Callable[[TaskOutcome], None]) -> None:
        try:
            background = effect.kind in BACKGROUND_TASKS
            executor = self.audit_executor if background and self.audit_executor is not None else self.executor
            started, (result, parts) = await self._compute.run(background, executor.run_timed, effect.task)
        except Exception as exc:
            if disk.is_disk_full(exc):
                self._disk_is_full(f"task {effect.kind}", exc)
            else:
                log.exception("task %s failed", effect.task_id)
            # the dashboard's "last error" (`EdgeView.last_error`), one line
            self.edge_view.set_last_error(f"{effect.kind} task failed: {' '.join(repr(exc).split())[:300]}")
            self._events.put(_Completion(functools.partial(done, exc)))
            return
        seconds = time.monotonic() - started
        # `started`: the unix time the task began on its worker (bench/window.py's utilization reads it); `parts`:
        # the seconds of its parts, where its kind names some (`ComputeExecutor.run_timed`: a train task's)
        line: dict[str, Any] = {"kind": effect.kind, "seconds": round(seconds, 4),
                                "started": round(time.time() - seconds, 3)}
        if parts:
            line["parts"] = parts
        self._emit_line("task-done", line)
        self._events.put(_Completion(functools.partial(done, result)))

    async def _dialer(self) -> None:
        """Dial what the address book says is due (bootstrap and discovered addresses, with backoff)."""
        while True:
            now = trio.current_time()
            for address in self.book.due(now):
                self.book.dial_started(address, now=now)
                assert self._nursery is not None
                self._nursery.start_soon(self._dial_once, address)
            wake = self.book.next_due(trio.current_time())
            self._book_changed = trio.Event()
            with trio.move_on_at(wake if wake is not None else math.inf):
                await self._book_changed.wait()

    async def _dial_once(self, address: str) -> None:
        transport = self._transport_for(address)
        try:
            if transport is None:
                raise TransportError("bad-address", f"no transport dials {address}")
            conn = await transport.dial(address, self.identity, max_message_bytes=self.options.max_message_bytes)
        except (OSError, TransportError) as exc:
            log.debug("dial %s failed: %s", address, exc)
            # Only a failed handshake counts toward a ban; a refused connection (a peer still starting) never does.
            handshake = isinstance(exc, TransportError) and exc.reason in HANDSHAKE_FAILURES
            self.book.dial_failed(address, now=trio.current_time(), handshake=handshake)
            self._book_changed.set()
            return
        if not self.book.connected(address, conn.remote_peer, now=trio.current_time()):
            await conn.aclose()  # banned, or over the connection limits
            self._book_changed.set()
            return
        try:
            await self._adopt_connection(conn, address)
        finally:
            self.book.disconnected(address, now=trio.current_time())
            self._book_changed.set()

    async def _serve(self, address: str, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Accept inbound connections on `address` through its transport; reports the bound address. The
        address book refuses banned or over-limit IPs before the handshake (`_make_transports`), and both
        directions count toward its connection limits. Raises ValueError for an address no transport
        listens on (memory:// without a network)."""
        transport = self._transport_for(address, listening=True)
        if transport is None:
            raise ValueError(f"no transport listens on {address!r}")
        await transport.listen(address, self.identity, self._serve_inbound,
                               max_message_bytes=self.options.max_message_bytes, task_status=task_status)

    async def _serve_inbound(self, conn: Connection) -> None:
        """Own one accepted connection (the transport's listener closes it when this returns)."""
        address = conn.remote_address
        if address is None:
            return  # the socket is already gone
        ip = address[0]
        self.book.inbound_handshake_ok(ip)
        if self.book.is_banned(conn.remote_peer, now=trio.current_time()):
            if self._may_log("refused/banned", conn.remote_peer):
                log.info("refused %s from %s: banned", conn.remote_peer.short(), ip)
            return
        if not self.book.inbound_opened(ip):
            if self._may_log("refused/connection-limit", conn.remote_peer):
                log.info("refused %s from %s: connection limit", conn.remote_peer.short(), ip)
            return
        try:
            await self._adopt_connection(conn)
        finally:
            self.book.inbound_closed(ip)
            self._book_changed.set()  # a slot is free: the dialer may go on

    async def _adopt_connection(self, conn: Connection, address: str | None = None) -> None:
        """Own a connection until it closes (or its outbox overflows): a reader loop and a writer per lane."""
        peer = conn.remote_peer
        if peer in self._conns or peer == self.identity.peer_id:
            await conn.aclose()  # one connection per peer pair is enough
            return
        control_out, control_in = trio.open_memory_channel[bytes](math.inf)
        bulk_out, bulk_in = trio.open_memory_channel[bytes](math.inf)
        scope = trio.CancelScope()
        outbox = _Outbox(channels=(control_out, bulk_out), scope=scope, admitted=peer in self._admitted)
        self._conns[peer], self._outboxes[peer] = conn, outbox
        self._seen[peer] = (address, time.time())  # written per window, admitted peers only (`_flush_reputation`)
        if self._may_log("connected", peer):
            self._emit_line("connected", {"peer": peer.to_text(), "address": address,
                                          "transport": getattr(conn, "transport_kind", None),
                                          "cipher": getattr(conn, "transport_cipher", None)})
        self._events.put(ev.PeerConnected(now=0.0, peer=peer), stranger=not outbox.admitted)
        try:
            with scope:
                await self._run_connection(conn, peer, outbox, control_in, bulk_in)
            self.book.connection_ok(peer)
        except Exception as exc:  # containment (spec/transport.md §6): this connection ends, nothing else
            self._connection_failed(peer, exc)
        finally:
            self.bytes_sent += conn.bytes_sent
            self.bytes_received += conn.bytes_received
            if outbox.admitted:
                old_sent, old_received = self._closed_bytes.get(peer) or (0, 0)
                self._closed_bytes[peer] = (old_sent + conn.bytes_sent, old_received + conn.bytes_received)
            else:
                self._add_other_bytes(conn.bytes_sent, conn.bytes_received)
                self._strangers_closed += 1
            del self._conns[peer], self._outboxes[peer]
            with trio.CancelScope(shield=True):
                await conn.aclose()
                self._events.put(ev.PeerDisconnected(now=0.0, peer=peer), stranger=not outbox.admitted)

    async def _run_connection(self, conn: Connection, peer: PeerId, outbox: _Outbox,
                              control_in: trio.MemoryReceiveChannel[bytes],
                              bulk_in: trio.MemoryReceiveChannel[bytes]) -> None:
        """The reader loop here, one writer task per lane; returns when any of them stops."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._writer, conn, outbox, control_in, LANE_CONTROL, nursery.cancel_scope)
            nursery.start_soon(self._writer, conn, outbox, bulk_in, LANE_BULK, nursery.cancel_scope)
            try:
                first = True
                while True:
                    await self._inbox_room(peer)  # backpressure: stop reading while the engine is behind
                    data = await conn.receive_message()
                    if first:  # a Hello says how far the peer's chain is: the head-lag metric
                        self._note_hello(data)
                        first = False
                    self._inbox[peer] += len(data)
                    self._events.put(ev.MessageReceived(now=0.0, peer=peer, data=data), stranger=not outbox.admitted)
            except TransportError as exc:
                if fault_reason(exc) in PEER_FAULTS:
                    nursery.cancel_scope.cancel()
                    raise
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
            nursery.cancel_scope.cancel()

    async def _inbox_room(self, peer: PeerId) -> None:
        """Wait while more than `PEER_INBOX_BYTES` of `peer`'s messages wait for the engine. The reader then
        stops taking messages from the connection, so its lanes grant no credit and the peer's sends block
        (spec/transport.md §4): one fast peer cannot grow this process's memory (spec/transport.md §5)."""
        while self._inbox[peer] > PEER_INBOX_BYTES:
            room = self._inbox_room_events.setdefault(peer, trio.Event())
            await room.wait()

    def _inbox_done(self, peer: PeerId, size: int) -> None:
        """The engine handled one of `peer`'s messages of `size` bytes: wake its reader if there is room."""
        left = self._inbox[peer] - size
        if left > 0:
            self._inbox[peer] = left
        else:
            del self._inbox[peer]
        if left <= PEER_INBOX_BYTES and (room := self._inbox_room_events.pop(peer, None)) is not None:
            room.set()

    def _connection_failed(self, peer: PeerId, exc: Exception) -> None:
        """Log and count the failure that ended `peer`'s connection: a TransportError (found inside an
        exception group too), charged to the peer when it is a peer fault (`PEER_FAULTS`), or any other
        exception: ``internal``, logged with its traceback and never charged to the peer (our own bug must
        not ban an honest peer)."""
        transport = exc if isinstance(exc, TransportError) else \
            first_transport_error(exc) if isinstance(exc, BaseExceptionGroup) else None
        reason = fault_reason(transport) if transport is not None else "internal"
        loud = self._may_log(f"connection-error/{reason}", peer)
        if transport is None:
            if loud:
                log.error("connection to %s ended by an internal error", peer.short(), exc_info=exc)
        elif loud:
            log.info("connection to %s ended: %s", peer.short(), transport)
        self.metrics.connection_errors.labels(reason).inc()
        if loud:
            self._emit_line("connection-error", {"peer": peer.to_text(), "reason": reason})
        if transport is not None and reason in PEER_FAULTS:
            if self.book.connection_failed(peer, now=trio.current_time()):
                self._emit_line("peer-banned", {"peer": peer.to_text(), "reason": reason})

    async def _writer(self, conn: Connection, outbox: _Outbox,
                      channel: trio.MemoryReceiveChannel[bytes], lane: int, scope: trio.CancelScope) -> None:
        try:
            async for data in channel:
                await conn.send_message(data, lane=lane)  # waits while the peer's credit on `lane` is spent
                outbox.queued[lane] -= len(data)
        except (TransportError, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            scope.cancel()

    # --- HTTP edge (EdgeView callables; called from the edge's thread unless noted) ------------------

    def _stored_chain(self) -> list[tuple[Head, QuorumCertificate]]:
        entries = []
        for _, _, entry in self.store.db.heads():
            try:
                entries.append(decode_chain_entry(entry))
            except Exception:  # a record the engine would refuse too; the edge serves what verifies
                continue
        return [(h, c) for h, c in entries if h.window > 0]

    def _artifact_path(self, digest: bytes) -> Path | None:
        return self.store.path_of(digest) if self.store.has(digest) else None

    def peer_infos(self) -> Sequence[PeerInfo]:
        """Connected peers with roles and wire bytes (a snapshot taken on the trio thread)."""
        def snapshot() -> list[PeerInfo]:
            out = []
            for peer, conn in self._conns.items():
                state = self.engine.peers.get(peer)
                rejected, last = self._rejections.get(peer, (0, ""))
                out.append(PeerInfo(peer_id=peer, roles=tuple(state.roles) if state else (),
                                    bytes_sent=conn.bytes_sent, bytes_received=conn.bytes_received,
                                    rejected=rejected, last_rejection=last))
            return out

        if self._trio_token is None:
            return []
        try:
            return trio.from_thread.run_sync(snapshot, trio_token=self._trio_token)
        except (trio.RunFinishedError, RuntimeError):
            return []  # the node is shutting down (RuntimeError: called from the trio thread itself)

    def _relay(self, envelope: SignedEnvelope, artifact: bytes | None) -> SubmitResult:
        """Hand a checked submission to the main loop and wait (at most SUBMIT_TIMEOUT_S) for the verdict."""
        async def submit() -> SubmitResult:
            self._submit_ids += 1
            item = _Submit(request_id=self._submit_ids, envelope=envelope, artifact=artifact)
            self._events.put(item)
            with trio.move_on_after(SUBMIT_TIMEOUT_S):
                await item.done.wait()
            self._submits.pop(item.request_id, None)
            return item.result or SubmitResult(accepted=False, reason="timeout")

        if self._trio_token is None:
            return SubmitResult(accepted=False, reason="not-running")
        try:
            return trio.from_thread.run(submit, trio_token=self._trio_token)
        except trio.RunFinishedError:
            return SubmitResult(accepted=False, reason="not-running")

    def _submit(self, item: _Submit) -> None:
        """On the trio thread: store the artifact, then feed the envelope as `events.Submit`; the engine
        judges it like a `Signed` message from its signer and answers with `SubmitReply` (`submit_reply`)."""
        try:
            if self.disk_full and item.artifact is not None:
                raise disk.DiskFullError(self.store.root)
            stored = self.store.put(item.artifact) if item.artifact is not None else None
        except OSError as exc:
            if not disk.is_disk_full(exc):
                raise
            self._disk_is_full("artifact store", exc)
            item.result = SubmitResult(accepted=False, reason="disk-full")
            item.done.set()
            return
        self._submits[item.request_id] = item
        self.driver.handle(ev.Submit(now=trio.current_time(), request_id=item.request_id, envelope=item.envelope,
                                     stored=stored))

    def _note_hello(self, data: bytes) -> None:
        if len(data) > 4096:
            return  # a Hello is small; the engine judges anything else
        try:
            message = decode_message(data, max_bytes=4096)
        except PeerloomError:
            return  # the engine rejects and charges it
        if isinstance(message, Hello):
            self.metrics.note_peer_head(message.head_window, self.engine.head.window)

    def _flush_reputation(self) -> None:
        """Once per window, one transaction each: the rejections counted since the last flush, and the last
        contact of the admitted peers seen (strangers get no row: spec/transport.md §14). On a
        full disk they wait for the next flush."""
        if self.disk_full:
            return
        rows: list[tuple[str, str | None, str | None, float]] = [
            (peer.to_text(), address, None, seen) for peer, (address, seen) in self._seen.items()
            if peer in self._admitted]
        try:
            self.store.db.charge_many([(peer, reason, count) for (peer, reason), count in self._reputation.items()])
            self._reputation.clear()
            self.store.db.note_peers(rows)
            self._seen.clear()
        except OSError as exc:
            if not disk.is_disk_full(exc):
                raise
            self._disk_is_full("records", exc)

    def _peer_bytes(self) -> list[tuple[str, int, int]]:
        """(peer id text, sent, received) wire bytes per admitted peer (open connections, and closed ones
        while in the LRU), and the OTHER_PEERS row for everyone else; safe from any thread."""
        totals = dict(self._closed_bytes.items())
        other_sent, other_received = self._other_bytes
        for peer, conn in list(self._conns.items()):
            outbox = self._outboxes.get(peer)
            if outbox is not None and outbox.admitted:
                sent, received = totals.get(peer, (0, 0))
                totals[peer] = (sent + conn.bytes_sent, received + conn.bytes_received)
            else:
                other_sent += conn.bytes_sent
                other_received += conn.bytes_received
        return [(peer.to_text(), sent, received) for peer, (sent, received) in totals.items()] + \
            [(OTHER_PEERS, other_sent, other_received)]

    def close(self) -> None:
        """Release files after `run` returned (the store's database, the event log)."""
        self._flush_reputation()
        if self._events_file is not None:
            try:
                self._events_file.close()
            except OSError as exc:  # its last lines did not fit on the disk
                log.warning("event log not closed cleanly: %s", exc)
            self._events_file = None
        self.store.close()

    def wire_bytes(self) -> tuple[int, int]:
        """(sent, received) bytes on the wire over all connections so far, open ones included."""
        sent = self.bytes_sent + sum(c.bytes_sent for c in self._conns.values())
        received = self.bytes_received + sum(c.bytes_received for c in self._conns.values())
        return sent, received


def _tcp_text(address: tuple[str, int]) -> str:
    """"H:P" (or "[H6]:P") for a (host, port) pair: a tcp address."""
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _port_of(address: str) -> int:
    """The port of a bound transport address ("/ip4/H/tcp/P", "http://H:P"); 0 for memory://."""
    if address.startswith("memory://") or "/p2p-circuit" in address:
        return 0
    return int(address.rstrip("/").replace("/tcp/", ":").rpartition(":")[2])


def _with_now(event: ev.Event, now: float) -> ev.Event:
    """Events queued by I/O tasks are stamped when the engine takes them, so `now` never goes back."""
    return attrs.evolve(event, now=now)

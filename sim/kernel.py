"""The simulation kernel: real engines on a virtual clock over a modelled network (spec/design.md §7,
spec/simulator.md §2).

One event heap ordered by (time, sequence): the sequence number is the deterministic tie-break, so two
events at the same virtual time run in the order they were scheduled. One master seed derives a
separate `random.Random` per subsystem (network, churn, compute, adversaries) and per engine, so adding
a fault does not shift the randomness of the network, and the same seed replays the same run exactly.

Every engine runs under the shared `Driver` (`adapters/host.py`), with one `_NodeHost` per node supplying the
I/O primitives on the virtual clock: `Send` goes over the memory transport (`adapters/memory.py`, which holds the
links and counts bytes per peer) and then through the `Network` model, `Persist` goes to the node's
`SimDisk` and completes only after the modelled fsync time (a crash in between loses it), `RunTask` runs the
real compute synchronously and completes after a modelled duration on the node's single compute queue, `Ban`
keeps the link down until the ban ends. A completion is an item on the heap (`_Done`); the driver builds the
event it feeds (`Persisted`, `TaskFinished`, `ArtifactStored`, ...). Faults (partitions, clogging,
crashes, joins, leaves) are scheduled actions on the same heap. No wall clock is read.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import json
import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import IO, Any

import attrs

from peerloom.adapters.compute import ComputeExecutor
from peerloom.adapters.host import Driver, Observer, TaskOutcome, commit
from peerloom.backends.privacy import privacy_accountant
from peerloom.core import effects as fx
from peerloom.core import events as ev
from peerloom.core.engine import Engine, EngineConfig
from peerloom.core.identity import Identity, PeerId
from peerloom.core.leases import leases_of
from peerloom.core.messages import DecodeMemo
from peerloom.core.objects import PROTOCOL_VERSION, ArtifactRef, Head, QuorumCertificate, Revision, UpdateAnnouncement
from peerloom.core.records import Record
from peerloom.core.tasks import Task, TaskResult, TrainResult, TrainTask

from .disk import SimDisk
from .links import Links
from .network import LinkSpec, Network

SUBSYSTEMS = ("network", "churn", "compute", "adversaries")
DEFAULT_TASK_S = {"train": 0.5, "screen": 0.01, "reduce": 0.05, "evaluate": 0.05, "audit": 0.5,
                  "audit-plan": 0.001}


def derive_seed(master: int, name: str) -> int:
    """A 64-bit seed for one subsystem (or node) from the master seed: SHA-256(master, name)."""
    return int.from_bytes(hashlib.sha256(f"peerloom-sim/{master}/{name}".encode()).digest()[:8], "big")


def sim_identity(seed: int, name: str) -> Identity:
    """A node's Ed25519 identity, derived from the master seed and its name (reproducible)."""
    return Identity(hashlib.sha256(f"peerloom-sim-identity/{seed}/{name}".encode()).digest())


class Trace:
    """JSONL trace: one canonical JSON object per line (sorted keys); the SHA-256 covers every byte."""

    def __init__(self, out: IO[str] | None = None, *, level: str = "log") -> None:
        if level not in ("log", "heads"):
            raise ValueError("trace level is 'log' or 'heads'")
        self.out = out
        self.level = level
        self.lines = 0
        self._sha = hashlib.sha256()

    def emit(self, t: float, node: str, kind: str, fields: Mapping[str, Any]) -> None:
        line = json.dumps({"t": round(t, 9), "node": node, "kind": kind, **fields}, sort_keys=True,
                          separators=(",", ":"), default=str) + "\n"
        self._sha.update(line.encode())
        self.lines += 1
        if self.out is not None:
            self.out.write(line)

    def sha256(self) -> str:
        return self._sha.hexdigest()


class Behaviour:
    """A named node behaviour (honest by default). Adversaries override the hooks (sim/adversary.py)."""

    name = "honest"
    byzantine = False

    def attach(self, sim: Simulation, node: SimNode) -> None:
        """Called once when the node is added (e.g. to swap its workload)."""

    def on_task(self, sim: Simulation, node: SimNode, task: Task, result: TaskResult) -> TaskResult:
        """What the node's engine hears back from its compute `task`, given what it computed (`result`)."""
        return result

    def on_send(self, sim: Simulation, node: SimNode, dst: str, data: bytes) -> list[tuple[float, bytes]]:
        """What actually leaves the node for one `Send`: (extra delay in s, bytes) pairs; [] drops it."""
        return [(0.0, data)]

    def on_head(self, sim: Simulation, node: SimNode, head: Head) -> None:
        """After the node promoted a certified head."""


HONEST = Behaviour()


@attrs.define(eq=False)
class SimNode:
    name: str
    identity: Identity
    role: str
    roles: frozenset[str]
    disk: SimDisk
    executor: ComputeExecutor
    capacity: int = 1
    behaviour: Behaviour = HONEST
    engine: Engine | None = None
    up: bool = False
    armed: float | None = None
    incarnation: int = 0
    compute_free_at: float = 0.0
    left: bool = False  # left for good: never restarted
    speed: float = 1.0
    heads: list[tuple[float, int, bytes]] = attrs.Factory(list)  # (time, window, head id)
    engine_factory: Callable[..., Engine] | None = None
    host: _NodeHost | None = None  # its I/O primitives (set by `Simulation.add_node`)
    driver: Driver | None = None  # drives its engine through `host` (set at each boot)

    @property
    def peer_id(self) -> PeerId:
        return self.identity.peer_id

    @property
    def honest(self) -> bool:
        return not self.behaviour.byzantine


class Simulation:
    """Build nodes with `add_node`, wire them with `link`, `start()`, schedule faults with `at(...)`,
    then `run(until=...)`. Observers (invariant checkers) get `on_head` / `on_event` callbacks."""

    def __init__(self, revision: Revision, *, seed: int, workload: Any, shards: list[list[int]],
                 default_link: LinkSpec | None = None,
                 link_overrides: Iterable[tuple[frozenset[str], LinkSpec]] = (),
                 task_s: Mapping[str, float] | None = None, compute_jitter: float = 0.0,
                 speed_sigma: float = 0.0, persist_s: float = 0.001, lose_unsynced: bool = True,
                 detect_s: float = 0.5, redial_s: float | None = 5.0, trace: Trace | None = None,
                 engine_options: Mapping[str, Any] | None = None) -> None:
        self.revision = revision
        self.manifest = revision.manifest
        self.seed = seed
        self.workload = workload
        self.shards = shards
        self.rngs = {name: random.Random(derive_seed(seed, name)) for name in SUBSYSTEMS}
        self.roles_of: dict[str, str] = {}
        self.network = Network(default_link or LinkSpec(), link_overrides, rng=self.rngs["network"],
                               roles_of=self.roles_of)
        self.task_s = dict(DEFAULT_TASK_S, **(task_s or {}))
        self.compute_jitter = compute_jitter
        self.speed_sigma = speed_sigma
        self.persist_s = persist_s
        self.lose_unsynced = lose_unsynced
        self.detect_s = detect_s
        self.redial_s = redial_s
        self.trace = trace
        self.engine_options = dict(engine_options or {})
        # One decode per broadcast, shared by every receiving engine (core/messages.py DecodeMemo).
        self.decode_memo = DecodeMemo()
        self.now = 0.0
        self.events = 0
        self.nodes: dict[str, SimNode] = {}
        self.by_peer: dict[PeerId, SimNode] = {}
        self.adjacent: dict[str, set[str]] = {}
        self.connected: set[tuple[str, str]] = set()  # links up (by node name); epochs tag connections
        self.transport = Links()
        self.epoch: dict[tuple[str, str], int] = {}
        self.cut: set[tuple[str, str]] = set()  # links held down by a partition
        self.down_at: dict[tuple[str, str], float] = {}
        self.observers: list[Any] = []
        self.updates: dict[bytes, tuple[PeerId, UpdateAnnouncement]] = {}  # every announcement seen
        self.honest_deltas: dict[int, list[tuple[str, Any]]] = {}  # window -> (trainer, delta ref)
        self.keep_honest_deltas = False  # set by attacks that read the honest cohort (ALIE, IPM)
        self.task_counts: Counter[str] = Counter()
        self.stopped = False
        self._heap: list[tuple[float, int, str, int, Any]] = []
        self._seq = 0
        self._seen_ann: dict[str, bytes] = {}
        # (banning node, banned node) -> virtual time the ban ends; a node forgets its bans when it restarts
        # (the runtime keeps them in memory too).
        self.bans: dict[tuple[str, str], float] = {}
        self.rejections: Counter[str] = Counter()  # `Rejected` effects of every engine, by reason
        self._last_vote_data: bytes | None = None

    # --- building ----------------------------------------------------------------------------------

    def add_node(self, name: str, role: str, *, identity: Identity | None = None, capacity: int = 1,
                 behaviour: Behaviour | None = None, genesis: bytes | None = None,
                 engine_factory: Callable[..., Engine] | None = None, extra_roles: Iterable[str] = (),
                 compute: str = "numpy", disk: SimDisk | None = None) -> SimNode:
        """A node (booted by `start`, or `restart` once started); `compute` is its backend for screening and
        reduction (node config key ``compute``: numpy or torch); `disk` replaces its fresh `SimDisk` (any
        object with SimDisk's methods, e.g. an on-disk store in `peerloom.testing.Cluster`)."""
        if name in self.nodes:
            raise ValueError(f"node {name!r} exists")
        identity = identity or sim_identity(self.seed, name)
        disk = disk if disk is not None else SimDisk(chunk_size=self.manifest.chunk_size)
        if genesis is not None:
            disk.put(genesis)
        node = SimNode(name=name, identity=identity, role=role, roles=frozenset({role, *extra_roles}), disk=disk,
                       executor=ComputeExecutor(disk, self.manifest, self.workload, self.shards, compute=compute),
                       capacity=capacity, behaviour=behaviour or HONEST, engine_factory=engine_factory)
        if self.speed_sigma:
            node.speed = self.rngs["compute"].lognormvariate(0.0, self.speed_sigma)
        node.host = _NodeHost(self, node)
        self.nodes[name] = node
        self.by_peer[identity.peer_id] = node
        self.roles_of[name] = role
        self.adjacent[name] = set()
        node.behaviour.attach(self, node)
        return node

    def link(self, a: str, b: str) -> None:
        """Make `a` and `b` neighbours: connected whenever both are up and no partition cuts them."""
        self.adjacent[a].add(b)
        self.adjacent[b].add(a)
        self._connect(a, b)

    def start(self) -> None:
        """Boot every node at the current time, then connect the links between them."""
        for node in self.nodes.values():
            if not node.up:
                self.boot(node.name)

    def boot(self, name: str) -> None:
        node = self.nodes[name]
        options = {"accountant": privacy_accountant(self.manifest), **self.engine_options}
        config = EngineConfig(roles=node.roles, revision=self.revision, capacity=node.capacity,
                              decode_memo=self.decode_memo, **options)
        rng = random.Random(derive_seed(self.seed, f"engine/{name}/{node.incarnation}"))
        factory = node.engine_factory or Engine
        node.engine = factory(config, node.identity, rng, stored=node.disk.refs(), records=node.disk.records())
        assert node.host is not None
        node.driver = Driver(node.engine, node.host, node.host)
        node.up, node.armed = True, None
        node.compute_free_at = self.now
        for key in [k for k in self.bans if k[0] == name]:
            del self.bans[key]
        self._push(self.now, name, node.incarnation, ev.Start(now=self.now))
        for other in sorted(self.adjacent[name]):
            self._connect(name, other)

    # --- scheduling --------------------------------------------------------------------------------

    def _push(self, t: float, name: str, incarnation: int, item: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, name, incarnation, item))

    def at(self, t: float, action: Callable[[], None]) -> None:
        """Run `action()` (a fault, a join...) at virtual time `t` (not before now)."""
        self._push(max(t, self.now), "", 0, action)

    def record(self, node: str, kind: str, **fields: Any) -> None:
        if self.trace is not None:
            self.trace.emit(self.now, node, kind, fields)

    def run(self, *, until: float, stop: Callable[[Simulation], bool] | None = None) -> bool:
        """Process events in order until virtual time `until`, `stop(self)` or an observer stops the run.
        Returns True iff `stop` became true."""
        while self._heap and not self.stopped:
            if stop is not None and stop(self):
                return True
            t, _seq, name, incarnation, item = self._heap[0]
            if t > until:
                break
            heapq.heappop(self._heap)
            self.now = t
            self.events += 1
            if not name:
                item()
            else:
                self._deliver(name, incarnation, item)
            for obs in self.observers:
                obs.on_tick(self)
        if not self.stopped and (not self._heap or self._heap[0][0] > until):
            self.now = max(self.now, until)
            for obs in self.observers:
                obs.on_tick(self)
        return stop is not None and stop(self)

    def _deliver(self, name: str, incarnation: int, event: Any) -> None:
        node = self.nodes[name]
        if node.engine is None or not node.up or incarnation != node.incarnation:
            return
        if isinstance(event, _Done):  # a primitive's work completed: the driver feeds the engine what it means
            if event.token is not None and not node.disk.sync(event.token):
                return  # a record lost in a crash is never `Persisted`
            event.done()
            self._handled(node)
            return
        if isinstance(event, tuple):  # ("msg", src, epoch, data)
            _, src, epoch, data = event
            link = _key(src, name)
            if link not in self.connected or self.epoch.get(link) != epoch:
                return  # the connection it travelled on is gone
            event = ev.MessageReceived(now=self.now, peer=self.nodes[src].peer_id, data=data)
        elif isinstance(event, ev.TimerDue):
            node.armed = None
        self.feed(name, event)

    def feed(self, name: str, event: ev.Event) -> None:
        """Feed node `name`'s driver one event now (it executes the effects and re-arms the node's timer)."""
        node = self.nodes[name]
        assert node.driver is not None
        node.driver.handle(event)
        self._handled(node)

    def _handled(self, node: SimNode) -> None:
        if node.role == "trainer":
            self._note_announcement(node)

    def _arm(self, node: SimNode, deadline: float | None) -> None:
        """The node's one timer (`Host.arm_timer`): a `TimerDue` on the heap at `deadline`, unless one is there."""
        if deadline is not None and deadline != node.armed:
            node.armed = deadline
            t = max(deadline, self.now)
            self._push(t, node.name, node.incarnation, ev.TimerDue(now=t))

    def _hang_up(self, name: str, other: str, reason: str) -> None:
        self.record(name, "hangup", peer=other, reason=reason)
        self._disconnect(name, other, delay=0.0)
        if self.redial_s is not None:
            self.at(self.now + self.redial_s, partial(self._connect, name, other))

    def _ban(self, name: str, other: str, until: float) -> None:
        """`name` refuses `other` until `until` (a `Ban` effect): `_connect` defers their link to then."""
        self.bans[(name, other)] = until
        self.record(name, "ban", peer=other, until=until)

    def _note_announcement(self, node: SimNode) -> None:
        """Register a trainer's signed announcement once (invariant checkers look cohort ids up here)."""
        engine = node.engine
        assert engine is not None
        for role in engine.roles:
            # the announcements it made durable for windows not yet closed (with overlap, some ahead)
            for envelope in getattr(role, "published", {}).values():
                self.register_update(envelope)

    def register_update(self, envelope: Any) -> None:
        if envelope.id not in self.updates:
            ann = UpdateAnnouncement.from_cbor(envelope.open(UpdateAnnouncement.KIND, PROTOCOL_VERSION))
            self.updates[envelope.id] = (envelope.signer, ann)

    def _run_task(self, node: SimNode, effect: fx.RunTask, done: Callable[[TaskOutcome], None]) -> None:
        task, kind = effect.task, effect.kind
        self.task_counts[kind] += 1
        rng = self.rngs["compute"]
        duration = self.task_s[kind] * node.speed
        if self.compute_jitter:
            duration *= 1.0 + self.compute_jitter * (2.0 * rng.random() - 1.0)
        start = max(self.now, node.compute_free_at)
        finish = start + duration
        node.compute_free_at = finish
        outcome: TaskOutcome
        try:
            result = node.executor.run(task)
            if isinstance(task, TrainTask) and isinstance(result, TrainResult) and node.honest \
                    and self.keep_honest_deltas:
                window = -1 if task.window is None else task.window
                self.honest_deltas.setdefault(window, []).append((node.name, result.delta))
            outcome = node.behaviour.on_task(self, node, task, result)
        except Exception as exc:  # a failing task is an event for the engine, not a crash of the simulator
            outcome = exc
        self._push(finish, node.name, node.incarnation, _Done(lambda: done(outcome)))

    def _on_head(self, node: SimNode, head: Head, cert: QuorumCertificate) -> None:
        # The certificate names the head id (checkers verify that it matches; hashing a head with a
        # 10,000-entry roster for every node would dominate the run).
        node.heads.append((self.now, head.window, cert.head))
        self.record(node.name, "head", window=head.window, id=cert.head.hex(), skipped=head.skipped,
                    cohort=len(head.cohort), metrics=dict(head.metrics), round=cert.round)
        for obs in self.observers:
            obs.on_head(self, node, head, cert)
        node.behaviour.on_head(self, node, head)

    def send(self, src: str, dst: str, data: bytes) -> None:
        """Put one message from `src` on the wire to `dst` (after the sender's behaviour hook)."""
        link = _key(src, dst)
        if link not in self.connected:
            return
        node = self.nodes[src]
        outgoing = [(0.0, data)] if node.behaviour is HONEST else node.behaviour.on_send(self, node, dst, data)
        epoch = self.epoch[link]
        target = self.nodes[dst]
        for extra, payload in outgoing:
            if node.role == "validator" and payload is not self._last_vote_data:
                self._last_vote_data = payload  # a broadcast sends one bytes object to every peer: look once
                for obs in self.observers:
                    obs.on_validator_message(self, node, payload)
            # The memory transport carries the message (and counts bytes per peer); the network model
            # then decides when, whether and how often it arrives.
            if not self.transport.send(node.peer_id, target.peer_id, payload):
                continue
            self.transport.pop()
            for t in self.network.plan(src, dst, len(payload), self.now + extra):
                self._push(t, dst, target.incarnation, ("msg", src, epoch, payload))

    # --- connections -------------------------------------------------------------------------------

    def _connect(self, a: str, b: str) -> None:
        link = _key(a, b)
        na, nb = self.nodes[a], self.nodes[b]
        if link in self.connected or link in self.cut or not (na.up and nb.up) or b not in self.adjacent[a]:
            return
        banned_until = max(self.bans.get((a, b), 0.0), self.bans.get((b, a), 0.0))
        if banned_until > self.now:  # one end refuses the other: dial again when the ban ends
            self.at(banned_until, lambda: self._connect(a, b))
            return
        self.connected.add(link)
        self.transport.connect(na.peer_id, nb.peer_id)
        self.epoch[link] = self.epoch.get(link, 0) + 1
        t = max(self.now, self.down_at.get(link, self.now))  # never before the old connection's drop
        self._push(t, a, na.incarnation, ev.PeerConnected(now=t, peer=nb.peer_id))
        self._push(t, b, nb.incarnation, ev.PeerConnected(now=t, peer=na.peer_id))

    def _disconnect(self, a: str, b: str, *, delay: float | None = None) -> None:
        link = _key(a, b)
        if link not in self.connected:
            return
        self.connected.discard(link)
        self.transport.disconnect(self.nodes[a].peer_id, self.nodes[b].peer_id)
        self.epoch[link] += 1
        t = self.now + (self.detect_s if delay is None else delay)
        self.down_at[link] = t
        for x, y in ((a, b), (b, a)):
            nx = self.nodes[x]
            if nx.up:
                self._push(t, x, nx.incarnation, ev.PeerDisconnected(now=t, peer=self.nodes[y].peer_id))

    def links_of(self, name: str) -> list[str]:
        return sorted(self.adjacent[name])

    # --- faults ------------------------------------------------------------------------------------

    def crash(self, name: str, *, keep_disk: bool = True) -> None:
        """Kill a node now. Un-synced records are lost (if the disk model says so); without its disk
        it restarts from nothing."""
        node = self.nodes[name]
        if not node.up:
            return
        for other in self.links_of(name):
            self._disconnect(name, other)
        lost = node.disk.crash(lose_unsynced=self.lose_unsynced)
        if not keep_disk:
            node.disk.wipe()
        node.up, node.engine = False, None
        node.incarnation += 1
        self.record(name, "crash", keep_disk=keep_disk, lost_records=lost)

    def restart(self, name: str) -> None:
        node = self.nodes[name]
        if node.up or node.left:
            return
        self.record(name, "restart")
        self.boot(name)

    def leave(self, name: str, *, signed: bool = True, linger_s: float = 2.0) -> None:
        """Leave for good. A trainer with `signed` first asks its engine to leave (a signed leave to the
        validators, spec/protocol.md §5) and disconnects `linger_s` seconds later, so the next head drops
        it through `left`; otherwise (or for other roles) it disconnects at once and stays down."""
        node = self.nodes[name]
        if not node.up:
            return
        if signed and "trainer" in node.roles and node.engine is not None and linger_s > 0:
            self.feed(name, ev.LeaveRequested(now=self.now))
            self.record(name, "leave-requested")
            self.at(self.now + linger_s, lambda: self._disconnect_for_good(name))
            return
        self._disconnect_for_good(name)

    def _disconnect_for_good(self, name: str) -> None:
        node = self.nodes[name]
        if not node.up:
            return
        for other in self.links_of(name):
            self._disconnect(name, other, delay=0.0)
        node.up, node.engine, node.left = False, None, True
        node.incarnation += 1
        self.record(name, "leave")

    def partition(self, groups: list[list[str]]) -> None:
        """Symmetric partition: links between nodes of different groups go down (unlisted nodes reach
        everyone)."""
        group_of = {n: i for i, g in enumerate(groups) for n in g}
        for a in sorted(group_of):
            for b in self.links_of(a):
                if b in group_of and group_of[a] != group_of[b]:
                    link = _key(a, b)
                    self.cut.add(link)
                    self.network.block(a, b)
                    self.network.block(b, a)
                    self._disconnect(a, b)
        self.record("", "partition", groups=[sorted(g) for g in groups])

    def block(self, sources: list[str], targets: list[str]) -> None:
        """Asymmetric partition: messages from `sources` to `targets` are silently lost (links stay up)."""
        for a in sources:
            for b in targets:
                if a != b:
                    self.network.block(a, b)
        self.record("", "block", sources=sorted(sources), targets=sorted(targets))

    def heal(self) -> None:
        """End every partition: unblock links and reconnect the ones a partition cut."""
        blocked = sorted(self.network.blocked)
        self.network.blocked.clear()
        cut, self.cut = sorted(self.cut), set()
        self.record("", "heal", links=len(cut))
        for a, b in cut:
            self._connect(a, b)
        # Links blocked one way stayed up but lost messages: bounce them so both sides exchange hellos
        # again (what a keep-alive timeout and a re-dial do on a real transport).
        for a, b in blocked:
            if _key(a, b) in self.connected:
                self._disconnect(a, b, delay=0.0)
                self._connect(a, b)

    def clog(self, pairs: list[tuple[str, str]], until: float) -> None:
        """Hold every message on these directed links until `until` (then deliver, in order)."""
        for a, b in pairs:
            self.network.clog(a, b, until)
        self.record("", "clog", links=len(pairs), until=until)

    def swizzle(self, names: list[str], start: float, duration: float) -> None:
        """FoundationDB swizzle-clogging: clog a random half of the links among `names` now, then unclog
        them one by one in a different random order over `duration` seconds."""
        rng = self.rngs["churn"]
        links = sorted({_key(a, b) for a in names for b in self.adjacent[a] if b in names})
        chosen = rng.sample(links, len(links) // 2)
        order = list(chosen)
        rng.shuffle(order)
        step = duration / max(1, len(order))
        for i, (a, b) in enumerate(order):
            until = start + step * (i + 1)
            self.network.clog(a, b, until)
            self.network.clog(b, a, until)
        self.record("", "swizzle", links=len(chosen), duration=duration)

    # --- views -------------------------------------------------------------------------------------

    def leases(self, head: Head, window: int | None = None) -> dict[PeerId, tuple[int, ...]]:
        """The leases of `window` (default `head.window + 1`) drawn from `head`, its lease head (core caches
        them per head; do not mutate)."""
        return leases_of(head, self.manifest, window)

    def honest_delta_bytes(self, entry: tuple[str, Any]) -> bytes:
        name, ref = entry
        return self.nodes[name].disk.get(ref.digest)

    def height(self, name: str) -> int:
        node = self.nodes[name]
        return node.engine.head.window if node.engine is not None else (node.heads[-1][1] if node.heads else 0)


@attrs.frozen
class _Done:
    """A heap item: the completion of a node's primitive (`done` feeds the engine through its driver); a record
    write's `token` must first sync on the node's `SimDisk`."""

    done: Callable[[], None]
    token: int | None = None


class _NodeHost(Observer):
    """One node's I/O primitives on the virtual clock (the driver's `Host`, spec/simulator.md §2), and its
    `Observer`. Every effect is carried out; the one refusal is `submit_reply` (see there)."""

    __slots__ = ("node", "sim", "writes")

    def __init__(self, sim: Simulation, node: SimNode) -> None:
        self.sim = sim
        self.node = node
        self.writes = itertools.count(1)  # ids of pending record writes on the SimDisk

    def clock(self) -> float:
        return self.sim.now

    def arm_timer(self, deadline: float | None) -> None:
        self.sim._arm(self.node, deadline)

    def send(self, peer: PeerId, data: bytes) -> None:
        self.sim.send(self.node.name, self.sim.by_peer[peer].name, data)

    def write_record(self, record: Record, done: Callable[[], None]) -> None:
        """Pending on the `SimDisk`; done `persist_s` later, once synced (a crash loses it)."""
        node, token = self.node, next(self.writes)
        node.disk.write_pending(token, record.key, record.data)
        self.sim._push(self.sim.now + self.sim.persist_s, node.name, node.incarnation, _Done(done, token))

    def read_chunk(self, ref: ArtifactRef, index: int) -> bytes:
        return self.node.disk.read_chunk(ref, index)

    def write_chunk(self, ref: ArtifactRef, index: int, data: bytes | memoryview) -> None:
        self.node.disk.write_chunk(ref, index, data)

    def commit_artifact(self, ref: ArtifactRef, durable: bool, done: Callable[[bool], None]) -> None:
        node, ok = self.node, commit(self.node.disk, ref, durable)
        self.sim._push(self.sim.now, node.name, node.incarnation, _Done(lambda: done(ok)))

    def run_task(self, task: fx.RunTask, done: Callable[[TaskOutcome], None]) -> None:
        self.sim._run_task(self.node, task, done)

    def remove_artifacts(self, digests: tuple[bytes, ...]) -> None:
        self.node.disk.remove(digests)

    def hang_up(self, peer: PeerId, reason: str) -> None:
        self.sim._hang_up(self.node.name, self.sim.by_peer[peer].name, reason)

    def ban(self, peer: PeerId, until: float) -> None:
        self.sim._ban(self.node.name, self.sim.by_peer[peer].name, until)

    # --- Observer ------------------------------------------------------------------------------------

    def rejected(self, peer: PeerId | None, reason: str, detail: str) -> None:
        self.sim.rejections[reason] += 1  # the trace has the matching `reject` log line

    def peers_discovered(self, peers: tuple[tuple[PeerId, str], ...]) -> None:
        """Addresses mean nothing on the virtual network: a peer id of a simulated node becomes a link (what
        a dial does), anything else is ignored. (Simulated engines advertise no listen address by default,
        so this happens only where a scenario sets ``listen_address``.)"""
        for peer, _address in peers:
            other = self.sim.by_peer.get(peer)
            if other is not None and other is not self.node:
                self.sim.link(self.node.name, other.name)

    def submit_reply(self, request_id: int, accepted: bool, reason: str) -> None:
        """Refused: the simulator feeds no `Submit` (its trainers all submit over links), so no request waits
        for a verdict; one that comes anyway is written to the trace and otherwise dropped."""
        self.sim.record(self.node.name, "submit-reply-dropped", request_id=request_id)

    def head_promoted(self, head: Head, certificate: QuorumCertificate) -> None:
        self.sim._on_head(self.node, head, certificate)

    def log(self, event: str, fields: dict[str, Any]) -> None:
        trace = self.sim.trace
        if trace is not None and trace.level == "log":
            trace.emit(self.sim.now, self.node.name, "log", {"event": event, **fields})


def _key(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a < b else (b, a)

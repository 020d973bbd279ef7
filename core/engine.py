"""The sans-IO protocol engine (spec/design.md §2, spec/protocol.md).

Call order, documented once: feed every input with `handle(event)`, then drain `next_effect()` until it
returns None and execute each effect in order; re-arm one timer at `next_deadline()` and call
`handle(TimerDue(now))` when it passes (a spurious call is a no-op). The first event must be `Start`.
`now` is seconds on the host's monotonic clock and never decreases.

The engine does no I/O, reads no clock and draws randomness only from the injected `random.Random`.
Peer misbehaviour never raises out of `handle`: it becomes a `Rejected` effect (also counted by reason), a
penalty, and at `penalty_limit` a `Ban` and a `HangUp`. Caller misuse raises LocalProtocolError.

Role behaviour lives in one module per state machine: `trainer`, `validator`, `reducer` (the latter two
share `collector`), each following the `roles.Role` protocol. This module holds what they share: peers,
timers, persist-then-send, artifact fetching with verify-on-arrival, compute tasks, adoption of certified
heads, and chain sync: every node archives every certified head, and one that learns of a head more than a
window ahead of its own fetches and verifies the windows in between before it adopts it (spec/protocol.md
§8), so its archive runs from window 1 to its head with no hole, also after a crash.

Work in flight (compute tasks, fetches, records being persisted) is held as plain data (core/pending.py):
each is an attrs frozen record of its owner (a role, or the engine: `Archive`, `Promote`) handed back to
the owner's `resume` with the outcome; `pending()` shows it by value.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from . import effects as fx
from . import events as ev
from .chain import decode_chain_entry, encode_chain_entry
from .collector import REPLAY_WINDOWS, FetchDelta
from .config import SERVE_MIN_COST_BYTES as SERVE_MIN_COST_BYTES
from .config import EngineConfig as EngineConfig
from .encoding import decode, encode
from .errors import DecodeError, LocalProtocolError, VerificationError
from .identity import Identity, PeerId
from .leases import lease_window, leases_of
from .messages import (
    MAX_CHAIN_ENTRIES,
    MAX_PEER_ENTRIES,
    ROLES,
    CertifiedHead,
    ChainEntries,
    ChainRequest,
    Chunk,
    ChunkMissing,
    ChunkRequest,
    Hello,
    Message,
    NextHead,
    PeerExchange,
    Signed,
    UpdatesRequest,
    decode_message,
    encode_message,
)
from .objects import MAX_OVERLAP, ArtifactRef, Head, QuorumCertificate, UpdateAnnouncement
from .pending import Done, Failed, Outcome, Pending, PendingState
from .reducer import ReducerRole
from .roles import Role
from .trainer import TrainerRole
from .validator import ValidatorRole

HEAD_RECORD = "head"
SERVER_ROLES = frozenset({"validator", "reducer"})
MAX_SERVED_PEERS = 4096  # peers whose bytes served in this window are tracked at once (spec/protocol.md §8.2)
CHAIN_BACKOFF_MAX_DOUBLINGS = 6  # a peer that never answers is asked again at most every 2^6 chain-get timeouts
CHAIN_SILENT_LIMIT = 2  # chain-gets in a row a peer leaves unanswered before it is hung up on (§8)
MAX_CHAIN_SILENT = 1024  # peers hung up on for silence whose back-off outlives a reconnect (oldest forgotten)
MAX_PROOFS = 256  # hello certificates verified lately, not verified again (oldest forgotten)


def chain_key(window: int) -> str:
    """Record key of the archived certified head of `window`."""
    return f"chain/{window}"

SNAPSHOT_VERSION = 1

# Failed fetches whose verified chunks are remembered for a later fetch of the same artifact (oldest
# forgotten first). The chunks themselves sit in the host's partial store until commit or restart.
MAX_PARTIAL_FETCHES = 64


@attrs.define
class PeerState:
    """What the engine knows of one connected peer. Quotas are per authenticated peer, never global."""

    roles: tuple[str, ...] = ()
    greeted: bool = False
    penalty: int = 0
    chunk_tokens: float = 0.0
    tokens_at: float = 0.0
    listen: str | None = None  # the listen address its Hello gave
    exchange_at: float = float("-inf")  # when it last sent a PeerExchange
    exchange_sent_at: float = float("-inf")  # when we last sent it one
    head_window: int = -1  # the highest window it told us it holds (its Hello, heads it sent)
    chain_lacks: int | None = None  # a window it could not serve us (asked again once its head moves)
    chain_asked_at: float = float("-inf")  # when we last sent it a chain-get
    chain_served: int = 0  # chain entries it sent us that verified (such peers are asked first)
    chain_timeouts: int = 0  # chain-gets in a row it left unanswered past their deadline
    chain_backoff_until: float = float("-inf")  # not asked for chain entries again before this time
    head_proven: int = 0  # the highest window whose quorum certificate it sent us and we verified


@attrs.frozen(kw_only=True)
class Archive:
    """The certified head of `window` is being archived (`chain/<window>`): nothing waits on it."""

    window: int


@attrs.frozen(kw_only=True)
class Promote:
    """`head`, certified by `certificate`, becomes canonical once its head record is durable."""

    head: Head
    certificate: QuorumCertificate


@attrs.define
class _Fetch:
    ref: ArtifactRef
    providers: list[PeerId]
    waiters: list[Pending]  # resumed with Done() once stored, or Failed(reason)
    in_flight: dict[int, PeerId] = attrs.Factory(dict)
    done: set[int] = attrs.Factory(set)
    failures: int = 0
    committing: bool = False
    started: float = 0.0  # engine time the fetch began (the "artifact-fetched" log's seconds)
    durable: bool = True  # `CommitArtifact.durable`: False only while every waiter fetches an update's delta


class Engine:
    """One node's protocol state machine. See the module docstring for the call order."""

    def __init__(self, config: EngineConfig, identity: Identity, rng: random.Random, *,
                 stored: Iterable[ArtifactRef] = (), records: Mapping[str, bytes] | None = None) -> None:
        self.config = config
        self.identity = identity
        self.me = identity.peer_id
        self.revision = config.revision
        self.manifest = config.revision.manifest
        self.rng = rng
        self.now = float("-inf")
        self.started = False
        self.stats: Counter[str] = Counter()
        self.rejected_by_reason: Counter[str] = Counter()
        # While a `Submit` is judged: (its signer, the reasons it was rejected for), else None.
        self._verdict: tuple[PeerId, list[str]] | None = None
        self.peers: dict[PeerId, PeerState] = {}
        # greeted peers that told us where they listen (peer exchange draws from these, not from all peers)
        self._listening: dict[PeerId, str] = {}
        self._effects: deque[fx.Effect] = deque()
        self._timers: list[tuple[float, int, tuple[Any, ...]]] = []
        self._timer_deadline: dict[tuple[Any, ...], float] = {}
        self._seq = 0
        self._held: dict[int, tuple[str, Pending]] = {}  # persist token -> (record key, what then)
        self._stored: dict[bytes, ArtifactRef] = {r.digest: r for r in stored}
        self._stored_at: dict[bytes, int] = {}  # digest -> head window when first held (retention)
        # The per-window serving budget (spec/protocol.md §8.2): peer -> {artifact digest: bytes served} while
        # the head is `_served_window`; cleared when the head moves. Kept across reconnects within a window.
        self._served: dict[PeerId, dict[bytes, int]] = {}
        self._served_window = -1
        self._validator_ids = frozenset(config.revision.manifest.validators)
        m = config.revision.manifest
        self._max_served_artifacts = 4 + 2 * len(m.shards) + len(m.validators)
        self._fetches: dict[bytes, _Fetch] = {}
        # digest -> (ref, verified chunk indices) of a failed fetch; in memory only, like the host's partial
        # chunks, which a restart also drops.
        self._partial: dict[bytes, tuple[ArtifactRef, set[int]]] = {}
        # digest -> {chunk index: provider} still asked for when a fetch ended because the artifact was
        # computed here (`note_stored`): those answers are dropped without charging anyone (oldest forgotten).
        self._superseded: dict[bytes, dict[int, PeerId]] = {}
        self._tasks: dict[str, Pending] = {}  # task id -> what its owner does with the result
        self.seen_deltas: dict[bytes, int] = {}  # accepted delta digest -> window (replay screening)
        # update id -> (author, announcement) of what this node's collectors took in the last windows: an
        # overlapped update names its author's previous one as its `prior` (spec/protocol.md §5.2)
        self.recent_updates: dict[bytes, tuple[PeerId, UpdateAnnouncement]] = {}
        records = dict(records or {})
        self.records = records
        # chain sync (spec/protocol.md §8): chain-gets out, peer -> (first, last); at most `chain_parallel`
        # are live (not timed out) at a time, and a late reply to one that timed out is still taken.
        self._chain_requests: dict[PeerId, tuple[int, int]] = {}
        # A verified certified head more than one window ahead, its sender: adopted once the windows between
        # are archived. `_sync_claim`: the highest window an unlinkable next-head announced.
        self._sync_target: tuple[Head, QuorumCertificate, PeerId] | None = None
        self._sync_claim = 0
        self._chain_live: dict[PeerId, float] = {}  # the live chain-gets: peer -> deadline
        self._chain_source: PeerId | None = None  # who sent the last segment that verified
        # peers hung up on after `CHAIN_SILENT_LIMIT` unanswered chain-gets: peer -> (unanswered, back-off end),
        # restored when they reconnect, so a reconnect does not buy a liar a fresh turn
        self._chain_silent: dict[PeerId, tuple[int, float]] = {}
        self._proofs: dict[bytes, None] = {}  # encodings of hello certificates that verified (`_check_proof`)
        self._contiguous = 0  # windows 1.._contiguous are all held (archive, or the current head)
        self._adopting = 0  # the highest window handed to `adopt` (promoted once its record is durable)
        self.head, self.certificate = self.revision.genesis(), QuorumCertificate(
            head=self.revision.genesis().id, window=0, round=0, votes=())
        if HEAD_RECORD in records:
            head, cert = decode_chain_entry(records[HEAD_RECORD])
            self.verify_certified(head, cert)
            self.head, self.certificate = head, cert
        # The last heads promoted, by window: an overlapped window's leases and bases are older heads
        # (spec/protocol.md §5.2), which a node without its chain archive (`keep_chain` off) holds only here.
        self._recent: dict[int, Head] = {self.head.window: self.head}
        self.roles: list[Role] = []
        # The validator serves announcements by id and holds snapshotted joins; the trainer leaves and joins.
        self._validator: ValidatorRole | None = None
        self._trainer: TrainerRole | None = None
        # role name -> the role, which resumes the pending work it owns (`pending.Pending`)
        self._owners: dict[str, Role] = {}
        if "validator" in config.roles:
            self._validator = ValidatorRole(self)
            self._owners["validator"] = self._validator
        if "reducer" in config.roles:
            self._owners["reducer"] = ReducerRole(self)
        if "trainer" in config.roles:
            self._trainer = TrainerRole(self)
            self._owners["trainer"] = self._trainer
        self.roles.extend(self._owners.values())

    # --- public API ------------------------------------------------------------------------------

    def handle(self, event: ev.Event) -> None:
        """Consume one event. Raises LocalProtocolError on misuse (time going backwards, no Start)."""
        if event.now < self.now:
            raise LocalProtocolError(f"time went backwards: {event.now} < {self.now}")
        self.now = event.now
        if isinstance(event, ev.Start):
            if self.started:
                raise LocalProtocolError("Start twice")
            self.started = True
            self.log("start", roles=sorted(self.config.roles), head_window=self.head.window)
            if self.config.peer_exchange_every_s > 0:
                self.set_timer(("peer-exchange",), self.now + self.config.peer_exchange_every_s)
            self._open_next_window()
            return
        if not self.started:
            raise LocalProtocolError(f"{type(event).__name__} before Start")
        match event:
            case ev.MessageReceived():
                self._on_message(event.peer, event.data)
            case ev.TimerDue():
                self._fire_timers()
            case ev.PeerConnected():
                state = self.peers[event.peer] = PeerState(chunk_tokens=float(self.config.serve_bytes_burst),
                                                           tokens_at=self.now)
                if event.peer in self._chain_silent:
                    state.chain_timeouts, state.chain_backoff_until = self._chain_silent[event.peer]
                self._listening.pop(event.peer, None)
                self.send(event.peer, Hello(revision=self.revision.id, roles=tuple(sorted(self.config.roles)),
                                            head_window=self.head.window, listen=self.config.listen_address,
                                            certificate=self.certificate if self.head.window > 0 else None))
            case ev.PeerDisconnected():
                self._drop_peer(event.peer)
            case ev.Submit():
                self._on_submit(event)
            case ev.TaskFinished():
                task = self._tasks.pop(event.task_id, None)
                if task is None:
                    raise LocalProtocolError(f"unknown task {event.task_id}")
                self._resume(task, Done(result=event.result))
            case ev.TaskFailed():
                task = self._tasks.pop(event.task_id, None)
                if task is None:
                    raise LocalProtocolError(f"unknown task {event.task_id}")
                self.log("task-failed", task=event.task_id, reason=event.reason)
                self._resume(task, Failed(reason=event.reason))
            case ev.ArtifactStored():
                self._on_artifact_stored(event.ref)
            case ev.ArtifactCorrupt():
                self._on_artifact_corrupt(event.ref)
            case ev.Persisted():
                held = self._held.pop(event.token, None)
                if held is None:
                    raise LocalProtocolError(f"unknown persist token {event.token}")
                self._resume(held[1], Done())
            case ev.LeaveRequested() | ev.JoinRequested():
                if self._trainer is None:
                    raise LocalProtocolError("only a trainer can leave or join the roster")
                self._trainer.set_membership(isinstance(event, ev.JoinRequested))
            case _:
                raise LocalProtocolError(f"unknown event {event!r}")

    def _resume(self, pending: Pending, outcome: Outcome) -> None:
        """Hand finished work back to its owner (`pending.Pending`)."""
        if pending.owner == "engine":
            self._resume_own(pending.work, outcome)
        else:
            self._owners[pending.owner].resume(pending.work, outcome)

    def _resume_own(self, work: Any, outcome: Outcome) -> None:
        match work:
            case Archive():
                pass  # an archived certified head: nothing waits on it
            case Promote(head=head, certificate=cert):
                self._promote(head, cert)
            case _:
                raise LocalProtocolError(f"no engine work {work!r}")

    def pending(self) -> PendingState:
        """The work in flight (compute tasks, fetches, records not yet durable) as plain data, comparable by
        value. It is not part of `snapshot()`: a restored engine starts with none."""
        return PendingState(tasks=tuple(self._tasks.values()),
                            fetches=tuple((f.ref, tuple(f.waiters)) for f in self._fetches.values()),
                            writes=tuple(self._held.values()))

    def _drop_peer(self, peer: PeerId) -> None:
        self.peers.pop(peer, None)
        self._listening.pop(peer, None)
        self._chain_requests.pop(peer, None)
        if self._chain_live.pop(peer, None) is not None:
            self._sync()  # ask someone else
        for fetch in list(self._fetches.values()):
            if peer in fetch.providers:
                fetch.providers.remove(peer)
                self._requeue(fetch, peer)

    def _on_submit(self, event: ev.Submit) -> None:
        """Judge an envelope the host received outside a connection as a `Signed` message from its signer
        (same decoding, checks, quotas and charges), then answer with `SubmitReply`. A signer that is not
        connected is, for this envelope only, a greeted trainer peer: roles see it become ready, then leave."""
        if event.stored is not None:
            self.note_stored(event.stored)
        signer = event.envelope.signer
        virtual = signer not in self.peers
        if virtual:
            self.peers[signer] = PeerState(roles=("trainer",), greeted=True, head_window=self.head.window,
                                           chunk_tokens=float(self.config.serve_bytes_burst), tokens_at=self.now)
            for role in self.roles:
                role.on_peer_ready(signer, ("trainer",))
        self._verdict = (signer, [])
        try:
            self._on_message(signer, encode_message(Signed(envelope=event.envelope)))
            reasons = self._verdict[1]
        finally:
            self._verdict = None
        if virtual:
            self._drop_peer(signer)
        self.emit(fx.SubmitReply(request_id=event.request_id, accepted=not reasons,
                                 reason=reasons[0] if reasons else ""))

    def next_effect(self) -> fx.Effect | None:
        """The next effect to execute, or None when there is nothing more to do for now."""
        return self._effects.popleft() if self._effects else None

    def next_deadline(self) -> float | None:
        """Earliest pending timer (host clock seconds), or None."""
        while self._timers and self._timer_deadline.get(self._timers[0][2]) != self._timers[0][0]:
            heapq.heappop(self._timers)  # cancelled or re-armed
        return self._timers[0][0] if self._timers else None

    def is_stored(self, digest: bytes) -> bool:
        return digest in self._stored

    def snapshot(self) -> bytes:
        """The engine's durable state as canonical CBOR (spec/design.md §2): its records (certified head, votes,
        locks, proposals, claims), the artifacts it holds, counters, replay digests, and the validator's
        joins (and admissions) and undelivered equivocation evidence.

        In-flight work (fetches, compute tasks, held sends, connections) is not part of it: a restored
        engine is a node restarted from this state, which re-fetches and recomputes what it needs.
        """
        state: dict[str, Any] = {
            "version": SNAPSHOT_VERSION, "revision": self.revision.id,
            "now": self.now if self.now != float("-inf") else None,
            "records": dict(sorted(self.records.items())),
            "stored": [r.to_cbor() for _, r in sorted(self._stored.items())],
            "stats": dict(sorted(self.stats.items())), "rejected": dict(sorted(self.rejected_by_reason.items())),
            "seen_deltas": sorted([d, w] for d, w in self.seen_deltas.items()),
            "joins": [], "admitted": [], "leaves": [], "evidence": [], "heard": [], "first_window": None,
        }
        if self._validator is not None:
            # Who was heard when (heartbeats, updates, joins) too: idle expiry picks up where it left off.
            state.update(self._validator.durable_state())
        return encode(state)

    @classmethod
    def restore(cls, data: bytes, config: EngineConfig, identity: Identity, rng: random.Random) -> Engine:
        """Rebuild an engine from `snapshot()` bytes; feed it `Start` (with `now` not before the snapshot's)
        as after a restart. Raises DecodeError/VerificationError for bytes that are not a snapshot of this
        revision, LocalProtocolError for a snapshot of another revision."""
        state = decode(data, max_bytes=1 << 30)
        keys = {"version", "revision", "now", "records", "stored", "stats", "rejected", "seen_deltas", "joins",
                "admitted", "leaves", "evidence", "heard", "first_window"}
        if not isinstance(state, dict) or set(state) != keys or state["version"] != SNAPSHOT_VERSION:
            raise DecodeError("bad-snapshot", "not an engine snapshot")
        if state["revision"] != config.revision.id:
            raise LocalProtocolError("snapshot of another revision")
        engine = cls(config, identity, rng, stored=[ArtifactRef.from_cbor(r) for r in state["stored"]],
                     records=state["records"])
        if state["now"] is not None:
            engine.now = float(state["now"])
        engine.stats.update(state["stats"])
        engine.rejected_by_reason.update(state["rejected"])
        engine.seen_deltas = {d: w for d, w in state["seen_deltas"]}
        if engine._validator is not None:
            engine._validator.restore_durable_state(state)
        return engine

    # --- services for the role state machines ----------------------------------------------------

    def emit(self, effect: fx.Effect) -> None:
        self._effects.append(effect)

    def log(self, event: str, **fields: Any) -> None:
        self.emit(fx.Log(event=event, fields=fields))

    def send(self, peer: PeerId, message: Message) -> None:
        self.emit(fx.Send(peer=peer, data=encode_message(message)))

    def broadcast(self, message: Message, roles: Iterable[str] = ROLES) -> None:
        """Send to every greeted peer holding any of `roles` (encoded once)."""
        wanted = set(roles)
        data = encode_message(message)
        for peer, state in self.peers.items():
            if state.greeted and wanted.intersection(state.roles):
                self.emit(fx.Send(peer=peer, data=data))

    def peers_with(self, role: str) -> list[PeerId]:
        return sorted(p for p, s in self.peers.items() if s.greeted and role in s.roles)

    def set_timer(self, key: tuple[Any, ...], deadline: float) -> None:
        self._timer_deadline[key] = deadline
        self._seq += 1
        heapq.heappush(self._timers, (deadline, self._seq, key))

    def cancel_timer(self, key: tuple[Any, ...]) -> None:
        self._timer_deadline.pop(key, None)

    def persist_then(self, key: str, record: bytes, owner: str, work: Any) -> None:
        """Durable before visible: emit Persist; only after Persisted does `owner` (a `pending.OWNERS` name)
        resume `work`, its attrs frozen record (which may send), with `Done()`."""
        self._seq += 1
        self._held[self._seq] = (key, Pending(owner=owner, work=work))
        self.records[key] = record
        self.emit(fx.Persist(token=self._seq, key=key, record=record))

    def run_task(self, kind: str, args: dict[str, Any], owner: str, work: Any) -> str:
        """Emit `RunTask(kind, args)` and return its task id. When it ends, `owner` (a `pending.OWNERS`
        name) resumes `work`, its attrs frozen record, with `Done(result)` or `Failed(reason)`."""
        self._seq += 1
        task_id = f"{kind}-{self._seq}"
        self._tasks[task_id] = Pending(owner=owner, work=work)
        self.emit(fx.RunTask(task_id=task_id, kind=kind, args=args))
        return task_id

    def note_stored(self, ref: ArtifactRef) -> None:
        """Record an artifact the host stored on its own (a compute task's output). A fetch of the same
        artifact under way (a reducer adopting the head whose params and optimizer state it is computing
        itself) is done at once; the chunks it still has asked for are dropped quietly when they come."""
        fetch = self._fetches.get(ref.digest)
        if fetch is not None and fetch.ref == ref and not fetch.committing:
            if fetch.in_flight:
                self._supersede(ref.digest, fetch.in_flight)
            self._on_artifact_stored(ref)
            return
        self._stored[ref.digest] = ref
        self._stored_at.setdefault(ref.digest, self.head.window)
        self._partial.pop(ref.digest, None)

    def _supersede(self, digest: bytes, requests: Mapping[int, PeerId]) -> None:
        """Chunk requests (index -> provider) whose answers are no longer wanted: dropped without a charge
        when they come (the oldest artifacts' are forgotten first)."""
        self._superseded.setdefault(digest, {}).update(requests)
        if len(self._superseded) > MAX_PARTIAL_FETCHES:
            del self._superseded[next(iter(self._superseded))]

    def fetch(self, ref: ArtifactRef, providers: Iterable[PeerId], owner: str, work: Any) -> None:
        """Make `ref` stored locally, fetching verified chunks from `providers`; then `owner` (a
        `pending.OWNERS` name) resumes `work`, its attrs frozen record, with `Done()` - at once when the
        artifact is already stored - or `Failed(reason)`, reason "no-provider", "too-many-failures",
        "ref-mismatch" or "corrupt-artifact".

        A fetch of an artifact whose earlier fetch failed resumes from the chunks that one verified and
        stored (same `ref` only).
        """
        waiter = Pending(owner=owner, work=work)
        if ref.digest in self._stored:
            self._resume(waiter, Done())
            return
        live = [p for p in dict.fromkeys(providers) if p in self.peers and p != self.me]
        # An update's delta can be fetched again from its author, and nothing this node signs or persists
        # needs it across a crash: its commit need not be durable (`CommitArtifact.durable`).
        durable = not isinstance(work, FetchDelta)
        fetch = self._fetches.get(ref.digest)
        if fetch is not None:
            if fetch.ref != ref:
                self._resume(waiter, Failed(reason="ref-mismatch"))
                return
            fetch.providers.extend(p for p in live if p not in fetch.providers)
            fetch.waiters.append(waiter)
            fetch.durable = fetch.durable or durable
        else:
            fetch = _Fetch(ref=ref, providers=live, waiters=[waiter], started=self.now, durable=durable)
            partial = self._partial.pop(ref.digest, None)
            # Another ref with the same digest chunks it differently: its record says nothing of ours, and
            # this fetch may overwrite its bytes, so it is dropped either way.
            if partial is not None and partial[0] == ref:
                fetch.done = partial[1]
            self._fetches[ref.digest] = fetch
        self._pump(fetch)

    def reject(self, peer: PeerId | None, reason: str, detail: str = "") -> None:
        """Refuse a peer's input: emit `Rejected` (and a `reject` log line), count it by reason and charge the
        peer that caused it (never a third party) one penalty point. At `penalty_limit` points, emit
        `Ban(peer, now + ban_s)` then `HangUp(peer, "penalty-limit")`."""
        self.rejected_by_reason[reason] += 1
        if self._verdict is not None and peer == self._verdict[0]:
            self._verdict[1].append(reason)
        self.emit(fx.Rejected(peer=peer, reason=reason, detail=detail))
        self.log("reject", peer=str(peer) if peer else None, reason=reason, detail=detail)
        if peer is not None and peer in self.peers:
            state = self.peers[peer]
            state.penalty += 1
            if state.penalty == self.config.penalty_limit:
                self.emit(fx.Ban(peer=peer, until=self.now + self.config.ban_s))
                self.emit(fx.HangUp(peer=peer, reason="penalty-limit"))

    def verify_certified(self, head: Head, cert: QuorumCertificate) -> None:
        """Raise VerificationError unless `cert` makes `head` canonical under this revision.

        Window 0 is the genesis head, certified by the manifest's own signature.
        """
        if head.window == 0:
            if head != self.revision.genesis() or cert.head != head.id or cert.votes:
                raise VerificationError("bad-genesis", "genesis head does not match the manifest")
            return
        cert.verify(self.revision, head)

    def adopt(self, head: Head, cert: QuorumCertificate) -> None:
        """Make a verified certified head canonical: persist it, then announce and start the next window."""
        if head.window <= self.head.window:
            return
        self._adopting = max(self._adopting, head.window)
        record = encode_chain_entry(head, cert)
        if self.config.keeps_chain and chain_key(head.window) not in self.records:
            # the chain archive first: a promoted head is always served, and durable before it is visible
            self.persist_then(chain_key(head.window), record, "engine", Archive(window=head.window))
        self.persist_then(HEAD_RECORD, record, "engine", Promote(head=head, certificate=cert))

    def _promote(self, head: Head, cert: QuorumCertificate) -> None:
        """The head record of `head` is durable: make it canonical, tell peers, open the next window."""
        if head.window <= self.head.window:
            return
        parent = self.head
        self.head, self.certificate = head, cert
        self._recent[head.window] = head
        for window in [w for w in self._recent if w < head.window - MAX_OVERLAP - 1]:
            del self._recent[window]
        self.emit(fx.HeadPromoted(head=head, certificate=cert))
        self._retire_artifacts()
        self.log("head", window=head.window, id=head.id.hex(), skipped=head.skipped,
                 cohort=len(head.cohort), metrics=dict(head.metrics))
        if self.config.roles & SERVER_ROLES:
            # Heads flow from the servers out: a trainer-only node is a leaf and relays none (with N
            # trainers, relaying would send N copies back to every server each window). Peers that
            # hold the parent get the head without its roster (spec/protocol.md §8).
            self.broadcast(NextHead.of(head, parent, cert) if head.parent == parent.id
                           else CertifiedHead(head=head, certificate=cert))
        self._open_next_window()

    # --- internals -------------------------------------------------------------------------------

    def _open_next_window(self) -> None:
        horizon = self.head.window + 1 - REPLAY_WINDOWS
        self.seen_deltas = {d: w for d, w in self.seen_deltas.items() if w >= horizon}
        self.recent_updates = {u: x for u, x in self.recent_updates.items() if x[1].window >= self.head.window}
        stop = self.config.stop_after_window
        if stop is not None and self.head.window >= stop:
            self.log("finished", window=self.head.window)
            return
        for role in self.roles:
            role.on_head(self.head)

    def _on_message(self, peer: PeerId, data: bytes) -> None:
        state = self.peers.get(peer)
        if state is None:
            raise LocalProtocolError(f"message from {peer} which is not connected")
        try:
            memo = self.config.decode_memo
            message = decode_message(data, max_bytes=self.config.max_message_bytes) if memo is None else \
                memo.decode(data, max_bytes=self.config.max_message_bytes)
        except DecodeError as exc:
            self.reject(peer, f"decode-{exc.reason}", exc.detail)
            return
        if not state.greeted and not isinstance(message, Hello):
            self.reject(peer, "no-hello")
            return
        try:
            self._dispatch(peer, state, message)
        except (DecodeError, VerificationError) as exc:
            self.reject(peer, exc.reason, exc.detail)

    def _dispatch(self, peer: PeerId, state: PeerState, message: Message) -> None:
        match message:
            case Hello():
                if message.revision != self.revision.id:
                    self.reject(peer, "wrong-revision")
                    self.emit(fx.HangUp(peer=peer, reason="wrong-revision"))
                    return
                if message.certificate is not None and message.head_window >= self._sync_floor():
                    # evidence for the claimed head: checked only when we might ask this peer for windows
                    self._check_proof(message.certificate)
                    state.head_proven = message.head_window
                state.roles, state.greeted, state.listen = message.roles, True, message.listen
                state.head_window, state.chain_lacks = message.head_window, None
                if message.listen is None:
                    self._listening.pop(peer, None)
                else:
                    self._listening[peer] = message.listen
                if message.head_window < self.head.window:
                    self.send(peer, CertifiedHead(head=self.head, certificate=self.certificate))
                self._send_peer_exchange(peer)
                for role in self.roles:
                    role.on_peer_ready(peer, message.roles)
                self._sync()  # a peer that may hold windows we lack
            case CertifiedHead():
                self._note_peer_head(state, message.head.window)
                if message.head.window <= max(self.head.window, self._adopting):
                    return
                self.verify_certified(message.head, message.certificate)
                state.head_proven = max(state.head_proven, message.head.window)
                if self.config.keeps_chain and message.head.window > max(self.head.window, self._adopting) + 1:
                    # We missed windows (a restart, a partition): fetch and verify them first, then adopt.
                    target = self._sync_target
                    if target is None or message.head.window > target[0].window:
                        self._sync_target = (message.head, message.certificate, peer)
                    self._sync()
                    return
                self.adopt(message.head, message.certificate)
                for role in self.roles:
                    role.on_head_source(peer, message.head)
            case NextHead():
                window = message.fields["window"]
                self._note_peer_head(state, window)
                if window <= max(self.head.window, self._adopting):
                    return
                parent = message.fields["parent"]
                if parent == self.head.id:
                    head = message.head_after(self.head)
                    self.verify_certified(head, message.certificate)
                    state.head_proven = max(state.head_proven, window)
                    self.adopt(head, message.certificate)
                    for role in self.roles:
                        role.on_head_source(peer, head)
                    return
                target = self._sync_target
                if target is not None and parent == target[0].id:
                    # the head after the one we are syncing to becomes the target; that one is archived (it
                    # links to the windows before it when they arrive, `_take_segment`)
                    head = message.head_after(target[0])
                    self.verify_certified(head, message.certificate)
                    state.head_proven = max(state.head_proven, window)
                    if chain_key(target[0].window) not in self.records:
                        self.persist_then(chain_key(target[0].window), encode_chain_entry(target[0], target[1]),
                                          "engine", Archive(window=target[0].window))
                    self._sync_target = (head, message.certificate, peer)
                else:
                    # We missed a head: the chain segment up to this one carries whole heads (and rosters);
                    # its last entry is adopted once every link verifies. Its certificate is checked first
                    # (for this header, in this window, a quorum's votes): sync goes only as far as evidence.
                    cert = message.certificate
                    if cert.head != message.head_id or cert.window != window:
                        raise VerificationError("wrong-head", "certificate is for another head")
                    self._check_proof(cert)
                    state.head_proven = max(state.head_proven, window)
                    self._sync_claim = max(self._sync_claim, window)
                self._sync()
            case ChainRequest():
                if not self._take_chunk_token(state):
                    self.reject(peer, "chain-quota")
                    return
                self._serve_chain(peer, message)
            case ChainEntries():
                self._on_chain_entries(peer, state, message)
            case UpdatesRequest():
                if not self._take_chunk_token(state):
                    self.reject(peer, "updates-quota")
                    return
                if self._validator is not None:
                    self._validator.on_updates_request(peer, message)
            case Signed():
                for role in self.roles:
                    role.on_signed(peer, message.envelope)
            case ChunkRequest():
                ref = self._stored.get(message.artifact)
                held = ref is not None and message.index < ref.num_chunks
                length = ref.chunk_length(message.index) if ref is not None and held else 0
                served = self._window_served(peer, length)
                refusal = None if served is None or ref is None else self._serve_refusal(served, ref, length)
                if refusal is not None:
                    self.reject(peer, "serve-quota", refusal)
                    return
                if not self._take_chunk_token(state, max(SERVE_MIN_COST_BYTES, length)):
                    self.reject(peer, "chunk-quota")
                    return
                if ref is None or not held:
                    self.send(peer, ChunkMissing(artifact=message.artifact, index=message.index))
                else:
                    if served is not None:
                        served[message.artifact] = served.get(message.artifact, 0) + length
                    self.stats["chunks_served"] += 1
                    self.emit(fx.ServeChunk(peer=peer, ref=ref, index=message.index))
            case Chunk():
                self._on_chunk(peer, message)
            case PeerExchange():
                self._on_peer_exchange(peer, state, message)
            case ChunkMissing():
                fetch = self._fetches.get(message.artifact)
                if fetch is not None and fetch.in_flight.get(message.index) == peer:
                    if peer in fetch.providers:
                        fetch.providers.remove(peer)
                    self._requeue(fetch, peer)

    # --- peer exchange (spec/transport.md §5) -------------------------------------------------------

    def _send_peer_exchange(self, peer: PeerId) -> None:
        """Tell a newly greeted peer where the other peers we are connected to listen (at most 32)."""
        known = sorted((p, a) for p, a in self._listening.items() if p != peer)
        entries: list[tuple[PeerId, str]] = []
        for p, address in known:
            if len(entries) == MAX_PEER_ENTRIES:
                break
            if address not in {a for _, a in entries}:
                entries.append((p, address))
        if entries:
            self.peers[peer].exchange_sent_at = self.now
            self.send(peer, PeerExchange(peers=tuple(entries)))

    def _peer_exchange_round(self) -> None:
        """Every `peer_exchange_every_s`: tell each greeted peer where the others listen now, so peers that
        connected later are found too. Skips peers told within twice the receivers' quota interval (their
        clock and the network may see the gap shorter than ours)."""
        if not self._listening:
            return
        for peer, state in sorted(self.peers.items()):
            if state.greeted and self.now - state.exchange_sent_at >= 2 * self.config.peer_exchange_interval_s:
                self._send_peer_exchange(peer)

    def _on_peer_exchange(self, peer: PeerId, state: PeerState, message: PeerExchange) -> None:
        """Quota first (one per `peer_exchange_interval_s` per peer), then report the addresses of peers we
        are not connected to; ourselves and the sender are never among them."""
        if self.now - state.exchange_at < self.config.peer_exchange_interval_s:
            self.reject(peer, "peers-quota")
            return
        state.exchange_at = self.now
        new = tuple((p, a) for p, a in message.peers if p != self.me and p != peer and p not in self.peers)
        self.stats["peers_learnt"] += len(new)
        if new:
            self.log("peers-discovered", peer=str(peer), count=len(new))
            self.emit(fx.PeersDiscovered(peers=new))

    # --- chain sync (spec/protocol.md §8) -----------------------------------------------------------

    def head_at(self, window: int) -> Head | None:
        """The certified head of `window` if this node holds it (current, recent, archived or genesis)."""
        if window in self._recent:
            return self._recent[window]
        entry = self.chain_entry(window)
        return None if entry is None else entry[0]

    def lease_head(self, window: int) -> Head | None:
        """The head that draws the leases of `window` (spec/protocol.md §4, §5.2), if this node holds it."""
        return self.head_at(lease_window(window, self.manifest))

    def window_leases(self, window: int) -> Mapping[PeerId, tuple[int, ...]]:
        """The leases of `window` (trainer -> sorted shards), empty when this node lacks its lease head."""
        head = self.lease_head(window)
        return {} if head is None else leases_of(head, self.manifest, window)

    def base_heads(self, window: int) -> dict[bytes, Head]:
        """The certified heads an update of `window` may name as its base, by id, of those this node holds: its
        parent and up to `overlap` windows before it (spec/protocol.md §5.2)."""
        heads = (self.head_at(w) for w in range(max(0, window - 1 - self.manifest.overlap), window))
        return {h.id: h for h in heads if h is not None}

    def chain_entry(self, window: int) -> tuple[Head, QuorumCertificate] | None:
        """The certified head of `window` if this node holds it (genesis, archive or current head)."""
        if window == 0:
            genesis = self.revision.genesis()
            return genesis, QuorumCertificate(head=genesis.id, window=0, round=0, votes=())
        if window == self.head.window:
            return self.head, self.certificate
        record = self.records.get(chain_key(window))
        return None if record is None else decode_chain_entry(record)

    def _serve_chain(self, peer: PeerId, request: ChainRequest) -> None:
        entries: list[tuple[Head, QuorumCertificate]] = []
        size = 0
        for window in range(request.from_window, min(request.to_window, self.head.window) + 1):
            entry = self.chain_entry(window)
            if entry is None or len(entries) == MAX_CHAIN_ENTRIES:
                break
            size += len(entry[0].to_bytes()) + 128 * len(entry[1].votes)
            if entries and size > self.config.max_chain_reply_bytes:
                break
            entries.append(entry)
        self.send(peer, ChainEntries(entries=tuple(entries)))

    def _on_chain_entries(self, peer: PeerId, state: PeerState, message: ChainEntries) -> None:
        """Take a reply to our chain-get: verify and archive it (`_take_segment`), then go on syncing. A peer
        whose reply brought nothing is not asked for that window again until it reports a newer head."""
        wanted = self._chain_requests.pop(peer, None)
        if wanted is None:
            self.reject(peer, "unsolicited-chain")
            return
        self._chain_live.pop(peer, None)
        state.chain_timeouts = 0  # it answers (an empty reply too): not silent
        self._chain_silent.pop(peer, None)
        verified = self._take_segment(peer, *wanted, message.entries)
        self.log("chain-entries", peer=str(peer), first=wanted[0], entries=len(message.entries),
                 verified=verified or 0, seconds=round(self.now - state.chain_asked_at, 3))
        if verified == 0:
            state.chain_lacks = wanted[0]
        elif verified:
            self._chain_source = peer
            state.chain_served += verified
            state.chain_backoff_until = float("-inf")
        self._sync()

    def _take_segment(self, peer: PeerId, first: int, last: int,
                      entries: tuple[tuple[Head, QuorumCertificate], ...]) -> int | None:
        """Verify a chain segment link by link - window, parent id, quorum certificate - from the head we
        hold before it; archive what verifies (a node that keeps no chain adopts its last entry instead).
        The first bad entry is charged to the sender and ends the segment. Returns how many entries were
        verified, or None when we no longer hold the head the segment hangs from."""
        previous = self.chain_entry(first - 1)
        if previous is None:
            return None
        prev, prev_cert = previous
        count = 0
        for head, cert in entries:
            if head.window != prev.window + 1 or not first <= head.window <= last:
                self.reject(peer, "chain-window", f"window {head.window} after {prev.window}")
                return count
            if head.parent != prev.id:
                self.reject(peer, "chain-parent", f"window {head.window}")
                return count
            try:
                self.verify_certified(head, cert)
            except VerificationError as exc:
                self.reject(peer, exc.reason, f"window {head.window}: {exc.detail}")
                return count
            ours = self.chain_entry(head.window)
            if ours is not None and ours[0].id != head.id:
                # Two certified heads for one window would break safety: keep ours, say so loudly.
                self.reject(peer, "chain-conflict", f"window {head.window}")
                return count
            if ours is None and self.config.keeps_chain:
                self.persist_then(chain_key(head.window), encode_chain_entry(head, cert), "engine",
                                  Archive(window=head.window))
            prev, prev_cert = head, cert
            count += 1
        after = self.chain_entry(prev.window + 1)
        target = self._sync_target
        if after is None and target is not None and target[0].window == prev.window + 1:
            after = target[0], target[1]
        if after is not None and after[0].parent != prev.id:
            self.reject(peer, "chain-parent", f"window {prev.window + 1}")
            return count
        self.stats["chain_entries_verified"] += count
        if not self.config.keeps_chain and prev.window > max(self.head.window, self._adopting):
            # asked for after a next-head we could not link: the segment reaches past our head
            self.adopt(prev, prev_cert)
            for role in self.roles:
                role.on_head_source(peer, prev)
        return count

    def _note_peer_head(self, state: PeerState, window: int) -> None:
        if window > state.head_window:
            state.head_window, state.chain_lacks = window, None

    def _held_through(self) -> int:
        """The highest window `n` such that we hold the certified heads of windows 1..n."""
        while self.chain_entry_held(self._contiguous + 1):
            self._contiguous += 1
        return self._contiguous

    def chain_entry_held(self, window: int) -> bool:
        """True if this node holds the certified head of `window` (without decoding it)."""
        return window == 0 or window == self.head.window or chain_key(window) in self.records

    def _sync(self) -> None:
        """Chain sync (spec/protocol.md §8), run whenever what we know changes: adopt what the archive now
        reaches, then ask peers for the lowest run of windows still missing (at most 64), up to
        `chain_parallel` chain-gets live at once. Missing: holes below our head, the windows before a
        verified head we learnt of (the sync target), and those up to a next-head we could not link. Peers
        asked: greeted, claiming that window, not lacking it, not asked already, not backing off after
        unanswered chain-gets; in order: those whose entries verified before, the manifest's validators, those
        that showed us a verified quorum certificate of a head that reaches the window, asked longest ago,
        peer id. What a peer claims (its roles, how high its head is) never puts it first: a claim costs
        nothing, so liars would take every turn."""
        self._advance()
        if len(self._chain_live) >= self.config.chain_parallel:
            return
        base = max(self.head.window, self._adopting)
        lo = self._sync_floor()
        if self.config.keeps_chain:
            goal = max(base - 1, self._sync_claim)
            if self._sync_target is not None:
                goal = max(goal, self._sync_target[0].window - 1)
        else:
            goal = self._sync_claim
        if lo > goal:
            return
        hi = lo
        while hi < goal and hi - lo + 1 < MAX_CHAIN_ENTRIES and not self.chain_entry_held(hi + 1):
            hi += 1
        ahead = [(p, s) for p, s in self.peers.items() if s.greeted and s.head_window >= lo]
        willing = [(p, s) for p, s in ahead if s.chain_lacks != lo]
        validators = self.revision.manifest.validators
        candidates = sorted((s.chain_served == 0, p not in validators, s.head_proven < lo, s.chain_asked_at, p)
                            for p, s in willing if p not in self._chain_live and s.chain_backoff_until <= self.now)
        while candidates and len(self._chain_live) < self.config.chain_parallel:
            peer = candidates.pop(0)[-1]
            self.peers[peer].chain_asked_at = self.now
            self._chain_requests[peer] = (lo, hi)
            self._chain_live[peer] = self.now + self.config.chain_request_timeout_s
            self.send(peer, ChainRequest(from_window=lo, to_window=hi))
            self.log("chain-get", peer=str(peer), first=lo, last=hi, proven=self.peers[peer].head_proven >= lo)
        self._arm_chain_timer()
        target = self._sync_target
        if ahead and not willing and not self._chain_live and target is not None and lo < target[0].window:
            # Every peer ahead of us was asked and lacks these windows: liveness first. Adopt the verified
            # head; the missing windows stay wanted (holes below the head) and are asked of later peers.
            self.log("chain-gap", first=lo, head_window=target[0].window)
            self._sync_target = None
            self._adopt_from(target[0], target[1], target[2])

    def _sync_floor(self) -> int:
        """The lowest window chain sync may want: the first one missing from the archive (the window after our
        head for a node that keeps no chain). Peers whose heads are below it are never asked."""
        if self.config.keeps_chain:
            return self._held_through() + 1
        return max(self.head.window, self._adopting) + 1

    def _check_proof(self, cert: QuorumCertificate) -> None:
        """Verify a hello's certificate (a quorum of the manifest's validators precommitted its head id in its
        window); raise VerificationError if it does not. The last `MAX_PROOFS` that verified are not
        verified again: every honest peer sends the fleet's head's one certificate."""
        key = encode(cert.to_cbor())
        if key in self._proofs or cert == self.certificate:
            return
        cert.verify_votes(self.revision)
        self._proofs[key] = None
        if len(self._proofs) > MAX_PROOFS:
            del self._proofs[next(iter(self._proofs))]

    def _arm_chain_timer(self) -> None:
        """One timer for chain sync: the earliest live chain-get's deadline, or the earliest end of a peer's
        back-off while no chain-get is live (then it may be asked again)."""
        deadlines = list(self._chain_live.values()) or \
            [s.chain_backoff_until for s in self.peers.values() if s.chain_backoff_until > self.now]
        if deadlines:
            self.set_timer(("chain-get",), min(deadlines))
        else:
            self.cancel_timer(("chain-get",))

    def _advance(self) -> None:
        """Adopt the sync target once the archive reaches the window before it; without a target, the
        highest archived head that follows ours without a gap (fetched after a next-head we missed)."""
        base = max(self.head.window, self._adopting)
        target = self._sync_target
        if target is not None and target[0].window <= base:
            self._sync_target = target = None
        if not self.config.keeps_chain:
            return
        top = base
        while self.chain_entry_held(top + 1):
            top += 1
        if target is not None:
            if top + 1 == target[0].window:
                self._sync_target = None
                entry = self.chain_entry(top)
                if entry is not None and entry[0].id == target[0].parent:
                    self._adopt_from(*target)
                else:  # two certified heads that do not link: keep ours, say so loudly (as `chain-conflict`)
                    self.reject(target[2], "chain-conflict", f"window {target[0].window} does not follow ours")
            return
        if top > base:
            entry = self.chain_entry(top)
            if entry is not None:
                self._adopt_from(entry[0], entry[1], self._chain_source)

    def _adopt_from(self, head: Head, cert: QuorumCertificate, source: PeerId | None) -> None:
        self.adopt(head, cert)
        if source is not None and source in self.peers:
            for role in self.roles:
                role.on_head_source(source, head)

    def _on_chain_timeout(self) -> None:
        """Chain-gets went unanswered for `chain_request_timeout_s`: their peers back off (the timeout times
        2^(unanswered in a row), at most `CHAIN_BACKOFF_MAX_DOUBLINGS` doublings) and others are asked; a
        late reply is still taken. Also runs when a back-off ends."""
        for peer, deadline in list(self._chain_live.items()):
            if deadline > self.now:
                continue
            del self._chain_live[peer]
            state = self.peers.get(peer)
            if state is not None:
                state.chain_timeouts += 1
                doublings = min(state.chain_timeouts, CHAIN_BACKOFF_MAX_DOUBLINGS)
                state.chain_backoff_until = self.now + self.config.chain_request_timeout_s * 2**doublings
                self.stats["chain_timeouts"] += 1
                if state.chain_timeouts >= CHAIN_SILENT_LIMIT:
                    # It claims a head it does not serve: drop it (an honest server answers every chain-get,
                    # if only with no entries). Not charged: a slow honest peer redials and is asked again.
                    self._chain_silent.pop(peer, None)
                    self._chain_silent[peer] = (state.chain_timeouts, state.chain_backoff_until)
                    if len(self._chain_silent) > MAX_CHAIN_SILENT:
                        del self._chain_silent[next(iter(self._chain_silent))]
                    self.log("chain-silent", peer=str(peer), unanswered=state.chain_timeouts,
                             claimed=state.head_window)
                    self.emit(fx.HangUp(peer=peer, reason="chain-silent"))
        self._sync()

    def _window_served(self, peer: PeerId, length: int) -> dict[bytes, int] | None:
        """What `peer` was served in this window of the head (spec/protocol.md §8.2), artifact digest -> bytes;
        None when the budget does not apply: to the manifest's validators (they fetch every update and audit,
        so only the byte bucket bounds them) and to a chunk we lack (`length` 0). Entries last until the head
        moves, across reconnects; at most `MAX_SERVED_PEERS` peers are tracked (the oldest forgotten)."""
        if peer in self._validator_ids or length == 0:
            return None
        if self._served_window != self.head.window:
            self._served.clear()
            self._served_window = self.head.window
        served = self._served.get(peer)
        if served is None:
            if len(self._served) >= MAX_SERVED_PEERS:
                del self._served[next(iter(self._served))]
            served = self._served[peer] = {}
        return served

    def _serve_refusal(self, served: dict[bytes, int], ref: ArtifactRef, length: int) -> str | None:
        """Why serving `length` more bytes of `ref` would exceed a peer's budget for this window (`served`, from
        `_window_served`), or None: each artifact at most `serve_copies` times its size, and at most
        `_max_served_artifacts` artifacts (spec/protocol.md §8.2)."""
        done = served.get(ref.digest)
        if done is None and len(served) >= self._max_served_artifacts:
            return f"{len(served)} artifacts served in window {self.head.window}"
        if (done or 0) + length > self.config.serve_copies * ref.size:
            return f"{done} of {ref.size} bytes of this artifact served in window {self.head.window}"
        return None

    def _take_chunk_token(self, state: PeerState, cost: int = SERVE_MIN_COST_BYTES) -> bool:
        """Byte token bucket per peer (`serve_bytes_burst`, refilled at `serve_bytes_per_s`): a request
        costs `cost` bytes, what serving it reads and sends (at least `SERVE_MIN_COST_BYTES`). An honest
        fetcher keeps at most `max_chunks_in_flight` chunks out and pulls each artifact once, so only a
        flooder runs it dry; its requests are refused without reading anything from storage."""
        c = self.config
        state.chunk_tokens = min(float(c.serve_bytes_burst),
                                 state.chunk_tokens + (self.now - state.tokens_at) * c.serve_bytes_per_s)
        state.tokens_at = self.now
        if state.chunk_tokens < cost:
            return False
        state.chunk_tokens -= cost
        return True

    def _on_chunk(self, peer: PeerId, chunk: Chunk) -> None:
        fetch = self._fetches.get(chunk.artifact)
        if fetch is None or fetch.in_flight.get(chunk.index) != peer:
            late = self._superseded.get(chunk.artifact)
            if late is not None and late.get(chunk.index) == peer:
                # Asked for before we computed the artifact ourselves, or before the request timed out and
                # went to another provider: a slow answer, not the peer's fault.
                del late[chunk.index]
                if not late:
                    del self._superseded[chunk.artifact]
                return
            self.reject(peer, "unsolicited-chunk")
            return
        del fetch.in_flight[chunk.index]
        if not fetch.ref.chunk_ok(chunk.index, chunk.data):
            # The sender lied about content it offered: charge it, never ask it again for this artifact.
            self.reject(peer, "bad-chunk", f"chunk {chunk.index}")
            if peer in fetch.providers:
                fetch.providers.remove(peer)
            self._requeue(fetch, peer)
            return
        self.stats["chunks_fetched"] += 1
        fetch.done.add(chunk.index)
        self.emit(fx.StoreChunk(ref=fetch.ref, index=chunk.index, data=chunk.data))
        self._pump(fetch)

    def _pump(self, fetch: _Fetch) -> None:
        ref = fetch.ref
        if len(fetch.done) == ref.num_chunks:
            if not fetch.committing:
                fetch.committing = True
                self.cancel_timer(("fetch", ref.digest))
                self.emit(fx.CommitArtifact(ref=ref, durable=fetch.durable))
            return
        if not fetch.providers:
            if not fetch.in_flight:
                self._fail_fetch(fetch, "no-provider")
            return
        for index in range(ref.num_chunks):
            if len(fetch.in_flight) >= self.config.max_chunks_in_flight:
                break
            if index in fetch.done or index in fetch.in_flight:
                continue
            provider = fetch.providers[(index + fetch.failures) % len(fetch.providers)]
            fetch.in_flight[index] = provider
            self.send(provider, ChunkRequest(artifact=ref.digest, index=index))
        self.set_timer(("fetch", ref.digest), self.now + self.config.chunk_timeout_s)

    def _requeue(self, fetch: _Fetch, peer: PeerId) -> None:
        for index, p in list(fetch.in_flight.items()):
            if p == peer:
                del fetch.in_flight[index]
        fetch.failures += 1
        if fetch.failures > self.config.fetch_attempts * max(1, fetch.ref.num_chunks):
            self._fail_fetch(fetch, "too-many-failures")
        else:
            self._pump(fetch)

    def _fail_fetch(self, fetch: _Fetch, reason: str) -> None:
        self._fetches.pop(fetch.ref.digest, None)
        self.cancel_timer(("fetch", fetch.ref.digest))
        if fetch.done:  # stored by StoreChunk: a later fetch of this artifact need not ask for them again
            self._partial[fetch.ref.digest] = (fetch.ref, fetch.done)
            if len(self._partial) > MAX_PARTIAL_FETCHES:
                del self._partial[next(iter(self._partial))]
        for waiter in fetch.waiters:
            self._resume(waiter, Failed(reason=reason))

    def _on_fetch_timeout(self, digest: bytes) -> None:
        """No chunk arrived for `chunk_timeout_s` (every `_pump` re-arms the timer), so each provider with a
        request out left it unanswered that long. While another provider remains, those silent ones are
        dropped from this fetch and their chunks asked of the others; when every provider is silent (a
        stall of our own link looks the same) they are all asked again, up to `fetch_attempts`."""
        fetch = self._fetches.get(digest)
        if fetch is None or fetch.committing:
            return
        silent = sorted(set(fetch.in_flight.values()))
        if fetch.in_flight:
            self._supersede(digest, fetch.in_flight)  # their answers may still come: taken quietly, unused
        if any(p not in silent for p in fetch.providers):
            fetch.providers = [p for p in fetch.providers if p not in silent]
        for peer in silent:
            self._requeue(fetch, peer)
            if digest not in self._fetches:
                return
        if not fetch.in_flight:
            self._pump(fetch)

    def _retire_artifacts(self) -> None:
        """Retention (spec/protocol.md §8.1): forget and drop (`DropArtifacts`) the stored artifacts first
        held while the head was older than ``window - keep_windows``, except the current head's params and
        optimizer state. What a window's work needs (its base head's params and state, its updates, the
        proposals and the next params) is held from the base head on, so it outlives the window by
        `keep_windows` heads; a peer asking for a dropped artifact gets `chunk-missing`. Overlapped windows
        keep `overlap` more: an update's base may be that many heads older (spec/protocol.md §5.2)."""
        keep = self.config.keep_windows
        if keep <= 0:
            return
        keep += self.manifest.overlap
        for digest in self._stored:
            self._stored_at.setdefault(digest, self.head.window)  # restored with the node: from now on
        pinned = {self.head.params.digest}
        if self.head.outer_state is not None:
            pinned.add(self.head.outer_state.digest)
        floor = self.head.window - keep
        old = sorted(d for d, w in self._stored_at.items() if w < floor and d not in pinned)
        if not old:
            return
        freed = 0
        for digest in old:
            freed += self._stored.pop(digest).size
            del self._stored_at[digest]
        self.emit(fx.DropArtifacts(digests=tuple(old)))
        self.log("artifacts-dropped", window=self.head.window, count=len(old), bytes=freed)

    def drop_stored(self, digests: Iterable[bytes]) -> None:
        """Forget and drop (`DropArtifacts`) stored artifacts this node will not serve again, such as a
        trainer's checkpoints that no audit selected (spec/protocol.md §6.3). The current head's params and
        optimizer state are never dropped."""
        pinned = {self.head.params.digest} | ({self.head.outer_state.digest} if self.head.outer_state else set())
        gone = tuple(sorted(d for d in set(digests) if d in self._stored and d not in pinned))
        for digest in gone:
            del self._stored[digest]
            self._stored_at.pop(digest, None)
        if gone:
            self.emit(fx.DropArtifacts(digests=gone))

    def _on_artifact_corrupt(self, ref: ArtifactRef) -> None:
        """Every chunk verified yet the whole is not `ref.digest`: the ref itself is false. Nothing of it
        is worth resuming, and no provider can fix it, so the fetch fails (its owner charges the author)."""
        self._partial.pop(ref.digest, None)
        fetch = self._fetches.get(ref.digest)
        if fetch is not None:
            fetch.done = set()
            self._fail_fetch(fetch, "corrupt-artifact")

    def _on_artifact_stored(self, ref: ArtifactRef) -> None:
        self._stored[ref.digest] = ref
        self._stored_at.setdefault(ref.digest, self.head.window)
        self._partial.pop(ref.digest, None)
        fetch = self._fetches.pop(ref.digest, None)
        if fetch is not None:
            self.cancel_timer(("fetch", ref.digest))
            self.log("artifact-fetched", digest=ref.digest.hex()[:16], bytes=ref.size, chunks=ref.num_chunks,
                     seconds=round(self.now - fetch.started, 4))
            for waiter in fetch.waiters:
                self._resume(waiter, Done())

    def _fire_timers(self) -> None:
        while True:
            deadline = self.next_deadline()
            if deadline is None or deadline > self.now:
                return
            _, _, key = heapq.heappop(self._timers)
            del self._timer_deadline[key]
            if key[0] == "fetch":
                self._on_fetch_timeout(key[1])
            elif key[0] == "chain-get":
                self._on_chain_timeout()
            elif key[0] == "peer-exchange":
                self._peer_exchange_round()
                self.set_timer(key, self.now + self.config.peer_exchange_every_s)
            else:
                for role in self.roles:
                    role.on_timer(key)


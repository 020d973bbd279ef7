"""The sans-IO protocol engine (spec/design.md §2, spec/protocol.md).

Call order, documented once: feed every input with `handle(event)`, then drain `next_effect()` until it
returns None and execute each effect in order; re-arm one timer at `next_deadline()` and call
`handle(TimerDue(now))` when it passes (a spurious call is a no-op). The first event must be `Start`.
`now` is seconds on the host's monotonic clock and never decreases.

The engine does no I/O, reads no clock and draws randomness only from the injected `random.Random`.
Peer misbehaviour never raises out of `handle`: it becomes a `Rejected` effect (also counted by reason), a
penalty, and at `penalty_limit` a `Ban` and a `HangUp`. Caller misuse raises LocalProtocolError.

Role behaviour lives in one module per state machine: `trainer`, `validator`, `reducer` (the latter two share
`collector`), each following the `roles.Role` protocol and acting through a Protocol of just the engine
members it uses (`trainer_work.TrainerServices`, `validator.ValidatorServices`, ...), all of which this engine
implements. This module decodes each input once and dispatches it; it holds timers, persist-then-send, compute
tasks, rejections and adoption of certified heads, and composes the parts that hold the rest by concern, each
acting through a narrow host interface of its own: `sessions` (peers, peer exchange, serving quotas),
`fetching` (artifacts held and fetched with verify-on-arrival), `chainsync` (the chain archive and
chain sync, spec/protocol.md §8) and `retention` (what is forgotten as the head moves, and snapshots).

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

from . import effects as fx
from . import events as ev
from . import retention
from .chain import decode_chain_entry, encode_chain_entry
from .chainsync import Archive, ChainSync, Promote
from .collector import REPLAY_WINDOWS
from .config import EngineConfig as EngineConfig
from .envelope import SignedEnvelope
from .errors import DecodeError, LocalProtocolError, VerificationError
from .fetching import Fetcher
from .identity import Identity, PeerId
from .leases import lease_window, leases_of
from .messages import (
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
from .objects import (
    MAX_OVERLAP,
    PROTOCOL_VERSION,
    SIGNED_BODIES,
    AdmissionRevocation,
    ArtifactRef,
    Head,
    QuorumCertificate,
    UpdateAnnouncement,
    decode_body,
)
from .pending import Done, Failed, Outcome, Pending, PendingState
from .records import HEAD_RECORD as HEAD_RECORD
from .records import ChainRecord, HeadRecord, Record
from .records import chain_key as chain_key
from .reducer import ReducerRole
from .roles import Role
from .sessions import PeerState, Sessions
from .tasks import Task
from .trainer import TrainerRole
from .validator import ValidatorRole

SERVER_ROLES = frozenset({"validator", "reducer"})


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
        self._effects: deque[fx.Effect] = deque()
        self._timers: list[tuple[float, int, tuple[Any, ...]]] = []
        self._timer_deadline: dict[tuple[Any, ...], float] = {}
        self._seq = 0
        self._held: dict[int, tuple[str, Pending]] = {}  # persist token -> (record key, what then)
        self._tasks: dict[str, Pending] = {}  # task id -> what its owner does with the result
        self.seen_deltas: dict[bytes, int] = {}  # accepted delta digest -> window (replay screening)
        # update id -> (author, announcement) of what this node's collectors took in the last windows: an
        # overlapped update names its author's previous one as its `prior` (spec/protocol.md §5.2)
        self.recent_updates: dict[bytes, tuple[PeerId, UpdateAnnouncement]] = {}
        records = dict(records or {})
        self.records = records
        self.adopting = 0  # the highest window handed to `adopt` (promoted once its record is durable)
        self.head, self.certificate = self.revision.genesis(), QuorumCertificate(
            head=self.revision.genesis().id, window=0, round=0, votes=())
        if HEAD_RECORD in records:
            head, cert = decode_chain_entry(records[HEAD_RECORD])
            self.verify_certified(head, cert)
            self.head, self.certificate = head, cert
        self.sessions = Sessions(self, self.manifest)
        self.fetching = Fetcher(self, stored)
        self.chain = ChainSync(self)
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
                if event.peer in self.chain.silent:
                    state.chain_timeouts, state.chain_backoff_until = self.chain.silent[event.peer]
                self.sessions.listening.pop(event.peer, None)
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
                self.resume_pending(task, Done(result=event.result))
            case ev.TaskFailed():
                task = self._tasks.pop(event.task_id, None)
                if task is None:
                    raise LocalProtocolError(f"unknown task {event.task_id}")
                self.log("task-failed", task=event.task_id, reason=event.reason)
                self.resume_pending(task, Failed(reason=event.reason))
            case ev.ArtifactStored():
                self.fetching.on_artifact_stored(event.ref)
            case ev.ArtifactCorrupt():
                self.fetching.on_artifact_corrupt(event.ref)
            case ev.ArtifactAdded():
                self.note_stored(event.ref)
            case ev.Persisted():
                held = self._held.pop(event.token, None)
                if held is None:
                    raise LocalProtocolError(f"unknown persist token {event.token}")
                self.resume_pending(held[1], Done())
            case ev.LeaveRequested() | ev.JoinRequested():
                if self._trainer is None:
                    raise LocalProtocolError("only a trainer can leave or join the roster")
                self._trainer.set_membership(isinstance(event, ev.JoinRequested))
            case _:
                raise LocalProtocolError(f"unknown event {event!r}")

    def resume_pending(self, pending: Pending, outcome: Outcome) -> None:
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
                            fetches=tuple((f.ref, tuple(f.waiters)) for f in self.fetching.fetches.values()),
                            writes=tuple(self._held.values()))

    def _drop_peer(self, peer: PeerId) -> None:
        self.peers.pop(peer, None)
        self.sessions.listening.pop(peer, None)
        self.chain.drop_peer(peer)
        self.fetching.drop_peer(peer)

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
        return digest in self.fetching.stored

    def snapshot(self) -> bytes:
        """The engine's durable state as canonical CBOR (spec/design.md §2): its records (certified head, votes,
        locks, proposals, claims), the artifacts it holds, counters, replay digests, and the validator's
        joins (and admissions) and undelivered equivocation evidence.

        In-flight work (fetches, compute tasks, held sends, connections) is not part of it: a restored
        engine is a node restarted from this state, which re-fetches and recomputes what it needs.
        """
        return retention.encode_snapshot(
            revision=self.revision.id, now=self.now, records=self.records, stored=self.fetching.stored,
            stats=self.stats, rejected=self.rejected_by_reason, seen_deltas=self.seen_deltas,
            validator=None if self._validator is None else self._validator.durable_state())

    @classmethod
    def restore(cls, data: bytes, config: EngineConfig, identity: Identity, rng: random.Random) -> Engine:
        """Rebuild an engine from `snapshot()` bytes; feed it `Start` (with `now` not before the snapshot's)
        as after a restart. Raises DecodeError/VerificationError for bytes that are not a snapshot of this
        revision, LocalProtocolError for a snapshot of another revision."""
        state = retention.decode_snapshot(data, config.revision.id)
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

    def persist_then(self, record: Record, owner: str, work: Any) -> None:
        """Durable before visible: emit Persist; only after Persisted does `owner` (a `pending.OWNERS` name)
        resume `work`, its attrs frozen record (which may send), with `Done()`."""
        self._seq += 1
        key = record.key
        self._held[self._seq] = (key, Pending(owner=owner, work=work))
        self.records[key] = record.data
        self.emit(fx.Persist(token=self._seq, record=record))

    def run_task(self, task: Task, owner: str, work: Any) -> str:
        """Emit `RunTask(task)` (a `core.tasks` class) and return its task id, ``<kind>-<n>``. When it ends,
        `owner` (a `pending.OWNERS` name) resumes `work`, its attrs frozen record, with `Done(result)` (the
        task's result class) or `Failed(reason)`."""
        self._seq += 1
        task_id = f"{task.kind}-{self._seq}"
        self._tasks[task_id] = Pending(owner=owner, work=work)
        self.emit(fx.RunTask(task_id=task_id, task=task))
        return task_id

    def note_stored(self, ref: ArtifactRef) -> None:
        """Record an artifact stored here outside a fetch (a compute task's output, which roles note when the task
        ends; a host feeds `events.ArtifactAdded` for one it made itself, never calls this). A fetch of the same
        artifact under way (a reducer adopting the head whose params and optimizer state it is computing
        itself) is done at once; the chunks it still has asked for are dropped quietly when they come."""
        self.fetching.note_stored(ref)

    def fetch(self, ref: ArtifactRef, providers: Iterable[PeerId], owner: str, work: Any) -> None:
        """Make `ref` stored locally, then resume `owner`'s `work` (`Fetcher.fetch` says how and with what)."""
        self.fetching.fetch(ref, providers, owner, work)

    def drop_stored(self, digests: Iterable[bytes]) -> None:
        """Forget and drop (`DropArtifacts`) stored artifacts this node will not serve again, such as a
        trainer's checkpoints that no audit selected (spec/protocol.md §6.3). The current head's params and
        optimizer state are never dropped."""
        gone = retention.drop(self.fetching.stored, self.fetching.stored_at, self.head, digests)
        if gone:
            self.emit(fx.DropArtifacts(digests=gone))

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
        self.adopting = max(self.adopting, head.window)
        record = encode_chain_entry(head, cert)
        if self.config.keeps_chain and chain_key(head.window) not in self.records:
            # the chain archive first: a promoted head is always served, and durable before it is visible
            self.persist_then(ChainRecord(window=head.window, data=record), "engine", Archive(window=head.window))
        self.persist_then(HeadRecord(data=record), "engine", Promote(head=head, certificate=cert))

    def _promote(self, head: Head, cert: QuorumCertificate) -> None:
        """The head record of `head` is durable: make it canonical, tell peers, open the next window."""
        if head.window <= self.head.window:
            return
        parent = self.head
        self.head, self.certificate = head, cert
        recent = self.chain.recent
        recent[head.window] = head
        for window in [w for w in recent if w < head.window - MAX_OVERLAP - 1]:
            del recent[window]
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

    def head_at(self, window: int) -> Head | None:
        """The certified head of `window` if this node holds it (current, recent, archived or genesis)."""
        return self.chain.head_at(window)

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
        return self.chain.chain_entry(window)

    # --- internals -------------------------------------------------------------------------------

    def _retire_artifacts(self) -> None:
        """Drop (`DropArtifacts`) the stored artifacts retention forgets at this head (`retention.retire`)."""
        old, freed = retention.retire(self.fetching.stored, self.fetching.stored_at, self.head,
                                      self.config.keep_windows, self.manifest.overlap)
        if not old:
            return
        self.emit(fx.DropArtifacts(digests=old))
        self.log("artifacts-dropped", window=self.head.window, count=len(old), bytes=freed)

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
                if message.certificate is not None and message.head_window >= self.chain.sync_floor():
                    # evidence for the claimed head: checked only when we might ask this peer for windows
                    self.chain.check_proof(message.certificate)
                    state.head_proven = message.head_window
                state.roles, state.greeted, state.listen = message.roles, True, message.listen
                state.head_window, state.chain_lacks = message.head_window, None
                if message.listen is None:
                    self.sessions.listening.pop(peer, None)
                else:
                    self.sessions.listening[peer] = message.listen
                if message.head_window < self.head.window:
                    self.send(peer, CertifiedHead(head=self.head, certificate=self.certificate))
                self.sessions.send_peer_exchange(peer)
                for role in self.roles:
                    role.on_peer_ready(peer, message.roles)
                self.chain.sync()  # a peer that may hold windows we lack
            case CertifiedHead():
                self.chain.on_certified_head(peer, state, message)
            case NextHead():
                self.chain.on_next_head(peer, state, message)
            case ChainRequest():
                if not self.sessions.take_chunk_token(state):
                    self.reject(peer, "chain-quota")
                    return
                self.chain.serve_chain(peer, message)
            case ChainEntries():
                self.chain.on_chain_entries(peer, state, message)
            case UpdatesRequest():
                if not self.sessions.take_chunk_token(state):
                    self.reject(peer, "updates-quota")
                    return
                if self._validator is not None:
                    self._validator.on_updates_request(peer, message)
            case Signed():
                self._on_signed(peer, message.envelope)
            case ChunkRequest():
                self.sessions.on_chunk_request(peer, state, message, self.fetching.stored)
            case Chunk():
                self.fetching.on_chunk(peer, message)
            case PeerExchange():
                self.sessions.on_peer_exchange(peer, state, message)
            case ChunkMissing():
                self.fetching.on_chunk_missing(peer, message)

    def _on_signed(self, peer: PeerId, envelope: SignedEnvelope) -> None:
        """Decode a signed envelope's body once, by its kind, and hand the typed body to every role; a body
        that does not decode is rejected once, charged to `peer` if some role would have charged it (a role
        may drop some unverified, e.g. an update for another window, or one a proposal names)."""
        try:
            body = decode_body(envelope)
        except (DecodeError, VerificationError) as exc:
            charged = [role.on_undecodable(peer, envelope) for role in self.roles]  # each role sees it
            if any(charged):
                reason, detail = exc.reason, exc.detail
                if envelope.kind in SIGNED_BODIES and envelope.kind != AdmissionRevocation.KIND and \
                        envelope.version == PROTOCOL_VERSION:
                    try:  # the signature first, as `SignedEnvelope.open` checks it: a relabelled envelope is
                        envelope.verify(envelope.kind, envelope.version)  # bad-signature, not a bad body
                    except VerificationError as bad:
                        reason, detail = bad.reason, bad.detail
                self.reject(peer, reason, detail)
            return
        for role in self.roles:
            role.on_signed(peer, envelope, body)

    def _fire_timers(self) -> None:
        while True:
            deadline = self.next_deadline()
            if deadline is None or deadline > self.now:
                return
            _, _, key = heapq.heappop(self._timers)
            del self._timer_deadline[key]
            if key[0] == "fetch":
                self.fetching.on_fetch_timeout(key[1])
            elif key[0] == "chain-get":
                self.chain.on_chain_timeout()
            elif key[0] == "peer-exchange":
                self.sessions.peer_exchange_round()
                self.set_timer(key, self.now + self.config.peer_exchange_every_s)
            else:
                for role in self.roles:
                    role.on_timer(key)

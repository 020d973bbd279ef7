"""Trainer role: lease -> fetch params -> train -> persist claim -> announce (spec/protocol.md §5).

Next-ranked claims (spec/protocol.md §4) run beside the own-lease pass, one job per leaseholder whose
shards this trainer ranks second for: `lease_s` after the head arrived the lease has expired and the
trainer trains those shards and announces an update naming the leaseholder (`claim`). Validators take
it only if the leaseholder's own update has not arrived; a cohort holds one update per lease.

One pass of this machine per window. A new certified head resets it to ``idle`` for the next window;
results that arrive for an old window are dropped. The claim (the signed announcement) is persisted
before it is sent, so a restarted trainer re-announces the same update instead of a different one.

Overlapped windows (manifest `overlap` k > 0, spec/protocol.md §5.2): once a window's announcement is
signed (``persisting`` -> ``announced``; it is sent once durable, `sealed` until then) the trainer goes on
(``announced`` -> ``fetching``) to the next window it holds a lease in, up to k
windows past the one open at validators, training from the latest certified head it holds; a new head
resets only work for a window that head closed. An announcement for a window that has not opened yet is
held until the head before it arrives, then sent.
"""

from __future__ import annotations

from typing import Any

from .audit import AUDIT_WINDOWS, audit_segment, audit_selected, start_args, train_seed
from .envelope import SignedEnvelope
from .fsm import Table, step
from .identity import PeerId
from .leases import claims_of, leases_of
from .messages import Signed
from .objects import (
    ArtifactRef,
    Head,
    Heartbeat,
    JoinRequest,
    LeaveRequest,
    UpdateAnnouncement,
    open_body,
    seal,
)
from .pending import Done, Failed, Outcome
from .privacy import ledger_epsilon, spent_steps
from .records import ClaimRecord
from .records import claim_key as claim_key
from .roles import RoleBase
from .tasks import EagerStart, TrainResult, TrainTask
from .trainer_work import Announce, FetchParams, FetchState, Prefetch, Train, TrainerServices, announcement_of, prior_of

TABLE: Table = {
    ("idle", "lease"): "fetching",
    ("idle", "no-lease"): "idle",
    ("idle", "reclaim"): "announced",
    ("fetching", "params-stored"): "training",
    ("fetching", "fetch-failed"): "idle",
    ("training", "trained"): "persisting",
    ("training", "train-failed"): "idle",
    ("persisting", "persisted"): "announced",
    # overlapped windows only (manifest `overlap` > 0): on to the next window without waiting for a head, and
    # without waiting for this window's claim to be durable ("signed"; its announcement is sent once it is)
    ("announced", "lease"): "fetching",
    ("persisting", "signed"): "announced",
}


# Roster membership (spec/protocol.md §5): "joining" sends joins while not rostered, "leaving" sends
# leaves while rostered; "left" does neither until the operator asks to join again; "member" sends one
# heartbeat per window when the manifest's idle_windows > 0 (an expired member is unrostered: it joins
# again). Inputs: each new head (rostered or not) and the operator's `LeaveRequested` / `JoinRequested`.
MEMBERSHIP_TABLE: Table = {
    ("joining", "head-rostered"): "member",
    ("joining", "head-unrostered"): "joining",
    ("joining", "leave"): "left",
    ("joining", "join"): "joining",
    ("member", "head-rostered"): "member",
    ("member", "head-unrostered"): "joining",
    ("member", "leave"): "leaving",
    ("member", "join"): "member",
    ("leaving", "head-rostered"): "leaving",
    ("leaving", "head-unrostered"): "left",
    ("leaving", "leave"): "leaving",
    ("leaving", "join"): "member",
    ("left", "head-rostered"): "leaving",
    ("left", "head-unrostered"): "left",
    ("left", "leave"): "left",
    ("left", "join"): "joining",
}


CLAIM_TABLE: Table = {
    ("waiting", "lease-expired"): "fetching",
    ("waiting", "reclaim"): "announced",
    ("fetching", "params-stored"): "training",
    ("fetching", "fetch-failed"): "failed",
    ("training", "trained"): "persisting",
    ("training", "train-failed"): "failed",
    ("persisting", "persisted"): "announced",
}


class TrainerRole(RoleBase):
    def __init__(self, engine: TrainerServices) -> None:
        self.engine = engine
        self.state = "idle"
        self.window = -1  # the window trained (or to train) now; the open one unless windows overlap
        self.head: Head | None = None  # the latest certified head
        self.base: Head | None = None  # the head `window` is trained from (`head`, or older with overlap)
        # with overlap, our own update of the window before `window` that `base` lacks: training starts from the
        # base moved by it (spec/protocol.md §5.2)
        self.prior: SignedEnvelope | None = None
        self.shards: tuple[int, ...] = ()
        # Durable announcements of windows not yet closed, by window: the open one is sent (and sent again
        # to servers that connect), a later one (overlap) waits until its window opens.
        self.published: dict[int, SignedEnvelope] = {}
        # With overlap, announcements signed but not yet durable (their claim is being written), by window: the
        # next window already trains from them (as its prior); they are sent, and published, once durable.
        self.sealed: dict[int, SignedEnvelope] = {}
        self.done = 0  # the highest window this trainer has announced or found no lease in
        self.head_sources: set[PeerId] = set()
        self.joined_window = -1
        self.membership = "joining"  # MEMBERSHIP_TABLE
        self.left_window = -1  # window of the last leave sent
        self.beat: SignedEnvelope | None = None  # this window's heartbeat (manifest idle_windows > 0)
        self.beat_sent: set[PeerId] = set()  # validators it went to (one each per window: their quota)
        self.claims: dict[PeerId, tuple[int, ...]] = {}
        self.claim_state: dict[PeerId, str] = {}
        self.claim_announcements: dict[PeerId, SignedEnvelope] = {}
        # Segment audits (spec/protocol.md §6.3): update id -> (window, committed artifacts in trajectory order:
        # checkpoints 1..S, then the residual if any, then the trajectory itself) until its head tells which
        # ones an audit needs; then update id -> (window, kept artifacts) until AUDIT_WINDOWS windows later.
        self.committed: dict[bytes, tuple[int, tuple[ArtifactRef, ...]]] = {}
        self.kept: dict[bytes, tuple[int, tuple[ArtifactRef, ...]]] = {}

    def _step(self, event: str) -> None:
        self.state = step("trainer", TABLE, self.state, event)

    def _retire_commitments(self, head: Head) -> None:
        """Keep, of each trajectory this head decides on, what a sampled audit of it needs: the checkpoints
        around its selected segment, the final one, the residual and the trajectory; drop the rest at once
        (a trainer stores S checkpoints of its whole training state per update only until its head)."""
        e, segments = self.engine, self.engine.manifest.audit_segments
        drop: list[bytes] = []
        for update_id, (window, refs) in list(self.committed.items()):
            if window > head.window:
                continue
            del self.committed[update_id]
            keep: set[int] = set()
            # Not only cohort updates: one the loss check rejected is audited too (spec/protocol.md §6.2), and
            # the head does not say which were rejected.
            if not head.skipped and audit_selected(head.id, update_id, e.manifest.audit_rate):
                j = audit_segment(head.id, update_id, segments)
                keep = {i for i in (j - 1, j, segments - 1) if i >= 0} | set(range(segments, len(refs)))
                self.kept[update_id] = (window, tuple(refs[i] for i in sorted(keep)))
            drop.extend(ref.digest for i, ref in enumerate(refs) if i not in keep)
        for update_id, (window, refs) in list(self.kept.items()):
            if window + AUDIT_WINDOWS <= head.window:
                del self.kept[update_id]
                drop.extend(ref.digest for ref in refs)
        if drop:
            e.drop_stored(drop)

    def _commit(self, window: int, envelope: SignedEnvelope, result: TrainResult) -> None:
        """Serve the artifacts a trajectory commits to (`result.committed`) until its head decides."""
        committed = result.committed
        for ref in committed:
            self.engine.note_stored(ref)
        if committed:
            self.committed[envelope.id] = (window, committed)

    @property
    def current(self) -> int:
        """The window open at the validators: the one after the latest certified head (-1 before any)."""
        return -1 if self.head is None else self.head.window + 1

    def on_head(self, head: Head) -> None:
        e = self.engine
        if self.committed or self.kept:
            self._retire_commitments(head)
        self.head = head
        self.published = {w: env for w, env in self.published.items() if w > head.window}
        self.sealed = {w: env for w, env in self.sealed.items() if w > head.window}
        self._drop_uncertified_prior(head)
        if self.window <= head.window or self.state in ("idle", "announced"):
            # the window in flight closed (its results are dropped as stale), or nothing is in flight
            self.state, self.window, self.base, self.shards = "idle", head.window + 1, head, ()
        self.claims = claims_of(head, e.manifest).get(e.me, {}) if e.manifest.lease_s > 0 else {}
        self.claim_state = {holder: "waiting" for holder in self.claims}
        self.claim_announcements = {}
        if self.claims:
            e.set_timer(("claim", self.current), e.now + e.manifest.lease_s)
        rostered = e.me in head.roster_peers
        before = self.membership
        self._membership_step("head-rostered" if rostered else "head-unrostered")
        if self.membership == "left" and before == "leaving":
            e.log("left", window=head.window)
        self._membership_act()
        self.beat, self.beat_sent = None, set()
        if rostered and self.membership == "member" and e.manifest.idle_windows > 0:
            # Alive in this window, lease or not: keeps an idle trainer's place in the roster (§5).
            self.beat = seal(e.identity, Heartbeat(revision=e.revision.id, window=self.current))
            for v in e.peers_with("validator"):
                self._send_beat(v)
        opened = self.published.get(self.current)
        if opened is not None:  # announced ahead of its window (overlap), which has now opened
            e.broadcast(Signed(envelope=opened), roles=("validator", "reducer"))
        if self.state == "idle":
            self._next()
        elif e.manifest.overlap:
            self._prefetch(head)

    def _prefetch(self, head: Head) -> None:
        """While a window ahead trains, fetch what the next one starts from: `head`'s params and momentum, so
        the next window does not wait for them (overlapped windows only)."""
        e = self.engine
        providers = sorted(self.head_sources) + e.peers_with("validator") + e.peers_with("reducer")
        for ref in (head.params, head.outer_state):
            if ref is not None and not e.is_stored(ref.digest) and providers:
                e.fetch(ref, providers, "trainer", Prefetch(window=head.window))

    def _drop_uncertified_prior(self, head: Head) -> None:
        """`head` opens the window we train (or announced) with a prior it did not certify: validators would
        drop that update (``prior-uncertified``), so we train the window again from `head` itself."""
        e, window = self.engine, head.window + 1
        held = self._signed(window)
        prior = prior_of(held) if held is not None else (self.prior.id if self.prior is not None and
                                                           self.window == window else None)
        if prior is None or prior in head.cohort:
            return
        e.log("prior-uncertified", window=window)
        self.published.pop(window, None)
        self.sealed.pop(window, None)
        self.done = min(self.done, window - 1)
        if self.window == window:
            self.state, self.prior = "idle", None

    def _next(self) -> None:
        """Start the next window this trainer holds a lease in, from the latest certified head: the open
        window, or with overlap k one of the k after it (spec/protocol.md §5.2), reannouncing instead an
        update a restarted trainer had already made durable. Idle when there is none."""
        e, head = self.engine, self.head
        assert head is not None
        for window in range(max(self.current, self.done + 1), self.current + 1 + e.manifest.overlap):
            lease_head = head if e.manifest.overlap == 0 else e.lease_head(window)
            if lease_head is None:
                return  # a head this node jumped over: try again at the next head
            shards = leases_of(lease_head, e.manifest, window).get(e.me, ())
            if not shards:
                self.done = window
                continue
            if self._budget_spent(window):
                self.done = window
                continue
            self.window, self.base, self.shards = window, head, shards
            # one window ahead of the head: start from it moved by our own update it lacks, if we made one
            self.prior = self._signed(window - 1) if window - 1 > head.window else None
            if self._reclaim(window):
                continue
            e.log("lease", window=window, shards=list(shards))
            self._begin()
            return
        if self.state == "idle":
            self._step("no-lease")
            self.window, self.base, self.shards = self.current, head, ()

    def _budget_spent(self, window: int) -> bool:
        """Under a manifest with `privacy`, whether training `window` would take this trainer past its epsilon
        budget (spec/protocol.md §10): its steps in the head's ledger, those of an update of ours the head
        lacks (overlap), and this window's. Then it trains no more and leaves the roster: validators would
        refuse the update (``privacy-budget``), and the head's ledger shows why."""
        e, head = self.engine, self.head
        params = e.manifest.privacy
        if params is None or head is None:
            return False
        assert e.config.accountant is not None
        uncertified = sum(1 for w in {*self.published, *self.sealed} if head.window < w < window)
        steps = spent_steps(head, e.me) + (uncertified + 1) * e.manifest.inner_steps
        if ledger_epsilon(e.config.accountant, params, steps) <= params.epsilon_budget:
            return False
        if self.membership == "member":
            e.log("privacy-budget-spent", window=window, epsilon=ledger_epsilon(
                e.config.accountant, params, spent_steps(head, e.me)), budget=params.epsilon_budget)
            self.set_membership(False)
        return True

    def _reclaim(self, window: int) -> bool:
        """A restarted trainer's durable announcement for `window` (its delta still stored, its base a head
        the window may name): announce it again instead of training a different update."""
        e = self.engine
        old = e.records.get(claim_key(window))
        if old is None:
            return False
        envelope = SignedEnvelope.from_bytes(old)
        ann = announcement_of(envelope)
        if ann.base not in e.base_heads(window) or not e.is_stored(ann.delta.digest) or \
                (ann.prior is not None and window == self.current and self.head is not None
                 and ann.prior not in self.head.cohort):
            return False
        if self.state == "idle":
            self._step("reclaim")
        self.done = window
        self.published[window] = envelope
        e.log("reannounce", window=window)
        if window == self.current:
            e.broadcast(Signed(envelope=envelope), roles=("validator", "reducer"))
        return True

    def _begin(self) -> None:
        """Fetch the base head's params (then train). Without any provider yet, wait for one to connect."""
        e, head = self.engine, self.base
        assert head is not None
        providers = sorted(self.head_sources) + e.peers_with("validator") + e.peers_with("reducer")
        if not providers and not e.is_stored(head.params.digest):
            return
        self._step("lease")
        window = self.window
        e.fetch(head.params, providers, "trainer", FetchParams(window=window, prior=self._attempt()))

    def resume(self, work: Any, outcome: Outcome) -> None:
        """Go on with work of ours the engine held (a task, fetch or write) once it ended with `outcome`."""
        attempt = (prior_of(work.envelope) or b"") if isinstance(work, Announce) else getattr(work, "prior", None)
        if isinstance(work, (FetchParams, FetchState, Train, Announce)) and getattr(work, "holder", None) is None \
                and work.window == self.window and attempt != self._attempt():
            if isinstance(work, Train) and isinstance(outcome, Done) and isinstance(outcome.result, TrainResult):
                self.engine.note_stored(outcome.result.delta)
            self.engine.log("stale-result", window=work.window)  # a window started again without its prior
            return
        match work, outcome:
            case FetchParams(holder=None), Done():
                self._params_stored(work.window)
            case FetchParams(holder=None), Failed(reason=reason):
                self._fetch_failed(work.window, reason)
            case Prefetch(), _:
                pass  # ready for the next window, or fetched again when it starts
            case FetchState(), Done():
                self._params_stored(work.window)
            case FetchState(), Failed(reason=reason):
                self._fetch_failed(work.window, f"state-{reason}")
            case FetchParams(holder=PeerId() as holder), Done():
                self._claim_params(work.window, holder)
            case FetchParams(holder=PeerId() as holder), Failed():
                self._claim_failed(work.window, holder, "fetch-failed")
            case Announce(), Done():
                self._announce(work)
            case Train(holder=None), Done(result=result):
                assert isinstance(result, TrainResult)
                self._trained(work.window, result)
            case Train(holder=None), Failed(reason=reason):
                self._train_failed(work.window, reason)
            case Train(holder=PeerId() as holder), Done(result=result):
                assert isinstance(result, TrainResult)
                self._claim_trained(work.window, holder, result)
            case Train(holder=PeerId() as holder), Failed():
                self._claim_failed(work.window, holder, "train-failed")
            case _:
                raise TypeError(f"not trainer work: {work!r}")

    def _membership_step(self, event: str) -> None:
        self.membership = step("trainer-membership", MEMBERSHIP_TABLE, self.membership, event)

    def _membership_act(self) -> None:
        if self.head is None:
            return
        if self.membership == "leaving":
            self._leave()
        elif self.membership == "joining":
            self._join()

    def set_membership(self, member: bool) -> None:
        """`LeaveRequested` (member False) or `JoinRequested` (member True) from the operator. Leaving
        while a join is pending also withdraws the join: the same signed leave, which validators take as
        a withdrawal from a trainer they have not rostered (spec/protocol.md §5)."""
        before = self.membership
        self._membership_step("join" if member else "leave")
        if before == "joining" and self.membership == "left" and self.joined_window >= 0:
            self._leave()
        self._membership_act()

    @property
    def join_pending(self) -> bool:
        """True while this trainer has sent a join that no head has answered (it is not rostered yet)."""
        return self.membership == "joining" and self.joined_window >= 0

    def _leave(self) -> None:
        """Ask the validators to drop this trainer from the roster of the head of the current window."""
        e = self.engine
        if self.left_window == self.current:
            return
        validators = e.peers_with("validator")
        if validators:
            self.left_window = self.current
            leave = seal(e.identity, LeaveRequest(revision=e.revision.id, window=self.current))
            e.log("leave", window=self.current)
            for v in validators:
                e.send(v, Signed(envelope=leave))

    def _send_beat(self, validator: PeerId) -> None:
        if self.beat is not None and validator not in self.beat_sent:
            self.beat_sent.add(validator)
            self.engine.send(validator, Signed(envelope=self.beat))

    def _join(self) -> None:
        e = self.engine
        if self.joined_window == self.current:
            return
        validators = e.peers_with("validator")
        if validators:
            self.joined_window = self.current
            join = seal(e.identity, JoinRequest(revision=e.revision.id, window=self.current,
                                                capacity=e.config.capacity, admission=e.config.admission,
                                                private=e.config.private_data))
            for v in validators:
                e.send(v, Signed(envelope=join))

    def _privacy_steps(self) -> int | None:
        """The DP-SGD steps an update of ours spends (spec/protocol.md §10): the manifest's inner steps under
        `privacy`, else None."""
        m = self.engine.manifest
        return None if m.privacy is None else m.inner_steps

    def _signed(self, window: int) -> SignedEnvelope | None:
        """Our announcement of `window`, durable (`published`) or still being made durable (`sealed`), if any."""
        return self.published.get(window) or self.sealed.get(window)

    def _attempt(self) -> bytes:
        """Which attempt at `window` runs: its prior's id (§5.2), or b"" without one."""
        return b"" if self.prior is None else self.prior.id

    def _start(self) -> EagerStart | None:
        """Where our training starts (`core.audit.start_args`): None without a prior."""
        prior = None if self.prior is None else announcement_of(self.prior).delta
        assert self.base is not None
        return start_args(self.engine.manifest, self.base, prior)

    def _params_stored(self, window: int) -> None:
        if window != self.window or self.state != "fetching" or self.base is None:
            return
        e = self.engine
        start = self._start()
        state = None if start is None else start.outer_state
        if state is not None and not e.is_stored(state.digest):  # the base's momentum, which the start needs
            providers = sorted(self.head_sources) + e.peers_with("validator") + e.peers_with("reducer")
            e.fetch(state, providers, "trainer", FetchState(window=window, prior=self._attempt()))
            return
        self._step("params-stored")
        task = TrainTask(params=self.base.params, shards=self.shards,
                         seed=train_seed(self.base.id, window, self.shards, e.me), window=window,
                         inner_steps=e.manifest.inner_steps, author=e.me, segments=e.manifest.audit_segments,
                         start=start)
        e.run_task(task, "trainer", Train(window=window, prior=self._attempt()))

    def _fetch_failed(self, window: int, reason: str) -> None:
        if window == self.window and self.state == "fetching":
            self._step("fetch-failed")
            self.engine.log("params-fetch-failed", window=window, reason=reason)

    def _train_failed(self, window: int, reason: str) -> None:
        if window == self.window and self.state == "training":
            self._step("train-failed")

    def _trained(self, window: int, result: TrainResult) -> None:
        e = self.engine
        delta = result.delta
        e.note_stored(delta)
        if window != self.window or self.state != "training" or self.base is None:
            e.log("stale-result", window=window)
            return
        self._step("trained")
        # A loss computed on private records without noise would leak them: a private-data trainer announces 0.0
        # (spec/protocol.md §10) and logs its real loss only locally.
        announced_loss = 0.0 if e.config.private_data else float(result.train_loss)
        ann = UpdateAnnouncement(revision=e.revision.id, window=window, base=self.base.id, shards=self.shards,
                                 delta=delta, delta_digest=result.delta_digest,
                                 train_loss=announced_loss, trajectory=result.trajectory,
                                 prior=None if self.prior is None else self.prior.id,
                                 privacy_steps=self._privacy_steps())
        envelope = seal(e.identity, ann)
        self._commit(window, envelope, result)
        e.persist_then(ClaimRecord(window=window, data=envelope.to_bytes(), artifacts=result.unsynced),
                       "trainer",
                       Announce(window=window, envelope=envelope, train_loss=float(result.train_loss),
                                delta=delta.digest))
        if e.manifest.overlap and self.head is not None:
            # On to the next window while the claim (and the delta, fsynced first) is written: the GPU does
            # not wait for the disk (spec/protocol.md §5.2). Its announcement is still sent only once durable.
            self.sealed[window] = envelope
            self.done = window
            self._step("signed")
            self._next()

    def _announce(self, work: Announce) -> None:
        """The announcement `work.envelope` is durable: send it (if its window is still ours; one that has not
        opened yet waits for its head). With overlap the trainer went on to the next window when it signed it
        (`_trained`), unless it found none then: it tries again now."""
        e, window, envelope = self.engine, work.window, work.envelope
        if work.holder is not None:
            if window != self.current:
                return
            self._claim_step(work.holder, "persisted")
            self.claim_announcements[work.holder] = envelope
            e.stats["claims_announced"] += 1
            e.log("announce-claim", window=window, holder=str(work.holder), update=envelope.id.hex())
            e.broadcast(Signed(envelope=envelope), roles=("validator", "reducer"))
            return
        if window in self.sealed:  # overlap: the trainer went on when it signed; sent now that it is durable
            if self.sealed[window] is not envelope:
                return
            del self.sealed[window]
        elif window != self.window or self.state != "persisting":
            return
        else:
            self._step("persisted")
        self.done = max(self.done, window)
        self.published[window] = envelope
        e.stats["updates_announced"] += 1
        e.log("announce", window=window, update=envelope.id.hex(), train_loss=work.train_loss,
              delta=work.delta.hex()[:16])
        if window == self.current:
            e.broadcast(Signed(envelope=envelope), roles=("validator", "reducer"))
        if e.manifest.overlap and self.head is not None and self.state == "announced":
            self._next()

    def on_peer_ready(self, peer: PeerId, roles: tuple[str, ...]) -> None:
        e = self.engine
        if self.head is not None and "validator" in roles:
            if self.membership == "leaving":
                e.send(peer, Signed(envelope=seal(e.identity, LeaveRequest(revision=e.revision.id,
                                                                           window=self.current))))
            elif self.membership == "joining":
                self._join()
            self._send_beat(peer)
        if not {"validator", "reducer"} & set(roles):
            return
        for envelope in self.claim_announcements.values():
            e.send(peer, Signed(envelope=envelope))
        opened = self.published.get(self.current)
        if opened is not None:
            e.send(peer, Signed(envelope=opened))
        if self.state in ("idle", "announced") and self.shards and self.window > self.done:
            self._begin()  # a lease we could not start for lack of a provider

    def on_head_source(self, peer: PeerId, head: Head) -> None:
        self.head_sources = {peer}

    def on_timer(self, key: tuple[Any, ...]) -> None:
        if key[0] == "claim" and key[1] == self.current:
            for holder in sorted(self.claims):
                self._claim(holder)

    # --- next-ranked claims ----------------------------------------------------------------------

    def _claim_step(self, holder: PeerId, event: str) -> None:
        self.claim_state[holder] = step("trainer-claim", CLAIM_TABLE, self.claim_state[holder], event)

    def _claim(self, holder: PeerId) -> None:
        e, head, window = self.engine, self.head, self.current
        assert head is not None
        old = e.records.get(claim_key(window, holder))
        if old is not None:  # restarted: stand by the claim we announced
            envelope = SignedEnvelope.from_bytes(old)
            ann = open_body(envelope, UpdateAnnouncement)
            if ann.base == head.id and e.is_stored(ann.delta.digest):
                self._claim_step(holder, "reclaim")
                self.claim_announcements[holder] = envelope
                e.broadcast(Signed(envelope=envelope), roles=("validator", "reducer"))
                return
        self._claim_step(holder, "lease-expired")
        e.log("lease-claim", window=window, holder=str(holder), shards=list(self.claims[holder]))
        providers = sorted(self.head_sources) + e.peers_with("validator") + e.peers_with("reducer")
        e.fetch(head.params, providers, "trainer", FetchParams(window=window, holder=holder))

    def _claim_failed(self, window: int, holder: PeerId, event: str) -> None:
        if window == self.current and self.claim_state.get(holder) in ("fetching", "training"):
            self._claim_step(holder, event)

    def _claim_params(self, window: int, holder: PeerId) -> None:
        if window != self.current or self.claim_state.get(holder) != "fetching" or self.head is None:
            return
        self._claim_step(holder, "params-stored")
        e = self.engine
        task = TrainTask(params=self.head.params, shards=self.claims[holder],
                         seed=train_seed(self.head.id, window, self.claims[holder], e.me), window=window,
                         inner_steps=e.manifest.inner_steps, author=e.me, segments=e.manifest.audit_segments)
        e.run_task(task, "trainer", Train(window=window, holder=holder))

    def _claim_trained(self, window: int, holder: PeerId, result: TrainResult) -> None:
        e = self.engine
        e.note_stored(result.delta)
        if window != self.current or self.claim_state.get(holder) != "training" or self.head is None:
            return
        self._claim_step(holder, "trained")
        envelope = seal(e.identity, UpdateAnnouncement(
            revision=e.revision.id, window=window, base=self.head.id, shards=self.claims[holder],
            delta=result.delta, delta_digest=result.delta_digest, train_loss=float(result.train_loss),
            claim=holder, trajectory=result.trajectory, privacy_steps=self._privacy_steps()))
        self._commit(window, envelope, result)
        e.persist_then(ClaimRecord(window=window, holder=holder, data=envelope.to_bytes(),
                                   artifacts=result.unsynced), "trainer",
                       Announce(window=window, envelope=envelope, train_loss=float(result.train_loss),
                                holder=holder))

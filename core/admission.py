"""A validator's view of roster membership (spec/protocol.md §4.1): the signed joins it holds (bounded,
kept by `join_priority`), the leaves and join withdrawals it heard, heartbeats and idle expiry, and the
roster rules of the next head - the roster its own head proposes (`next_roster`, `departures`,
`expirations`) and the check of a proposed head's roster against what it heard (`roster_fault`).

What a join, leave or heartbeat changes here is local to this validator until a head certifies it; every
honest validator that heard the same messages derives the same roster.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Protocol

import attrs

from .envelope import SignedEnvelope
from .errors import DecodeError, VerificationError
from .identity import PeerId
from .leases import next_unproven, undelivered
from .messages import Signed
from .objects import (
    MAX_HEAD_REVOCATIONS,
    PROTOCOL_VERSION,
    AdmissionRevocation,
    Head,
    Heartbeat,
    JoinRequest,
    LeaveRequest,
    check_admission,
    check_revocation,
    unauditable_fault,
)
from .privacy import next_private
from .records import REVOCATION_PREFIX as REVOCATION_PREFIX
from .records import RevocationRecord
from .services import (
    Broadcasts,
    HasManifest,
    HasRecords,
    HasRejectedByReason,
    HasRevision,
    HasStats,
    Logs,
    Persists,
    Rejects,
)

JOIN_PRIORITY_DOMAIN = b"peerloom/join-priority/v1"
WINDOWS_AHEAD = 2  # joins, leaves (and other messages) for windows this far ahead are taken, later ones dropped
# Joins withdrawn by a signed leave are remembered this many windows (older joins are stale by then anyway).
WITHDRAWN_WINDOWS = 2
MAX_WITHDRAWN = 4096
# Joins a validator holds at once, per manifest `max_joins` (or at least this many); more are refused.
JOIN_BACKLOG_FACTOR = 4
MIN_JOIN_BACKLOG = 64
# Revocations (spec/auth.md §6) a validator takes from peers; only the admission authority can sign them.
MAX_REVOCATIONS = 4096


@attrs.frozen(kw_only=True)
class RevocationWrite:
    """A revocation envelope being persisted (a `records.RevocationRecord`): forwarded to the other
    validators once durable."""

    envelope: SignedEnvelope


def join_priority(head_id: bytes, peer: PeerId) -> bytes:
    """The order in which joins pending on head `head_id` are rostered and kept (spec/protocol.md §4.1):
    SHA-256(domain, head id, peer id). Fresh each window, the same at every validator."""
    return hashlib.sha256(JOIN_PRIORITY_DOMAIN + head_id + peer.to_bytes()).digest()


class AdmissionServices(HasRevision, HasManifest, HasStats, HasRejectedByReason, HasRecords, Logs, Broadcasts,
                        Persists, Rejects, Protocol):
    """What `Admission` uses of the engine (core/engine.py implements it)."""

    def window_leases(self, window: int) -> Mapping[PeerId, tuple[int, ...]]: ...


class Admission:
    """Joins, leaves, heartbeats and idle expiry at one validator, for the window after `head`.

    `joins`: peer -> requested capacity; `admitted`: peer -> certified max capacity (admission policy
    "certificate"); `leaves`: rostered trainer -> window whose head drops it; `withdrawn`: trainer -> window
    of the leave that withdrew its join before any head rostered it (a join for that window or earlier is
    the withdrawn one, a later one is a new request); `heard`: trainer -> latest window it was heard in
    (heartbeat, update or join); `first_window`: the first window this validator saw (a trainer counts as
    heard then, so a validator that just started expires nobody early); `heartbeats_taken`: (sender,
    signer, window), one each; `revocations`: envelope id -> the admission authority's revocation
    envelope, and `revoked`: peer -> the id of the envelope that revokes it (spec/auth.md §6). `joins`,
    `admitted`, `leaves`, `heard` and `first_window` are in the engine snapshot; revocations are records of
    their own (`records.RevocationRecord`), read back when the engine starts from its records.
    """

    def __init__(self, engine: AdmissionServices) -> None:
        self.engine = engine
        self.head: Head | None = None  # the parent of the window being collected
        self.joins: dict[PeerId, int] = {}
        self.private_joins: set[PeerId] = set()  # joiners whose held join declares private data (§10)
        self.admitted: dict[PeerId, int] = {}
        self.leaves: dict[PeerId, int] = {}
        self.withdrawn: dict[PeerId, int] = {}
        self.heard: dict[PeerId, int] = {}
        self.first_window: int | None = None
        self.heartbeats_taken: set[tuple[PeerId, PeerId, int]] = set()
        self.revocations: dict[bytes, SignedEnvelope] = {}
        self.revoked: dict[PeerId, bytes] = {}
        # `join_priority` of held joins on `head`, computed once each: a join that meets a full backlog compares
        # itself with the lowest-ranked held join, and without these it hashed the whole backlog every time
        self._priorities: dict[PeerId, bytes] = {}
        for key in sorted(k for k in engine.records if k.startswith(REVOCATION_PREFIX)):
            try:
                self.learn_revocation(SignedEnvelope.from_bytes(engine.records[key]))
            except (DecodeError, VerificationError):
                engine.stats["bad_revocation_records"] += 1  # not ours to trust (another revision's)

    @property
    def window(self) -> int:
        """The window being collected (-1 before the first head)."""
        return -1 if self.head is None else self.head.window + 1

    def open(self, head: Head) -> None:
        """A window opens on `head`: forget what its roster settled (peers that left or expired start afresh
        with a later join), old withdrawals, and heartbeats of past windows."""
        self.head = head
        self._priorities = {}  # a priority is drawn afresh on every head
        window = self.window
        for envelope in head.revoked:  # certified: a validator that never heard it learns it here
            try:
                if self.learn_revocation(envelope):
                    self._persist(envelope)
            except VerificationError:  # only a faulty quorum certifies a bad one: not kept, never a crash
                self.engine.stats["bad_certified_revocations"] += 1
        revoked_out = [p for p in self.joins if p in self.revoked and p not in head.roster_peers]
        for p in head.left + head.expired + tuple(revoked_out):
            self.joins.pop(p, None)
            self.admitted.pop(p, None)
        self.leaves = {p: w for p, w in self.leaves.items() if w >= window and p not in head.left}
        for p in [p for p, w in self.withdrawn.items() if w + WITHDRAWN_WINDOWS < window]:
            del self.withdrawn[p]
            if p not in head.roster_peers:
                self.joins.pop(p, None)
                self.admitted.pop(p, None)
        if self.first_window is None:
            self.first_window = window
        known = head.roster_peers | set(self.joins)
        self.heard = {p: w for p, w in self.heard.items() if p in known}
        self.heartbeats_taken = {x for x in self.heartbeats_taken if x[2] >= window}

    def joining(self) -> bool:
        """True if a join not yet rostered (and not withdrawn) waits for the next head."""
        head = self.head
        return head is not None and any(p not in head.roster_peers and p not in self.withdrawn for p in self.joins)

    # --- signed messages ---------------------------------------------------------------------------

    def on_join(self, peer: PeerId, envelope: SignedEnvelope, join: JoinRequest) -> bool:
        """A signed join from `peer` (its author or a relaying validator). True if it is held now (the
        window's clock may start). Raises VerificationError (wrong-revision, join-not-admitted) and
        DecodeError for a bad one, charged to `peer` by the engine."""
        e = self.engine
        envelope.verify(JoinRequest.KIND, PROTOCOL_VERSION)
        if join.revision != e.revision.id:
            raise VerificationError("wrong-revision", "join")
        if join.private and not e.manifest.private_data:
            raise VerificationError("private-not-admitted", "the manifest admits no private-data trainers")
        if unauditable_fault(e.manifest, join.unauditable):
            raise VerificationError("unauditable-not-admitted",
                                    "the manifest audits and admits no unauditable trainers")
        if self.head is None or join.window < self.window or join.window > self.window + WINDOWS_AHEAD:
            e.stats["stale_joins"] += 1  # an old join (a replay cannot re-roster a trainer that left)
            return False
        signer = envelope.signer
        if join.window <= self.withdrawn.get(signer, -1):
            e.stats["withdrawn_joins_ignored"] += 1  # withdrawn since: a late relay or a replay
            return False
        capacity = max(1, join.capacity)
        cert = None
        if signer in self.revoked:
            if peer == signer:
                raise VerificationError("join-not-admitted", "revoked")
            e.stats["revoked_joins_ignored"] += 1  # relayed before the relay heard the revocation
            return False
        if e.manifest.admission == "certificate":
            # Raises join-not-admitted, charged to the sender (an honest validator relays only admitted
            # joins). Checked before the backlog: a join that is not admitted evicts nobody.
            # Expiry is checked against the join's own signed window: one verdict per join everywhere.
            cert = check_admission(join.admission, e.revision.id, e.manifest, signer, window=join.window)
            capacity = min(capacity, cert.max_capacity)
        if signer not in self.joins and not self.make_room_for_join(signer):
            # A join flood (Sybils) cannot grow this validator's state (spec/protocol.md §4.1). Charged only
            # to a joiner sending its own join; a relaying validator did nothing wrong.
            if peer == signer:
                e.reject(peer, "join-backlog-full")
            else:
                e.rejected_by_reason["join-backlog-full"] += 1
            return False
        self.withdrawn.pop(signer, None)  # a join for a later window: asked anew
        if cert is not None:
            self.admitted[signer] = cert.max_capacity
        if signer not in self.joins:
            e.log("join", peer=str(signer), capacity=join.capacity)
            if peer == signer:
                # Relay a join heard from the joiner itself (one hop), so every validator knows it and a
                # proposal that adds the joiner to the roster is not refused as an unknown join.
                e.broadcast(Signed(envelope=envelope), roles=("validator",))
        self.joins[signer] = capacity
        if join.private:
            self.private_joins.add(signer)
        else:
            self.private_joins.discard(signer)
        self.hear(signer, self.window)
        return True

    def on_revocation(self, peer: PeerId, envelope: SignedEnvelope, revocation: AdmissionRevocation) -> None:
        """The admission authority's signed revocation, from any peer (spec/auth.md §6): kept, forwarded
        once to the other validators; the revoked peers' pending joins are dropped. Raises
        VerificationError ``bad-revocation`` (charged to `peer` by the engine)."""
        e = self.engine
        check_revocation(envelope, e.revision.id, e.manifest, revocation)
        if envelope.id in self.revocations:
            return
        if len(self.revocations) >= MAX_REVOCATIONS:
            e.stats["revocations_dropped"] += 1
            return
        self.learn_revocation(envelope, revocation)
        e.log("revocation", peers=len(self.revocations))
        self._persist(envelope)

    def _persist(self, envelope: SignedEnvelope) -> None:
        """Write a newly kept revocation as a record; `durable` forwards it once written."""
        self.engine.persist_then(RevocationRecord(envelope_id=envelope.id, data=envelope.to_bytes()), "validator",
                                 RevocationWrite(envelope=envelope))

    def durable(self, work: RevocationWrite) -> None:
        """A kept revocation is durable: forward it once to the other validators (they keep it too)."""
        self.engine.broadcast(Signed(envelope=work.envelope), roles=("validator",))

    def learn_revocation(self, envelope: SignedEnvelope, checked: AdmissionRevocation | None = None) -> bool:
        """Keep a revocation `envelope` (from a peer, a certified head or a record): its peers are revoked,
        and their joins not yet rostered are dropped. False if it was kept already. Raises
        VerificationError ``bad-revocation``."""
        if envelope.id in self.revocations:
            return False
        revocation = checked if checked is not None else \
            check_revocation(envelope, self.engine.revision.id, self.engine.manifest)
        self.revocations[envelope.id] = envelope
        for p in revocation.peers:
            self.revoked.setdefault(p, envelope.id)
            if self.head is None or p not in self.head.roster_peers:
                self.joins.pop(p, None)
                self.admitted.pop(p, None)
        return True

    def removals(self, head: Head) -> tuple[SignedEnvelope, ...]:
        """The revocation envelopes the head after `head` carries: those revoking a peer of `head`'s
        roster, sorted by id, at most MAX_HEAD_REVOCATIONS (the rest wait for a later head)."""
        ids = sorted({self.revoked[p] for p in head.roster_peers if p in self.revoked})
        return tuple(self.revocations[i] for i in ids[:MAX_HEAD_REVOCATIONS])

    def on_leave(self, peer: PeerId, envelope: SignedEnvelope, leave: LeaveRequest) -> None:
        """A rostered trainer's signed leave: the head of its window drops it from the roster. From a trainer
        not rostered yet, a withdrawal of its pending join."""
        e = self.engine
        envelope.verify(LeaveRequest.KIND, PROTOCOL_VERSION)
        if leave.revision != e.revision.id:
            raise VerificationError("wrong-revision", "leave")
        signer, head = envelope.signer, self.head
        if head is None or leave.window < self.window or leave.window > self.window + WINDOWS_AHEAD:
            e.stats["stale_leaves"] += 1  # for a window certified already (or far ahead): no effect, no penalty
            return
        if signer not in head.roster_peers:
            # A withdrawal of a pending join. Without a join known here (yet: a relayed one may be on its
            # way) it is still recorded, and costs a direct sender one penalty point (spam of fresh keys).
            if signer not in self.joins and signer not in self.withdrawn and peer == signer:
                e.reject(peer, "leave-not-rostered")
            if len(self.withdrawn) < MAX_WITHDRAWN:
                self._withdraw_join(peer, envelope, leave.window)
            return
        if signer in self.leaves:
            return
        self.leaves[signer] = leave.window
        e.log("leave", peer=str(signer), window=leave.window)
        if peer == signer:
            e.broadcast(Signed(envelope=envelope), roles=("validator",))  # one hop, like joins

    def _withdraw_join(self, peer: PeerId, envelope: SignedEnvelope, window: int) -> None:
        """A trainer not yet rostered leaves: its pending join is dropped, so no later head rosters it."""
        signer = envelope.signer
        if self.withdrawn.get(signer, -1) >= window:
            return
        self.withdrawn[signer] = window  # its join stays known: a head a quorum backs may still roster it
        self.engine.stats["joins_withdrawn"] += 1
        self.engine.log("join-withdrawn", peer=str(signer), window=window)
        if peer == signer:
            self.engine.broadcast(Signed(envelope=envelope), roles=("validator",))  # one hop, like joins

    def on_heartbeat(self, peer: PeerId, envelope: SignedEnvelope, beat: Heartbeat) -> None:
        """A trainer's signed heartbeat: it was heard in its window. One per (sender, signer, window), for
        the window being collected or the next; relayed one hop to the other validators."""
        e, head = self.engine, self.head
        envelope.verify(Heartbeat.KIND, PROTOCOL_VERSION)
        if beat.revision != e.revision.id:
            raise VerificationError("wrong-revision", "heartbeat")
        signer = envelope.signer
        if head is None or not self.window <= beat.window <= self.window + 1 or e.manifest.idle_windows == 0:
            e.stats["stale_heartbeats"] += 1  # old (or far ahead, or expiry off): no effect, no penalty
            return
        key = (peer, signer, beat.window)
        if key in self.heartbeats_taken:
            e.reject(peer, "heartbeat-quota", f"{signer} window {beat.window}")
            return
        self.heartbeats_taken.add(key)
        if signer not in self.joins and signer not in head.roster_peers:
            e.stats["stale_heartbeats"] += 1  # not a trainer here (yet, or any more): nothing to keep alive
            return
        self.hear(signer, beat.window)
        if peer == signer:
            e.broadcast(Signed(envelope=envelope), roles=("validator",))  # one hop, like joins and leaves

    def hear(self, peer: PeerId, window: int) -> None:
        """`peer` was heard in `window` (its heartbeat, update or join)."""
        if window > self.heard.get(peer, -1):
            self.heard[peer] = window

    # --- the next roster -----------------------------------------------------------------------------

    def idle(self, peer: PeerId, window: int) -> bool:
        """True if this validator has not heard `peer` in the last `idle_windows` windows up to `window`."""
        idle = self.engine.manifest.idle_windows
        first = window if self.first_window is None else self.first_window
        return idle > 0 and max(self.heard.get(peer, -1), first) <= window - idle

    def departures(self, head: Head) -> tuple[PeerId, ...]:
        """Trainers of `head`'s roster that sent a leave for the next window (or an earlier one), sorted."""
        rostered = head.roster_peers
        return tuple(sorted(p for p, w in self.leaves.items() if w <= head.window + 1 and p in rostered))

    def expirations(self, head: Head, left: tuple[PeerId, ...],
                    delivered: frozenset[PeerId] | None = None) -> tuple[PeerId, ...]:
        """Trainers of `head`'s roster (not leaving) unheard here for `idle_windows` windows, and, for a head
        with a cohort (`delivered`: the authors of its cohort and rejected updates), the unproven
        leaseholders of the window that delivered nothing (spec/protocol.md §4.1); sorted."""
        window = head.window + 1
        silent = frozenset() if delivered is None else \
            undelivered(head, self.engine.window_leases(window), delivered)
        return tuple(sorted(p for p, _ in head.roster if p not in left and (self.idle(p, window) or p in silent)))

    def make_room_for_join(self, joiner: PeerId) -> bool:
        """True if a new join of `joiner` may be held: the pending joins (not yet rostered) are fewer than
        the backlog, or `joiner` ranks before the last of them by `join_priority`, which is then dropped.
        Every honest validator that hears the same joins keeps the same ones, whatever their order."""
        head = self.head
        assert head is not None
        backlog = max(JOIN_BACKLOG_FACTOR * self.engine.manifest.max_joins, MIN_JOIN_BACKLOG)
        pending = [p for p in self.joins if p not in head.roster_peers]
        if len(pending) < backlog:
            return True
        last = max(pending, key=self._priority)
        if join_priority(head.id, joiner) >= self._priority(last):
            return False
        del self.joins[last]
        self.admitted.pop(last, None)
        self._priorities.pop(last, None)
        return True

    def _priority(self, peer: PeerId) -> bytes:
        """`join_priority` of a held join's `peer` on `head`, remembered until the next head (at most one per
        held join: a join that is not held is hashed afresh, so a flood grows nothing here)."""
        priority = self._priorities.get(peer)
        if priority is None:
            assert self.head is not None
            priority = self._priorities[peer] = join_priority(self.head.id, peer)
        return priority

    def next_roster(self, head: Head, quarantine: tuple[tuple[PeerId, int], ...],
                    left: tuple[PeerId, ...], expired: tuple[PeerId, ...] = (),
                    revoked: frozenset[PeerId] = frozenset()) -> tuple[tuple[PeerId, int], ...]:
        """The parent's roster less the peers that `left`, `expired` or are `revoked` (by the new head's
        revocations), plus joins seen here, except from peers quarantined by the new head or revoked."""
        gone = set(left) | set(expired) | revoked
        roster = {p: c for p, c in head.roster if p not in gone}
        quarantined = {p for p, until in quarantine if until > head.window + 2}
        room = self.engine.manifest.max_joins or len(self.joins)  # joins are taken by priority (§4.1)
        for peer, capacity in sorted(self.joins.items(), key=lambda kv: join_priority(head.id, kv[0])):
            if room and peer not in quarantined and peer not in roster and peer not in gone and \
                    peer not in self.withdrawn and peer not in self.revoked:
                roster[peer] = min(capacity, self.engine.manifest.max_capacity)
                room -= 1
        return tuple(sorted(roster.items()))

    def roster_fault(self, head: Head, cohort: frozenset[PeerId], delivered: frozenset[PeerId],
                     backed: Callable[[], bool]) -> str:
        """Why the roster of `head`, proposed for the window being collected, is invalid here, or "".
        `cohort`: the authors of its cohort updates; `delivered`: those and the authors of its rejected
        updates; `backed()`: True if a quorum of votes backs the head (spec/agreement.md §6: view-dependent
        faults, ``expired-heard`` and ``join-withdrawn``, do not refuse a head a quorum backs)."""
        e, parent = self.engine, self.head
        assert parent is not None
        window = self.window
        roster, before, left = dict(head.roster), dict(parent.roster), set(head.left)
        fault = self.revocation_fault(head, parent)
        if fault:
            return fault
        revoked = head.revoked_peers
        if list(head.left) != sorted(left) or any(p not in before or p in roster for p in left) or \
                any(self.leaves.get(p, window + 1) > window for p in left):
            return "left-unknown"  # a departure without a signed leave held here for this window
        expired = set(head.expired)
        leases = e.window_leases(window)
        silent = frozenset() if head.skipped else undelivered(parent, leases, delivered) - left
        if list(head.expired) != sorted(expired) or expired & left or \
                (e.manifest.idle_windows == 0 and not expired <= silent) or \
                any(p not in before or p in roster for p in expired):
            return "expired-unknown"  # not a peer of the parent's roster that the new roster drops
        if not silent <= expired:
            return "unproven-kept"  # an unproven leaseholder that delivered nothing stays rostered
        if any(not self.idle(p, window) for p in expired - silent) and not backed():
            return "expired-heard"  # this validator heard it within idle_windows: not valid here
        if any(roster.get(p) != cap for p, cap in before.items()
               if p not in left and p not in expired and p not in revoked):
            return "roster-shrunk"  # the roster shrinks only by the peers that left or expired
        if any(p in self.withdrawn for p in roster if p not in before) and not backed():
            return "join-withdrawn"  # it withdrew its join here: not valid here, unless a quorum backs it
        if any(p not in self.joins and p not in before for p in roster) or \
                any(p in head.quarantined for p in roster if p not in before):
            return "roster-unknown-join"
        if e.manifest.admission == "certificate" and any(
                p not in self.admitted or cap > self.admitted[p] for p, cap in roster.items() if p not in before):
            return "roster-not-admitted"
        if any(p in self.revoked for p in roster if p not in before):
            return "roster-not-admitted"  # a revoked peer joins again
        if e.manifest.max_joins and sum(1 for p in roster if p not in before) > e.manifest.max_joins:
            return "roster-too-many-joins"
        if head.unproven != next_unproven(parent, leases, head.roster, cohort,
                                          None if head.skipped else delivered):
            return "unproven-mismatch"
        if head.private != self.next_private(parent, head.roster):
            if head.private and not e.manifest.private_data:
                return "private-mismatch"
            # A new member's flag is the one of the join held here: a trainer that sent validators joins that
            # differ makes this view-dependent, so a head a quorum backs is not refused for it.
            if not backed():
                return "private-mismatch"
        return ""

    def next_private(self, parent: Head, roster: tuple[tuple[PeerId, int], ...]) -> tuple[PeerId, ...]:
        """The `private` list of the head after `parent` with `roster`, by the joins held here (§10)."""
        return next_private(parent, roster, self.private_joins & self.joins.keys())

    def revocation_fault(self, head: Head, parent: Head) -> str:
        """``bad-revocation`` unless every revocation `head` carries is the admission authority's, for this
        revision, names a peer of `parent`'s roster, and none of its peers stays in `head`'s roster; else ""."""
        e = self.engine
        for envelope in head.revoked:
            try:
                revocation = check_revocation(envelope, e.revision.id, e.manifest)
            except VerificationError:
                return "bad-revocation"
            if not set(revocation.peers) & parent.roster_peers or set(revocation.peers) & head.roster_peers:
                return "bad-revocation"
        return ""

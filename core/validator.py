"""Validator role: collect and screen updates, agree on the next head, certify it (spec/agreement.md).

A validator recomputes everything it votes for: a proposed head is *valid* only after this validator
has itself fetched and screened every cohort update, re-reduced the cohort in canonical order to the
same params and re-evaluated them to the same metrics (within `METRIC_TOLERANCE`). Agreement on the
head is Tendermint (`agreement.py`); this module is its host. Every vote - and the lock that a
non-nil precommit implies - is persisted before it is sent, and after a restart the validator resumes
from those records, so it never signs two different votes for one (window, round, step).

A window closes when every lease has reported or at its deadline (`window_s` after the window opened
here, counted from when a leaseholder is reachable). With fewer than `min_updates` accepted updates a
proposer proposes a *skipped* head (parent's params, empty cohort), and validators accept a skip only if
their own collection also fell short.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from .agreement import WindowAgreement
from .collector import Collector, slot_of
from .encoding import decode, encode
from .envelope import MAX_BODY_BYTES, SignedEnvelope
from .errors import DecodeError, VerificationError
from .fsm import Table, step
from .identity import PeerId
from .leases import leases_of
from .messages import MAX_UPDATE_IDS, Signed, UpdatesRequest
from .objects import (
    OUTLIER_REASONS,
    PRECOMMIT,
    PREVOTE,
    PROTOCOL_VERSION,
    VOTE_KIND,
    Head,
    HeadProposal,
    Heartbeat,
    JoinRequest,
    LeaveRequest,
    Manifest,
    QuorumCertificate,
    ReductionProposal,
    UpdateAnnouncement,
    check_admission,
    seal,
    sign_vote,
)
from .quarantine import STRIKE_REASONS, check_evidence, make_evidence, next_records

if TYPE_CHECKING:
    from .engine import Engine

TABLE: Table = {
    ("collecting", "close"): "closed",
    ("collecting", "head"): "collecting",
    ("closed", "head"): "collecting",
}

WINDOWS_AHEAD = 2  # messages for windows this far ahead are held, later ones dropped
WITHDRAWN_WINDOWS = 2
MAX_HELD = 4096
METRIC_TOLERANCE = 1e-4
PROPOSER_DOMAIN = b"peerloom/proposer/v1"
JOIN_PRIORITY_DOMAIN = b"peerloom/join-priority/v1"


def proposer_of(parent: bytes, window: int, round_: int, validators: tuple[PeerId, ...]) -> PeerId:
    """The proposer of `round_` of `window` on head `parent` (spec/agreement.md): round-robin by hash, the
    validator with the smallest SHA-256(domain, parent, window, round, id)."""
    prefix = PROPOSER_DOMAIN + parent + window.to_bytes(8, "big") + round_.to_bytes(4, "big")
    return min(validators, key=lambda v: hashlib.sha256(prefix + v.to_bytes()).digest())


def next_unproven(parent: Head, roster: tuple[tuple[PeerId, int], ...],
                  proven: frozenset[PeerId]) -> tuple[PeerId, ...]:
    """The `unproven` of the head after `parent` with `roster` whose cohort's authors are `proven`
    (spec/protocol.md §4.1): the parent's unproven and the newly rostered trainers, less those that left the
    roster and those with an update in the cohort; sorted."""
    before = parent.roster_peers
    return tuple(sorted(p for p, _ in roster if (p in parent.unproven or p not in before) and p not in proven))


def join_priority(head_id: bytes, peer: PeerId) -> bytes:
    """The order in which joins pending on head `head_id` are rostered and kept (spec/protocol.md §4.1):
    SHA-256(domain, head id, peer id). Fresh each window, the same at every validator."""
    return hashlib.sha256(JOIN_PRIORITY_DOMAIN + head_id + peer.to_bytes()).digest()


def undelivered(parent: Head, manifest: Manifest, delivered: frozenset[PeerId]) -> frozenset[PeerId]:
    """Unproven trainers of `parent` that hold a lease in the next window and are not among `delivered` (the
    authors of the next head's cohort and rejected updates): the next head drops them (§4.1)."""
    if not parent.unproven:
        return frozenset()
    leases = leases_of(parent, manifest)
    return frozenset(p for p in parent.unproven if p in leases and p not in delivered)


# A window whose leaseholders are all unreachable closes at most this many window_s after it opened.
WAIT_WINDOWS = 3
# A window's deadline never runs past this many window_s after its clock started (adapted or extended).
MAX_DEADLINE_WINDOWS = 3
# Joins a validator holds at once, per manifest `max_joins` (or at least this many); more are refused.
JOIN_BACKLOG_FACTOR = 4
MIN_JOIN_BACKLOG = 64

# Announcements a head proposal names by id (spec/agreement.md §3): asked MAX_UPDATE_IDS at a time from one
# provider; a batch that is not complete after UPDATES_RETRY_S is asked of the next provider, and after
# UPDATES_ROUNDS passes over the providers the proposal is given up (its round then times out as without it).
UPDATES_RETRY_S = 1.0
UPDATES_ROUNDS = 2
# updates-get requests one peer may make of us per window: enough to fetch a whole cohort (MAX_COHORT
# ids) four times over, so an honest validator retrying never hits it.
MAX_UPDATES_REQUESTS = 512


def metrics_match(mine: Mapping[str, float], claimed: Mapping[str, float]) -> bool:
    """Same metric names, each within `METRIC_TOLERANCE` of ours. A diverged model's NaN or infinite
    metrics must be claimed exactly as such (NaN for NaN, the same infinity): `abs(x - nan) > tol` is
    False, so a plain tolerance test would let a proposer claim NaN for any value, or any value for NaN."""
    if set(mine) != set(claimed):
        return False
    for name, ours in mine.items():
        theirs = claimed[name]
        if math.isnan(ours) or math.isnan(theirs):
            if not (math.isnan(ours) and math.isnan(theirs)):
                return False
        elif math.isinf(ours) or math.isinf(theirs):
            if ours != theirs:
                return False
        elif abs(ours - theirs) > METRIC_TOLERANCE:
            return False
    return True


def head_metrics(evaluated: Mapping[str, float], train_loss: float) -> dict[str, float]:
    """A head's metrics (spec/protocol.md §2 "Head"): every metric the ``evaluate`` task reported, named
    ``test_<name>`` (``test_loss``, ``test_accuracy`` for the bundled workloads), and ``train_loss``, the
    mean of the kept updates' announced training losses."""
    return {**{f"test_{name}": float(value) for name, value in evaluated.items()}, "train_loss": float(train_loss)}


# A proposed value: the head and the signed announcements it names - its cohort's and its rejected ones.
Value = tuple[Head, tuple[SignedEnvelope, ...]]


def vote_key(window: int, round_: int, vote_step: str) -> str:
    return f"vote/{window}/{round_}/{vote_step}"


def lock_key(window: int) -> str:
    return f"lock/{window}"


def proposal_key(window: int, round_: int) -> str:
    return f"proposal/{window}/{round_}"


@attrs.define
class _Awaiting:
    """A head proposal whose named announcements are being fetched before it goes to the agreement."""

    rounds: list[HeadProposal]  # every proposal of this head taken while fetching (re-proposals in later rounds)
    signer: PeerId
    providers: list[PeerId]
    found: dict[bytes, SignedEnvelope]
    missing: list[bytes]  # named ids not found yet, in the order they are asked for
    asked: tuple[bytes, ...] = ()
    attempt: int = 0


@attrs.define
class _Check:
    """Recomputation of one proposed head: screening -> computing -> done."""

    head: Head
    updates: tuple[SignedEnvelope, ...]
    stage: str = "screening"


class ValidatorRole:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.state = "collecting"
        self.collector: Collector | None = None
        self.agreement: WindowAgreement | None = None
        self.wait_deadline: float | None = None  # set while a window waits for a reachable leaseholder
        self.armed_at: float | None = None  # when this window's clock started (None: not started yet)
        self.deadline_s = engine.manifest.window_s  # adapted to the slowest accepted update (_adapt_deadline)
        self.joins: dict[PeerId, int] = {}
        self.admitted: dict[PeerId, int] = {}  # admission policy "certificate": peer -> certified max capacity
        self.leaves: dict[PeerId, int] = {}  # rostered trainer -> window whose head drops it (signed leaves)
        # Joins withdrawn by a signed leave before any head rostered them: trainer -> window of the leave.
        # A join for that window or earlier is the withdrawn one (or a copy); a later one is a new request.
        # Entries are dropped WITHDRAWN_WINDOWS windows on (older joins are stale by then anyway).
        self.withdrawn: dict[PeerId, int] = {}
        # Idle expiry (manifest `idle_windows`): the latest window in which each trainer was heard here
        # (heartbeat, update or join), the first window this validator saw (a trainer counts as heard then:
        # a validator that just started never expires anyone early), and heartbeats taken per
        # (sender, signer, window) - one each, more is charged as heartbeat-quota.
        self.heard: dict[PeerId, int] = {}
        self.first_window: int | None = None
        self.heartbeats_taken: set[tuple[PeerId, PeerId, int]] = set()
        self.refused_expiry: set[bytes] = set()  # heads refused as expired-heard (logged once each)
        self.verdicts: dict[bytes, bool] = {}
        self.checks: dict[bytes, _Check] = {}
        self.own: Value | None = None
        self.building = False
        self.held: list[tuple[PeerId, SignedEnvelope]] = []
        self.vote_of: dict[tuple[int, int, str, PeerId], bytes | None] = {}
        # head ids proposed per (window, round), in arrival order (more than one: the proposer equivocates)
        self.proposals_in: dict[tuple[int, int], list[bytes]] = {}
        self.proposal_givers: dict[tuple[int, int], set[PeerId]] = {}  # peers that gave a head, per round
        self.proposal_envelopes: set[bytes] = set()  # ids of proposal envelopes taken (relays are dropped)
        self.proposal_signer: dict[bytes, PeerId] = {}
        self.reducer_proposals: dict[int, dict[PeerId, ReductionProposal]] = {}
        self.results: dict[int, tuple[tuple[bytes, ...], bytes]] = {}
        self.vote_envelopes: dict[tuple[int, int, str, PeerId], SignedEnvelope] = {}
        self.extra_votes: set[tuple[tuple[int, int, str, PeerId], bytes | None]] = set()  # equivocators' others
        self.visible: set[str] = set()  # record keys of this window's votes and proposals already sent
        self.evidence: dict[PeerId, tuple[SignedEnvelope, SignedEnvelope]] = {}  # not yet in a certified head
        # Proposals that name announcements by id (spec/agreement.md §3): those still fetching, by head id;
        # which of them wait for each update id; announcements taken from proposals or fetched this window;
        # updates-get requests served per peer this window.
        self.awaiting: dict[bytes, _Awaiting] = {}
        self.wanted: dict[bytes, set[bytes]] = {}
        self.requested: set[bytes] = set()  # every id asked for this window (late or duplicate answers)
        self.known_updates: dict[bytes, SignedEnvelope] = {}
        self.updates_served: dict[PeerId, int] = {}

    def _step(self, event: str) -> None:
        self.state = step("validator", TABLE, self.state, event)

    @property
    def window(self) -> int:
        return self.collector.window if self.collector is not None else -1

    # --- window lifecycle ------------------------------------------------------------------------

    def on_head(self, head: Head) -> None:
        e = self.engine
        self._step("head")
        self.collector = Collector(e, head, self._on_collector_change)
        window = self.collector.window
        self.own, self.building = None, False
        self.wait_deadline = self.armed_at = None
        self.verdicts, self.checks, self.refused_expiry = {}, {}, set()
        self.reducer_proposals = {w: v for w, v in self.reducer_proposals.items() if w >= window}
        self.proposals_in = {k: v for k, v in self.proposals_in.items() if k[0] >= window}
        self.proposal_givers = {k: v for k, v in self.proposal_givers.items() if k[0] >= window}
        self.proposal_envelopes = set()
        self.awaiting, self.wanted, self.known_updates, self.updates_served = {}, {}, {}, {}
        self.requested = set()
        self.results = {w: v for w, v in self.results.items() if w >= window}
        self.evidence = {p: x for p, x in self.evidence.items() if p not in head.quarantined}
        for p in head.left + head.expired:  # gone: a later join (with its certificate) starts afresh
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
        self.vote_envelopes = {k: v for k, v in self.vote_envelopes.items() if k[0] >= window}
        self.vote_of = {k: v for k, v in self.vote_of.items() if k[0] >= window}
        self.extra_votes = {x for x in self.extra_votes if x[0][0] >= window}
        self.visible = set()
        e.log("window-open", window=window, leases=len(self.collector.leases))
        m = e.manifest
        self.agreement = WindowAgreement(self, e.me, m.validators, m.quorum, timeout_s=e.config.agreement_timeout_s,
                                         first_propose_extra_s=m.window_s)
        if not self._restore(window):
            self.agreement.start(0)
        self._arm_deadline()
        held, self.held = self.held, []
        for peer, envelope in held:
            self.on_signed(peer, envelope)

    def _restore(self, window: int) -> bool:
        """After a restart, resume the agreement from this window's persisted votes. True if any."""
        e = self.engine
        prefix = f"vote/{window}/"
        cast = [k[len(prefix):].split("/") for k in e.records if k.startswith(prefix)]
        if not cast:
            return False
        round_ = max(int(r) for r, _ in cast)
        steps = {s for r, s in cast if int(r) == round_}
        locked, locked_round = None, -1
        if lock_key(window) in e.records:
            record = decode(e.records[lock_key(window)], max_bytes=e.config.max_message_bytes)
            proposal = HeadProposal.from_cbor(record["proposal"])
            locked, locked_round = (proposal.head, proposal.updates + proposal.rejected), record["round"]
            self.verdicts[proposal.head.id] = True  # we checked it before we locked on it
        assert self.agreement is not None
        self.agreement.restore(round_, PRECOMMIT if PRECOMMIT in steps else PREVOTE, locked, locked_round)
        e.log("resume-agreement", window=window, round=round_)
        for key in sorted(k for k in e.records if k.startswith(prefix)):  # re-announce what we signed
            self.visible.add(key)
            envelope = SignedEnvelope.from_bytes(e.records[key])
            e.broadcast(Signed(envelope=envelope), roles=("validator",))
            self._on_vote(e.me, envelope)
        return True

    def _arm_deadline(self) -> None:
        """Start the window's clock: `window_s` once a trainer holding a lease (or, with lease expiry, a
        next-ranked claimant) is reachable or a join is waiting, and in any case at most
        `WAIT_WINDOWS * window_s` after the window opened here (spec/protocol.md §6).

        A window that no leaseholder can reach would only be skipped, so it first waits for one - but never
        for ever: leaseholders that never come (Sybil joiners, say) must not stall the chain, and the
        skipped head is also what rosters a waiting joiner.
        """
        e, c = self.engine, self.collector
        if c is None or self.state != "collecting" or self.armed_at is not None:
            return
        key = ("close", "validator", c.window)
        workers = set(c.leases) | (set(c.claims) if e.manifest.lease_s > 0 else set())
        joining = any(p not in c.head.roster_peers and p not in self.withdrawn for p in self.joins)
        if not workers & set(e.peers_with("trainer")) and not joining:
            if self.wait_deadline is None:
                self.wait_deadline = e.now + WAIT_WINDOWS * e.manifest.window_s
                e.set_timer(key, self.wait_deadline)
                e.log("window-waiting", window=c.window, until=self.wait_deadline)
            return
        self.armed_at = e.now
        deadline = e.now + self.deadline_s
        e.set_timer(key, deadline if self.wait_deadline is None else min(deadline, self.wait_deadline))
        if e.manifest.lease_s > 0:
            e.set_timer(("claims", "validator", c.window), e.now + e.manifest.lease_s)

    def _on_collector_change(self) -> None:
        c = self.collector
        if c is not None and self.state == "collecting" and c.complete():
            self._close()
        for check in list(self.checks.values()):
            if check.stage == "screening":
                self._advance(check)

    def on_timer(self, key: tuple[Any, ...]) -> None:
        c = self.collector
        if c is None:
            return
        if key[:2] == ("claims", "validator") and key[2] == c.window:
            c.claims_open = True  # leases without an update may now be claimed by the next-ranked trainer
            self.engine.log("leases-expired", window=c.window)
            self._on_collector_change()
        elif key[:2] == ("close", "validator") and key[2] == c.window and self.state == "collecting":
            if self._extend_deadline():
                return
            self.engine.log("window-deadline", window=c.window, reported=len(c.entries), leases=len(c.leases))
            self._close()
        elif key[0] == "agreement" and key[1] == c.window and self.agreement is not None:
            self.agreement.on_timeout(key[2], key[3])
        elif key[0] == "updates" and key[1] == c.window:
            waiting = self.awaiting.get(key[2])
            if waiting is not None and waiting.attempt == key[3]:
                self._ask_next_provider(key[2], waiting)

    def _extend_deadline(self) -> bool:
        """At the deadline, a window with fewer than `min_updates` accepted updates waits on (in steps of
        half a `window_s`) while a leaseholder is reachable, up to `MAX_DEADLINE_WINDOWS * window_s` after
        its clock started: a loaded machine's slow honest cohort is not skipped (spec/protocol.md §6)."""
        e, c = self.engine, self.collector
        assert c is not None
        m = e.manifest
        if self.armed_at is None:
            return False  # the wait deadline (no leaseholder reachable): nothing to wait for
        limit = self.armed_at + MAX_DEADLINE_WINDOWS * m.window_s
        accepted = sum(1 for x in c.entries.values() if x.state == "accepted")
        reachable = set(c.leases) & set(e.peers_with("trainer"))
        if accepted >= m.min_updates or not reachable or e.now >= limit:
            return False
        e.log("window-extended", window=c.window, accepted=accepted, needed=m.min_updates)
        e.set_timer(("close", "validator", c.window), min(limit, e.now + m.window_s / 2))
        return True

    def _adapt_deadline(self) -> None:
        """The next window's deadline from this one's slowest accepted update (spec/protocol.md §6): 1.5 times
        its time since the clock started, within [window_s, MAX_DEADLINE_WINDOWS * window_s]; after a window
        that closed at its deadline with leases unreported, 1.25 times the current deadline. Local timing
        only: heads do not depend on it."""
        e, c = self.engine, self.collector
        assert c is not None
        m = e.manifest
        if self.armed_at is None:
            return
        slowest = max((t - self.armed_at for t in c.accepted_at.values()), default=0.0)
        target = 1.25 * self.deadline_s if not c.complete() else 1.5 * slowest
        deadline_s = min(max(target, m.window_s), MAX_DEADLINE_WINDOWS * m.window_s)
        if abs(deadline_s - self.deadline_s) > 1e-9:
            e.log("deadline-adapted", window=c.window, deadline_s=round(deadline_s, 3),
                  slowest_s=round(slowest, 3))
        self.deadline_s = deadline_s

    def _close(self) -> None:
        e, c = self.engine, self.collector
        assert c is not None and self.agreement is not None
        self._step("close")
        self._adapt_deadline()
        c.closed = True
        e.cancel_timer(("close", "validator", c.window))
        if len(c.cohort()) < e.manifest.min_updates:
            e.log("window-short", window=c.window, accepted=len(c.cohort()), needed=e.manifest.min_updates)
        self.agreement.progress()

    # --- values: our own head, and recomputation of proposed ones ---------------------------------

    def own_value(self) -> Value | None:
        """The head this validator would propose: available once its window closed and it computed it."""
        e, c = self.engine, self.collector
        if c is None or not c.closed:
            return None
        if self.own is None and not self.building:
            cohort = c.cohort()
            if len(cohort) < e.manifest.min_updates:
                self._own_skip(len(cohort))
            else:
                self.building = True
                self._compute(tuple(x.envelope for x in cohort), None, self._built)
        return self.own

    def _own_skip(self, accepted: int) -> None:
        e, c = self.engine, self.collector
        assert c is not None
        skip = self._skip_head(c.head, self._pending_evidence(c.head))
        e.log("window-skipped", window=c.window, accepted=accepted, needed=e.manifest.min_updates)
        self.own = (skip, ())
        self.verdicts[skip.id] = True

    def _pending_evidence(self, parent: Head) -> tuple[tuple[SignedEnvelope, SignedEnvelope], ...]:
        quarantined = parent.quarantined
        return tuple(x for p, x in sorted(self.evidence.items()) if p not in quarantined)

    def _built(self, result: dict[str, Any] | None) -> None:
        self.building = False
        e, c = self.engine, self.collector
        if result is None or c is None or result["window"] != c.window:
            return
        for update_id, reason in result["outliers"]:
            c.reject_outlier(update_id, reason)
        if len(result["kept"]) < e.manifest.min_updates:
            self._own_skip(len(result["kept"]))
        else:
            struck = tuple(x.envelope for x in c.struck())
            head = self._make_head(result, struck, self._pending_evidence(c.head))
            kept = set(result["kept"])
            self.own = (head, tuple(u for u in result["candidates"] if u.id in kept) + struck)
            self.verdicts[head.id] = True
            if head.window not in self.results:
                self.results[head.window] = (head.cohort, head.params_digest)
                for reducer, proposal in self.reducer_proposals.get(head.window, {}).items():
                    self._compare(reducer, proposal)
        if self.agreement is not None:
            self.agreement.progress()

    def _skip_head(self, parent: Head, evidence: tuple[tuple[SignedEnvelope, SignedEnvelope], ...]) -> Head:
        window = parent.window + 1
        quarantine, strikes = next_records(parent, window, (), (a.signer for a, _ in evidence), self.engine.manifest)
        left = self._departures(parent)
        expired = self._expirations(parent, left)
        roster = self._next_roster(parent, quarantine, left, expired)
        return Head(revision=parent.revision, parent=parent.id, window=window, skipped=True,
                    params=parent.params, params_digest=parent.params_digest, cohort=(),
                    roster=roster, quarantine=quarantine,
                    metrics=parent.metrics, strikes=strikes, evidence=evidence, outer_state=parent.outer_state,
                    outer_state_digest=parent.outer_state_digest, left=left, expired=expired,
                    unproven=next_unproven(parent, roster, frozenset()))

    def _make_head(self, result: dict[str, Any], rejected: tuple[SignedEnvelope, ...],
                   evidence: tuple[tuple[SignedEnvelope, SignedEnvelope], ...]) -> Head:
        """The head of a reduction `result`, with the quarantine records its rejections and evidence imply."""
        e, c = self.engine, self.collector
        assert c is not None
        parent, window = c.head, c.window
        quarantine, strikes = next_records(parent, window, (u.signer for u in rejected),
                                           (a.signer for a, _ in evidence), e.manifest)
        kept = set(result["kept"])
        proven = frozenset(u.signer for u in result["candidates"] if u.id in kept)
        left = self._departures(parent)
        expired = self._expirations(parent, left, proven | {u.signer for u in rejected})
        roster = self._next_roster(parent, quarantine, left, expired)
        return Head(revision=e.revision.id, parent=parent.id, window=window, skipped=False,
                    params=result["params"], params_digest=result["params_digest"],
                    cohort=tuple(sorted(result["kept"])),
                    roster=roster, quarantine=quarantine,
                    metrics=result["metrics"], strikes=strikes, rejected=tuple(sorted(u.id for u in rejected)),
                    evidence=evidence, outer_state=result["outer_state"],
                    outer_state_digest=result["outer_state_digest"], left=left, expired=expired,
                    unproven=next_unproven(parent, roster, proven))

    def _compute(self, candidates: tuple[SignedEnvelope, ...], check: _Check | None, done: Any) -> None:
        """Screen the candidates against each other, reduce the rest onto the parent (canonical order),
        evaluate, and call ``done(result)`` with the task results (or None on failure). The result names
        outliers and kept members by update id."""
        e, c = self.engine, self.collector
        assert c is not None
        candidates = tuple(sorted(candidates, key=lambda u: u.id))
        entries = [c.entry_for(u) for u in candidates]
        assert all(x is not None for x in entries)
        window = c.window
        args = c.reduce_args(entries)

        def reduced(result: dict[str, Any]) -> None:
            e.note_stored(result["params"])
            if result.get("outer_state") is not None:
                e.note_stored(result["outer_state"])
            outliers = [(candidates[i].id, f"screen-{reason}") for i, reason in result["outliers"]]
            kept = [candidates[i].id for i in result["kept"]]
            if not kept:
                done({"window": window, "outliers": outliers, "kept": kept, "candidates": candidates})
                return
            train_loss = sum(entries[i].announcement.train_loss for i in result["kept"]) / len(kept)

            def evaluated(metrics: dict[str, Any]) -> None:
                done({"window": window, "outliers": outliers, "kept": kept, "candidates": candidates,
                      "params": result["params"], "params_digest": result["params_digest"],
                      "outer_state": result.get("outer_state"), "outer_state_digest": result.get("outer_state_digest"),
                      "metrics": head_metrics(metrics, train_loss)})

            e.run_task("evaluate", {"params": result["params"]}, evaluated, lambda why: done(None))

        e.run_task("reduce", args, reduced, lambda why: done(None))

    def validity(self, head: Head, updates: tuple[SignedEnvelope, ...]) -> bool | None:
        """True/False once this validator has recomputed `head`; None while it is still checking."""
        if head.id in self.verdicts:
            return self.verdicts[head.id]
        c = self.collector
        if c is None:
            return False
        reason = self._structural_fault(head, updates)
        if reason in ("expired-heard", "join-withdrawn"):
            # Not cached: refused only while this validator's own view differs and no quorum backs the head
            # (spec/agreement.md §6, view-dependent validity).
            if head.id not in self.refused_expiry:
                self.refused_expiry.add(head.id)
                self.engine.log("proposal-invalid", window=head.window, reason=reason)
                self.engine.stats["proposals_invalid"] += 1
            return False
        if reason:
            self.engine.log("proposal-invalid", window=head.window, reason=reason)
            self.verdicts[head.id] = False
            return False
        if head.skipped:
            if not c.closed:
                return None
            self.verdicts[head.id] = len(c.cohort()) < self.engine.manifest.min_updates
            return self.verdicts[head.id]
        check = self.checks.get(head.id)
        if check is None:
            check = self.checks[head.id] = _Check(head=head, updates=updates)
            proposer = self.proposer_of_head(head)
            for u in updates:
                c.offer(proposer, u, force=True)
            self._advance(check)
        return self.verdicts.get(head.id)

    def _evidence_fault(self, head: Head) -> str:
        e, c = self.engine, self.collector
        assert c is not None
        signers = []
        for pair in head.evidence:
            try:
                signers.append(check_evidence(pair, e.revision.id, e.manifest))
            except (DecodeError, VerificationError):
                return "bad-evidence"
        if signers != sorted(set(signers)) or set(signers) & c.head.quarantined:
            return "bad-evidence"
        return ""

    def proposer_of_head(self, head: Head) -> PeerId:
        """Who proposed `head` (charged for its bad updates); ourselves for our own head."""
        return self.proposal_signer.get(head.id, self.engine.me)

    def _structural_fault(self, head: Head, updates: tuple[SignedEnvelope, ...]) -> str:
        e, c = self.engine, self.collector
        assert c is not None
        parent = c.head
        if head.revision != e.revision.id or head.parent != parent.id or head.window != c.window:
            return "wrong-parent"
        fault = self._evidence_fault(head)
        if fault:
            return fault
        cohort_ids, rejected_ids = set(head.cohort), set(head.rejected)
        cohort = tuple(u for u in updates if u.id in cohort_ids)
        rejected = tuple(u for u in updates if u.id in rejected_ids)
        quarantine, strikes = next_records(parent, c.window, (u.signer for u in rejected),
                                           (a.signer for a, _ in head.evidence), e.manifest)
        if (head.quarantine, head.strikes) != (quarantine, strikes):
            return "quarantine-mismatch"
        roster, before, left = dict(head.roster), dict(parent.roster), set(head.left)
        if list(head.left) != sorted(left) or any(p not in before or p in roster for p in left) or \
                any(self.leaves.get(p, c.window + 1) > c.window for p in left):
            return "left-unknown"  # a departure without a signed leave held here for this window
        expired = set(head.expired)
        silent = frozenset() if head.skipped else \
            undelivered(parent, e.manifest, frozenset(u.signer for u in cohort + rejected)) - left
        if list(head.expired) != sorted(expired) or expired & left or \
                (e.manifest.idle_windows == 0 and not expired <= silent) or \
                any(p not in before or p in roster for p in expired):
            return "expired-unknown"  # not a peer of the parent's roster that the new roster drops
        if not silent <= expired:
            return "unproven-kept"  # an unproven leaseholder that delivered nothing stays rostered
        if any(not self._idle(p, c.window) for p in expired - silent) and not self._quorum_backs(head.id):
            return "expired-heard"  # this validator heard it within idle_windows: not valid here
        if any(roster.get(p) != cap for p, cap in before.items() if p not in left and p not in expired):
            return "roster-shrunk"  # the roster shrinks only by the peers that left or expired
        if any(p in self.withdrawn for p in roster if p not in before) and not self._quorum_backs(head.id):
            return "join-withdrawn"  # it withdrew its join here: not valid here, unless a quorum backs it
        if any(p not in self.joins and p not in before for p in roster) or \
                any(p in head.quarantined for p in roster if p not in before):
            return "roster-unknown-join"
        if e.manifest.admission == "certificate" and any(
                p not in self.admitted or cap > self.admitted[p] for p, cap in roster.items() if p not in before):
            return "roster-not-admitted"
        if e.manifest.max_joins and sum(1 for p in roster if p not in before) > e.manifest.max_joins:
            return "roster-too-many-joins"
        if head.unproven != next_unproven(parent, head.roster, frozenset(u.signer for u in cohort)):
            return "unproven-mismatch"
        if head.skipped:
            if updates or head.cohort or head.rejected or head.params != parent.params or \
                    head.metrics != parent.metrics or head.outer_state != parent.outer_state:
                return "bad-skip"
            return ""
        ids = tuple(u.id for u in cohort)
        if len(cohort) + len(rejected) != len(updates) or head.cohort != tuple(sorted(ids)) or \
                len(set(ids)) != len(ids) or head.rejected != tuple(sorted(u.id for u in rejected)):
            return "cohort-mismatch"
        anns: dict[bytes, UpdateAnnouncement] = {}
        for u in updates:
            # An envelope our collector took was verified on arrival: same bytes, same signature.
            entry = c.entry_for(u)
            if entry is not None and entry.envelope == u:
                anns[u.id] = entry.announcement
                continue
            try:
                anns[u.id] = UpdateAnnouncement.from_cbor(u.open(UpdateAnnouncement.KIND, PROTOCOL_VERSION))
            except (DecodeError, VerificationError):
                return "cohort-update-rejected"
        if len({slot_of(u.signer, anns[u.id]) for u in updates}) != len(updates):
            return "cohort-duplicate-lease"
        shards = [s for u in cohort for s in anns[u.id].shards]
        if len(shards) != len(set(shards)):
            return "cohort-duplicate-lease"  # a leaseholder's update and a claim on it: one update per lease
        if len(cohort) < e.manifest.min_updates:
            return "cohort-too-small"
        if {u.signer for u in cohort} & parent.quarantined:
            return "cohort-quarantined"
        return ""

    def _advance(self, check: _Check) -> None:
        """Once every named update is screened here: cohort members must pass individual screening, rejected
        ones must fail it deterministically or be outliers, which the recomputation must confirm."""
        c = self.collector
        assert c is not None
        if check.stage != "screening":
            return
        head = check.head
        cohort_ids, candidates, outliers, pending = set(head.cohort), [], set(), False
        for u in check.updates:
            entry = c.entry_for(u)
            if entry is None:
                state = "bad"
            elif entry.state == "accepted" or (entry.state == "rejected" and entry.reason in OUTLIER_REASONS):
                state = "ok"
            elif entry.state == "rejected" and entry.reason in STRIKE_REASONS:
                state = "struck"
            elif entry.state == "rejected" and not c.retry(u.id, [self.proposer_of_head(head),
                                                                  *self.engine.peers_with("validator"),
                                                                  *self.engine.peers_with("reducer")]):
                state = "bad"
            else:
                state, pending = "pending", True
            if state == "bad" or (u.id in cohort_ids and state == "struck"):
                check.stage = "done"
                self._verdict(head, False, "cohort-update-rejected")
                return
            if state == "ok":
                candidates.append(u)
                if u.id not in cohort_ids:
                    outliers.add(u.id)
        if pending:
            return
        check.stage = "computing"
        self._compute(tuple(candidates), check, lambda mine: self._compared(check, mine, outliers))

    def _compared(self, check: _Check, mine: dict[str, Any] | None, outliers: set[bytes]) -> None:
        check.stage = "done"
        head = check.head
        if mine is None or "params" not in mine:
            self._verdict(head, False, "recompute-failed")
        elif {p for p, _ in mine["outliers"]} != outliers:
            self._verdict(head, False, "outliers-mismatch")
        elif (mine["params"], mine["params_digest"], mine["outer_state_digest"]) != (
                head.params, head.params_digest, head.outer_state_digest) or mine["outer_state"] != head.outer_state:
            self._verdict(head, False, "params-mismatch")
        elif not metrics_match(mine["metrics"], head.metrics):
            self._verdict(head, False, "metrics-mismatch")
        else:
            first = head.window not in self.results
            self.results[head.window] = (head.cohort, head.params_digest)
            if first:  # reducer proposals that arrived before we had a result of our own
                for reducer, proposal in self.reducer_proposals.get(head.window, {}).items():
                    self._compare(reducer, proposal)
            self._verdict(head, True, "")

    def _verdict(self, head: Head, ok: bool, reason: str) -> None:
        self.verdicts[head.id] = ok
        self.engine.log("proposal-checked", window=head.window, head=head.id.hex(), ok=ok, reason=reason)
        if not ok:
            self.engine.stats["proposals_invalid"] += 1
        if self.agreement is not None and self.collector is not None and head.window == self.collector.window:
            self.agreement.progress()

    def _departures(self, head: Head) -> tuple[PeerId, ...]:
        """Trainers of `head`'s roster that sent a leave for the next window (or an earlier one), sorted."""
        rostered = head.roster_peers
        return tuple(sorted(p for p, w in self.leaves.items() if w <= head.window + 1 and p in rostered))

    def _idle(self, peer: PeerId, window: int) -> bool:
        """True if this validator has not heard `peer` in the last `idle_windows` windows up to `window`."""
        idle = self.engine.manifest.idle_windows
        first = window if self.first_window is None else self.first_window
        return idle > 0 and max(self.heard.get(peer, -1), first) <= window - idle

    def _quorum_backs(self, head_id: bytes) -> bool:
        """A quorum of prevotes (or precommits) for `head_id` in some round of this window: at least f + 1
        honest validators found the head valid, its expiries included (spec/agreement.md §6)."""
        a = self.agreement
        if a is None:
            return False
        tallies = [*a.prevotes.values(), *a.precommits.values()]
        return any(sum(head_id in v for v in votes.values()) >= a.quorum for votes in tallies)

    def _expirations(self, head: Head, left: tuple[PeerId, ...],
                     delivered: frozenset[PeerId] | None = None) -> tuple[PeerId, ...]:
        """Trainers of `head`'s roster (not leaving) unheard here for `idle_windows` windows, and, for a head
        with a cohort (`delivered`: the authors of its cohort and rejected updates), the unproven
        leaseholders of the window that delivered nothing (spec/protocol.md §4.1); sorted."""
        window = head.window + 1
        silent = undelivered(head, self.engine.manifest, delivered) if delivered is not None else frozenset()
        return tuple(sorted(p for p, _ in head.roster if p not in left and (self._idle(p, window) or p in silent)))

    def _make_room_for_join(self, joiner: PeerId) -> bool:
        """True if a new join of `joiner` may be held: the pending joins (not yet rostered) are fewer than
        the backlog, or `joiner` ranks before the last of them by `join_priority`, which is then dropped.
        Every honest validator that hears the same joins keeps the same ones, whatever their order."""
        c = self.collector
        assert c is not None
        backlog = max(JOIN_BACKLOG_FACTOR * self.engine.manifest.max_joins, MIN_JOIN_BACKLOG)
        pending = [p for p in self.joins if p not in c.head.roster_peers]
        if len(pending) < backlog:
            return True
        last = max(pending, key=lambda p: join_priority(c.head.id, p))
        if join_priority(c.head.id, joiner) >= join_priority(c.head.id, last):
            return False
        del self.joins[last]
        self.admitted.pop(last, None)
        return True

    def _next_roster(self, head: Head, quarantine: tuple[tuple[PeerId, int], ...],
                     left: tuple[PeerId, ...], expired: tuple[PeerId, ...] = ()) -> tuple[tuple[PeerId, int], ...]:
        """The parent's roster less the peers that `left` or `expired`, plus joins seen here, except from
        peers quarantined by the new head."""
        gone = set(left) | set(expired)
        roster = {p: c for p, c in head.roster if p not in gone}
        quarantined = {p for p, until in quarantine if until > head.window + 2}
        room = self.engine.manifest.max_joins or len(self.joins)  # joins are taken by priority (§4.1)
        for peer, capacity in sorted(self.joins.items(), key=lambda kv: join_priority(head.id, kv[0])):
            if room and peer not in quarantined and peer not in roster and peer not in gone and \
                    peer not in self.withdrawn:
                roster[peer] = min(capacity, self.engine.manifest.max_capacity)
                room -= 1
        return tuple(sorted(roster.items()))

    # --- agreement host: proposer, votes, proposals, timers, decision -----------------------------

    def proposer(self, round_: int) -> PeerId:
        c = self.collector
        assert c is not None
        return proposer_of(c.head.id, c.window, round_, self.engine.manifest.validators)

    def cast(self, vote_step: str, round_: int, head_id: bytes | None) -> None:
        e, window = self.engine, self.window
        key = vote_key(window, round_, vote_step)
        if key in e.records:  # restarted: stand by what we signed, never sign anything else
            e.log("double-vote-refused", window=window, round=round_, step=vote_step)
            return
        vote = sign_vote(e.identity, e.revision.id, window, round_, vote_step, head_id)

        def send() -> None:
            self.visible.add(key)
            e.stats["votes_cast"] += 1
            e.log("vote", window=window, round=round_, step=vote_step, head=head_id.hex() if head_id else None)
            e.broadcast(Signed(envelope=vote), roles=("validator",))
            self._on_vote(e.me, vote)

        def persist_vote() -> None:
            e.persist_then(key, vote.to_bytes(), send)

        locked = self.agreement.locked if self.agreement is not None else None
        if vote_step == PRECOMMIT and head_id is not None and locked is not None:
            # The lock record keeps every envelope, whatever the size: a restart re-checks nothing from it.
            proposal = self._head_proposal(window, round_, None, locked[0], locked[1], carry=True)
            e.persist_then(lock_key(window), encode({"round": round_, "proposal": proposal.to_cbor()}), persist_vote)
        else:
            persist_vote()

    def propose(self, round_: int, head: Head, updates: tuple[SignedEnvelope, ...], valid_round: int | None) -> None:
        e, window = self.engine, self.window
        key = proposal_key(window, round_)
        if key in e.records:
            envelope = SignedEnvelope.from_bytes(e.records[key])
        else:
            envelope = seal(e.identity, self._head_proposal(window, round_, valid_round, head, updates))
            if len(envelope.body) > MAX_BODY_BYTES:  # even by id (a huge roster): nobody could open it
                e.log("proposal-too-large", window=window, round=round_, bytes=len(envelope.body))
                return  # the round times out as a silent proposer's would

        def send() -> None:
            self.visible.add(key)
            e.log("head-proposal", window=window, round=round_, head=head.id.hex(), skipped=head.skipped)
            e.broadcast(Signed(envelope=envelope), roles=("validator",))
            self._on_proposal(e.me, envelope)

        if key in e.records:
            send()
        else:
            e.persist_then(key, envelope.to_bytes(), send)

    def _head_proposal(self, window: int, round_: int, valid_round: int | None, head: Head,
                       updates: tuple[SignedEnvelope, ...], *, carry: bool | None = None) -> HeadProposal:
        """The proposal of `head`. It carries the named announcements when `carry`, or (None) while they
        and the head fit in `proposal_carry_bytes`; otherwise it names them by id only, through the head's
        `cohort` and `rejected` (spec/agreement.md §3)."""
        if carry is None:
            size = len(head.to_bytes()) + sum(len(u.to_bytes()) for u in updates)
            # Never past what an envelope body may hold, whatever the setting (4 KiB for the other fields).
            carry = size <= min(self.engine.config.proposal_carry_bytes, MAX_BODY_BYTES - 4096)
        if not carry:
            updates = ()
        rejected = set(head.rejected)
        return HeadProposal(revision=self.engine.revision.id, window=window, round=round_, valid_round=valid_round,
                            head=head, updates=tuple(u for u in updates if u.id not in rejected),
                            rejected=tuple(u for u in updates if u.id in rejected))

    def schedule(self, timeout: str, round_: int, delay_s: float) -> None:
        self.engine.set_timer(("agreement", self.window, timeout, round_), self.engine.now + delay_s)

    def decide(self, head: Head, round_: int, precommits: dict[PeerId, bytes]) -> None:
        e = self.engine
        cert = QuorumCertificate.from_votes(head.id, head.window, round_, precommits)
        e.verify_certified(head, cert)
        e.log("decide", window=head.window, round=round_, head=head.id.hex())
        e.adopt(head, cert)

    # --- messages --------------------------------------------------------------------------------

    def _hold(self, peer: PeerId, envelope: SignedEnvelope, window: Any) -> bool:
        """Hold messages for a window a little ahead of ours; True if the message was consumed here."""
        if not isinstance(window, int) or window <= self.window:
            return window != self.window
        if window <= self.window + WINDOWS_AHEAD and len(self.held) < MAX_HELD:
            self.held.append((peer, envelope))
        return True

    def _on_vote(self, peer: PeerId, vote: SignedEnvelope) -> None:
        e = self.engine
        body = vote.open(VOTE_KIND, PROTOCOL_VERSION)
        if set(body) != {"revision", "window", "round", "step", "head"}:
            raise DecodeError("bad-fields", "vote")
        window, round_, vote_step, head_id = body["window"], body["round"], body["step"], body["head"]
        if body["revision"] != e.revision.id:
            raise VerificationError("wrong-revision", "vote")
        if vote.signer not in e.manifest.validators:
            raise VerificationError("not-a-validator", str(vote.signer))
        if vote_step not in (PREVOTE, PRECOMMIT) or not isinstance(round_, int) or isinstance(round_, bool) or \
                round_ < 0 or not (head_id is None or isinstance(head_id, bytes)):
            raise DecodeError("bad-field", "vote")
        if self._hold(peer, vote, window):
            return
        key = (window, round_, vote_step, vote.signer)
        if key in self.vote_of:
            if self.vote_of[key] == head_id:
                return  # a duplicate
            first = (key, head_id) not in self.extra_votes
            if first:
                self.extra_votes.add((key, head_id))
                e.stats["equivocations"] += 1
                e.reject(vote.signer, "equivocation", f"{vote.signer} {vote_step} window {window} round {round_}")
                if vote.signer not in self.evidence and vote.signer != e.me:
                    # Transferable evidence: the next head this validator proposes quarantines the signer.
                    self.evidence[vote.signer] = make_evidence(self.vote_envelopes[key], vote)
                    e.log("evidence", validator=str(vote.signer), window=window, round=round_, step=vote_step)
                if peer == vote.signer:
                    e.broadcast(Signed(envelope=vote), roles=("validator",))
                assert self.agreement is not None
                self.agreement.on_vote(vote.signer, vote_step, round_, head_id, vote.signature)
            return
        self.vote_of[key] = head_id
        self.vote_envelopes[key] = vote
        if peer == vote.signer and peer != e.me:
            # Relay votes heard from their signer (Tendermint gossips votes): every honest validator sees
            # each vote that reached one of them, so a validator that signs different votes for different
            # recipients is caught with transferable evidence. One hop only: no loops.
            e.broadcast(Signed(envelope=vote), roles=("validator",))
        assert self.agreement is not None
        self.agreement.on_vote(vote.signer, vote_step, round_, head_id, vote.signature)

    def _on_proposal(self, peer: PeerId, envelope: SignedEnvelope) -> None:
        e = self.engine
        if envelope.id in self.proposal_envelopes:
            return  # a relay of a proposal we already took
        proposal = HeadProposal.from_cbor(envelope.open(HeadProposal.KIND, PROTOCOL_VERSION))
        if proposal.revision != e.revision.id:
            raise VerificationError("wrong-revision", "head-proposal")
        if self._hold(peer, envelope, proposal.window):
            return
        if envelope.signer != self.proposer(proposal.round):
            e.reject(peer, "not-proposer", f"round {proposal.round}")
            return
        key = (proposal.window, proposal.round)
        heads = self.proposals_in.setdefault(key, [])
        if proposal.head.id in heads:
            return
        givers = self.proposal_givers.setdefault(key, set())
        if peer in givers:
            # One head per round from each peer: the proposer sent us two (equivocation), or a relayer
            # relayed more than the one it took first (honest ones never do).
            e.stats["equivocations"] += 1
            e.reject(peer, "proposal-equivocation", f"{envelope.signer} round {proposal.round}")
            return
        if heads:
            # The proposer showed others another head. Keep it: the polka and decide rules need in hand
            # whichever head a quorum votes for (spec/agreement.md §5).
            e.stats["equivocations"] += 1
            e.log("proposal-conflict", window=proposal.window, round=proposal.round, via=str(peer))
        givers.add(peer)
        heads.append(proposal.head.id)
        self.proposal_envelopes.add(envelope.id)
        self.proposal_signer.setdefault(proposal.head.id, envelope.signer)
        if len(heads) == 1 and peer == envelope.signer and peer != e.me:
            # Relay the proposal we take first (the one we prevote), one hop, like votes: a validator shown
            # another head by an equivocating proposer still gets the one a quorum prevotes (Tendermint
            # gossips proposals). Each peer gives at most one head per round, so at most one per validator
            # is kept.
            e.broadcast(Signed(envelope=envelope), roles=("validator",))
        carried = proposal.updates + proposal.rejected
        for u in carried:
            self.known_updates.setdefault(u.id, u)
        named = proposal.head.cohort + proposal.head.rejected
        if len(carried) == len(named) or not {u.id for u in carried} <= set(named):
            # Everything carried, or a carried envelope the head does not name: `validity` judges it as is.
            self._to_agreement(proposal, carried, envelope.signer)
            return
        found = {u.id: u for u in carried}
        for update_id in named:
            if update_id not in found and (known := self._known_update(update_id)) is not None:
                found[update_id] = known
        if len(found) == len(named):
            self._to_agreement(proposal, tuple(found[i] for i in named), envelope.signer)
            return
        self._fetch_named(peer, envelope.signer, proposal, found)

    def _to_agreement(self, proposal: HeadProposal, updates: tuple[SignedEnvelope, ...], signer: PeerId) -> None:
        assert self.agreement is not None
        self.agreement.on_proposal(proposal.round, proposal.head, updates, proposal.valid_round, signer)

    def _known_update(self, update_id: bytes) -> SignedEnvelope | None:
        """An announcement of this window we hold: taken by the collector, carried by a proposal, or fetched."""
        entry = self.collector.by_id.get(update_id) if self.collector is not None else None
        return entry.envelope if entry is not None else self.known_updates.get(update_id)

    def _fetch_named(self, giver: PeerId, signer: PeerId, proposal: HeadProposal,
                     found: dict[bytes, SignedEnvelope]) -> None:
        """Ask for the announcements `proposal` names and we lack - first of the peer that gave it, then its
        proposer, then the other validators - and hand it to the agreement once all are here."""
        e, head = self.engine, proposal.head
        if head.id in self.awaiting:
            self.awaiting[head.id].rounds.append(proposal)
            return
        providers = list(dict.fromkeys(p for p in (giver, signer, *sorted(e.peers_with("validator")))
                                       if p != e.me))
        missing = [i for i in head.cohort + head.rejected if i not in found]
        waiting = self.awaiting[head.id] = _Awaiting(rounds=[proposal], signer=signer, providers=providers,
                                                      found=found, missing=missing)
        for update_id in missing:
            self.wanted.setdefault(update_id, set()).add(head.id)
        e.log("proposal-fetching", window=proposal.window, round=proposal.round, missing=len(missing))
        self._ask(head.id, waiting)

    def _ask(self, head_id: bytes, waiting: _Awaiting) -> None:
        """Ask the current provider for the next batch of missing announcements (re-armed retry timer)."""
        e = self.engine
        if not waiting.providers:
            return
        provider = waiting.providers[waiting.attempt % len(waiting.providers)]
        waiting.asked = tuple(waiting.missing[:MAX_UPDATE_IDS])
        self.requested.update(waiting.asked)
        e.send(provider, UpdatesRequest(window=self.window, ids=waiting.asked))
        e.set_timer(("updates", self.window, head_id, waiting.attempt), e.now + UPDATES_RETRY_S)

    def _ask_next_provider(self, head_id: bytes, waiting: _Awaiting) -> None:
        waiting.attempt += 1
        if waiting.attempt >= UPDATES_ROUNDS * max(1, len(waiting.providers)):
            del self.awaiting[head_id]
            for update_id in waiting.missing:
                heads = self.wanted.get(update_id, set())
                heads.discard(head_id)
                if not heads:
                    self.wanted.pop(update_id, None)
            self.engine.stats["proposals_unavailable"] += 1
            first = waiting.rounds[0]
            self.engine.log("proposal-unavailable", window=first.window, round=first.round,
                            missing=len(waiting.missing))
            return
        self._ask(head_id, waiting)

    def _on_named_update(self, envelope: SignedEnvelope) -> None:
        """An announcement a waiting proposal names: its id is the hash of these very bytes, so whoever sent
        it, it is the named one (its signature and content are checked by `validity`, charged to the
        proposer)."""
        self.known_updates.setdefault(envelope.id, envelope)
        self.engine.stats["updates_fetched"] += 1
        for head_id in self.wanted.pop(envelope.id, set()):
            waiting = self.awaiting.get(head_id)
            if waiting is None:
                continue
            waiting.found[envelope.id] = envelope
            head = waiting.rounds[0].head
            named = head.cohort + head.rejected
            if len(waiting.found) == len(named):
                del self.awaiting[head_id]
                updates = tuple(waiting.found[i] for i in named)
                for proposal in waiting.rounds:
                    self._to_agreement(proposal, updates, waiting.signer)
            elif all(i in waiting.found for i in waiting.asked):
                # The batch is complete: the next one, of the same provider.
                waiting.missing = [i for i in waiting.missing if i not in waiting.found]
                self._ask(head_id, waiting)

    def on_updates_request(self, peer: PeerId, request: UpdatesRequest) -> None:
        """Serve announcements by id (one `Signed` each) for our current window; unknown ids are skipped."""
        e = self.engine
        if request.window != self.window:
            return
        served = self.updates_served.get(peer, 0) + 1
        self.updates_served[peer] = served
        if served > MAX_UPDATES_REQUESTS:
            e.reject(peer, "updates-quota", f"window {self.window}")
            return
        for update_id in request.ids:
            envelope = self._known_update(update_id)
            if envelope is not None:
                e.stats["updates_served"] += 1
                e.send(peer, Signed(envelope=envelope))

    def on_signed(self, peer: PeerId, envelope: SignedEnvelope) -> None:
        e = self.engine
        if envelope.kind == "update" and (envelope.id in self.wanted or envelope.id in self.requested):
            # An answer to updates-get (or the author's own copy of an id we asked for): never counted
            # against the sender's announcement quota - a late or duplicate answer is simply dropped.
            if envelope.id in self.wanted:
                self._on_named_update(envelope)
            if peer == envelope.signer and self.collector is not None:
                self.collector.offer(peer, envelope)  # from its author: an announcement like any other
        elif envelope.kind == "update":
            if self.collector is not None:
                self.collector.offer(peer, envelope)
                entry = self.collector.entry_for(envelope)
                if entry is not None and entry.announcement.window == self.window:
                    self._hear(envelope.signer, self.window)
        elif envelope.kind == VOTE_KIND:
            self._on_vote(peer, envelope)
        elif envelope.kind == HeadProposal.KIND:
            self._on_proposal(peer, envelope)
        elif envelope.kind == JoinRequest.KIND:
            join = JoinRequest.from_cbor(envelope.open(JoinRequest.KIND, PROTOCOL_VERSION))
            if join.revision != e.revision.id:
                raise VerificationError("wrong-revision", "join")
            c = self.collector
            if c is None or join.window < c.window or join.window > c.window + WINDOWS_AHEAD:
                e.stats["stale_joins"] += 1  # an old join (a replay cannot re-roster a trainer that left)
                return
            if join.window <= self.withdrawn.get(envelope.signer, -1):
                e.stats["withdrawn_joins_ignored"] += 1  # withdrawn since: a late relay or a replay
                return
            capacity = max(1, join.capacity)
            cert = None
            if e.manifest.admission == "certificate":
                # Raises join-not-admitted, charged to the sender (an honest validator relays only
                # admitted joins). Checked before the backlog: a join that is not admitted evicts nobody.
                cert = check_admission(join.admission, e.revision.id, e.manifest, envelope.signer)
                capacity = min(capacity, cert.max_capacity)
            if envelope.signer not in self.joins and not self._make_room_for_join(envelope.signer):
                # A join flood (Sybils) cannot grow this validator's state (spec/protocol.md §4.1). Charged
                # only to a joiner sending its own join; a relaying validator did nothing wrong.
                if peer == envelope.signer:
                    e.reject(peer, "join-backlog-full")
                else:
                    e.rejected_by_reason["join-backlog-full"] += 1
                return
            self.withdrawn.pop(envelope.signer, None)  # a join for a later window: asked anew
            if cert is not None:
                self.admitted[envelope.signer] = cert.max_capacity
            if envelope.signer not in self.joins:
                e.log("join", peer=str(envelope.signer), capacity=join.capacity)
                if peer == envelope.signer:
                    # Relay a join heard from the joiner itself (one hop), so every validator knows it and
                    # a proposal that adds the joiner to the roster is not refused as an unknown join.
                    e.broadcast(Signed(envelope=envelope), roles=("validator",))
            self.joins[envelope.signer] = capacity
            self._hear(envelope.signer, self.window)
            self._arm_deadline()  # a waiting window closes so the next head can roster the joiner
        elif envelope.kind == LeaveRequest.KIND:
            self._on_leave(peer, envelope)
        elif envelope.kind == Heartbeat.KIND:
            self._on_heartbeat(peer, envelope)
        elif envelope.kind == ReductionProposal.KIND:
            proposal = ReductionProposal.from_cbor(envelope.open(ReductionProposal.KIND, PROTOCOL_VERSION))
            if proposal.revision != e.revision.id:
                raise VerificationError("wrong-revision", "proposal")
            known = self.reducer_proposals.setdefault(proposal.window, {})
            if self.window <= proposal.window <= self.window + WINDOWS_AHEAD and envelope.signer not in known:
                known[envelope.signer] = proposal
                self._compare(envelope.signer, proposal)
        else:
            e.reject(peer, "unexpected-envelope", envelope.kind)

    def _on_leave(self, peer: PeerId, envelope: SignedEnvelope) -> None:
        """A rostered trainer's signed leave: the head of its window drops it from the roster."""
        e, c = self.engine, self.collector
        leave = LeaveRequest.from_cbor(envelope.open(LeaveRequest.KIND, PROTOCOL_VERSION))
        if leave.revision != e.revision.id:
            raise VerificationError("wrong-revision", "leave")
        signer = envelope.signer
        if c is None or leave.window < c.window or leave.window > c.window + WINDOWS_AHEAD:
            e.stats["stale_leaves"] += 1  # for a window certified already (or far ahead): no effect, no penalty
            return
        if signer not in c.head.roster_peers:
            # A withdrawal of a pending join. Without a join known here (yet: a relayed one may be on its
            # way) it is still recorded, and costs a direct sender one penalty point (spam of fresh keys).
            if signer not in self.joins and signer not in self.withdrawn and peer == signer:
                e.reject(peer, "leave-not-rostered")
            if len(self.withdrawn) < MAX_HELD:
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

    def _hear(self, peer: PeerId, window: int) -> None:
        if window > self.heard.get(peer, -1):
            self.heard[peer] = window

    def _on_heartbeat(self, peer: PeerId, envelope: SignedEnvelope) -> None:
        """A trainer's signed heartbeat: it was heard in its window. One per (sender, signer, window), for
        the window being collected or the next; relayed one hop to the other validators."""
        e, c = self.engine, self.collector
        beat = Heartbeat.from_cbor(envelope.open(Heartbeat.KIND, PROTOCOL_VERSION))
        if beat.revision != e.revision.id:
            raise VerificationError("wrong-revision", "heartbeat")
        signer = envelope.signer
        if c is None or not c.window <= beat.window <= c.window + 1 or e.manifest.idle_windows == 0:
            e.stats["stale_heartbeats"] += 1  # old (or far ahead, or expiry off): no effect, no penalty
            return
        key = (peer, signer, beat.window)
        if key in self.heartbeats_taken:
            e.reject(peer, "heartbeat-quota", f"{signer} window {beat.window}")
            return
        self.heartbeats_taken.add(key)
        if signer not in self.joins and signer not in c.head.roster_peers:
            e.stats["stale_heartbeats"] += 1  # not a trainer here (yet, or any more): nothing to keep alive
            return
        self._hear(signer, beat.window)
        if peer == signer:
            e.broadcast(Signed(envelope=envelope), roles=("validator",))  # one hop, like joins and leaves

    def _compare(self, reducer: PeerId, proposal: ReductionProposal) -> None:
        """Once both our own result and a reducer's proposal for a window exist, judge the proposal."""
        e = self.engine
        own = self.results.get(proposal.window)
        if own is None:
            return
        if (proposal.cohort, proposal.params_digest) == own:
            e.stats["proposals_confirmed"] += 1
            e.log("proposal-confirmed", window=proposal.window, reducer=str(reducer))
        else:
            e.reject(reducer, "proposal-mismatch", f"window {proposal.window}")

    def on_peer_ready(self, peer: PeerId, roles: tuple[str, ...]) -> None:
        if "trainer" in roles:
            self._arm_deadline()
        if "validator" in roles and self.collector is not None:
            # A validator that (re)connects may have lost what we signed for this window while it was
            # away: send our proposals and votes again (already persisted; nothing new is signed).
            e = self.engine
            for key in sorted(self.visible):  # only what is durable and was already sent once
                e.send(peer, Signed(envelope=SignedEnvelope.from_bytes(e.records[key])))

    def on_head_source(self, peer: PeerId, head: Head) -> None:
        pass

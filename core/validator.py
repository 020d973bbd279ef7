"""Validator role: collect and screen updates, agree on the next head, certify it (spec/agreement.md).

This module wires the validator's parts, one module per concern, and routes the engine's hooks to them:

- `collector.Collector`: this window's update announcements, fetched and screened one by one;
- `admission.Admission`: joins, leaves, heartbeats, idle expiry and the roster rules of the next head;
- `deadlines.WindowClock`: when the window closes here;
- `screening.Screening`: our own head, and the validity of proposed heads by recomputation;
- `proposals.ProposalTracker`: head proposals taken, and the announcements they name fetched by id;
- `voting.Voting`: our votes and proposals (persisted before they are sent) and the votes of others, for
  `agreement.WindowAgreement`, the Tendermint rules, whose host (`AgreementHost`) this role is.

A window closes when every lease has reported or at its deadline; messages for a window up to
`WINDOWS_AHEAD` ahead are held until it opens.
"""

from __future__ import annotations

import hashlib
from typing import Any, Protocol

from .admission import (
    WINDOWS_AHEAD,
    Admission,
    AdmissionServices,
    RevocationWrite,
)
from .agreement import WindowAgreement
from .auditing import AuditServices, FetchCheckpoint, FetchTrajectory, PlanAudit, Replay, SampledAudits
from .collector import Collector, CollectorServices, FetchAuditParams, FetchBase, FetchDelta, Screen, resume_collector
from .deadlines import MAX_DEADLINE_WINDOWS, WAIT_WINDOWS, ClockServices, WindowClock
from .envelope import SignedEnvelope
from .fsm import Table, step
from .identity import PeerId
from .messages import UpdatesRequest
from .objects import (
    AdmissionRevocation,
    AuditFailure,
    Head,
    HeadProposal,
    Heartbeat,
    JoinRequest,
    LeaveRequest,
    ReductionProposal,
    SignedBody,
    UpdateAnnouncement,
    Vote,
)
from .pending import Outcome
from .proposals import ProposalServices, ProposalTracker
from .roles import RoleBase
from .screening import Screening, ScreeningServices, ScreeningTask, Value
from .voting import Voting, VotingServices, VotingWrite

__all__ = ["MAX_HELD", "TABLE", "ValidatorRole", "proposer_of"]

TABLE: Table = {
    ("collecting", "close"): "closed",
    ("collecting", "head"): "collecting",
    ("closed", "head"): "collecting",
}

MAX_HELD = 4096  # messages held for windows ahead
PROPOSER_DOMAIN = b"peerloom/proposer/v1"


def proposer_of(parent: bytes, window: int, round_: int, validators: tuple[PeerId, ...]) -> PeerId:
    """The proposer of `round_` of `window` on head `parent` (spec/agreement.md §3): the validators ordered
    by SHA-256(domain, parent, window, u32(0), id), and round r's proposer the (r mod n)-th of that order,
    so n consecutive rounds have n different proposers: a silent validator costs one round per window,
    never several in a row (drawing each round afresh once gave a crashed validator 3 rounds running)."""
    prefix = PROPOSER_DOMAIN + parent + window.to_bytes(8, "big") + (0).to_bytes(4, "big")
    order = sorted(validators, key=lambda v: hashlib.sha256(prefix + v.to_bytes()).digest())
    return order[round_ % len(order)]


class ValidatorServices(AdmissionServices, ClockServices, AuditServices, CollectorServices, ScreeningServices,
                        VotingServices, ProposalServices, Protocol):
    """What `ValidatorRole` uses of the engine: only what its parts use, since it hands the engine to each
    (core/engine.py implements it)."""


class ValidatorRole(RoleBase):
    """One validator's state machine (table `TABLE`: collecting -> closed, each window)."""

    def __init__(self, engine: ValidatorServices) -> None:
        self.engine = engine
        self.state = "collecting"
        self.collector: Collector | None = None
        self.agreement: WindowAgreement | None = None
        self.opened_at = 0.0  # engine time the window being collected opened here
        self.held: list[tuple[PeerId, SignedEnvelope, SignedBody]] = []  # messages for windows ahead
        self.admission = Admission(engine)
        self.clock = WindowClock(engine)
        self.screening = Screening(self, engine)
        self.proposals = ProposalTracker(self, engine)
        self.voting = Voting(self, engine)
        self.audits = SampledAudits(engine)

    def _step(self, event: str) -> None:
        self.state = step("validator", TABLE, self.state, event)

    @property
    def window(self) -> int:
        return self.collector.window if self.collector is not None else -1

    # --- durable state (Engine.snapshot) ---------------------------------------------------------------

    def durable_state(self) -> dict[str, Any]:
        """What the engine snapshot keeps of this validator: joins and admissions, leaves, equivocation
        evidence not yet in a certified head, who was heard when, and the first window it saw."""
        a = self.admission
        return {
            # [peer, capacity], or [peer, capacity, true] for a join that declares private data (§10)
            "joins": [[p.to_bytes(), c, *([True] if p in a.private_joins else [])] for p, c in sorted(a.joins.items())],
            "admitted": [[p.to_bytes(), c] for p, c in sorted(a.admitted.items())],
            "leaves": [[p.to_bytes(), w] for p, w in sorted(a.leaves.items())],
            "evidence": [[x.to_cbor(), y.to_cbor()] for _, (x, y) in sorted(self.voting.evidence.items())],
            "heard": [[p.to_bytes(), w] for p, w in sorted(a.heard.items())],
            "first_window": a.first_window,
        }

    def restore_durable_state(self, state: dict[str, Any]) -> None:
        """Take back `durable_state()` (decoded). Raises DecodeError/VerificationError for a bad one."""
        a = self.admission
        a.joins = {PeerId.from_bytes(p): c for p, c, *_ in state["joins"]}
        a.private_joins = {PeerId.from_bytes(p) for p, _, *private in state["joins"] if private == [True]}
        a.admitted = {PeerId.from_bytes(p): c for p, c in state["admitted"]}
        a.leaves = {PeerId.from_bytes(p): w for p, w in state["leaves"]}
        for x, y in state["evidence"]:
            pair = (SignedEnvelope.from_cbor(x), SignedEnvelope.from_cbor(y))
            self.voting.evidence[pair[0].signer] = pair
        a.heard = {PeerId.from_bytes(p): w for p, w in state["heard"]}
        a.first_window = state["first_window"]

    # --- pending work (pending.Pending) -----------------------------------------------------------------

    def resume(self, work: Any, outcome: Outcome) -> None:
        """Go on with work of ours the engine held (a task, fetch or write) once it ended with `outcome`."""
        match work:
            case ScreeningTask():
                self.screening.on_task(work.seq, outcome)
            case VotingWrite():
                self.voting.durable(work.seq)
            case RevocationWrite():
                self.admission.durable(work)
            case Replay() | FetchTrajectory() | PlanAudit() | FetchCheckpoint():
                self.audits.resume(work, outcome)
            case Screen() | FetchBase() | FetchDelta() | FetchAuditParams():
                resume_collector(self.engine.log, self.collector, work, outcome)
            case _:
                raise TypeError(f"not validator work: {work!r}")

    # --- window lifecycle ----------------------------------------------------------------------------

    def on_head(self, head: Head) -> None:
        e = self.engine
        self._step("head")
        self.audits.on_certified(head, self.collector)  # the window's collector, before the next one replaces it
        self.collector = Collector(e, head, self._on_collector_change, owner="validator")
        window = self.collector.window
        self.clock.open()
        self.screening.open(window)
        self.proposals.open(window)
        self.voting.open(head)
        self.admission.open(head)
        e.log("window-open", window=window, leases=len(self.collector.leases))
        m = e.manifest
        # Round 0's propose timeout is armed again when the collection closes (`_close`); until then it is
        # only a backstop past the latest close the window clock allows (core/deadlines.py).
        self.opened_at = e.now
        self.agreement = WindowAgreement(self, e.me, m.validators, m.quorum, timeout_s=e.config.agreement_timeout_s,
                                         first_propose_extra_s=(WAIT_WINDOWS + MAX_DEADLINE_WINDOWS) * m.window_s)
        if not self.voting.restore(window):
            self.agreement.start(0)
        self._arm_deadline()
        held, self.held = self.held, []
        for peer, envelope, body in held:
            self.on_signed(peer, envelope, body)

    def _arm_deadline(self) -> None:
        c = self.collector
        if c is not None and self.state == "collecting" and self.clock.armed_at is None:
            self.clock.arm(c, self.admission.joining())

    def _on_collector_change(self) -> None:
        c = self.collector
        if c is not None and self.state == "collecting" and c.complete():
            self._close()
        for check in list(self.screening.checks.values()):
            if check.stage == "screening":
                self.screening.advance(check)

    def on_timer(self, key: tuple[Any, ...]) -> None:
        c = self.collector
        if c is None:
            return
        if key[:2] == ("claims", "validator") and key[2] == c.window:
            c.claims_open = True  # leases without an update may now be claimed by the next-ranked trainer
            self.engine.log("leases-expired", window=c.window)
            self._on_collector_change()
        elif key[:2] == ("close", "validator") and key[2] == c.window and self.state == "collecting":
            if self.clock.extend(c):
                return
            self.engine.log("window-deadline", window=c.window, reported=len(c.entries), leases=len(c.leases))
            self._close()
        elif key[0] == "agreement" and key[1] == c.window and self.agreement is not None:
            self.agreement.on_timeout(key[2], key[3])
        elif key[0] == "updates" and key[1] == c.window:
            self.proposals.on_timer(key)

    def _close(self) -> None:
        e, c = self.engine, self.collector
        assert c is not None and self.agreement is not None
        self._step("close")
        self.clock.close(c)
        c.closed = True
        if len(c.cohort()) < e.manifest.min_updates:
            e.log("window-short", window=c.window, accepted=len(c.cohort()), needed=e.manifest.min_updates)
        # The first proposal may come until window_s after the opening, or agreement_timeout_s after this
        # close if that is later (spec/agreement.md §4).
        self.agreement.first_proposal_due(max(0.0, self.opened_at + e.manifest.window_s - e.now)
                                          + e.config.agreement_timeout_s)
        self.agreement.progress()

    # --- agreement host (agreement.AgreementHost) ------------------------------------------------------

    def proposer(self, round_: int) -> PeerId:
        c = self.collector
        assert c is not None
        return proposer_of(c.head.id, c.window, round_, self.engine.manifest.validators)

    def own_value(self) -> Value | None:
        return self.screening.own_value()

    def validity(self, head: Head, updates: tuple[SignedEnvelope, ...]) -> bool | None:
        return self.screening.validity(head, updates)

    def cast(self, vote_step: str, round_: int, head_id: bytes | None) -> None:
        self.voting.cast(vote_step, round_, head_id)

    def propose(self, round_: int, head: Head, updates: tuple[SignedEnvelope, ...], valid_round: int | None) -> None:
        self.voting.propose(round_, head, updates, valid_round)

    def schedule(self, timeout: str, round_: int, delay_s: float) -> None:
        self.engine.set_timer(("agreement", self.window, timeout, round_), self.engine.now + delay_s)

    def decide(self, head: Head, round_: int, precommits: dict[PeerId, bytes]) -> None:
        self.voting.decide(head, round_, precommits)

    # --- messages ------------------------------------------------------------------------------------

    def hold(self, peer: PeerId, envelope: SignedEnvelope, body: Vote | HeadProposal) -> bool:
        """Hold messages for a window a little ahead of ours; True if the message was consumed here (held,
        dropped as too far ahead, or for an older window, or for no window: a vote's window that is not an
        integer)."""
        window = body.window
        if window is None or window <= self.window:
            return window != self.window
        if window <= self.window + WINDOWS_AHEAD and len(self.held) < MAX_HELD:
            self.held.append((peer, envelope, body))
        return True

    def on_updates_request(self, peer: PeerId, request: UpdatesRequest) -> None:
        self.proposals.on_updates_request(peer, request)

    def on_signed(self, peer: PeerId, envelope: SignedEnvelope, body: SignedBody) -> None:
        c = self.collector
        match body:
            case UpdateAnnouncement():
                if self.proposals.on_update(peer, envelope):
                    if peer == envelope.signer and c is not None:
                        c.offer(peer, envelope, body)  # from its author: an announcement like any other
                elif c is not None:
                    c.offer(peer, envelope, body)
                    entry = c.entry_for(envelope)
                    if entry is not None and entry.announcement.window == self.window:
                        self.admission.hear(envelope.signer, self.window)
            case Vote():
                self.voting.on_vote(peer, envelope, body)
            case HeadProposal():
                self.proposals.on_proposal(peer, envelope, body)
            case JoinRequest():
                if self.admission.on_join(peer, envelope, body):
                    self._arm_deadline()  # a waiting window closes so the next head can roster the joiner
            case LeaveRequest():
                self.admission.on_leave(peer, envelope, body)
            case Heartbeat():
                self.admission.on_heartbeat(peer, envelope, body)
            case AdmissionRevocation():
                self.admission.on_revocation(peer, envelope, body)
            case ReductionProposal():
                self.screening.on_reduction_proposal(envelope, body)
            case AuditFailure():
                if c is not None:
                    self.audits.on_verdict(peer, envelope, body, c.head)
            case _:
                pass

    def on_undecodable(self, peer: PeerId, envelope: SignedEnvelope) -> bool:
        c = self.collector
        if envelope.kind == UpdateAnnouncement.KIND:
            # An answer to our updates-get is taken by id whatever its body: `validity` charges the proposer
            # that named it. Otherwise the collector decides, as for any announcement.
            if self.proposals.on_update(peer, envelope) and peer != envelope.signer:
                return False
            return c is not None and c.charges_undecodable(peer, envelope)
        if envelope.kind == AuditFailure.KIND:
            if c is None:
                return False
            if envelope.signer not in self.engine.manifest.validators:
                self.engine.reject(peer, "not-a-validator", "audit verdict")  # checked before the body
                return False
        return True  # every other kind, and kinds no peer sends (``unexpected-envelope``)

    def on_peer_ready(self, peer: PeerId, roles: tuple[str, ...]) -> None:
        if "trainer" in roles:
            self._arm_deadline()
            self.audits.on_peer_ready(peer)
        if "validator" in roles and self.collector is not None:
            # A validator that (re)connects may have lost what we signed for this window while it was away.
            self.voting.resend(peer)

"""A validator's judgement of heads (spec/agreement.md §4, spec/protocol.md §9): the head it would propose
itself, and whether a proposed head is valid here.

A validator recomputes everything it votes for: a proposed head is *valid* only after this validator has
itself fetched and screened every cohort update, re-reduced the cohort in canonical order to the same
params and re-evaluated them to the same metrics (within `METRIC_TOLERANCE`). Its structure - parent,
evidence, quarantine records, roster (`admission.Admission.roster_fault`), cohort - is checked first.
With fewer than `min_updates` accepted updates a *skipped* head is proposed, and a proposed skip is valid
only if this validator's own collection also fell short.

Recomputation runs as compute tasks (``reduce``, then ``evaluate``); the work in flight is plain data
(`Recompute`, `Evaluate` in `Screening.tasks`; the engine holds a `ScreeningTask` naming one), resumed by
`Screening.on_task`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import attrs

from .admission import WINDOWS_AHEAD
from .auditing import audit_authors
from .collector import slot_of
from .envelope import SignedEnvelope
from .errors import DecodeError, VerificationError
from .identity import PeerId
from .leases import next_unproven
from .objects import (
    OUTLIER_REASONS,
    PROTOCOL_VERSION,
    ArtifactRef,
    AuditEvidence,
    Head,
    PrivacyRecord,
    ReductionProposal,
    UpdateAnnouncement,
    decode_as,
    open_body,
    revocation_peers,
)
from .pending import Failed, Outcome
from .privacy import budget_fault, next_ledger
from .quarantine import STRIKE_REASONS, check_evidence, next_records
from .services import FindsPeers, HasConfig, HasManifest, HasRevision, HasStats, Logs, NotesStored, Rejects, RunsTasks
from .tasks import EvaluateResult, EvaluateTask, ReduceResult, Task
from .validating import ValidatorParts

METRIC_TOLERANCE = 1e-4

# A proposed value: the head and the signed announcements it names - its cohort's and its rejected ones.
Value = tuple[Head, tuple[SignedEnvelope, ...]]
Evidence = tuple[tuple[SignedEnvelope, SignedEnvelope], ...]


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


def quarantined_now(evidence: Evidence, audits: tuple[AuditEvidence, ...]) -> tuple[PeerId, ...]:
    """The peers a head quarantines at once (spec/protocol.md §9): validators named by its equivocation
    `evidence` and authors of its failed `audits` (both checked already)."""
    return (*(a.signer for a, _ in evidence), *audit_authors(audits))


@attrs.define
class Check:
    """Recomputation of one proposed head: screening -> computing -> done."""

    head: Head
    updates: tuple[SignedEnvelope, ...]
    stage: str = "screening"


@attrs.frozen(kw_only=True)
class Recompute:
    """A ``reduce`` task in flight: `candidates` (canonical order, by update id) onto the parent of
    `window`, for our own head (`check` None) or to check a proposed head; `outliers`: the candidates that
    head leaves out of its cohort (the reduction must find exactly these); `train_losses`: the candidates'
    announced training losses, in order."""

    window: int
    candidates: tuple[SignedEnvelope, ...]
    train_losses: tuple[float | None, ...]  # None: a private-data author's (spec/protocol.md §10)
    check: Check | None = None
    outliers: frozenset[bytes] = frozenset()


@attrs.frozen(kw_only=True)
class Evaluate:
    """An ``evaluate`` task in flight on the params `recompute` reduced: `kept` and `outliers` (update id,
    ``screen-<reason>``) as the reduction found them."""

    recompute: Recompute
    outliers: tuple[tuple[bytes, str, str], ...]  # (update id, reason, detail)
    kept: tuple[bytes, ...]
    params: ArtifactRef
    params_digest: bytes
    outer_state: ArtifactRef | None
    outer_state_digest: bytes | None
    train_loss: float


@attrs.frozen(kw_only=True)
class ScreeningTask:
    """What the engine holds for a recomputation task in flight: its work is `Screening.tasks[seq]`."""

    seq: int


class ScreeningServices(HasConfig, HasRevision, HasManifest, HasStats, Logs, FindsPeers, RunsTasks, NotesStored,
                        Rejects, Protocol):
    """What `Screening` uses of the engine (core/engine.py implements it)."""


class Screening:
    """Verdicts on the heads of the window being collected by `role`, and its own head.

    `verdicts`: head id -> valid; `checks`: recomputations by head id; `refused_expiry`: heads refused for a
    view-dependent fault (logged once each); `own`: our own value once built; `results`: window -> (cohort,
    params digest) of our own reduction, which reducers' proposals are compared with; `reducer_proposals`:
    window -> reducer -> its proposal; `tasks`: recomputation work in flight, by a local sequence number.
    """

    def __init__(self, role: ValidatorParts, engine: ScreeningServices) -> None:
        self.role = role
        self.engine = engine
        self.verdicts: dict[bytes, bool] = {}
        self.checks: dict[bytes, Check] = {}
        self.refused_expiry: set[bytes] = set()
        self.own: Value | None = None
        self.building = False
        self.results: dict[int, tuple[tuple[bytes, ...], bytes]] = {}
        self.reducer_proposals: dict[int, dict[PeerId, ReductionProposal]] = {}
        self.tasks: dict[int, Recompute | Evaluate] = {}
        self._seq = 0

    def open(self, window: int) -> None:
        """Window `window` opens: verdicts and our own value start afresh."""
        self.own, self.building = None, False
        self.verdicts, self.checks, self.refused_expiry = {}, {}, set()
        self.reducer_proposals = {w: v for w, v in self.reducer_proposals.items() if w >= window}
        self.results = {w: v for w, v in self.results.items() if w >= window}

    # --- our own head ----------------------------------------------------------------------------

    def own_value(self) -> Value | None:
        """The head this validator would propose: available once its window closed and it computed it."""
        e, c = self.engine, self.role.collector
        if c is None or not c.closed:
            return None
        if self.own is None and not self.building:
            cohort = c.cohort()
            if len(cohort) < e.manifest.min_updates:
                self._own_skip(len(cohort))
            else:
                self.building = True
                self._compute(tuple(x.envelope for x in cohort), None, frozenset())
        return self.own

    def _own_skip(self, accepted: int) -> None:
        e, c = self.engine, self.role.collector
        assert c is not None
        skip = self.skip_head(c.head, self.role.voting.pending_evidence(c.head), self.role.audits.pending(c.head))
        e.log("window-skipped", window=c.window, accepted=accepted, needed=e.manifest.min_updates)
        self.own = (skip, ())
        self.verdicts[skip.id] = True

    def _built(self, result: dict[str, Any] | None) -> None:
        self.building = False
        e, c = self.engine, self.role.collector
        if result is None or c is None or result["window"] != c.window:
            return
        for update_id, reason, detail in result["outliers"]:
            c.reject_outlier(update_id, reason, detail)
        if len(result["kept"]) < e.manifest.min_updates:
            self._own_skip(len(result["kept"]))
        else:
            struck = tuple(x.envelope for x in c.struck())
            head = self.make_head(result, struck, self.role.voting.pending_evidence(c.head),
                                  self.role.audits.pending(c.head))
            kept = set(result["kept"])
            self.own = (head, tuple(u for u in result["candidates"] if u.id in kept) + struck)
            self.verdicts[head.id] = True
            self._note_result(head)
        if self.role.agreement is not None:
            self.role.agreement.progress()

    def skip_head(self, parent: Head, evidence: Evidence, audits: tuple[AuditEvidence, ...] = ()) -> Head:
        """The skipped head after `parent` (parent's params, empty cohort), with `evidence` and failed `audits`
        recorded."""
        admission, m = self.role.admission, self.engine.manifest
        window = parent.window + 1
        quarantine, strikes = next_records(parent, window, (), quarantined_now(evidence, audits), m)
        left = admission.departures(parent)
        expired = admission.expirations(parent, left)
        revoked = admission.removals(parent)
        roster = admission.next_roster(parent, quarantine, left, expired, revocation_peers(revoked))
        return Head(revision=parent.revision, parent=parent.id, window=window, skipped=True,
                    params=parent.params, params_digest=parent.params_digest, cohort=(),
                    roster=roster, quarantine=quarantine, revoked=revoked,
                    metrics=parent.metrics, strikes=strikes, evidence=evidence, outer_state=parent.outer_state,
                    outer_state_digest=parent.outer_state_digest, left=left, expired=expired,
                    unproven=next_unproven(parent, {}, roster, frozenset(), None), audits=audits,
                    private=admission.next_private(parent, roster), privacy=parent.privacy)

    def make_head(self, result: dict[str, Any], rejected: tuple[SignedEnvelope, ...], evidence: Evidence,
                  audits: tuple[AuditEvidence, ...] = ()) -> Head:
        """The head of a reduction `result`, with the quarantine records its rejections, evidence and failed
        audits imply."""
        e, c, admission = self.engine, self.role.collector, self.role.admission
        assert c is not None
        parent, window = c.head, c.window
        quarantine, strikes = next_records(parent, window, (u.signer for u in rejected),
                                           quarantined_now(evidence, audits), e.manifest)
        kept = set(result["kept"])
        entries = [c.entry_for(u) for u in result["candidates"]]
        proven = frozenset(u.signer for u in result["candidates"] if u.id in kept)
        left = admission.departures(parent)
        delivered = proven | {u.signer for u in rejected}
        expired = admission.expirations(parent, left, delivered)
        revoked = admission.removals(parent)
        roster = admission.next_roster(parent, quarantine, left, expired, revocation_peers(revoked))
        return Head(revision=e.revision.id, parent=parent.id, window=window, skipped=False,
                    params=result["params"], params_digest=result["params_digest"],
                    cohort=tuple(sorted(result["kept"])),
                    roster=roster, quarantine=quarantine, revoked=revoked,
                    metrics=result["metrics"], strikes=strikes, rejected=tuple(sorted(u.id for u in rejected)),
                    evidence=evidence, outer_state=result["outer_state"],
                    outer_state_digest=result["outer_state_digest"], left=left, expired=expired,
                    unproven=next_unproven(parent, c.leases, roster, proven, delivered), audits=audits,
                    private=admission.next_private(parent, roster),
                    privacy=self.next_ledger(parent, [(x.envelope.signer, x.announcement) for x in entries
                                                      if x is not None and x.envelope.id in kept]))

    def next_ledger(self, parent: Head,
                    cohort: Iterable[tuple[PeerId, UpdateAnnouncement]]) -> tuple[PrivacyRecord, ...]:
        """The privacy ledger of the head after `parent` with `cohort` ((author, announcement) of each
        cohort update): `parent`'s, unless the manifest has `privacy` (spec/protocol.md §10)."""
        e = self.engine
        params = e.manifest.privacy
        if params is None:
            return parent.privacy
        spends = {signer: ann.privacy_steps or 0 for signer, ann in cohort}
        assert e.config.accountant is not None
        return next_ledger(parent, spends, params, e.config.accountant)

    # --- recomputation: reduce, then evaluate -----------------------------------------------------

    def _compute(self, candidates: tuple[SignedEnvelope, ...], check: Check | None, outliers: frozenset[bytes]) -> None:
        """Screen the candidates against each other, reduce the rest onto the parent (canonical order),
        evaluate, then finish with the task results (None on failure): `_built` for our own head, `_compared`
        for a check. The result names outliers and kept members by update id."""
        c = self.role.collector
        assert c is not None
        candidates = tuple(sorted(candidates, key=lambda u: u.id))
        entries = [c.entry_for(u) for u in candidates]
        assert all(x is not None for x in entries)
        # a private-data trainer's announced loss is no loss at all (spec/protocol.md §10): the mean leaves it out
        losses = tuple(None if x.envelope.signer in c.head.private_peers else x.announcement.train_loss
                       for x in entries if x is not None)
        work = Recompute(window=c.window, candidates=candidates, train_losses=losses, check=check, outliers=outliers)
        self._run(c.reduce_task([x for x in entries if x is not None]), work)

    def _run(self, task: Task, work: Recompute | Evaluate) -> None:
        self._seq += 1
        self.tasks[self._seq] = work
        self.engine.run_task(task, "validator", ScreeningTask(seq=self._seq))

    def on_task(self, seq: int, outcome: Outcome) -> None:
        """The task `seq` ended with `outcome` (`Done` with the task's result class): go on with its work."""
        if isinstance(outcome, Failed):
            self.on_task_failed(seq, outcome.reason)
            return
        e, result = self.engine, outcome.result
        match self.tasks.pop(seq):
            case Recompute() as work:
                assert isinstance(result, ReduceResult)
                e.note_stored(result.params)
                if result.outer_state is not None:
                    e.note_stored(result.outer_state)
                candidates = work.candidates
                outliers = tuple((candidates[o.index].id, f"screen-{o.reason}", o.detail) for o in result.outliers)
                kept = tuple(candidates[i].id for i in result.kept)
                if not kept:
                    self._finish(work, {"window": work.window, "outliers": list(outliers), "kept": list(kept),
                                        "candidates": candidates})
                    return
                public = [loss for i in result.kept if (loss := work.train_losses[i]) is not None]
                train_loss = sum(public) / len(public) if public else 0.0
                self._run(EvaluateTask(params=result.params),
                          Evaluate(recompute=work, outliers=outliers, kept=kept, params=result.params,
                                   params_digest=result.params_digest, outer_state=result.outer_state,
                                   outer_state_digest=result.outer_state_digest, train_loss=train_loss))
            case Evaluate() as work:
                assert isinstance(result, EvaluateResult)
                rc = work.recompute
                self._finish(rc, {"window": rc.window, "outliers": list(work.outliers), "kept": list(work.kept),
                                  "candidates": rc.candidates, "params": work.params,
                                  "params_digest": work.params_digest, "outer_state": work.outer_state,
                                  "outer_state_digest": work.outer_state_digest,
                                  "metrics": head_metrics(result.metrics, work.train_loss)})

    def on_task_failed(self, seq: int, reason: str) -> None:
        """The task `seq` failed: its recomputation has no result."""
        work = self.tasks.pop(seq)
        self._finish(work.recompute if isinstance(work, Evaluate) else work, None)

    def _finish(self, work: Recompute, result: dict[str, Any] | None) -> None:
        if work.check is None:
            self._built(result)
        else:
            self._compared(work.check, result, work.outliers)

    # --- proposed heads ----------------------------------------------------------------------------

    def validity(self, head: Head, updates: tuple[SignedEnvelope, ...]) -> bool | None:
        """True/False once this validator has recomputed `head`; None while it is still checking."""
        if head.id in self.verdicts:
            return self.verdicts[head.id]
        e, c = self.engine, self.role.collector
        if c is None:
            return False
        reason = self.structural_fault(head, updates)
        if reason in ("expired-heard", "join-withdrawn", "private-mismatch"):
            # Not cached: refused only while this validator's own view differs and no quorum backs the head
            # (spec/agreement.md §6, view-dependent validity).
            if head.id not in self.refused_expiry:
                self.refused_expiry.add(head.id)
                e.log("proposal-invalid", window=head.window, reason=reason)
                e.stats["proposals_invalid"] += 1
            return False
        if reason:
            e.log("proposal-invalid", window=head.window, reason=reason)
            self.verdicts[head.id] = False
            return False
        if head.skipped:
            if not c.closed:
                return None
            self.verdicts[head.id] = len(c.cohort()) < e.manifest.min_updates
            return self.verdicts[head.id]
        check = self.checks.get(head.id)
        if check is None:
            check = self.checks[head.id] = Check(head=head, updates=updates)
            proposer = self.role.proposals.proposer_of_head(head)
            for u in updates:
                try:
                    ann = decode_as(u, UpdateAnnouncement)
                except (DecodeError, VerificationError) as exc:
                    e.reject(proposer, exc.reason, exc.detail)  # as the collector charges a bad named update
                    continue
                c.offer(proposer, u, ann, force=True)
            self.advance(check)
        return self.verdicts.get(head.id)

    def _evidence_fault(self, head: Head) -> str:
        e, c = self.engine, self.role.collector
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

    def structural_fault(self, head: Head, updates: tuple[SignedEnvelope, ...]) -> str:
        """Why `head` (with the announcements it names) cannot be the next head here, before any
        recomputation, or "": parent, evidence, quarantine records, roster, skip and cohort rules."""
        e, c = self.engine, self.role.collector
        assert c is not None
        parent = c.head
        if head.revision != e.revision.id or head.parent != parent.id or head.window != c.window:
            return "wrong-parent"
        fault = self._evidence_fault(head) or self.role.audits.fault(head, parent)
        if fault:
            return fault
        cohort_ids, rejected_ids = set(head.cohort), set(head.rejected)
        cohort = tuple(u for u in updates if u.id in cohort_ids)
        rejected = tuple(u for u in updates if u.id in rejected_ids)
        quarantine, strikes = next_records(parent, c.window, (u.signer for u in rejected),
                                           quarantined_now(head.evidence, head.audits), e.manifest)
        if (head.quarantine, head.strikes) != (quarantine, strikes):
            return "quarantine-mismatch"
        fault = self.role.admission.roster_fault(
            head, frozenset(u.signer for u in cohort), frozenset(u.signer for u in cohort + rejected),
            lambda: self.role.voting.quorum_backs(head.id))
        if fault:
            return fault
        if head.skipped:
            if updates or head.cohort or head.rejected or head.params != parent.params or \
                    head.metrics != parent.metrics or head.outer_state != parent.outer_state or \
                    head.privacy != parent.privacy:
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
                anns[u.id] = open_body(u, UpdateAnnouncement)
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
        if any(budget_fault(e.manifest, parent, u.signer, anns[u.id].privacy_steps, e.config.accountant)
               for u in cohort):
            return "cohort-privacy-budget"
        if head.privacy != self.next_ledger(parent, [(u.signer, anns[u.id]) for u in cohort]):
            return "privacy-mismatch"
        return ""

    def advance(self, check: Check) -> None:
        """Once every named update is screened here: cohort members must pass individual screening, rejected
        ones must fail it deterministically or be outliers, which the recomputation must confirm."""
        e, c = self.engine, self.role.collector
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
            elif entry.state == "rejected" and not c.retry(u.id, [self.role.proposals.proposer_of_head(head),
                                                                  *e.peers_with("validator"),
                                                                  *e.peers_with("reducer")]):
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
        self._compute(tuple(candidates), check, frozenset(outliers))

    def _compared(self, check: Check, mine: dict[str, Any] | None, outliers: frozenset[bytes]) -> None:
        check.stage = "done"
        head = check.head
        if mine is None or "params" not in mine:
            self._verdict(head, False, "recompute-failed")
        elif {p for p, *_ in mine["outliers"]} != outliers:
            self._verdict(head, False, "outliers-mismatch")
        elif (mine["params"], mine["params_digest"], mine["outer_state_digest"]) != (
                head.params, head.params_digest, head.outer_state_digest) or mine["outer_state"] != head.outer_state:
            self._verdict(head, False, "params-mismatch")
        elif not metrics_match(mine["metrics"], head.metrics):
            self._verdict(head, False, "metrics-mismatch")
        else:
            self._note_result(head, replace=True)
            self._verdict(head, True, "")

    def _verdict(self, head: Head, ok: bool, reason: str) -> None:
        self.verdicts[head.id] = ok
        self.engine.log("proposal-checked", window=head.window, head=head.id.hex(), ok=ok, reason=reason)
        if not ok:
            self.engine.stats["proposals_invalid"] += 1
        c, agreement = self.role.collector, self.role.agreement
        if agreement is not None and c is not None and head.window == c.window:
            agreement.progress()

    # --- reducers' proposals, compared with our own result -----------------------------------------

    def _note_result(self, head: Head, *, replace: bool = False) -> None:
        """Our own reduction of `head`'s window gave `head` (a head we built, or one we recomputed: `replace`
        then keeps it over an earlier result). The first result judges the reducer proposals held so far."""
        first = head.window not in self.results
        if first or replace:
            self.results[head.window] = (head.cohort, head.params_digest)
        if first:
            for reducer, proposal in self.reducer_proposals.get(head.window, {}).items():
                self._compare(reducer, proposal)

    def on_reduction_proposal(self, envelope: SignedEnvelope, proposal: ReductionProposal) -> None:
        """A reducer's signed proposal (its body decoded: `core.bodies.decode_body`): compared with our own
        result once both exist. Raises VerificationError for a bad one."""
        e, window = self.engine, self.role.window
        envelope.verify(ReductionProposal.KIND, PROTOCOL_VERSION)
        if proposal.revision != e.revision.id:
            raise VerificationError("wrong-revision", "proposal")
        known = self.reducer_proposals.setdefault(proposal.window, {})
        if window <= proposal.window <= window + WINDOWS_AHEAD and envelope.signer not in known:
            known[envelope.signer] = proposal
            self._compare(envelope.signer, proposal)

    def _compare(self, reducer: PeerId, proposal: ReductionProposal) -> None:
        e = self.engine
        own = self.results.get(proposal.window)
        if own is None:
            return
        if (proposal.cohort, proposal.params_digest) == own:
            e.stats["proposals_confirmed"] += 1
            e.log("proposal-confirmed", window=proposal.window, reducer=str(reducer))
        else:
            e.reject(reducer, "proposal-mismatch", f"window {proposal.window}")

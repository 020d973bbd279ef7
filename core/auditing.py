"""A validator's sampled audits, run after the fact (spec/protocol.md §6.2).

With ``audit = true`` and ``audit_rate > 0`` in the manifest, updates are screened without a replay. Once a
head certifies a window, each validator audits the updates of that window (its cohort, and those the loss
check rejected: `audit_candidates`) that `audit_selected` picks with the head's id - randomness no trainer
knew when it announced - by re-running the author's training (an ``audit`` compute task) off the critical
path, while the next window trains. An audit that fails is signed as an `AuditFailure` verdict and sent to
every validator. A proposer puts each update that holds `verdicts_needed` verdicts of distinct validators
into the next head's ``audits``; that head quarantines its author (`core/quarantine.py`). Anyone checks the
verdicts from the head alone (`check_audit_evidence`); `peerloom verify` also checks the selection against
the chain.

The work in flight is plain data (`Replay`, `PlanAudit`, fetches), resumed by `SampledAudits.on_task`. Verdicts
are held in memory only: a restarted validator forgets those it held (its peers still hold theirs).
"""

from __future__ import annotations

from typing import Protocol

import attrs

from .audit import (
    AUDIT_WINDOWS,
    audit_segment,
    audit_selected,
    check_audit_evidence,
    segment_bounds,
    verdicts_needed,
)
from .collector import Collector, audit_args
from .envelope import SignedEnvelope
from .errors import DecodeError, VerificationError
from .identity import PeerId
from .messages import Signed
from .objects import (
    MAX_HEAD_AUDITS,
    PROTOCOL_VERSION,
    ArtifactRef,
    AuditEvidence,
    AuditFailure,
    Head,
    UpdateAnnouncement,
    open_body,
    seal,
)
from .pending import Done, Failed, Outcome
from .services import Broadcasts, Fetches, HasIdentity, HasManifest, HasRevision, HasStats, Logs, RunsTasks
from .tasks import AuditPlanResult, AuditPlanTask, AuditResult, AuditTask, SegmentAudit, SegmentPlan

MAX_VERDICTS_PER_SIGNER = 64  # verdicts held per validator at a time (a faulty one cannot grow our state)
UNSERVED_GRACE_WINDOWS = 2
"""Heads an author may stay unreachable before a segment audit that needs its checkpoints fails
(spec/protocol.md §6.3): a fetch that fails is tried again when the author reconnects and at each head."""
UNSERVED_AT_ONCE = ("ref-mismatch", "corrupt-artifact")  # the author served other bytes: no second chance


@attrs.frozen(kw_only=True)
class Replay:
    """The ``audit`` task (`core.tasks.AuditTask`) of the cohort update `update_id` of the head of `window` is in
    flight."""

    update_id: bytes
    window: int


@attrs.frozen(kw_only=True)
class FetchTrajectory:
    """The author's `Trajectory` artifact of `update_id` is being fetched (segment audits, §6.3)."""

    update_id: bytes
    window: int


@attrs.frozen(kw_only=True)
class PlanAudit:
    """The ``audit-plan`` task (which checkpoints the audit of `update_id` needs) is in flight."""

    update_id: bytes
    window: int


@attrs.frozen(kw_only=True)
class FetchCheckpoint:
    """One artifact (`digest`) the segment audit of `update_id` needs is being fetched from its author."""

    update_id: bytes
    window: int
    digest: bytes


AuditWork = Replay | FetchTrajectory | PlanAudit | FetchCheckpoint


@attrs.define
class _Run:
    """One audit in flight: the update, the base head it was trained on, its segment (None: whole replay),
    what the segment needs (`plan`, from the trajectory) and the artifacts still being fetched."""

    envelope: SignedEnvelope
    announcement: UpdateAnnouncement
    base: Head
    segment: int | None
    window: int  # of the head that selected it
    prior: ArtifactRef | None = None  # the delta an overlapped update's start subtracts (spec/protocol.md §5.2)
    plan: SegmentPlan | None = None
    waiting: set[bytes] = attrs.Factory(set)
    stalled: list[FetchTrajectory | FetchCheckpoint] = attrs.Factory(list)  # failed fetches to try again


def audit_candidates(head: Head, collector: Collector) -> list[bytes]:
    """The updates of `head`'s window that a sampled audit may select, sorted by id (spec/protocol.md §6.2):
    its cohort, and the updates `collector` rejected with ``screen-loss``. The loss check keeps an update
    out of the cohort without a strike (§6.1), so without this a cheater whose update points uphill would
    never be audited for it."""
    loss_rejected = (x.envelope.id for x in collector.entries.values()
                     if x.state == "rejected" and x.reason == "screen-loss")
    return sorted({*head.cohort, *loss_rejected})


def audit_authors(audits: tuple[AuditEvidence, ...]) -> tuple[PeerId, ...]:
    """The authors of the updates whose failed `audits` a head carries (already checked)."""
    return tuple(open_body(v[0], AuditFailure).update.signer
                 for v in audits)


class AuditServices(HasIdentity, HasRevision, HasManifest, HasStats, Logs, Broadcasts, RunsTasks, Fetches, Protocol):
    """What `SampledAudits` uses of the engine (core/engine.py implements it)."""


class SampledAudits:
    """Sampled audits of one validator: the audits it runs, and the verdicts it holds (its own and other
    validators'), by update id."""

    def __init__(self, engine: AuditServices) -> None:
        self.engine = engine
        self.running: dict[bytes, _Run] = {}  # update id -> its audit in flight
        self.updates: dict[bytes, tuple[SignedEnvelope, UpdateAnnouncement]] = {}
        self.verdicts: dict[bytes, dict[PeerId, SignedEnvelope]] = {}  # update id -> signer -> verdict

    @property
    def enabled(self) -> bool:
        m = self.engine.manifest
        return m.audit and m.audit_rate > 0.0

    def on_certified(self, head: Head, collector: Collector | None) -> None:
        """`head` is now canonical; `collector` collected the updates of its window here (None or another
        window: this validator holds none of them and audits nothing of this head). Start the audits
        `audit_selected` picks, and forget verdicts the head makes useless."""
        e, m = self.engine, self.engine.manifest
        if not self.enabled:
            return
        self._prune(head)
        self._retry_stalled(head.window)
        if head.skipped or collector is None or collector.window != head.window:
            return
        for update_id in audit_candidates(head, collector):
            if not audit_selected(head.id, update_id, m.audit_rate):
                continue
            entry = collector.by_id.get(update_id)
            if entry is not None and (entry.envelope.signer in collector.head.private_peers
                                      or entry.announcement.unauditable):
                continue  # nobody else holds a private-data trainer's samples (spec/protocol.md §10); an
                # unauditable update cannot be replayed (§6.4)
            if entry is None:  # a head we adopted with an update we never screened: others audit it
                e.stats["audits_unavailable"] += 1
                continue
            e.stats["audits_started"] += 1
            segment = audit_segment(head.id, update_id, m.audit_segments) if m.audit_segments else None
            run = self.running[update_id] = _Run(envelope=entry.envelope, announcement=entry.announcement,
                                                 base=entry.base, prior=entry.prior_delta, segment=segment,
                                                 window=head.window)
            if segment is None:
                self._replay(update_id, head.window, run)
            else:
                # Only the author holds its checkpoints: it must serve them (spec/protocol.md §6.3).
                assert entry.announcement.trajectory is not None  # the collector took it only with one
                e.fetch(entry.announcement.trajectory, [entry.envelope.signer], "validator",
                        FetchTrajectory(update_id=update_id, window=head.window))

    def resume(self, work: AuditWork, outcome: Outcome) -> None:
        """Go on with an audit's fetch or task once it ended with `outcome`."""
        e = self.engine
        run = self.running.get(work.update_id)
        if run is None:
            return
        if isinstance(work, (FetchTrajectory, FetchCheckpoint)) and isinstance(outcome, Failed):
            if outcome.reason in UNSERVED_AT_ONCE:
                self._concluded(work, False, f"unserved-{outcome.reason}")  # it served other bytes than it committed
            else:
                run.stalled.append(work)  # unreachable for now: tried again on reconnect and at each head
                e.log("audit-stalled", window=work.window, author=str(run.envelope.signer), reason=outcome.reason)
            return
        if isinstance(work, (Replay, PlanAudit)) and isinstance(outcome, Failed):
            del self.running[work.update_id]
            e.stats["audits_errored"] += 1  # this validator's trouble, never the author's
            e.log("audit-error", window=work.window, author=str(run.envelope.signer), reason=outcome.reason)
            return
        result = outcome.result if isinstance(outcome, Done) else None
        match work:
            case FetchTrajectory():
                assert run.announcement.trajectory is not None and run.segment is not None
                e.run_task(AuditPlanTask(trajectory=run.announcement.trajectory, segment=run.segment,
                                         segments=e.manifest.audit_segments), "validator",
                           PlanAudit(update_id=work.update_id, window=work.window))
            case PlanAudit():
                assert isinstance(result, AuditPlanResult)
                if result.plan is None:
                    self._concluded(work, False, result.reason)
                    return
                run.plan = result.plan
                needed = {ref.digest: ref for ref in run.plan.refs()}
                run.waiting = set(needed)
                for digest, ref in needed.items():
                    e.fetch(ref, [run.envelope.signer], "validator",
                            FetchCheckpoint(update_id=work.update_id, window=work.window, digest=digest))
            case FetchCheckpoint():
                run.waiting.discard(work.digest)
                if not run.waiting:
                    self._replay(work.update_id, work.window, run)
            case Replay():
                assert isinstance(result, AuditResult)
                self._concluded(work, result.ok, result.reason)

    def on_peer_ready(self, peer: PeerId) -> None:
        """`peer` (re)connected: fetch again what stalled audits need from it."""
        for run in list(self.running.values()):
            if run.stalled and run.envelope.signer == peer:
                self._refetch(run)

    def _retry_stalled(self, head_window: int) -> None:
        """At each head: a stalled audit fails once its author stayed unreachable `UNSERVED_GRACE_WINDOWS` heads
        after the head that selected it; the others fetch again."""
        for run in list(self.running.values()):
            if not run.stalled:
                continue
            if head_window >= run.window + UNSERVED_GRACE_WINDOWS:
                self._concluded(run.stalled[0], False, "unserved")
            else:
                self._refetch(run)

    def _refetch(self, run: _Run) -> None:
        e = self.engine
        works, run.stalled = run.stalled, []
        for work in works:
            if isinstance(work, FetchTrajectory):
                assert run.announcement.trajectory is not None
                ref: ArtifactRef | None = run.announcement.trajectory
            else:
                refs = () if run.plan is None else run.plan.refs()
                ref = next((r for r in refs if r.digest == work.digest), None)
            if ref is not None:
                e.fetch(ref, [run.envelope.signer], "validator", work)

    def _replay(self, update_id: bytes, window: int, run: _Run) -> None:
        """Start the ``audit`` task: the whole training, or the run's segment from its checkpoints."""
        e, m = self.engine, self.engine.manifest
        segment = None
        if run.segment is not None:
            assert run.plan is not None  # its checkpoints are all fetched
            bounds = segment_bounds(m.inner_steps, m.audit_segments)
            segment = SegmentAudit(plan=run.plan, from_step=bounds[run.segment], to_step=bounds[run.segment + 1])
        task = AuditTask(delta=run.announcement.delta, segment=segment,
                         audit=audit_args(m, run.base, run.envelope.signer, run.announcement, run.prior))
        e.run_task(task, "validator", Replay(update_id=update_id, window=window))

    def _concluded(self, work: AuditWork, ok: bool, reason: str) -> None:
        """An audit ended: a failure is signed, kept and sent to every validator."""
        e = self.engine
        run = self.running.pop(work.update_id)
        author = str(run.envelope.signer)
        if ok:
            e.stats["audits_passed"] += 1
            e.log("audit-passed", window=work.window, author=author, segment=run.segment)
            return
        e.stats["audits_failed"] += 1
        e.log("audit-failed", window=work.window, author=author, reason=reason, segment=run.segment)
        verdict = seal(e.identity, AuditFailure(revision=e.revision.id, update=run.envelope))
        self._hold(verdict, run.envelope, run.announcement)
        e.broadcast(Signed(envelope=verdict), roles=("validator",))

    def on_verdict(self, peer: PeerId, verdict: SignedEnvelope, failure: AuditFailure, head: Head) -> None:
        """Another validator's `AuditFailure` verdict (sent by `peer`; its body `failure` decoded:
        `core.bodies.decode_body`), taken while `head` is canonical here. Raises DecodeError /
        VerificationError for a bad one (the engine charges `peer`)."""
        e = self.engine
        if verdict.signer not in e.manifest.validators:
            raise VerificationError("not-a-validator", "audit verdict")
        verdict.verify(AuditFailure.KIND, PROTOCOL_VERSION)
        if failure.revision != e.revision.id:
            raise VerificationError("wrong-revision", "audit verdict")
        ann = open_body(failure.update, UpdateAnnouncement)
        if ann.revision != e.revision.id:
            raise VerificationError("wrong-revision", "audited update")
        if not self.enabled or ann.window > head.window or ann.window + AUDIT_WINDOWS <= head.window:
            e.stats["stale_audit_verdicts"] += 1  # too old to enter a head, or not audited yet here: no charge
            return
        held = sum(verdict.signer in v for v in self.verdicts.values())
        if held >= MAX_VERDICTS_PER_SIGNER and verdict.signer not in self.verdicts.get(failure.update.id, {}):
            raise VerificationError("audit-quota", str(verdict.signer))
        self._hold(verdict, failure.update, ann)

    def _hold(self, verdict: SignedEnvelope, update: SignedEnvelope, ann: UpdateAnnouncement) -> None:
        self.updates.setdefault(update.id, (update, ann))
        self.verdicts.setdefault(update.id, {}).setdefault(verdict.signer, verdict)

    def _prune(self, head: Head) -> None:
        """Drop verdicts that can no longer enter a head after `head`: too old, or their author quarantined."""
        for update_id in list(self.verdicts):
            update, ann = self.updates[update_id]
            if ann.window + AUDIT_WINDOWS <= head.window or update.signer in head.quarantined:
                del self.verdicts[update_id]
        for update_id in list(self.updates):
            if update_id not in self.verdicts and update_id not in self.running:
                del self.updates[update_id]

    def pending(self, parent: Head) -> tuple[AuditEvidence, ...]:
        """The ``audits`` of the head this validator proposes after `parent`: every failed audit it holds
        enough verdicts for, whose author `parent` does not quarantine, within `AUDIT_WINDOWS`, one per
        author, at most `MAX_HEAD_AUDITS`, sorted by update id; each with the first `verdicts_needed`
        verdicts by signer."""
        if not self.enabled:
            return ()
        need, window = verdicts_needed(self.engine.manifest), parent.window + 1
        out: list[AuditEvidence] = []
        authors: set[PeerId] = set()
        for update_id in sorted(self.verdicts):
            update, ann = self.updates[update_id]
            held = self.verdicts[update_id]
            if len(held) < need or update.signer in parent.quarantined or update.signer in authors or \
                    ann.window + AUDIT_WINDOWS < window:
                continue
            authors.add(update.signer)
            out.append(tuple(held[s] for s in sorted(held)[:need]))
            if len(out) == MAX_HEAD_AUDITS:
                break
        return tuple(out)

    def fault(self, head: Head, parent: Head) -> str:
        """``bad-audit`` if the proposed `head`'s ``audits`` do not hold here (spec/protocol.md §6.2), else
        "": each entry proves a failed audit (`check_audit_evidence`) of an update of a window in
        ``[head.window - AUDIT_WINDOWS, head.window)`` whose author `parent` does not quarantine; sorted by
        update id, one per author; none unless the manifest samples audits."""
        if not head.audits:
            return ""
        if not self.enabled:
            return "bad-audit"
        ids: list[bytes] = []
        authors: set[PeerId] = set()
        for verdicts in head.audits:
            try:
                update, ann = check_audit_evidence(verdicts, self.engine.revision.id, self.engine.manifest)
            except (DecodeError, VerificationError):
                return "bad-audit"
            if update.signer in parent.quarantined or update.signer in authors or \
                    update.signer in parent.private_peers or \
                    not head.window - AUDIT_WINDOWS <= ann.window < head.window:
                return "bad-audit"
            ids.append(update.id)
            authors.add(update.signer)
        return "" if ids == sorted(ids) else "bad-audit"

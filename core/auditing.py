"""A validator's sampled audits, run after the fact (spec/protocol.md §6.2).

With ``audit = true`` and ``audit_rate > 0`` in the manifest, updates are screened without a replay. Once
a head certifies a window, each validator audits the cohort updates that `audit_selected` picks with the
head's id - randomness no trainer knew when it announced - by re-running the author's training (an
``audit`` compute task) off the critical path, while the next window trains. An audit that fails is
signed as an `AuditFailure` verdict and sent to every validator. A proposer puts each update that holds
`verdicts_needed` verdicts of distinct validators into the next head's ``audits``; that head quarantines
its author (`core/quarantine.py`). Anyone checks the verdicts from the head alone
(`check_audit_evidence`); `peerloom verify` also checks the selection against the chain.

The work in flight is plain data (`AuditTask`), resumed by `SampledAudits.on_task`. Verdicts are held in
memory only: a restarted validator forgets those it held (its peers still hold theirs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from .audit import AUDIT_WINDOWS, audit_selected, check_audit_evidence, verdicts_needed
from .collector import Collector, audit_args
from .envelope import SignedEnvelope
from .errors import DecodeError, VerificationError
from .identity import PeerId
from .messages import Signed
from .objects import (
    MAX_HEAD_AUDITS,
    PROTOCOL_VERSION,
    AuditEvidence,
    AuditFailure,
    Head,
    UpdateAnnouncement,
    seal,
)
from .pending import Failed, Outcome

if TYPE_CHECKING:
    from .engine import Engine

MAX_VERDICTS_PER_SIGNER = 64  # verdicts held per validator at a time (a faulty one cannot grow our state)


@attrs.frozen(kw_only=True)
class AuditTask:
    """The ``audit`` task of the cohort update `update_id` of the head of `window` is in flight."""

    update_id: bytes
    window: int


def audit_authors(audits: tuple[AuditEvidence, ...]) -> tuple[PeerId, ...]:
    """The authors of the updates whose failed `audits` a head carries (already checked)."""
    return tuple(AuditFailure.from_cbor(v[0].open(AuditFailure.KIND, PROTOCOL_VERSION)).update.signer
                 for v in audits)


class SampledAudits:
    """Sampled audits of one validator: the audits it runs, and the verdicts it holds (its own and other
    validators'), by update id."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.running: dict[bytes, SignedEnvelope] = {}  # update id -> its envelope, audit in flight
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
        if head.skipped or collector is None or collector.window != head.window:
            return
        for update_id in head.cohort:
            if not audit_selected(head.id, update_id, m.audit_rate):
                continue
            entry = collector.by_id.get(update_id)
            if entry is None:  # a head we adopted with an update we never screened: others audit it
                e.stats["audits_unavailable"] += 1
                continue
            e.stats["audits_started"] += 1
            self.running[update_id] = entry.envelope
            self.updates[update_id] = (entry.envelope, entry.announcement)
            args = {"delta": entry.announcement.delta,
                    "audit": audit_args(m, collector.head, entry.envelope.signer, entry.announcement)}
            e.run_task("audit", args, "validator", AuditTask(update_id=update_id, window=head.window))

    def on_task(self, work: AuditTask, outcome: Outcome) -> None:
        """An audit ended: a failure is signed, kept and sent to every validator."""
        e = self.engine
        envelope = self.running.pop(work.update_id, None)
        if envelope is None:
            return
        author = str(envelope.signer)
        if isinstance(outcome, Failed):
            e.stats["audits_errored"] += 1  # this validator's trouble, never the author's
            e.log("audit-error", window=work.window, author=author, reason=outcome.reason)
            return
        assert outcome.result is not None
        if outcome.result["ok"]:
            e.stats["audits_passed"] += 1
            e.log("audit-passed", window=work.window, author=author)
            return
        e.stats["audits_failed"] += 1
        e.log("audit-failed", window=work.window, author=author, reason=outcome.result["reason"])
        verdict = seal(e.identity, AuditFailure(revision=e.revision.id, update=envelope))
        self._hold(verdict, envelope, self.updates[work.update_id][1])
        e.broadcast(Signed(envelope=verdict), roles=("validator",))

    def on_verdict(self, peer: PeerId, verdict: SignedEnvelope, head: Head) -> None:
        """Another validator's `AuditFailure` verdict (sent by `peer`), taken while `head` is canonical here.
        Raises DecodeError / VerificationError for a bad one (the engine charges `peer`)."""
        e = self.engine
        if verdict.signer not in e.manifest.validators:
            raise VerificationError("not-a-validator", "audit verdict")
        failure = AuditFailure.from_cbor(verdict.open(AuditFailure.KIND, PROTOCOL_VERSION))
        if failure.revision != e.revision.id:
            raise VerificationError("wrong-revision", "audit verdict")
        ann = UpdateAnnouncement.from_cbor(failure.update.open(UpdateAnnouncement.KIND, PROTOCOL_VERSION))
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
                    not head.window - AUDIT_WINDOWS <= ann.window < head.window:
                return "bad-audit"
            ids.append(update.id)
            authors.add(update.signer)
        return "" if ids == sorted(ids) else "bad-audit"

"""Recomputation audits: validators re-run a trainer's training and compare (spec/protocol.md §6).

Statistical screening cannot catch an update crafted to look typical (ALIE, Baruch et al. 2019,
arXiv:1902.06156, sits *closer* to the cohort's centre than honest updates do). What it cannot fake is
the computation itself: a trainer's update is a deterministic function of the base head's params, its
leased shards, the manifest's training settings and a seed that nobody chooses. With ``audit = true`` in
the manifest, every validator and reducer re-runs that training in its `screen` task and rejects an
update whose cosine to the recomputation is below ``audit_min_cosine`` (``screen-audit``, a strike).

This module holds the two pure pieces every peer must agree on: the training seed and the comparison
threshold's meaning. The seed is derived from public values only, so a trainer cannot pick a seed that
happens to favour it, and a claimant training a silent leaseholder's shards gets a seed of its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from .envelope import SignedEnvelope
from .errors import VerificationError
from .identity import PeerId
from .objects import (
    ArtifactRef,
    AuditEvidence,
    AuditFailure,
    Head,
    Manifest,
    UpdateAnnouncement,
    open_body,
)
from .tasks import EagerStart

AUDIT_WINDOWS = 8
"""A failed audit enters a head at most this many windows after the update's own window (spec/protocol.md
§6.2): older verdicts are dropped, so one failure cannot quarantine its author twice when the quarantine
is shorter than this."""
SEED_DOMAIN = b"peerloom/train-seed/v1"
LOSS_BATCH_DOMAIN = b"peerloom/loss-batch/v1"
AUDIT_SELECT_DOMAIN = b"peerloom/audit-select/v1"
AUDIT_SEGMENT_DOMAIN = b"peerloom/audit-segment/v1"


def train_seed(base: bytes, window: int, shards: Sequence[int], author: PeerId) -> int:
    """The 32-bit seed a trainer MUST train with: the first 4 bytes (big-endian) of
    SHA-256(``SEED_DOMAIN`` ‖ base head id ‖ window as 8 bytes ‖ each shard as 4 bytes ‖ author peer id bytes).
    """
    h = hashlib.sha256(SEED_DOMAIN)
    h.update(base)
    h.update(window.to_bytes(8, "big"))
    for shard in shards:
        h.update(shard.to_bytes(4, "big"))
    h.update(author.to_bytes())
    return int.from_bytes(h.digest()[:4], "big")


def start_args(manifest: Manifest, base: Head, prior_delta: ArtifactRef | None) -> EagerStart | None:
    """Where an overlapped update's training starts (spec/protocol.md §5.2), as the ``start`` of the ``train``,
    ``screen`` (loss check) and ``audit`` tasks (`core.tasks.EagerStart`): None (its base's params) unless it
    names a `prior`, the author's own update that the base lacks; then the base's params moved by the part of
    the next outer step every cohort shares (``outer_lr * outer_momentum^2`` times the base's DiLoCo momentum
    buffer, `outer_state`; none under FedAvg) and by the prior's pseudo-gradient: ``params - scale *
    outer_state - decode(prior delta)``, computed in float64 and rounded once to the params' dtype. This is
    the "eager update" of Kale et al. 2025 (arXiv 2502.12996): the trainer's own pseudo-gradient stands in
    for the cohort's one it has not seen yet."""
    if prior_delta is None:
        return None
    scale = manifest.outer_lr * manifest.outer_momentum ** 2 if base.outer_state is not None else 0.0
    return EagerStart(prior=prior_delta, outer_state=base.outer_state if scale else None, scale=scale)


def loss_batch_seed(update_id: bytes) -> int:
    """The 64-bit seed that picks the samples of an update's loss check (spec/protocol.md §6.1): the first 8
    bytes (big-endian) of SHA-256(``LOSS_BATCH_DOMAIN`` ‖ update id). Every validator draws the same batch."""
    return int.from_bytes(hashlib.sha256(LOSS_BATCH_DOMAIN + update_id).digest()[:8], "big")


def audit_selected(head_id: bytes, update_id: bytes, rate: float) -> bool:
    """Whether the cohort update `update_id` of the head `head_id` is audited (spec/protocol.md §6.2): the
    first 8 bytes (big-endian) of SHA-256(``AUDIT_SELECT_DOMAIN`` ‖ head id ‖ update id), as a fraction of
    2^64, are below `rate`. The head id depends on every cohort member's signature and on the validators'
    recomputation, so no trainer knows, when it announces, whether its update will be audited."""
    draw = int.from_bytes(hashlib.sha256(AUDIT_SELECT_DOMAIN + head_id + update_id).digest()[:8], "big")
    return draw < rate * 2.0**64


def verdicts_needed(manifest: Manifest) -> int:
    """Distinct validators whose `AuditFailure` verdicts quarantine an update's author: ``n - quorum + 1``,
    one more than the faulty validators a revision tolerates, so at least one of them is honest."""
    return len(manifest.validators) - manifest.quorum + 1


def check_audit_evidence(verdicts: AuditEvidence, revision_id: bytes,
                         manifest: Manifest) -> tuple[SignedEnvelope, UpdateAnnouncement]:
    """The update (its envelope and announcement) that `verdicts` prove failed a sampled audit, checked from
    the verdicts alone (spec/protocol.md §6.2): each is an `AuditFailure` signed by a distinct validator of
    the manifest (sorted by signer), for this revision, about one and the same update announcement, signed
    by its author for this revision; there are at least `verdicts_needed` of them.

    Whether that update was in a certified cohort and selected for audit needs the chain
    (`peerloom verify` checks both; `audit_selected`). Raises VerificationError (``bad-audit``,
    ``not-a-validator``, ``wrong-revision``, ``bad-signature``) or DecodeError.
    """
    if len(verdicts) < verdicts_needed(manifest):
        raise VerificationError("bad-audit", f"{len(verdicts)} verdicts, {verdicts_needed(manifest)} needed")
    signers = [v.signer for v in verdicts]
    if signers != sorted(set(signers)):
        raise VerificationError("bad-audit", "verdicts must come from distinct validators, sorted by signer")
    update: SignedEnvelope | None = None
    for verdict in verdicts:
        if verdict.signer not in manifest.validators:
            raise VerificationError("not-a-validator", str(verdict.signer))
        failure = open_body(verdict, AuditFailure)
        if failure.revision != revision_id:
            raise VerificationError("wrong-revision", "audit verdict")
        if update is not None and failure.update != update:
            raise VerificationError("bad-audit", "verdicts name different updates")
        update = failure.update
    assert update is not None
    ann = open_body(update, UpdateAnnouncement)
    if ann.revision != revision_id:
        raise VerificationError("wrong-revision", "audited update")
    if ann.unauditable:
        raise VerificationError("bad-audit", "the update says it is unauditable: it gets no audit")
    return update, ann


def segment_bounds(inner_steps: int, segments: int) -> tuple[int, ...]:
    """The inner-step counts ``b_0 = 0 < b_1 < ... < b_S = H`` at which a trainer's committed checkpoints
    are taken (spec/protocol.md §6.3): ``b_j = floor(j H / S)``. ValueError unless ``1 <= S <= H``."""
    if not 1 <= segments <= inner_steps:
        raise ValueError(f"need 1 <= segments <= inner_steps, got {segments}, {inner_steps}")
    return tuple((j * inner_steps) // segments for j in range(segments + 1))


def audit_segment(head_id: bytes, update_id: bytes, segments: int) -> int:
    """Which segment ``j`` (steps ``b_j .. b_{j+1}``, 0-based ``j < segments``) a sampled audit of `update_id`
    replays (spec/protocol.md §6.3): SHA-256(``AUDIT_SEGMENT_DOMAIN`` ‖ head id ‖ update id) as a big-endian
    integer, modulo `segments`. Fixed by the certifying head, so unknown to the trainer when it commits."""
    return int.from_bytes(hashlib.sha256(AUDIT_SEGMENT_DOMAIN + head_id + update_id).digest(), "big") % segments

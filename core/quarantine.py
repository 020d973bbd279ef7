"""Quarantine and equivocation evidence (spec/design.md §4, spec/protocol.md §9).

Everything here is a pure function of a certified parent head, the window's inputs and the manifest, so
every validator derives the same quarantine set and can check a proposed head's records exactly:

- a **strike** is one update of a trainer rejected by deterministic screening (reason in
  `STRIKE_REASONS`) and listed in a head's `rejected`; strikes older than `strike_windows` windows expire;
- `quarantine_strikes` live strikes quarantine the trainer for `quarantine_windows` windows;
- **equivocation evidence** (two votes signed by one validator for the same (window, round, step) with
  different heads) is transferable: anyone can check it from the manifest, and a head that includes it
  quarantines the validator for `quarantine_windows` windows.

A quarantined peer holds no lease (`core/leases.py`) and so no cohort slot, and its joins are ignored,
until the window named by its record.
"""

from __future__ import annotations

from collections.abc import Iterable

from .envelope import SignedEnvelope
from .errors import DecodeError, VerificationError
from .identity import PeerId
from .objects import PRECOMMIT, PREVOTE, PROTOCOL_VERSION, VOTE_KIND, Evidence, Head, Manifest

# Screening reasons that any honest validator reproduces from the signed announcement and the delta
# bytes alone; only these are strikes. Fetch failures, local task errors and replays (which depend on the
# order announcements arrived in) never are, nor is the loss check's `screen-loss`: an honest update on data
# the model has already fit can fail it (spec/protocol.md §6.1), so it keeps the update out of the aggregate
# and no more; audits are what quarantine a trainer that never trains.
STRIKE_REASONS = frozenset({
    "screen-undecodable", "screen-schema", "screen-non-finite", "screen-digest-mismatch", "screen-norm-bound",
    "screen-norm-outlier", "screen-cosine", "screen-audit",
})


def next_records(parent: Head, window: int, struck: Iterable[PeerId], equivocators: Iterable[PeerId],
                 manifest: Manifest) -> tuple[tuple[tuple[PeerId, int], ...], tuple[tuple[PeerId, int, int], ...]]:
    """(quarantine, strikes) of the head of `window` whose parent is `parent`.

    `struck`: authors of this window's rejected updates (one strike each); `equivocators`: validators
    named by new evidence. Released records (release window <= window + 1) and expired strikes are dropped.
    """
    release = window + 1 + manifest.quarantine_windows
    quarantine = {p: until for p, until in parent.quarantine if until > window + 1}
    strikes = {p: (n, w) for p, n, w in parent.strikes if w > window - manifest.strike_windows}
    for peer in struck:
        n, _ = strikes.get(peer, (0, window))
        strikes[peer] = (n + 1, window)
    for peer, (n, _) in list(strikes.items()):
        if n >= manifest.quarantine_strikes:
            quarantine[peer] = max(quarantine.get(peer, 0), release)
            del strikes[peer]
    for peer in equivocators:
        quarantine[peer] = max(quarantine.get(peer, 0), release)
    return (tuple(sorted(quarantine.items())),
            tuple(sorted((p, n, w) for p, (n, w) in strikes.items())))


def make_evidence(a: SignedEnvelope, b: SignedEnvelope) -> Evidence:
    """Canonical evidence pair (sorted by envelope id)."""
    return (a, b) if a.id <= b.id else (b, a)


def check_evidence(evidence: Evidence, revision_id: bytes, manifest: Manifest) -> PeerId:
    """Return the equivocating validator, or raise VerificationError/DecodeError if `evidence` is not two
    validly signed votes of one validator for the same (revision, window, round, step) and different heads."""
    a, b = evidence
    if a.signer != b.signer or a.id >= b.id:
        raise VerificationError("bad-evidence", "two distinct votes of one signer, sorted by id")
    if a.signer not in manifest.validators:
        raise VerificationError("not-a-validator", str(a.signer))
    bodies = [x.open(VOTE_KIND, PROTOCOL_VERSION) for x in (a, b)]
    for body in bodies:
        if set(body) != {"revision", "window", "round", "step", "head"} or body["step"] not in (PREVOTE, PRECOMMIT):
            raise DecodeError("bad-fields", "vote")
        if body["revision"] != revision_id:
            raise VerificationError("wrong-revision", "evidence")
    slot = [(x["window"], x["round"], x["step"]) for x in bodies]
    if slot[0] != slot[1] or bodies[0]["head"] == bodies[1]["head"]:
        raise VerificationError("bad-evidence", "votes are for different slots or agree")
    return a.signer

"""`peerloom verify DIR`: check a chain directory from genesis against its signed manifest.

The directory holds ``manifest.cbor`` (the signed revision manifest) and one ``NNNNNN.cbor`` per window
(a head with its quorum certificate), as the demo and every node write them. Checks, in order: the
manifest's signature (and its authority, when given); for every head, its certificate's signatures and
quorum against the manifest's validator set, its parent link and window number
(`peerloom.core.chain.verify_chain`); and the manifest's cohort and roster rules (`check_rules`). Prints
what it checked; exit status 0 only if everything verified.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Sequence
from pathlib import Path

from peerloom.core.chain import decode_chain_entry, verify_chain
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.errors import PeerloomError, VerificationError
from peerloom.core.identity import PeerId
from peerloom.core.objects import Head, QuorumCertificate, Revision


def check_rules(revision: Revision, entries: Sequence[tuple[Head, QuorumCertificate]]) -> list[str]:
    """The manifest's cohort and roster rules, head by head (spec/protocol.md).

    A certified (not skipped) head has at least ``min_updates`` distinct updates in its cohort; every
    roster is sorted, names each trainer once, with a capacity in 1..``max_capacity``; a trainer leaves
    the roster only by a signed leave, which the head records in ``left``, or by idle expiry (manifest
    ``idle_windows`` > 0), recorded in ``expired``: the roster shrinks by exactly the head's ``left`` and
    ``expired`` (disjoint peers of the previous roster, absent from the new one) and by no other peer
    (quarantine, not removal, takes a misbehaving peer out of the leases). Raises VerificationError
    naming the window at the first failure.
    """
    m = revision.manifest
    previous = revision.genesis()
    for head, _ in entries:
        where = f"window {head.window}"
        if not head.skipped and len(head.cohort) < m.min_updates:
            raise VerificationError("cohort-too-small", f"{where}: {len(head.cohort)} < {m.min_updates}")
        if len(set(head.cohort)) != len(head.cohort):
            raise VerificationError("cohort-duplicate", where)
        peers = [p for p, _ in head.roster]
        if len(set(peers)) != len(peers):
            raise VerificationError("roster-duplicate", where)
        if any(not 1 <= cap <= m.max_capacity for _, cap in head.roster):
            raise VerificationError("roster-capacity", where)
        dropped = {p for p, _ in previous.roster} - set(peers)
        if head.expired and m.idle_windows == 0:
            raise VerificationError("expired-disabled", f"{where}: expiry is off in this manifest")
        if set(head.left) & set(head.expired) or dropped != set(head.left) | set(head.expired):
            raise VerificationError("roster-shrunk", f"{where}: {len(dropped)} trainer(s) dropped, "
                                                     f"{len(head.left)} left, {len(head.expired)} expired")
        previous = head
    return [f"cohort and roster rules hold for {len(entries)} heads (cohort >= {m.min_updates}, "
            f"capacity <= {m.max_capacity}, roster shrinks only by signed leaves and idle expiry)"]


def run_verify(chain_dir: Path, authority: str | None = None, *, echo: Callable[[str], None] = print,
               brief: bool = False) -> int:
    """Verify `chain_dir`; print (via `echo`) each check (`brief`: first and last few windows only);
    return 0 if all passed, 1 otherwise. FileNotFoundError when `chain_dir` holds no manifest.cbor."""
    if not (chain_dir / "manifest.cbor").is_file():
        raise FileNotFoundError(errno.ENOENT, "not a chain directory (no manifest.cbor)", str(chain_dir))
    try:
        envelope = SignedEnvelope.from_bytes((chain_dir / "manifest.cbor").read_bytes())
        revision = Revision.verify(envelope, PeerId.from_text(authority) if authority else None)
        paths = sorted(chain_dir.glob("[0-9]*.cbor"))
        entries = []
        for path in paths:
            try:
                entries.append(decode_chain_entry(path.read_bytes()))
            except PeerloomError as exc:
                raise PeerloomError(f"{path.name}: {exc}") from exc
        checked = verify_chain(revision, entries)
        checked += check_rules(revision, entries)
    except (OSError, PeerloomError) as exc:
        echo(f"FAILED: {exc}")
        return 1
    shown = checked if not brief or len(checked) <= 8 else [*checked[:3], f"... {len(checked) - 6} more windows ...",
                                               *checked[-3:]]
    for line in shown:
        echo(line)
    if not entries:
        echo("FAILED: no certified heads in the chain")
        return 1
    echo(f"OK: {len(entries)} certified heads verified from genesis")
    return 0

"""`peerloom admit`: the admission authority issues a trainer's admission certificate.

Under a manifest with ``admission = "certificate"`` a validator adds a joining trainer to the roster only
if its join carries an `AdmissionCertificate` ``{revision, peer, max_capacity}`` signed by the manifest's
``admission_authority`` (spec/protocol.md §2 and §5 "Admission"). This command signs one with the
authority's key and writes the envelope's bytes (`SignedEnvelope.to_bytes()`), which the trainer's node
config names as ``admission = "admission.cbor"`` (peerloom/node.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from peerloom.adapters.keys import load_identity
from peerloom.adapters.storage import atomic_write
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.errors import PeerloomError
from peerloom.core.identity import Identity, PeerId
from peerloom.core.objects import AdmissionCertificate, Revision, check_admission, seal

MAX_CAPACITY = 1 << 16  # the largest max_capacity an admission certificate may carry (`AdmissionCertificate`)


def issue_admission(authority: Identity, revision: Revision, peer: PeerId, max_capacity: int, *,
                    expires_window: int | None = None, login: bytes | None = None) -> SignedEnvelope:
    """Seal an admission certificate for `peer` in `revision` (declared capacity clamped to
    `max_capacity`, 1..65536), valid for joins naming windows up to `expires_window` (None: no expiry) and
    bound to the 32-byte `login` digest (spec/auth.md §3; None for operator-issued certificates). ValueError
    if `authority` is not the manifest's admission_authority or the capacity is out of range; the result
    passes `check_admission` as validators run it."""
    expected = revision.manifest.admission_authority
    if expected is None:
        raise ValueError(f"the manifest names no admission_authority (its admission policy is "
                         f"{revision.manifest.admission!r}): it needs no certificates")
    if authority.peer_id != expected:
        raise ValueError(f"the key's peer id {authority.peer_id.to_text()} is not the manifest's "
                         f"admission_authority {expected.to_text()}")
    if not 1 <= max_capacity <= MAX_CAPACITY:
        raise ValueError(f"max capacity must be 1..{MAX_CAPACITY}, got {max_capacity}")
    envelope = seal(authority, AdmissionCertificate(revision=revision.id, peer=peer, max_capacity=max_capacity,
                                                    expires_window=expires_window, login=login))
    check_admission(envelope, revision.id, revision.manifest, peer)
    return envelope


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("admit", help="sign an admission certificate for a trainer (manifest admission = "
                                     "\"certificate\")")
    p.add_argument("--authority-key", type=Path, required=True,
                   help="key file of the manifest's admission_authority (must exist)")
    p.add_argument("--manifest", type=Path, required=True, help="the signed revision manifest (manifest.cbor)")
    p.add_argument("--peer", required=True, help="peer id of the trainer to admit")
    p.add_argument("--max-capacity", type=int, default=1, metavar="N",
                   help="largest capacity the trainer may declare (default 1; the manifest clamps it too)")
    p.add_argument("--expires-window", type=int, default=None, metavar="W",
                   help="last window a join carrying the certificate may name (default: no expiry)")
    p.add_argument("--out", type=Path, required=True, help="where to write the certificate (admission.cbor)")


def run(args: argparse.Namespace) -> int | str:
    """Exit status for `sys.exit`: 0, or a message naming what is wrong."""
    if not args.authority_key.exists():
        return f"peerloom admit: authority key {args.authority_key} does not exist"
    try:
        authority = load_identity(args.authority_key)
    except (OSError, ValueError) as exc:
        return f"peerloom admit: {exc}"
    try:
        envelope = SignedEnvelope.from_bytes(args.manifest.read_bytes())
        revision = Revision.verify(envelope)  # its own signer's signature; the trainer's node pins the authority
    except OSError as exc:
        return f"peerloom admit: manifest: {exc}"
    except PeerloomError as exc:
        return f"peerloom admit: {args.manifest} is not a signed manifest: {exc}"
    try:
        peer = PeerId.from_text(args.peer)
    except Exception:
        return f"peerloom admit: --peer {args.peer!r} is not a peer id"
    try:
        if args.expires_window is not None and args.expires_window < 0:
            raise ValueError(f"--expires-window must be >= 0, got {args.expires_window}")
        certificate = issue_admission(authority, revision, peer, args.max_capacity,
                                      expires_window=args.expires_window)
    except ValueError as exc:
        return f"peerloom admit: {exc}"
    try:
        atomic_write(args.out, certificate.to_bytes())
    except OSError as exc:
        return f"peerloom admit: --out: {exc}"
    print(f"admitted {peer.to_text()} to revision {revision.id.hex()} (max capacity {args.max_capacity}): "
          f"{args.out}", file=sys.stdout)
    return 0

"""`peerloom verify DIR`: check a chain directory from genesis against its signed manifest.

The directory holds ``manifest.cbor`` (the signed revision manifest) and one ``NNNNNN.cbor`` per window
(a head with its quorum certificate), as the demo and every node write them. Prints what it checked;
exit status 0 only if everything verified.
"""

from __future__ import annotations

from pathlib import Path

from peerloom.core.chain import decode_chain_entry, verify_chain
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.errors import PeerloomError
from peerloom.core.identity import PeerId
from peerloom.core.objects import Revision


def run_verify(chain_dir: Path, authority: str | None = None) -> int:
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
    except (OSError, PeerloomError) as exc:
        print(f"FAILED: {exc}")
        return 1
    for line in checked:
        print(line)
    if not entries:
        print("FAILED: no certified heads in the chain")
        return 1
    print(f"OK: {len(entries)} certified heads verified from genesis")
    return 0

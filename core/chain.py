"""Verifying a chain of certified heads from genesis (spec/design.md §4: anyone holding the manifest can).

Checks, for each entry in window order: the certificate verifies against the revision's validator set
and quorum, the head names the revision, windows advance by one, and each head's parent is the id of the
previous head (genesis first, as the manifest defines it). Skipped heads must keep their parent's params
and have an empty cohort.
"""

from __future__ import annotations

from collections.abc import Sequence

from .encoding import decode, encode
from .errors import DecodeError, VerificationError
from .objects import Head, QuorumCertificate, Revision

# RFC 8949 §4.2.1: a canonical map sorts its keys by their encodings, bytewise: "head" (0x64 ...) comes
# before "certificate" (0x6b ...). Splicing lets a record reuse the head's cached encoding.
_MAP2 = b"\xa2"
_KEY_HEAD = encode("head")
_KEY_CERTIFICATE = encode("certificate")


# The last few records built, by (head id, certificate bytes): every engine of a simulator process that
# adopts one certified head persists the same record, and shares one bytes object instead of a copy each.
_RECORDS: dict[tuple[bytes, bytes], bytes] = {}
_RECORDS_KEPT = 8


def encode_chain_entry(head: Head, cert: QuorumCertificate) -> bytes:
    """The canonical ``{"head", "certificate"}`` record: one chain file, and the engine's head record.

    Byte-identical to ``encode({"head": head.to_cbor(), "certificate": cert.to_cbor()})``."""
    cert_bytes = encode(cert.to_cbor())
    key = (head.id, cert_bytes)
    record = _RECORDS.get(key)
    if record is None:
        record = _MAP2 + _KEY_HEAD + head.to_bytes() + _KEY_CERTIFICATE + cert_bytes
        if len(_RECORDS) >= _RECORDS_KEPT:
            del _RECORDS[next(iter(_RECORDS))]
        _RECORDS[key] = record
    return record


def decode_chain_entry(data: bytes) -> tuple[Head, QuorumCertificate]:
    """Parse one ``{"head", "certificate"}`` record. DecodeError on anything else."""
    obj = decode(data, max_bytes=1 << 24)
    if not isinstance(obj, dict) or set(obj) != {"head", "certificate"}:
        raise DecodeError("bad-record", "expected {head, certificate}")
    return Head.from_cbor(obj["head"]), QuorumCertificate.from_cbor(obj["certificate"])


def verify_chain(revision: Revision, entries: Sequence[tuple[Head, QuorumCertificate]]) -> list[str]:
    """Verify `entries` (windows 1..n, in order) as a chain from genesis; returns what was checked.

    Raises VerificationError at the first failure, naming the window.
    """
    checked = [f"manifest signed by {revision.authority} (revision {revision.id[2:].hex()[:16]})"]
    previous = revision.genesis()
    for head, cert in entries:
        where = f"window {head.window}"
        if head.window > previous.window + 1:
            missing = (f"window {previous.window + 1} is" if head.window == previous.window + 2 else
                       f"windows {previous.window + 1}-{head.window - 1} are")
            raise VerificationError("window-gap", f"{missing} missing ({where} follows window {previous.window})")
        if head.window != previous.window + 1:
            raise VerificationError("window-gap", f"{where} follows window {previous.window}")
        if head.parent != previous.id:
            raise VerificationError("bad-parent", where)
        try:
            cert.verify(revision, head)
        except VerificationError as exc:
            raise VerificationError(exc.reason, f"{where}: {exc.detail}") from exc
        if head.skipped and (head.cohort or head.params_digest != previous.params_digest):
            raise VerificationError("bad-skip", where)
        if not head.skipped and not head.cohort:
            raise VerificationError("empty-cohort", where)
        signers = ", ".join(p.short() for p, _ in cert.votes)
        checked.append(f"{where}: head {head.id[2:].hex()[:16]} parent ok, {len(cert.votes)}/"
                       f"{revision.manifest.quorum} signatures ok ({signers}), cohort {len(head.cohort)}"
                       + (" [skipped]" if head.skipped else ""))
        previous = head
    return checked

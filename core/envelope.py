"""Signed envelopes: every object that moves trust travels inside one (spec/design.md §3, spec/wire.md §3).

An envelope is the CBOR array ``[kind, version, body, signer, signature]`` where `body` is the canonical
CBOR encoding of the object and `signature` is Ed25519 over the domain-separated preimage::

    encode(["peerloom/envelope/v1", kind, version, signer_peer_id_bytes, body])

The context string and the kind keep a signature for one purpose from being replayed as another.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs

from .encoding import content_id, decode, encode
from .errors import DecodeError, VerificationError
from .identity import Identity, PeerId

ENVELOPE_DOMAIN = "peerloom/envelope/v1"
MAX_BODY_BYTES = 1 << 20


def signing_preimage(kind: str, version: int, signer: PeerId, body: bytes) -> bytes:
    return encode([ENVELOPE_DOMAIN, kind, version, signer.to_bytes(), body])


@attrs.frozen(kw_only=True)
class SignedEnvelope:
    """A signed, canonical protocol object. Build with `seal`; check with `open`."""

    kind: str
    version: int
    body: bytes
    signer: PeerId
    signature: bytes

    @classmethod
    def seal(cls, identity: Identity, kind: str, version: int, body: Any) -> SignedEnvelope:
        body_bytes = encode(body)
        sig = identity.sign(signing_preimage(kind, version, identity.peer_id, body_bytes))
        return cls(kind=kind, version=version, body=body_bytes, signer=identity.peer_id, signature=sig)

    def open(self, kind: str, version: int) -> dict[str, Any]:
        """Verify kind, version and signature; return the decoded body map.

        Raises VerificationError (``wrong-kind``, ``unknown-version``, ``bad-signature``) or DecodeError.
        """
        self.verify(kind, version)
        return self.body_map()

    def verify(self, kind: str, version: int) -> None:
        """Check kind, version and signature, without decoding the body (`core.bodies.decode_body` does).

        Raises VerificationError (``wrong-kind``, ``unknown-version``, ``bad-signature``).
        """
        if self.kind != kind:
            raise VerificationError("wrong-kind", f"expected {kind}, got {self.kind}")
        if self.version != version:
            raise VerificationError("unknown-version", f"{kind} v{self.version}")
        if not self.signer.verify(signing_preimage(kind, version, self.signer, self.body), self.signature):
            raise VerificationError("bad-signature", kind)

    def body_map(self) -> dict[str, Any]:
        """The body decoded as a CBOR map (its signature unchecked). Raises DecodeError."""
        body = decode(self.body, max_bytes=MAX_BODY_BYTES)
        if not isinstance(body, dict):
            raise DecodeError("bad-type", "envelope body must be a map")
        return body

    def to_cbor(self) -> list[Any]:
        return [self.kind, self.version, self.body, self.signer.to_bytes(), self.signature]

    @classmethod
    def from_cbor(cls, obj: Any) -> SignedEnvelope:
        if not (isinstance(obj, list) and len(obj) == 5):
            raise DecodeError("bad-envelope", "expected a 5-element array")
        kind, version, body, signer, signature = obj
        if not (isinstance(kind, str) and isinstance(version, int) and not isinstance(version, bool)):
            raise DecodeError("bad-envelope", "kind/version")
        if not (isinstance(body, bytes) and isinstance(signer, bytes) and isinstance(signature, bytes)):
            raise DecodeError("bad-envelope", "body/signer/signature must be bytes")
        return cls(kind=kind, version=version, body=body, signer=PeerId.from_bytes(signer), signature=signature)

    def to_bytes(self) -> bytes:
        return encode(self.to_cbor())

    @classmethod
    def from_bytes(cls, data: bytes, *, max_bytes: int = MAX_BODY_BYTES + 256) -> SignedEnvelope:
        return cls.from_cbor(decode(data, max_bytes=max_bytes))

    @functools.cached_property
    def id(self) -> bytes:
        """Content id of the whole envelope (what cohorts list as update ids); computed once per instance."""
        return content_id(self.to_bytes())

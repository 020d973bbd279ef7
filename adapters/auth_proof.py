"""The bytes both sides of a login agree on (spec/auth.md §2-3), with no dependency beyond core: the client
(`peerloom login`, which needs neither aiohttp nor PyJWT) and the auth service (`adapters.auth_service`)."""

from __future__ import annotations

import hashlib

from peerloom.core.encoding import encode
from peerloom.core.identity import PeerId

LOGIN_PROOF_DOMAIN = "peerloom/auth-login/v1"  # spec/auth.md §2
LOGIN_ID_DOMAIN = b"peerloom/auth-login-id/v1\x00"  # spec/auth.md §3


def login_proof_preimage(revision_id: bytes, session: str, nonce: bytes, peer: PeerId, provider: str) -> bytes:
    """The bytes a client signs with its peer key to ask for a certificate (spec/auth.md §2): canonical CBOR
    of ``[LOGIN_PROOF_DOMAIN, revision_id, session, nonce, peer, provider]``. The domain string differs from
    every envelope's (``peerloom/envelope/v1``), so the signature is no protocol object."""
    return encode([LOGIN_PROOF_DOMAIN, revision_id, session, nonce, peer.to_bytes(), provider])


def login_digest(login: str) -> bytes:
    """The 32-byte digest a certificate's ``login`` field carries for a login name such as ``github:583231``
    or ``oidc:https://issuer#subject`` (spec/auth.md §3): SHA-256 of a domain prefix and the UTF-8 name."""
    return hashlib.sha256(LOGIN_ID_DOMAIN + login.encode()).digest()

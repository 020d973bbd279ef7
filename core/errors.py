"""Error types of the protocol engine (spec/design.md §2).

`LocalProtocolError` means the caller misused the API: a bug in the host, never caused by a peer.
`RemoteProtocolError` means a peer misbehaved; it carries the peer and a stable reason code, and the
engine turns it into a rejection, a penalty or a hang-up - it never crashes the engine.
"""

from __future__ import annotations


class PeerloomError(Exception):
    """Base class of every error peerloom raises on purpose."""


class LocalProtocolError(PeerloomError):
    """The host called the engine wrongly (unknown event, time going backwards, misuse)."""


class DecodeError(PeerloomError):
    """Bytes that are not a valid canonical protocol object.

    `reason` is a short stable code (e.g. ``"too-large"``, ``"non-canonical"``) used in metrics.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class VerificationError(PeerloomError):
    """A signature, certificate or digest did not verify. `reason` is a stable code."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class RemoteProtocolError(PeerloomError):
    """A peer sent something it must not have. Carries the peer (a PeerId) and a reason code."""

    def __init__(self, peer: object, reason: str, detail: str = "") -> None:
        super().__init__(f"{peer}: {reason}: {detail}" if detail else f"{peer}: {reason}")
        self.peer = peer
        self.reason = reason
        self.detail = detail

"""A trainer's work in flight (core/pending.py): the frozen records `TrainerRole` (core/trainer.py) hands the
engine with a fetch, a compute task or a write, and gets back with the outcome; reading the update
announcements it signed; and `TrainerServices`, what the trainer uses of the engine."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import attrs

from .envelope import SignedEnvelope
from .identity import PeerId
from .objects import UpdateAnnouncement, open_body
from .services import (
    BaseHeads,
    Broadcasts,
    ChecksStored,
    Fetches,
    FindsPeers,
    HasConfig,
    HasIdentity,
    HasManifest,
    HasMe,
    HasNow,
    HasRecords,
    HasRevision,
    HasStats,
    LeaseHeads,
    Logs,
    NotesStored,
    Persists,
    RunsTasks,
    Sends,
    SetsTimers,
)


@attrs.frozen(kw_only=True)
class FetchParams:
    """The head's params are being fetched to train `window`: on our own lease (`holder` None) or claiming
    `holder`'s."""

    window: int
    holder: PeerId | None = None
    prior: bytes = b""  # the attempt: the id of its prior (§5.2), b"" for none


@attrs.frozen(kw_only=True)
class Prefetch:
    """The params (or momentum) of the head of `window` are fetched ahead of the window that starts from them."""

    window: int


@attrs.frozen(kw_only=True)
class FetchState:
    """The base head's DiLoCo momentum is being fetched to start `window` from it moved by our prior (§5.2)."""

    window: int
    prior: bytes = b""


def announcement_of(envelope: SignedEnvelope) -> UpdateAnnouncement:
    """The update announcement a signed envelope carries (raises DecodeError/VerificationError if it is none)."""
    return open_body(envelope, UpdateAnnouncement)


def prior_of(envelope: SignedEnvelope) -> bytes | None:
    """The id of the update an announcement names as its prior (spec/protocol.md §5.2), if any."""
    return announcement_of(envelope).prior


@attrs.frozen(kw_only=True)
class Train:
    """The ``train`` task of `window` is in flight: on our own lease (`holder` None) or claiming `holder`'s."""

    window: int
    holder: PeerId | None = None
    prior: bytes = b""  # the attempt: the id of its prior (§5.2), b"" for none


@attrs.frozen(kw_only=True)
class Announce:
    """The signed announcement `envelope` of `window` (on our own lease, or claiming `holder`'s) is being
    persisted: it is sent once durable. `train_loss` is the one it announces, `delta` its delta artifact's
    digest (for the log line)."""

    window: int
    envelope: SignedEnvelope
    train_loss: float
    holder: PeerId | None = None
    delta: bytes = b""


class TrainerServices(HasConfig, HasIdentity, HasMe, HasRevision, HasManifest, HasNow, HasStats, HasRecords, Logs,
                      Sends, Broadcasts, FindsPeers, SetsTimers, Persists, RunsTasks, Fetches, NotesStored,
                      ChecksStored, LeaseHeads, BaseHeads, Protocol):
    """What `TrainerRole` uses of the engine (core/engine.py implements it)."""

    def drop_stored(self, digests: Iterable[bytes]) -> None: ...

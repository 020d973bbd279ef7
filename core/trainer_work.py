"""A trainer's work in flight (core/pending.py): the frozen records `TrainerRole` (core/trainer.py) hands the
engine with a fetch, a compute task or a write, and gets back with the outcome; reading the update
announcements it signed; and `TrainerServices`, what the trainer uses of the engine."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any, Protocol

import attrs

from .config import EngineConfig
from .envelope import SignedEnvelope
from .identity import Identity, PeerId
from .messages import ROLES, Message
from .objects import ArtifactRef, Head, Manifest, Revision, UpdateAnnouncement, open_body
from .records import Record
from .roles import TimerKey
from .tasks import Task


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


class TrainerServices(Protocol):
    """What `TrainerRole` uses of the engine (core/engine.py implements it)."""

    @property
    def config(self) -> EngineConfig: ...
    @property
    def identity(self) -> Identity: ...
    @property
    def me(self) -> PeerId: ...
    @property
    def revision(self) -> Revision: ...
    @property
    def manifest(self) -> Manifest: ...
    @property
    def now(self) -> float: ...
    @property
    def stats(self) -> Counter[str]: ...
    @property
    def records(self) -> dict[str, bytes]: ...
    def log(self, event: str, **fields: Any) -> None: ...
    def send(self, peer: PeerId, message: Message) -> None: ...
    def broadcast(self, message: Message, roles: Iterable[str] = ROLES) -> None: ...
    def peers_with(self, role: str) -> list[PeerId]: ...
    def set_timer(self, key: TimerKey, deadline: float) -> None: ...
    def persist_then(self, record: Record, owner: str, work: Any) -> None: ...
    def run_task(self, task: Task, owner: str, work: Any) -> str: ...
    def fetch(self, ref: ArtifactRef, providers: Iterable[PeerId], owner: str, work: Any) -> None: ...
    def note_stored(self, ref: ArtifactRef) -> None: ...
    def is_stored(self, digest: bytes) -> bool: ...
    def drop_stored(self, digests: Iterable[bytes]) -> None: ...
    def lease_head(self, window: int) -> Head | None: ...
    def base_heads(self, window: int) -> dict[bytes, Head]: ...

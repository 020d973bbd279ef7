"""The engine, one member at a time: a Protocol per member that a role or a part of one may use
(core/engine.py implements them all). Each role's or part's own Protocol (`CollectorServices`,
`VotingServices`, ...) inherits the ones it uses, so it sees only those and each signature is written once
(spec/design.md, "Roles")."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any, Protocol

from .config import EngineConfig
from .identity import Identity, PeerId
from .messages import ROLES, Message
from .objects import ArtifactRef, Head, Manifest, Revision
from .records import Record
from .roles import TimerKey
from .tasks import Task


class HasConfig(Protocol):
    """``config``: the node's static configuration."""

    @property
    def config(self) -> EngineConfig: ...


class HasIdentity(Protocol):
    """``identity``: the node's signing identity."""

    @property
    def identity(self) -> Identity: ...


class HasMe(Protocol):
    """``me``: the node's peer id."""

    @property
    def me(self) -> PeerId: ...


class HasRevision(Protocol):
    """``revision``: the verified revision."""

    @property
    def revision(self) -> Revision: ...


class HasManifest(Protocol):
    """``manifest``: the revision's manifest."""

    @property
    def manifest(self) -> Manifest: ...


class HasNow(Protocol):
    """``now``: the time of the event being handled (seconds)."""

    @property
    def now(self) -> float: ...


class HasStats(Protocol):
    """``stats``: the engine's counters."""

    @property
    def stats(self) -> Counter[str]: ...


class HasRejectedByReason(Protocol):
    """``rejected_by_reason``: rejections counted by reason."""

    @property
    def rejected_by_reason(self) -> Counter[str]: ...


class HasRecords(Protocol):
    """``records``: the durable records by key."""

    @property
    def records(self) -> dict[str, bytes]: ...


class Logs(Protocol):
    """``log``: log an event."""

    def log(self, event: str, **fields: Any) -> None: ...


class Sends(Protocol):
    """``send``: send a message to a peer."""

    def send(self, peer: PeerId, message: Message) -> None: ...


class Broadcasts(Protocol):
    """``broadcast``: send to every peer of some roles."""

    def broadcast(self, message: Message, roles: Iterable[str] = ROLES) -> None: ...


class FindsPeers(Protocol):
    """``peers_with``: the connected peers with a role."""

    def peers_with(self, role: str) -> list[PeerId]: ...


class SetsTimers(Protocol):
    """``set_timer``: arm a timer."""

    def set_timer(self, key: TimerKey, deadline: float) -> None: ...


class CancelsTimers(Protocol):
    """``cancel_timer``: disarm a timer."""

    def cancel_timer(self, key: TimerKey) -> None: ...


class Persists(Protocol):
    """``persist_then``: persist a record, then resume work."""

    def persist_then(self, record: Record, owner: str, work: Any) -> None: ...


class RunsTasks(Protocol):
    """``run_task``: run a compute task, then resume work."""

    def run_task(self, task: Task, owner: str, work: Any) -> str: ...


class Fetches(Protocol):
    """``fetch``: fetch an artifact, then resume work."""

    def fetch(self, ref: ArtifactRef, providers: Iterable[PeerId], owner: str, work: Any) -> None: ...


class NotesStored(Protocol):
    """``note_stored``: record an artifact a task stored."""

    def note_stored(self, ref: ArtifactRef) -> None: ...


class ChecksStored(Protocol):
    """``is_stored``: whether an artifact is stored."""

    def is_stored(self, digest: bytes) -> bool: ...


class Rejects(Protocol):
    """``reject``: count (and charge) a rejection."""

    def reject(self, peer: PeerId | None, reason: str, detail: str = "") -> None: ...


class LeaseHeads(Protocol):
    """``lease_head``: the head a window's leases come from."""

    def lease_head(self, window: int) -> Head | None: ...


class BaseHeads(Protocol):
    """``base_heads``: the heads an update of a window may train from."""

    def base_heads(self, window: int) -> dict[bytes, Head]: ...

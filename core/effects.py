"""Outputs of the engine (spec/design.md §2), pulled with `Engine.next_effect()` after each `handle()`.

Two kinds, two unions (quinn-proto keeps `poll_transmit` apart from `poll` the same way):

- a `Command` is work a host must carry out, in order: send, hang up, ban, write a record, run a task, serve,
  store or commit chunks, drop artifacts (`adapters.host.Driver` executes each on the `Host` primitives);
- a `Notification` tells a host what happened and asks for nothing: a promoted head, discovered addresses, a
  rejection, a `SubmitReply`, a log line (the driver hands each to the optional `Observer`; a host that ignores
  them writes nothing for them).

`Effect` is both, in the one order the engine emits them. Effects are frozen value objects; don't subclass them.
"""

from __future__ import annotations

from typing import Any

import attrs

from .identity import PeerId
from .objects import ArtifactRef, Head, QuorumCertificate
from .records import Record
from .tasks import Task


@attrs.frozen(kw_only=True)
class Send:
    """Send one wire message (`data`, already encoded) to a connected peer."""
    peer: PeerId
    data: bytes


@attrs.frozen(kw_only=True)
class HangUp:
    """Close the connection to `peer`; `reason` is a stable code for logs."""
    peer: PeerId
    reason: str


@attrs.frozen(kw_only=True)
class Persist:
    """Write `record.data` under `record.key` durably (fsync), then feed back `Persisted(token)`.

    `record` is one of the `core.records` classes (a vote, a lock, a claim, a head...): its fields say what it
    is, and its `key` is the storage key, derived there. Messages that depend on the record are held by the
    engine until then (durable before visible).
    """
    token: int
    record: Record

    @property
    def key(self) -> str:
        """The record's storage key (`core.records`)."""
        return self.record.key


@attrs.frozen(kw_only=True)
class RunTask:
    """Run heavy compute off the engine; feed back `TaskFinished` (with `task`'s result class) or `TaskFailed`
    with `task_id`.

    `task` is one of the `core.tasks` classes, its fields typed (artifacts as `ArtifactRef`): ``train``
    (`TrainTask` -> `TrainResult`), ``screen`` (`ScreenTask` -> `ScreenResult`), ``audit`` (`AuditTask` ->
    `AuditResult`), ``audit-plan`` (`AuditPlanTask` -> `AuditPlanResult`), ``reduce`` (`ReduceTask` ->
    `ReduceResult`) and ``evaluate`` (`EvaluateTask` -> `EvaluateResult`). `task_id` is ``<kind>-<n>``, unique
    within the engine's life.
    """
    task_id: str
    task: Task

    @property
    def kind(self) -> str:
        """The task's kind (``train``, ``screen``...: `core.tasks`), for logs and per-kind accounting."""
        return self.task.kind


@attrs.frozen(kw_only=True)
class ServeChunk:
    """Read chunk `index` of the stored artifact `ref` and send it to `peer` as a `Chunk` message."""
    peer: PeerId
    ref: ArtifactRef
    index: int


@attrs.frozen(kw_only=True)
class StoreChunk:
    """Write a verified chunk of an artifact being fetched to temporary storage."""
    ref: ArtifactRef
    index: int
    data: bytes | memoryview


@attrs.frozen(kw_only=True)
class CommitArtifact:
    """Every chunk of `ref` is stored: assemble, verify the whole digest, make it visible, then feed back
    `ArtifactStored`.

    `durable` (the default) asks for it durable before `ArtifactStored` (fsync). False where the node can
    fetch the artifact again and neither signs nor persists anything that needs it across a crash (an
    update's delta, fetched to screen and reduce): the host may skip the fsyncs, and after a crash such an
    artifact is missing, or checked before it is trusted again (spec/design.md §6, Storage)."""
    ref: ArtifactRef
    durable: bool = True


@attrs.frozen(kw_only=True)
class DropArtifacts:
    """Retention (spec/protocol.md §8.1, `EngineConfig.keep_windows`): the engine no longer needs these
    stored artifacts (it has stopped serving them); the host deletes them from its store."""
    digests: tuple[bytes, ...]


@attrs.frozen(kw_only=True)
class HeadPromoted:
    """A new certified head is canonical at this node."""
    head: Head
    certificate: QuorumCertificate


@attrs.frozen(kw_only=True)
class PeersDiscovered:
    """Listen addresses ("host:port", syntax already checked: `messages.parse_address`) of peers this
    node is not connected to, learnt from a connected peer's PeerExchange. The host may dial them."""
    peers: tuple[tuple[PeerId, str], ...]


@attrs.frozen(kw_only=True)
class Rejected:
    """The engine refused input from `peer` (a message, a signed envelope, a chunk) and charged it one penalty
    point; `peer` is None where no peer can be blamed. `reason` is a stable code (the keys of
    `Engine.rejected_by_reason`, e.g. ``bad-signature``, ``screen-norm-outlier``), `detail` free text for
    humans. Hosts may keep reputation from these; nothing needs the matching `Log(event="reject")`."""
    peer: PeerId | None
    reason: str
    detail: str = ""


@attrs.frozen(kw_only=True)
class Ban:
    """`peer` reached `EngineConfig.penalty_limit`: refuse it, inbound or dialed, until `until` (seconds on
    the host's monotonic clock, `now + EngineConfig.ban_s`). The engine emits a `HangUp` for its current
    connection right after this effect; a `Ban` itself closes nothing."""
    peer: PeerId
    until: float


@attrs.frozen(kw_only=True)
class SubmitReply:
    """The engine's verdict on the envelope of `events.Submit` with this `request_id`: `accepted` unless the
    engine rejected something its signer sent in it, then `reason` is the first such rejection's code (as in
    `Rejected.reason`; empty when accepted). Accepted means taken for judgement, not yet in a head."""
    request_id: int
    accepted: bool
    reason: str = ""


@attrs.frozen(kw_only=True)
class Log:
    """A structured log line: `event` is a stable name, `fields` plain values."""
    event: str
    fields: dict[str, Any]


Command = Send | HangUp | Persist | RunTask | ServeChunk | StoreChunk | CommitArtifact | DropArtifacts | Ban
"""Effects a host must carry out (module docstring)."""

Notification = HeadPromoted | PeersDiscovered | Rejected | SubmitReply | Log
"""Effects a host may ignore (module docstring)."""

Effect = Command | Notification

"""Inputs to the engine (spec/design.md §2). Every event carries `now`: seconds on the host's monotonic clock.

Events are frozen, keyword-only value objects; don't subclass them.
"""

from __future__ import annotations

import attrs

from .envelope import SignedEnvelope
from .identity import PeerId
from .objects import ArtifactRef
from .tasks import TaskResult


@attrs.frozen(kw_only=True)
class Start:
    """Local command: begin taking part (send hellos, start the first window)."""
    now: float


@attrs.frozen(kw_only=True)
class PeerConnected:
    """An authenticated connection to `peer` is up (the transport verified its key)."""
    now: float
    peer: PeerId


@attrs.frozen(kw_only=True)
class PeerDisconnected:
    """The connection to `peer` closed (either side, any reason); what it had in flight is asked of others."""
    now: float
    peer: PeerId


@attrs.frozen(kw_only=True)
class MessageReceived:
    """One whole wire message from an authenticated peer (untrusted bytes)."""
    now: float
    peer: PeerId
    data: bytes


@attrs.frozen(kw_only=True)
class TimerDue:
    """The host's clock passed `next_deadline()`; a spurious call does nothing."""
    now: float


@attrs.frozen(kw_only=True)
class TaskFinished:
    """A compute task asked for by a `RunTask` effect finished; `result` is its kind's result class
    (`core.tasks.TaskResult`: a `TrainTask` gives a `TrainResult`...)."""
    now: float
    task_id: str
    result: TaskResult


@attrs.frozen(kw_only=True)
class TaskFailed:
    """A compute task asked for by a `RunTask` effect failed; `reason` is free text for logs."""
    now: float
    task_id: str
    reason: str


@attrs.frozen(kw_only=True)
class ArtifactStored:
    """The host durably stored (and verified) the artifact named by `ref`."""
    now: float
    ref: ArtifactRef


@attrs.frozen(kw_only=True)
class ArtifactCorrupt:
    """The host refused to commit the fetched artifact `ref`: its chunks all verified, but the whole does not
    hash to `ref.digest` (a ref whose author signed inconsistent digests). The fetch fails."""
    now: float
    ref: ArtifactRef


@attrs.frozen(kw_only=True)
class ArtifactAdded:
    """The host stored the artifact named by `ref` on its own, not through a `CommitArtifact` (bytes it computed
    or made itself outside a compute task). The engine counts it as stored and serves it; a fetch of the same
    artifact under way is done at once, and the chunks it still has asked for are dropped quietly when they
    come (`Engine.note_stored`)."""
    now: float
    ref: ArtifactRef


@attrs.frozen(kw_only=True)
class Persisted:
    """The host durably wrote the record of the `Persist` effect with this token."""
    now: float
    token: int


@attrs.frozen(kw_only=True)
class LeaveRequested:
    """Local command: this trainer leaves the roster (signs a `LeaveRequest` to the validators) and stops
    joining again until `JoinRequested`."""
    now: float


@attrs.frozen(kw_only=True)
class JoinRequested:
    """Local command: a trainer that left asks to join the roster again."""
    now: float


@attrs.frozen(kw_only=True)
class Submit:
    """Local command: a signed envelope that reached the host some other way than a peer connection (an HTTP
    light trainer's upload), judged as if its signer had sent it in a `Signed` message: the same checks,
    quotas and charges. A signer with no connection is treated, for this one envelope, as a greeted peer with
    the trainer role. `stored`: the artifact the host stored for it first (its update delta), or None.
    The engine answers with one `effects.SubmitReply` carrying `request_id` (chosen by the host)."""
    now: float
    request_id: int
    envelope: SignedEnvelope
    stored: ArtifactRef | None = None


Event = (Start | PeerConnected | PeerDisconnected | MessageReceived | TimerDue | TaskFinished | TaskFailed
         | ArtifactStored | ArtifactCorrupt | ArtifactAdded | Persisted | LeaveRequested | JoinRequested | Submit)

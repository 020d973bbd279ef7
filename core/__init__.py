"""The sans-IO protocol engine and the protocol's objects (spec/design.md §2-4). Pure: no I/O of any kind."""

from .chain import verify_chain
from .effects import (
    Ban,
    Command,
    CommitArtifact,
    DropArtifacts,
    Effect,
    HangUp,
    HeadPromoted,
    Log,
    Notification,
    PeersDiscovered,
    Persist,
    Rejected,
    RunTask,
    Send,
    ServeChunk,
    StoreChunk,
    SubmitReply,
)
from .engine import Engine, EngineConfig
from .errors import DecodeError, LocalProtocolError, PeerloomError, RemoteProtocolError, VerificationError
from .events import (
    ArtifactAdded,
    ArtifactCorrupt,
    ArtifactStored,
    Event,
    JoinRequested,
    LeaveRequested,
    MessageReceived,
    PeerConnected,
    PeerDisconnected,
    Persisted,
    Start,
    Submit,
    TaskFailed,
    TaskFinished,
    TimerDue,
)
from .identity import Identity, PeerId
from .objects import ArtifactRef, Head, Manifest, QuorumCertificate, Revision
from .roles import Role
from .tasks import Task, TaskResult

__all__ = [
    "ArtifactAdded", "ArtifactCorrupt", "ArtifactRef", "ArtifactStored", "Ban", "Command", "CommitArtifact",
    "DecodeError", "DropArtifacts", "Effect", "Engine", "EngineConfig", "Event", "HangUp", "Head", "HeadPromoted",
    "Identity", "JoinRequested", "LeaveRequested", "LocalProtocolError", "Log", "Manifest", "MessageReceived",
    "Notification", "PeerConnected", "PeerDisconnected", "PeerId", "PeerloomError", "PeersDiscovered", "Persist",
    "Persisted", "QuorumCertificate", "Rejected", "RemoteProtocolError", "Revision", "Role", "RunTask", "Send",
    "ServeChunk", "Start", "StoreChunk", "Submit", "SubmitReply", "Task", "TaskFailed", "TaskFinished", "TaskResult",
    "TimerDue", "VerificationError", "verify_chain",
]

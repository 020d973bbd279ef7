"""The sans-IO protocol engine and the protocol's objects (DESIGN §2-4). Pure: no I/O of any kind."""

from .chain import verify_chain
from .effects import (
    CommitArtifact,
    Effect,
    HangUp,
    HeadPromoted,
    Log,
    Persist,
    RunTask,
    Send,
    ServeChunk,
    StoreChunk,
)
from .engine import Engine, EngineConfig
from .errors import DecodeError, LocalProtocolError, PeerloomError, RemoteProtocolError, VerificationError
from .events import (
    ArtifactStored,
    Event,
    MessageReceived,
    PeerConnected,
    PeerDisconnected,
    Persisted,
    Start,
    TaskFailed,
    TaskFinished,
    TimerDue,
)
from .identity import Identity, PeerId
from .objects import ArtifactRef, Head, Manifest, QuorumCertificate, Revision

__all__ = [
    "ArtifactRef", "ArtifactStored", "CommitArtifact", "DecodeError", "Effect", "Engine", "EngineConfig", "Event",
    "HangUp", "Head", "HeadPromoted", "Identity", "LocalProtocolError", "Log", "Manifest", "MessageReceived",
    "PeerConnected", "PeerDisconnected", "PeerId", "PeerloomError", "Persist", "Persisted", "QuorumCertificate",
    "RemoteProtocolError", "Revision", "RunTask", "Send", "ServeChunk", "Start", "StoreChunk", "TaskFailed",
    "TaskFinished", "TimerDue", "VerificationError", "verify_chain",
]

"""Effect execution shared by every host of an engine (the trio runtime and the simulator).

Only the storage-side effects live here; sending, timers and compute scheduling differ per host.
"""

from __future__ import annotations

from peerloom.core import effects as fx
from peerloom.core import events as ev
from peerloom.core.errors import VerificationError
from peerloom.core.messages import Chunk, encode_message

from .storage import ArtifactStore


def chunk_message(store: ArtifactStore, effect: fx.ServeChunk) -> bytes:
    """The encoded `Chunk` message answering a ServeChunk effect."""
    data = store.read_chunk(effect.ref, effect.index)
    return encode_message(Chunk(artifact=effect.ref.digest, index=effect.index, data=data))


def stored_event(store: ArtifactStore, effect: fx.CommitArtifact, now: float) -> ev.Event:
    """Commit a fetched artifact and return the event to feed back: `ArtifactStored`, or `ArtifactCorrupt`
    when the bytes do not hash to the ref's digest (a hostile ref must never stop the host)."""
    try:
        store.commit(effect.ref)
    except VerificationError:
        return ev.ArtifactCorrupt(now=now, ref=effect.ref)
    return ev.ArtifactStored(now=now, ref=effect.ref)


def apply_storage_effect(store: ArtifactStore, effect: fx.Effect) -> bool:
    """Execute Persist / StoreChunk against `store`; False for any other effect (`CommitArtifact` goes through
    `stored_event`, which says whether the artifact was stored).

    The caller feeds back `Persisted` (with its own clock) after this returns True for a Persist.
    A Persist is committed to the node database (SQLite WAL, synchronous=FULL) before this returns, so the
    messages the engine releases on `Persisted` are always sent after their record is durable (the engine's
    persist_then contract). A conflicting vote raises DoubleVoteError: the node stops rather than equivocate.
    """
    match effect:
        case fx.Persist():
            store.put_record(effect.key, effect.record)
        case fx.StoreChunk():
            store.write_chunk(effect.ref, effect.index, effect.data)
        case _:
            return False
    return True

# TEMPORARY during the port to Driver (adapters/host.py); removed once every host uses it.
"""The one interpreter of engine effects, shared by every host: the trio node runtime
(`adapters/runtime.py`), the discrete-event simulator (`sim/kernel.py`) and a user's own loop
(`examples/embed_engine_asyncio.py`).

A host is anything with one method per effect (`Host`). `drain(engine, host)` pulls the engine's effects
in order and `dispatch` hands each to the method named after it (``Send`` -> ``send``, ``HangUp`` ->
``hang_up``, ...). `dispatch` matches the `core.effects.Effect` union exhaustively and ends in
`typing.assert_never`: a new effect that is not dispatched fails type checking here (`make typecheck`, strict on this
module; tests/adapters/test_host_exhaustive.py shows it), and `tests/adapters/test_host.py` fails at run time. A
host that cannot carry out an effect still implements its method and says there why it refuses it (e.g. the
simulator feeds no `Submit`, so it awaits no `SubmitReply`).

What differs per host stays in the host: when `Persisted`, `ArtifactStored` and task results are fed
back (at once, after a modelled delay, from a worker thread), how bytes reach a peer, and timers (every
host re-arms its one timer at `Engine.next_deadline()` after a drain). The storage helpers below are the
parts of storage effects that do not differ.

The engine contract this relies on: spec/design.md §2 and core/engine.py's module docstring (handle, then drain
`next_effect()` until None, executing each effect in order).
"""

from __future__ import annotations

from typing import Protocol, assert_never

from peerloom.core import effects as fx
from peerloom.core import events as ev
from peerloom.core.engine import Engine
from peerloom.core.errors import VerificationError
from peerloom.core.messages import Chunk, encode_message

from peerloom.adapters.storage import ArtifactStore


class Host(Protocol):
    """What a host of an engine provides: one method per effect, each given the effect. Methods may feed
    events back into the engine (e.g. `Persisted` once a record is durable); `drain` then goes on with the
    effects that produced. The effects' docstrings (core/effects.py) say what each must do."""

    def send(self, effect: fx.Send) -> None:
        """Queue `effect.data` for the connected peer `effect.peer`; drop it if there is no connection."""

    def hang_up(self, effect: fx.HangUp) -> None:
        """Close the connection to `effect.peer` (if any); the host feeds `PeerDisconnected` once it is gone."""

    def persist(self, effect: fx.Persist) -> None:
        """Write the record durably, then (not before) feed back `Persisted(token)`."""

    def run_task(self, effect: fx.RunTask) -> None:
        """Run the compute task off the engine; feed back `TaskFinished` or `TaskFailed`."""

    def serve_chunk(self, effect: fx.ServeChunk) -> None:
        """Send the stored chunk to the peer (`chunk_message`)."""

    def store_chunk(self, effect: fx.StoreChunk) -> None:
        """Write a verified chunk of an artifact being fetched to temporary storage."""

    def commit_artifact(self, effect: fx.CommitArtifact) -> None:
        """Assemble and verify the artifact, then feed back `stored_event`'s event."""

    def drop_artifacts(self, effect: fx.DropArtifacts) -> None:
        """Delete the stored artifacts the engine dropped (retention; `ArtifactStore.remove` does it for a
        store)."""

    def head_promoted(self, effect: fx.HeadPromoted) -> None:
        """A new certified head is canonical (notification)."""

    def peers_discovered(self, effect: fx.PeersDiscovered) -> None:
        """Addresses of peers not connected to: dial them, or say why not."""

    def rejected(self, effect: fx.Rejected) -> None:
        """The engine refused a peer's input (reputation, metrics)."""

    def ban(self, effect: fx.Ban) -> None:
        """Refuse `effect.peer`, inbound or dialed, until `effect.until` (host monotonic seconds)."""

    def submit_reply(self, effect: fx.SubmitReply) -> None:
        """The verdict on a `Submit` this host fed, by `request_id`."""

    def log(self, effect: fx.Log) -> None:
        """A structured log line."""


def dispatch(effect: fx.Effect, host: Host) -> None:
    """Hand one effect to the `host` method named after its type. Raises AssertionError (via
    `assert_never`) for an object that is not a member of `core.effects.Effect`."""
    match effect:
        case fx.Send():
            host.send(effect)
        case fx.HangUp():
            host.hang_up(effect)
        case fx.Persist():
            host.persist(effect)
        case fx.RunTask():
            host.run_task(effect)
        case fx.ServeChunk():
            host.serve_chunk(effect)
        case fx.StoreChunk():
            host.store_chunk(effect)
        case fx.CommitArtifact():
            host.commit_artifact(effect)
        case fx.DropArtifacts():
            host.drop_artifacts(effect)
        case fx.HeadPromoted():
            host.head_promoted(effect)
        case fx.PeersDiscovered():
            host.peers_discovered(effect)
        case fx.Rejected():
            host.rejected(effect)
        case fx.Ban():
            host.ban(effect)
        case fx.SubmitReply():
            host.submit_reply(effect)
        case fx.Log():
            host.log(effect)
        case _:
            assert_never(effect)


def drain(engine: Engine, host: Host) -> None:
    """Execute every effect `engine` has for now, in order (call after each `Engine.handle`). Events a
    host method feeds back into the engine add effects that this same loop then executes."""
    while (effect := engine.next_effect()) is not None:
        dispatch(effect, host)


# --- storage parts every host shares ----------------------------------------------------------------


def chunk_message(store: ArtifactStore, effect: fx.ServeChunk) -> bytes:
    """The encoded `Chunk` message answering a ServeChunk effect."""
    data = store.read_chunk(effect.ref, effect.index)
    return encode_message(Chunk(artifact=effect.ref.digest, index=effect.index, data=data))


def stored_event(store: ArtifactStore, effect: fx.CommitArtifact, now: float) -> ev.Event:
    """Commit a fetched artifact and return the event to feed back: `ArtifactStored`, or `ArtifactCorrupt`
    when the bytes do not hash to the ref's digest (a hostile ref must never stop the host)."""
    try:
        store.commit(effect.ref, durable=effect.durable)
    except VerificationError:
        return ev.ArtifactCorrupt(now=now, ref=effect.ref)
    return ev.ArtifactStored(now=now, ref=effect.ref)

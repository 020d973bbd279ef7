"""Artifact writes off the node's event loop (spec/design.md §6, Storage).

The engine asks its host to write each verified chunk of an artifact it fetches (`StoreChunk`) and then to
commit the whole (`CommitArtifact`: the size check, fsync, rename, directory fsync, unless the effect says
it need not be durable). Done on the trio thread, at 100M parameters these writes were a third of a
validator's event loop (bench/README.md, window.py). A `StoreWriter` takes them off it:

- the runtime queues each write and commit (`write_chunk`, `commit`: the driver's primitives, adapters/host.py)
  in the order the engine emitted them, without blocking;
- one trio task (`run`) hands what is queued, in that order, to a worker thread in batches, one batch at a
  time, so every chunk of an artifact is written before its commit, and a commit never starts before the
  chunks queued ahead of it are on disk;
- each operation's outcome comes back on the trio thread (`on_done`), after the batch that held it
  finished: only then does the runtime complete a commit (its `done`, which feeds the engine `ArtifactStored` or
  `ArtifactCorrupt`), as it did when it committed inline;
- a chunk that cannot be written (OSError: a full disk) loses its fetch, as before: the store drops the
  partial file (`ArtifactStore.write_chunk`), later writes and the commit of that artifact are skipped
  (outcome `SKIPPED`), and the runtime never commits it;
- the bytes queued are bounded (`max_queued_bytes`): the runtime's main loop waits for `room` before it takes
  the next event, so a fast sender fills the peer's flow-control window, not this process's memory.

`Persist` records stay where they were (committed on the trio thread before `Persisted` is fed back): they
are small, and the engine holds its votes until then.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import trio

from peerloom.core.errors import VerificationError
from peerloom.core.objects import ArtifactRef

from .storage import ArtifactStore

MAX_QUEUED_BYTES = 64 << 20
"""Chunk bytes queued for the writer thread past which the runtime stops taking events (`room`)."""
MAX_BATCH = 64
"""Operations handed to the worker thread in one call (each call costs a thread hand-off)."""

STORED = "stored"
CORRUPT = "corrupt"
FAILED = "failed"  # the write or commit raised an OSError (`Outcome.error`): its fetch is lost
SKIPPED = "skipped"  # an earlier chunk of this artifact could not be written: its fetch is lost


@attrs.frozen
class ChunkWrite:
    """A queued write of one verified chunk."""

    ref: ArtifactRef
    index: int
    data: bytes | memoryview


@attrs.frozen
class Commit:
    """A queued commit of an artifact; `done(ok)` is the driver's completion (`ok`: not corrupt), called by the
    runtime when the outcome is `STORED` or `CORRUPT`."""

    ref: ArtifactRef
    durable: bool = True
    done: Callable[[bool], None] = attrs.field(default=lambda ok: None, eq=False)


@attrs.frozen
class Outcome:
    """What became of one queued operation: `STORED` (a chunk written, or an artifact committed),
    `CORRUPT` (the commit's size or id check failed: `ArtifactCorrupt`), `FAILED` (with the OSError the write
    or commit raised, `error`) or `SKIPPED`."""

    op: ChunkWrite | Commit
    status: str
    error: OSError | None = None


class StoreWriter:
    """Applies chunk writes and artifact commits to `store` on a worker thread, in the order queued
    (module docstring). `on_done` is called on the trio thread with each `Outcome`, in order; an exception
    it raises ends `run` (and the node). Methods other than `run` are called from the trio thread."""

    def __init__(self, store: ArtifactStore, on_done: Callable[[Outcome], None], *,
                 max_queued_bytes: int = MAX_QUEUED_BYTES) -> None:
        self.store = store
        self.on_done = on_done
        self.max_queued_bytes = max_queued_bytes
        self.queued_bytes = 0
        self._send, self._receive = trio.open_memory_channel[ChunkWrite | Commit](float("inf"))
        self._room = trio.Event()
        self._room.set()
        self._lost: set[bytes] = set()  # artifacts with a chunk that failed; touched by the worker thread only
        self._pending = 0  # operations queued or being applied
        self._drained = trio.Event()
        self._drained.set()

    def write_chunk(self, ref: ArtifactRef, index: int, data: bytes | memoryview) -> None:
        """Queue one verified chunk for writing; never blocks."""
        self.queued_bytes += len(data)
        if self.queued_bytes > self.max_queued_bytes and self._room.is_set():
            self._room = trio.Event()
        self._queue(ChunkWrite(ref, index, data))

    def commit(self, ref: ArtifactRef, durable: bool = True,
               done: Callable[[bool], None] = lambda ok: None) -> None:
        """Queue the commit of an artifact, after every chunk of it queued so far; never blocks."""
        self._queue(Commit(ref, durable, done))

    def _queue(self, op: ChunkWrite | Commit) -> None:
        if self._pending == 0:
            self._drained = trio.Event()
        self._pending += 1
        self._send.send_nowait(op)

    async def room(self) -> None:
        """Return once at most `max_queued_bytes` of chunks wait for the worker thread."""
        await self._room.wait()

    async def drained(self) -> None:
        """Return once every operation queued so far has been applied and its outcome handed to `on_done`."""
        await self._drained.wait()

    async def run(self) -> None:
        """Apply what is queued, batch by batch, until cancelled (a batch under way finishes first: a worker
        thread is not interrupted, so no write is torn by a cancellation)."""
        while True:
            batch = [await self._receive.receive()]
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self._receive.receive_nowait())
                except trio.WouldBlock:
                    break
            outcomes = await trio.to_thread.run_sync(self._apply, batch)
            self.queued_bytes -= sum(len(op.data) for op in batch if isinstance(op, ChunkWrite))
            if self.queued_bytes <= self.max_queued_bytes:
                self._room.set()
            try:
                for outcome in outcomes:
                    self.on_done(outcome)
            finally:
                self._pending -= len(batch)
                if self._pending == 0:
                    self._drained.set()

    def _apply(self, batch: list[Any]) -> list[Outcome]:
        """On the worker thread: each operation in order."""
        return [self._apply_one(op) for op in batch]

    def _apply_one(self, op: ChunkWrite | Commit) -> Outcome:
        digest = op.ref.digest
        if digest in self._lost:
            return Outcome(op, SKIPPED)
        try:
            if isinstance(op, ChunkWrite):
                self.store.write_chunk(op.ref, op.index, op.data)
            else:
                try:
                    self.store.commit(op.ref, durable=op.durable)
                except VerificationError:
                    return Outcome(op, CORRUPT)
        except OSError as exc:
            self._lost.add(digest)
            return Outcome(op, FAILED, error=exc)
        return Outcome(op, STORED)

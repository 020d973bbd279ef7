"""The node runtime's store writer (adapters/store_writer.py): chunk writes and artifact commits on a worker
thread, in the order queued, each outcome handed back on the trio thread after its operation finished."""

from __future__ import annotations

import errno
import threading

import trio

from peerloom.adapters.storage import ArtifactStore
from peerloom.adapters.store_writer import CORRUPT, FAILED, SKIPPED, STORED, ChunkWrite, Commit, Outcome, StoreWriter
from peerloom.core.errors import VerificationError
from peerloom.core.objects import make_artifact_ref


class _Recording:
    """A store that records each write and commit, with the thread that did it; `fail` maps (digest, index)
    to the OSError that chunk's write raises, `corrupt` is digests whose commit fails its checks, `gate`
    holds every commit until set."""

    def __init__(self) -> None:
        self.done: list[tuple[str, bytes, int | None]] = []
        self.threads: set[int] = set()
        self.fail: dict[tuple[bytes, int], OSError] = {}
        self.corrupt: set[bytes] = set()
        self.gate = threading.Event()
        self.gate.set()

    def write_chunk(self, ref, index, data) -> None:
        self.threads.add(threading.get_ident())
        if (ref.digest, index) in self.fail:
            raise self.fail[ref.digest, index]
        self.done.append(("write", ref.digest, index))

    def commit(self, ref, *, durable: bool = True) -> None:
        self.threads.add(threading.get_ident())
        self.gate.wait(10)
        if ref.digest in self.corrupt:
            raise VerificationError("corrupt-artifact", ref.digest.hex())
        self.done.append(("commit" if durable else "commit-volatile", ref.digest, None))


def _chunks(data: bytes, size: int) -> tuple:
    ref = make_artifact_ref(data, size)
    return ref, [ChunkWrite(ref=ref, index=i, data=data[i * size:(i + 1) * size]) for i in range(ref.num_chunks)]


def _run(writer: StoreWriter, body) -> None:
    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer.run)
            await body()
            await writer.drained()
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_writes_of_each_artifact_are_applied_in_order_and_its_commit_after_the_last():
    store = _Recording()
    outcomes: list[Outcome] = []
    # each commit's outcome must come back only once every write of its artifact is done
    seen_at_commit: dict[bytes, list] = {}

    def on_done(outcome: Outcome) -> None:
        outcomes.append(outcome)
        if isinstance(outcome.op, Commit):
            seen_at_commit[outcome.op.ref.digest] = list(store.done)

    writer = StoreWriter(store, on_done)  # type: ignore[arg-type]  # a stand-in store
    a, a_chunks = _chunks(bytes(range(256)) * 40, 1000)  # 11 chunks
    b, b_chunks = _chunks(b"b" * 5000, 1000)
    queued = []

    async def body():
        # two fetches interleaved, with yields between, as chunks arrive from two peers
        for i in range(max(len(a_chunks), len(b_chunks))):
            for chunks in (a_chunks, b_chunks):
                if i < len(chunks):
                    writer.write_chunk(chunks[i].ref, chunks[i].index, chunks[i].data)
                    queued.append(chunks[i])
            if i == len(b_chunks) - 1:
                writer.commit(b, False)
                queued.append("commit-b")
            if i % 3 == 0:
                await trio.sleep(0)
        writer.commit(a)
        queued.append("commit-a")

    _run(writer, body)
    assert threading.get_ident() not in store.threads  # never on the trio thread
    # applied in exactly the order queued (so per artifact: chunk 0, 1, ..., then the commit)
    expected = [("write", e.ref.digest, e.index) if isinstance(e, ChunkWrite) else
                ("commit-volatile", b.digest, None) if e == "commit-b" else ("commit", a.digest, None)
                for e in queued]
    assert store.done == expected
    assert [o.status for o in outcomes] == [STORED] * len(queued)
    assert [o.op for o in outcomes if isinstance(o.op, ChunkWrite)] == \
        [e for e in queued if isinstance(e, ChunkWrite)]
    for ref, chunks in ((a, a_chunks), (b, b_chunks)):
        assert {("write", ref.digest, c.index) for c in chunks} <= set(seen_at_commit[ref.digest])
    assert writer.queued_bytes == 0


def test_a_commit_runs_off_the_event_loop_and_its_outcome_comes_only_once_it_finished():
    store = _Recording()
    store.gate.clear()  # the commit (an fsync, say) takes a while
    outcomes: list[Outcome] = []
    writer = StoreWriter(store, outcomes.append)  # type: ignore[arg-type]  # a stand-in store
    ref, chunks = _chunks(b"x" * 3000, 1000)
    ticks = 0

    async def body():
        nonlocal ticks
        for chunk in chunks:
            writer.write_chunk(chunk.ref, chunk.index, chunk.data)
        writer.commit(ref)
        while len(store.done) < len(chunks):
            await trio.sleep(0.001)
        for _ in range(20):  # the loop keeps running while the commit is held
            await trio.sleep(0.001)
            ticks += 1
        assert not any(isinstance(o.op, Commit) for o in outcomes)  # not before it finished
        store.gate.set()

    _run(writer, body)
    assert ticks == 20
    assert isinstance(outcomes[-1].op, Commit) and outcomes[-1].status == STORED


def test_a_failed_write_loses_its_fetch_and_a_bad_commit_is_corrupt_while_other_artifacts_go_on():
    store = _Recording()
    outcomes: list[Outcome] = []
    writer = StoreWriter(store, outcomes.append)  # type: ignore[arg-type]  # a stand-in store
    lost, lost_chunks = _chunks(b"L" * 3000, 1000)
    bad, bad_chunks = _chunks(b"B" * 2000, 1000)
    good, good_chunks = _chunks(b"G" * 2000, 1000)
    full = OSError(errno.ENOSPC, "No space left on device")
    store.fail[lost.digest, 1] = full
    store.corrupt.add(bad.digest)

    async def body():
        for chunk in [*lost_chunks, *bad_chunks, *good_chunks]:
            writer.write_chunk(chunk.ref, chunk.index, chunk.data)
        for ref in (lost, bad, good):
            writer.commit(ref)

    _run(writer, body)
    by_ref = {ref.digest: [(o.op.index if isinstance(o.op, ChunkWrite) else "commit", o.status)
                           for o in outcomes if o.op.ref.digest == ref.digest] for ref in (lost, bad, good)}
    # the failed chunk is reported with its error; what follows it of that artifact is skipped, commit included
    assert by_ref[lost.digest] == [(0, STORED), (1, FAILED), (2, SKIPPED), ("commit", SKIPPED)]
    assert next(o.error for o in outcomes if o.status == FAILED) is full
    assert by_ref[bad.digest] == [(0, STORED), (1, STORED), ("commit", CORRUPT)]
    assert by_ref[good.digest] == [(0, STORED), (1, STORED), ("commit", STORED)]
    assert ("commit", lost.digest, None) not in store.done


def test_room_waits_while_more_than_the_cap_is_queued():
    store = _Recording()
    store.gate.clear()
    # the ignore: a stand-in store
    writer = StoreWriter(store, lambda outcome: None, max_queued_bytes=2500)  # type: ignore[arg-type]
    _, chunks = _chunks(b"r" * 4000, 1000)
    blocked_for = []

    async def body():
        other, other_chunks = _chunks(b"o" * 1000, 1000)
        writer.write_chunk(other_chunks[0].ref, other_chunks[0].index, other_chunks[0].data)
        writer.commit(other)  # held at the gate: what follows waits behind it
        for chunk in chunks:
            writer.write_chunk(chunk.ref, chunk.index, chunk.data)
        with trio.move_on_after(0.05) as scope:
            await writer.room()
        blocked_for.append(scope.cancelled_caught)
        store.gate.set()
        await writer.room()  # the writes drain: room again

    _run(writer, body)
    assert blocked_for == [True] and writer.queued_bytes == 0


def test_with_a_real_store_the_artifact_is_whole_and_a_volatile_one_is_named_so(tmp_path):
    store = ArtifactStore(tmp_path / "s", chunk_size=1000)
    outcomes: list[Outcome] = []
    writer = StoreWriter(store, outcomes.append)
    data = bytes(range(256)) * 20
    ref, chunks = _chunks(data, 1000)

    async def body():
        for chunk in reversed(chunks):  # any order of chunks: each has its offset
            writer.write_chunk(chunk.ref, chunk.index, chunk.data)
        writer.commit(ref, False)

    try:
        _run(writer, body)
        assert outcomes[-1].status == STORED and store.get(ref.digest) == data
        assert (tmp_path / "s" / "artifacts" / (ref.digest[2:].hex() + ".vref")).exists()
    finally:
        store.close()


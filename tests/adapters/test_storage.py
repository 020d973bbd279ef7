"""Artifact store: atomic writes, verify on read, chunked fetch assembly, records, keys."""

import itertools
import os
import stat

import attrs
import pytest

from peerloom.adapters.keys import load_identity, load_or_create_identity, save_identity
from peerloom.adapters.storage import ArtifactStore
from peerloom.core.errors import VerificationError
from peerloom.core.identity import Identity
from peerloom.core.objects import make_artifact_ref


def test_put_get_and_reopen(tmp_path):
    store = ArtifactStore(tmp_path, chunk_size=10)
    ref = store.put(b"x" * 25)
    assert ref.num_chunks == 3 and store.get(ref.digest) == b"x" * 25
    assert store.read_chunk(ref, 2) == b"x" * 5
    again = ArtifactStore(tmp_path, chunk_size=10)
    assert again.refs() == [ref]


def test_a_non_durable_put_skips_fsync_and_is_stored_the_same(tmp_path, monkeypatch):
    """A trainer's checkpoints are stored without fsync (spec/protocol.md §6.3): same artifact, same reads."""
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    store = ArtifactStore(tmp_path, chunk_size=10)
    ref = store.put_parts([b"ab" * 6, b"c" * 13], durable=False)
    assert synced == [] and store.get(ref.digest) == b"ab" * 6 + b"c" * 13
    assert ArtifactStore(tmp_path, chunk_size=10).refs() == [ref]
    store.put(b"durable")
    assert synced  # the default still syncs


def test_digest_is_trusted_on_read_and_verified_by_check(tmp_path):
    """Hashed once when stored (spec/design.md §6, Storage): a read checks the size only; `verify`/`check` re-hash."""
    store = ArtifactStore(tmp_path)
    ref = store.put(b"hello world")
    path = tmp_path / "artifacts" / ref.digest[2:].hex()
    path.write_bytes(b"hello worle")
    assert store.get(ref.digest) == b"hello worle"  # same size: trusted, no hash on the read path
    with pytest.raises(VerificationError):
        store.verify(ref.digest)
    assert len(store.check()) == 1
    path.write_bytes(b"hello")
    with pytest.raises(VerificationError):  # a truncated file is caught on read
        store.get(ref.digest)


def test_chunk_reads_and_writes_keep_one_file_open_per_artifact(tmp_path):
    """Chunks move through one cached descriptor per artifact; more artifacts than OPEN_FILES stay correct."""
    from peerloom.adapters.storage import OPEN_FILES

    source = ArtifactStore(tmp_path / "a", chunk_size=7)
    blobs = [os.urandom(50 + i) for i in range(OPEN_FILES + 3)]
    refs = [source.put(b) for b in blobs]
    sink = ArtifactStore(tmp_path / "b", chunk_size=7)
    # interleaved across every artifact: the LRU closes and reopens files
    for index in range(max(r.num_chunks for r in refs)):
        for ref in refs:
            if index < ref.num_chunks:
                sink.write_chunk(ref, index, source.read_chunk(ref, index))
    for ref, blob in zip(refs, blobs, strict=True):
        sink.commit(ref)
        assert sink.get(ref.digest) == blob
    assert sink.check() == [] and source.check() == []
    fds = len(os.listdir("/proc/self/fd"))
    source.close()
    sink.close()
    assert len(os.listdir("/proc/self/fd")) < fds



@pytest.mark.parametrize("cuts", [(), (0,), (3,), (7, 10), (1, 2, 3, 20, 49)])
def test_put_parts_equals_put_of_the_joined_bytes(tmp_path, cuts):
    """Pieces hashed in place give the ref `put` gives, across chunk boundaries."""
    data = os.urandom(50)
    bounds = [0, *cuts, len(data)]
    parts = [memoryview(data)[a:b] for a, b in itertools.pairwise(bounds)]
    store = ArtifactStore(tmp_path / "a", chunk_size=7)
    ref = store.put_parts(parts)
    assert ref == make_artifact_ref(data, 7)
    assert store.get(ref.digest) == data and store.check() == []
    assert ArtifactStore(tmp_path / "b", chunk_size=7).put(data) == ref
    assert store.put_parts([b""]) == make_artifact_ref(b"", 7)


def test_storing_an_artifact_being_fetched_ends_the_fetch_on_disk(tmp_path):
    """A node that computes bytes it was also fetching (core Engine.note_stored): the partial file goes,
    chunk writes still queued are skipped rather than recreating it, and a commit then is a no-op."""
    data = os.urandom(30)
    ref = make_artifact_ref(data, 10)
    store = ArtifactStore(tmp_path, chunk_size=10)
    store.write_chunk(ref, 0, data[:10])
    partial = tmp_path / "partial" / ref.digest[2:].hex()
    assert partial.exists()
    assert store.put(data) == ref
    assert not partial.exists()
    store.write_chunk(ref, 1, data[10:20])  # queued before the engine heard of the computed artifact
    assert not partial.exists()
    store.commit(ref)
    assert store.get(ref.digest) == data and not partial.exists() and store.check() == []

def test_commit_of_an_empty_artifact(tmp_path):
    store = ArtifactStore(tmp_path)
    ref = make_artifact_ref(b"", 10)
    store.commit(ref)
    assert store.get(ref.digest) == b"" and store.check() == []


def test_chunks_assemble_out_of_order_and_bad_assembly_refused(tmp_path):
    data = os.urandom(1000)
    ref = make_artifact_ref(data, 300)
    store = ArtifactStore(tmp_path, chunk_size=300)
    for i in (3, 0, 2, 1):
        store.write_chunk(ref, i, data[i * 300:(i + 1) * 300])
    store.commit(ref)
    assert store.get(ref.digest) == data
    # The chunks were verified as they arrived (the engine's job), so commit hashes nothing again; what it
    # refuses is a ref whose digest does not name its chunks (one built in-process: none decodes).
    forged = attrs.evolve(make_artifact_ref(b"a" * 600, 300), digest=ref.digest[:2] + bytes(32))
    store.write_chunk(forged, 0, b"a" * 300)
    store.write_chunk(forged, 1, b"a" * 300)
    with pytest.raises(VerificationError):
        store.commit(forged)
    assert not store.has(forged.digest) and not list((tmp_path / "partial").iterdir())


def test_records_round_trip_and_no_temp_files_left(tmp_path):
    store = ArtifactStore(tmp_path)
    store.put_record("vote/3", b"v3")
    store.put_record("vote/3", b"v3 again")
    store.put_record("head", b"h")
    assert ArtifactStore(tmp_path).records() == {"vote/3": b"v3 again", "head": b"h"}


def test_open_removes_crash_leftovers_and_keeps_complete_artifacts(tmp_path):
    store = ArtifactStore(tmp_path, chunk_size=4)
    ref = store.put(b"complete")
    half = make_artifact_ref(b"partial data", 4)
    store.write_chunk(half, 0, b"part")  # a fetch interrupted by a crash
    (tmp_path / "artifacts" / ".abc.1.2.tmp").write_bytes(b"torn")  # a write interrupted before its rename
    orphan = make_artifact_ref(b"orphan", 4)  # renamed into place, crashed before its ref was written
    (tmp_path / "artifacts" / orphan.digest[2:].hex()).write_bytes(b"orphan")
    again = ArtifactStore(tmp_path, chunk_size=4)
    assert again.refs() == [ref] and again.check() == []
    assert sorted(p.name for p in (tmp_path / "artifacts").iterdir()) == sorted(
        [ref.digest[2:].hex(), ref.digest[2:].hex() + ".ref"])
    assert list((tmp_path / "partial").iterdir()) == []


def test_gc_keeps_only_pinned_artifacts(tmp_path):
    store = ArtifactStore(tmp_path)
    keep, old, loose = store.put(b"head params"), store.put(b"old params"), store.put(b"some update")
    store.pin("head", old.digest)
    store.pin("head", keep.digest)  # moving a label releases the old digest
    assert set(store.gc()) == {old.digest, loose.digest}
    assert [r.digest for r in ArtifactStore(tmp_path).refs()] == [keep.digest]
    with pytest.raises(KeyError):
        store.get(old.digest)
    assert store.get(keep.digest) == b"head params"


def test_check_reports_a_corrupt_artifact(tmp_path):
    store = ArtifactStore(tmp_path)
    ref = store.put(b"abcdef")
    (tmp_path / "artifacts" / ref.digest[2:].hex()).write_bytes(b"abcdeg")
    assert len(store.check()) == 1 and "corrupt-artifact" in store.check()[0]


def test_key_files_are_private_and_never_overwritten(tmp_path):
    path = tmp_path / "node.key"
    identity = load_or_create_identity(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_identity(path).peer_id == identity.peer_id
    with pytest.raises(FileExistsError):
        save_identity(Identity(b"\1" * 32), path)
    path.write_text("zz")
    with pytest.raises(ValueError):
        load_identity(path)


def test_an_artifact_written_in_pieces_is_the_artifact_put_whole(tmp_path):
    store = ArtifactStore(tmp_path, chunk_size=1000)
    data = bytes(range(256)) * 30  # 7,680 bytes: 7 full chunks and a short one
    writer = store.open_writer(len(data))
    for start in range(0, len(data), 333):
        writer.write(memoryview(data)[start:start + 333])
    ref = writer.commit()
    assert ref == make_artifact_ref(data, 1000) and store.get(ref.digest) == data
    assert ArtifactStore(tmp_path, chunk_size=1000).ref(ref.digest) == ref  # durable: a reopened store has it
    again = store.open_writer(len(data))
    again.write(data)
    assert again.commit() == ref  # storing it twice is harmless
    assert not list((tmp_path / "artifacts").glob(".*.tmp"))


def test_an_artifact_writer_refuses_too_many_or_too_few_bytes_and_leaves_nothing(tmp_path):
    store = ArtifactStore(tmp_path)
    writer = store.open_writer(4)
    with pytest.raises(ValueError, match="5 bytes > 4"):
        writer.write(b"abcde")
    writer.write(b"abc")
    with pytest.raises(ValueError, match="3 of 4 bytes"):
        writer.commit()
    aborted = store.open_writer(2)
    aborted.write(b"ab")
    aborted.abort()
    assert store.refs() == [] and not list((tmp_path / "artifacts").iterdir())


def _fetch(store, data: bytes, chunk: int):
    ref = make_artifact_ref(data, chunk)
    for i in range(ref.num_chunks):
        store.write_chunk(ref, i, data[i * chunk:(i + 1) * chunk])
    return ref


def test_a_non_durable_commit_skips_fsync_and_is_hashed_again_and_made_durable_at_the_next_open(tmp_path, monkeypatch):
    """An update's delta is committed without fsync (core.effects.CommitArtifact.durable): visible at once
    under a ``.vref``; the next open hashes it, keeps it whole, and writes its ref durably."""
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    store = ArtifactStore(tmp_path, chunk_size=10)
    data = os.urandom(35)
    ref = _fetch(store, data, 10)
    store.commit(ref, durable=False)
    assert synced == [] and store.get(ref.digest) == data
    name = ref.digest[2:].hex()
    assert (tmp_path / "artifacts" / f"{name}.vref").exists() and not (tmp_path / "artifacts" / f"{name}.ref").exists()
    store.close()
    again = ArtifactStore(tmp_path, chunk_size=10)
    assert again.refs() == [ref] and again.get(ref.digest) == data and synced  # fsynced now
    assert sorted(p.name for p in (tmp_path / "artifacts").iterdir()) == [name, f"{name}.ref"]
    assert again.check() == []
    again.remove([ref.digest])
    assert list((tmp_path / "artifacts").iterdir()) == []


def test_a_non_durable_artifact_stays_volatile_when_the_disk_is_full_at_the_next_open(tmp_path, monkeypatch):
    """Making a volatile artifact durable at open writes its ref: on a full disk that fails, and the store still
    opens (a node restarted on a full disk must stay up, spec/design.md §6) with the artifact whole and still
    volatile, to be checked again at the next open."""
    import errno

    store = ArtifactStore(tmp_path, chunk_size=10)
    data = os.urandom(35)
    ref = _fetch(store, data, 10)
    store.commit(ref, durable=False)
    store.close()
    import peerloom.adapters.storage as storage

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "no space left on device")

    monkeypatch.setattr(storage, "atomic_write", full)
    again = ArtifactStore(tmp_path, chunk_size=10)
    name = ref.digest[2:].hex()
    assert again.get(ref.digest) == data
    assert sorted(p.name for p in (tmp_path / "artifacts").iterdir()) == [name, f"{name}.vref"]
    monkeypatch.undo()
    again.close()
    assert ArtifactStore(tmp_path, chunk_size=10).get(ref.digest) == data
    assert (tmp_path / "artifacts" / f"{name}.ref").exists()


@pytest.mark.parametrize("damage", ["zeros", "short", "missing", "torn-ref", "empty-ref"])
def test_a_non_durable_artifact_a_crash_tore_is_deleted_at_the_next_open(tmp_path, damage):
    """After a power loss a file stored without fsync can be full of zeros at its full (preallocated) size,
    short, or gone, and its ref torn: `get` checks only sizes, so the store must not trust it again."""
    store = ArtifactStore(tmp_path, chunk_size=10)
    kept = store.put(b"a durable artifact")
    data = os.urandom(35)
    ref = _fetch(store, data, 10)
    store.commit(ref, durable=False)
    store.close()
    path = tmp_path / "artifacts" / ref.digest[2:].hex()
    meta = path.with_suffix(".vref")
    if damage == "zeros":
        path.write_bytes(bytes(len(data)))
    elif damage == "short":
        path.write_bytes(data[:20])
    elif damage == "missing":
        path.unlink()
    elif damage == "torn-ref":
        meta.write_bytes(meta.read_bytes()[:7])
    else:
        meta.write_bytes(b"")
    again = ArtifactStore(tmp_path, chunk_size=10)
    assert again.refs() == [kept] and not again.has(ref.digest) and again.check() == []
    assert not path.exists() and not meta.exists()


def test_make_durable_fsyncs_a_volatile_artifact_and_writes_its_durable_ref(tmp_path, monkeypatch):
    """A trainer's delta is stored without fsync and made durable before its claim (spec/design.md §6, Storage):
    the file and the directory are fsynced, ``.vref`` becomes ``.ref``, and the next open does not hash it."""
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    store = ArtifactStore(tmp_path, chunk_size=10)
    ref = store.put_parts([b"delta" * 9], durable=False)
    name = ref.digest[2:].hex()
    assert synced == [] and (tmp_path / "artifacts" / f"{name}.vref").exists()
    assert store.make_durable(ref.digest)
    assert len(synced) >= 3  # the file, the directory, the ref file
    assert sorted(p.name for p in (tmp_path / "artifacts").iterdir()) == [name, f"{name}.ref"]
    synced.clear()
    assert store.make_durable(ref.digest) and synced == []  # already durable: nothing to do
    store.close()
    hashed: list[bytes] = []
    monkeypatch.setattr(ArtifactStore, "_keep_volatile", lambda self, meta: hashed.append(meta))
    assert ArtifactStore(tmp_path, chunk_size=10).refs() == [ref] and hashed == []
    assert not ArtifactStore(tmp_path, chunk_size=10).make_durable(b"\x12\x20" + bytes(32))  # not held


def test_map_is_the_artifact_read_only_and_survives_its_removal(tmp_path):
    store = ArtifactStore(tmp_path, chunk_size=10)
    data = os.urandom(37)
    ref = store.put(data)
    mapped = store.map(ref.digest)
    assert mapped[:] == data
    with pytest.raises(TypeError):
        mapped[0] = 0  # read-only
    store.remove([ref.digest])
    assert mapped[:] == data  # retention may drop a file a kernel still reads
    with pytest.raises(KeyError):
        store.map(ref.digest)
    other = store.put(b"x" * 20)
    (tmp_path / "artifacts" / other.digest[2:].hex()).write_bytes(b"short")
    with pytest.raises(VerificationError):
        store.map(other.digest)

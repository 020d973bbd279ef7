"""A full disk is a state, not a crash (spec/transport.md §15): every write path raises one typed
`DiskFullError`, commits nothing, and works again once space is back."""

import errno
import sqlite3

import pytest

from peerloom.adapters import disk
from peerloom.adapters.database import Database
from peerloom.adapters.storage import ArtifactStore, atomic_write
from peerloom.core.objects import make_artifact_ref


@pytest.fixture
def full(tmp_path, monkeypatch):
    """The test-only seam: while the returned flag file exists, every store write fails with ENOSPC."""
    flag = tmp_path / "disk-full.flag"
    monkeypatch.setenv(disk.TEST_FAULT_ENV, str(flag))
    return flag


def test_is_disk_full_recognises_each_form():
    assert disk.is_disk_full(OSError(errno.ENOSPC, "no space"))
    assert disk.is_disk_full(disk.DiskFullError("/x"))
    assert disk.is_disk_full(sqlite3.OperationalError("database or disk is full"))
    assert disk.is_disk_full(ExceptionGroup("g", [OSError(errno.EDQUOT, "quota")]))
    assert not disk.is_disk_full(OSError(errno.EACCES, "denied"))
    assert not disk.is_disk_full(sqlite3.OperationalError("no such table: x"))


def test_a_database_write_on_a_full_disk_raises_disk_full_not_cannot_rollback(tmp_path, full):
    """SQLite rolls the transaction back by itself on SQLITE_FULL; our rollback then used to raise
    "cannot rollback - no transaction is active" and hide the real error."""
    db = Database(tmp_path / "node.db")
    db.put_record("a", b"1")
    full.touch()
    with pytest.raises(disk.DiskFullError) as caught:
        db.put_record("b", b"2")
    assert caught.value.errno == errno.ENOSPC and "cannot rollback" not in str(caught.value)
    assert db.records() == {"a": b"1"}  # nothing half-written; reads go on
    full.unlink()
    db.put_record("b", b"2")  # and writes work again once space is back
    assert db.records() == {"a": b"1", "b": b"2"}
    db.close()


def test_a_real_sqlite_full_is_disk_full_and_the_database_stays_usable(tmp_path):
    db = Database(tmp_path / "node.db")
    db._conn.execute("PRAGMA max_page_count = 40")  # SQLite's own SQLITE_FULL, no seam
    with pytest.raises(disk.DiskFullError):
        for n in range(1000):
            db.put_record(f"k{n}", bytes(4096))
    assert db.records()  # what was committed is there
    db._conn.execute("PRAGMA max_page_count = 1000000")
    db.put_record("after", b"ok")
    db.close()


def test_a_store_with_a_current_schema_opens_on_a_full_disk(tmp_path, full):
    ArtifactStore(tmp_path / "store").close()
    full.touch()
    store = ArtifactStore(tmp_path / "store")  # no write needed to open it: a node can start and serve reads
    store.close()


def test_artifact_writes_on_a_full_disk_leave_nothing_behind(tmp_path, full):
    store = ArtifactStore(tmp_path / "store", chunk_size=4)
    full.touch()
    with pytest.raises(disk.DiskFullError):
        store.put(b"abcdefgh")
    with pytest.raises(disk.DiskFullError):
        atomic_write(tmp_path / "x", b"data")
    assert not list((tmp_path / "store" / "artifacts").iterdir()) and not (tmp_path / "x").exists()
    full.unlink()
    ref = make_artifact_ref(b"abcdefgh", 4)
    store.write_chunk(ref, 0, b"abcd")
    full.touch()
    with pytest.raises(disk.DiskFullError):
        store.write_chunk(ref, 1, b"efgh")
    # the preallocated partial file (which would pass commit's size check with a hole) is gone
    assert not list((tmp_path / "store" / "partial").iterdir())
    full.unlink()
    store.close()


def test_space_available_probes_with_a_durable_write(tmp_path, full):
    assert disk.space_available(tmp_path, need=0)
    full.touch()
    assert not disk.space_available(tmp_path, need=0)
    assert not (tmp_path / ".space-probe").exists()
    full.unlink()
    assert not disk.space_available(tmp_path, need=1 << 62)  # more than any disk has free

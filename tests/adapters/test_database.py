"""Node database: WAL mode, versioned migrations, typed views, the no-double-vote rule, durability."""

import sqlite3

import pytest

from peerloom.adapters.database import MIGRATIONS, Database, DoubleVoteError
from peerloom.adapters.storage import ArtifactStore
from peerloom.core.chain import encode_chain_entry
from peerloom.core.objects import QuorumCertificate
from tests.helpers import ident, make_revision


def test_wal_mode_and_schema_version(tmp_path):
    db = Database(tmp_path / "node.db")
    assert db.schema_version == len(MIGRATIONS)
    assert db._read("PRAGMA journal_mode")[0][0] == "wal"
    assert db._read("PRAGMA synchronous")[0][0] == 2  # FULL: the WAL is fsynced at every commit
    assert db.integrity_check() == "ok"
    db.close()
    assert Database(tmp_path / "node.db").schema_version == len(MIGRATIONS)  # reopening runs nothing twice


def test_legacy_record_files_are_migrated(tmp_path):
    legacy = tmp_path / "records"
    legacy.mkdir()
    (legacy / "vote~2~0~prevote").write_bytes(b"signed vote")
    (legacy / "claim~2").write_bytes(b"claim")
    (legacy / ".vote~3.tmp").write_bytes(b"torn")  # a temp file is never a record
    store = ArtifactStore(tmp_path)
    assert store.records() == {"vote/2/0/prevote": b"signed vote", "claim/2": b"claim"}
    assert store.db.votes() == [(2, 0, "prevote", b"signed vote")]
    assert store.db.claims() == [(2, b"claim")]


def test_newer_schema_is_refused(tmp_path):
    Database(tmp_path / "node.db").close()
    conn = sqlite3.connect(tmp_path / "node.db")
    conn.execute("UPDATE schema_version SET version=99")
    conn.commit()
    conn.close()
    with pytest.raises(RuntimeError, match="newer"):
        Database(tmp_path / "node.db")


def test_a_second_different_vote_for_one_slot_is_refused(tmp_path):
    db = Database(tmp_path / "node.db")
    db.put_record("vote/4/1/precommit", b"A")
    db.put_record("vote/4/1/precommit", b"A")  # the same vote again is fine (restart re-persist)
    with pytest.raises(DoubleVoteError):
        db.put_record("vote/4/1/precommit", b"B")
    db.put_record("vote/4/1/prevote", b"B")
    assert db.records()["vote/4/1/precommit"] == b"A"  # the refused write committed nothing
    assert [v[:3] for v in db.votes()] == [(4, 1, "precommit"), (4, 1, "prevote")]


def test_head_records_build_the_chain_view(tmp_path):
    revision = make_revision()
    genesis = revision.genesis()
    entry = encode_chain_entry(genesis, QuorumCertificate(head=genesis.id, window=0, round=0, votes=()))
    db = Database(tmp_path / "node.db")
    db.put_record("head", entry)
    db.put_record("head", b"not a chain entry")  # kept as a record; the engine rejects it when it reads it
    assert db.heads() == [(0, genesis.id, entry)]
    assert db.head_entry(genesis.id) == entry and db.head_entry(b"nope") is None
    assert db.records()["head"] == b"not a chain entry"


def _entries(n):
    from tests.helpers import certify, child

    revision = make_revision()
    head, out = revision.genesis(), []
    for _ in range(n):
        head = child(revision, head)
        out.append((head, encode_chain_entry(head, certify(revision, head, [ident(1)]))))
    return out


def test_archived_chain_records_join_the_chain_view(tmp_path):
    """Heads archived by chain sync (``chain/<w>``) are part of the store's chain, like promoted ones."""
    entries = _entries(3)
    db = Database(tmp_path / "node.db")
    db.put_record("chain/1", entries[0][1])
    db.put_record("chain/2", entries[1][1])
    db.put_record("head", entries[2][1])
    assert db.heads() == [(w, h.id, e) for w, (h, e) in zip((3, 2, 1), reversed(entries), strict=True)]


def test_migration_3_makes_chain_records_and_the_chain_view_agree(tmp_path):
    """A store from before: a validator's chain-synced heads were in ``records`` only, a trainer's
    promoted heads in ``heads`` only. Opening it with this version puts each in the other."""
    entries = _entries(4)
    db = Database(tmp_path / "node.db")
    conn = db._conn
    conn.execute("DELETE FROM heads")
    conn.execute("INSERT INTO records VALUES ('chain/1', ?)", (entries[0][1],))
    conn.execute("INSERT INTO records VALUES ('chain/2', ?)", (entries[1][1],))
    conn.execute("INSERT INTO heads VALUES (2, ?, ?, 0)", (entries[1][0].id, entries[1][1]))
    conn.execute("INSERT INTO heads VALUES (4, ?, ?, 0)", (entries[3][0].id, entries[3][1]))
    conn.execute("UPDATE schema_version SET version=2")
    db.close()
    db = Database(tmp_path / "node.db")
    assert db.schema_version == len(MIGRATIONS) == 3
    assert [w for w, _, _ in db.heads()] == [4, 2, 1]
    assert {k: v for k, v in db.records().items() if k.startswith("chain/")} == {
        "chain/1": entries[0][1], "chain/2": entries[1][1], "chain/4": entries[3][1]}


def test_peers_reputation_and_pins(tmp_path):
    db = Database(tmp_path / "node.db")
    db.note_peer("p1", address="127.0.0.1:7000", roles="trainer")
    db.note_peer("p1")  # a later contact keeps what was known
    db.charge("p1", "bad-signature")
    db.charge("p1", "bad-signature", 2)
    db.pin("head", b"\x12\x20" + b"\1" * 32)
    db.close()
    db = Database(tmp_path / "node.db")
    assert [p[:3] for p in db.peers()] == [("p1", "127.0.0.1:7000", "trainer")]
    assert db.reputation() == {"p1": {"bad-signature": 3}}
    assert db.pins() == {"head": b"\x12\x20" + b"\1" * 32}


def test_committed_records_survive_an_unclosed_connection(tmp_path):
    """A record is durable once put_record returns, even if the process never closes the database."""
    import subprocess
    import sys

    code = ("import os; from peerloom.adapters.database import Database; "
            f"db = Database({str(tmp_path / 'node.db')!r}); db.put_record('vote/1/0/prevote', b'v'); "
            "os._exit(0)")  # no close, no checkpoint, no atexit
    subprocess.run([sys.executable, "-c", code], check=True)
    assert Database(tmp_path / "node.db").records() == {"vote/1/0/prevote": b"v"}

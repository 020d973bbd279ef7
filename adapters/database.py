"""The node's durable records in SQLite, WAL mode (spec/design.md §6 storage).

One file, ``node.db``, next to the artifact store. It holds:

- ``records``: every engine record by key (what `Persist` effects write; what `Engine(records=...)` reads back);
- typed views kept in the same transaction as the record that feeds them, for operators and tools:
  ``heads`` (every certified head this node holds, by window: the chain - each head it promoted, from the
  ``head`` record, and each one it archived, from the ``chain/<w>`` records, those fetched by chain sync
  included), ``votes`` (every vote this node signed, one per (window, round, step)), ``claims`` (this
  trainer's signed lease claims / announcements);
- ``peers`` (addresses seen, last contact), ``reputation`` (rejections charged to a peer, by reason),
  ``pins`` (artifacts garbage collection must keep).

Durability: ``journal_mode=WAL`` with ``synchronous=FULL`` makes every committed transaction durable (the WAL
is fsynced at commit), so a `Persist` that returned survives SIGKILL or power loss; an interrupted
transaction is rolled back on the next open. The no-double-vote rule is enforced here too: inserting a
different vote for a (window, round, step) that already has one raises `DoubleVoteError` and commits nothing.

A write that fails because the disk is full raises `adapters.disk.DiskFullError` and commits nothing: SQLite
may already have rolled the transaction back itself (it does on ``SQLITE_FULL``), so the rollback here runs
only while a transaction is still open. Opening a store whose schema is current writes nothing, so a node
can start (and serve reads) on a full disk.

Schema changes are ordered migration functions; ``schema_version`` records how many have run.
Thread-safe: one connection guarded by a lock (the HTTP edge reads from its own thread).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from peerloom.core import records
from peerloom.core.chain import decode_chain_entry
from peerloom.core.errors import DecodeError

from . import disk

DB_NAME = "node.db"


class DoubleVoteError(RuntimeError):
    """Refused to store a second, different vote for one (window, round, step)."""


def _v1_tables(conn: sqlite3.Connection, root: Path) -> None:
    # One statement at a time: executescript() would commit the migration's transaction half-way.
    script = """
        CREATE TABLE records (key TEXT PRIMARY KEY, value BLOB NOT NULL);
        CREATE TABLE heads (window INTEGER PRIMARY KEY, head_id BLOB NOT NULL, entry BLOB NOT NULL,
                            stored_at REAL NOT NULL);
        CREATE TABLE votes (window INTEGER NOT NULL, round INTEGER NOT NULL, step TEXT NOT NULL,
                            envelope BLOB NOT NULL, stored_at REAL NOT NULL, PRIMARY KEY (window, round, step));
        CREATE TABLE claims (window INTEGER PRIMARY KEY, envelope BLOB NOT NULL, stored_at REAL NOT NULL);
        CREATE TABLE peers (peer TEXT PRIMARY KEY, address TEXT, roles TEXT, last_seen REAL NOT NULL);
        CREATE TABLE reputation (peer TEXT NOT NULL, reason TEXT NOT NULL, count INTEGER NOT NULL,
                                 PRIMARY KEY (peer, reason));
        CREATE TABLE pins (label TEXT PRIMARY KEY, digest BLOB NOT NULL);
    """
    for statement in script.split(";"):
        if statement.strip():
            conn.execute(statement)


def _v2_import_record_files(conn: sqlite3.Connection, root: Path) -> None:
    """Stores written before the database kept records as files under ``records/``: import them."""
    legacy = root / "records"
    if not legacy.is_dir():
        return
    for path in sorted(legacy.iterdir()):
        if not path.name.startswith("."):
            _put_record(conn, path.name.replace("~", "/"), path.read_bytes())


def _v3_chain_records_and_heads(conn: sqlite3.Connection, root: Path) -> None:
    """Stores from before ``heads`` took the ``chain/<w>`` records had heads fetched by chain sync in
    ``records`` only, and trainers archived no ``chain/<w>`` records: make each of the two hold the other's
    certified heads (both were verified by the engine before it persisted them)."""
    for (value,) in conn.execute("SELECT value FROM records WHERE key LIKE 'chain/%'").fetchall():
        _index_head(conn, bytes(value), replace=False)
    conn.execute("INSERT OR IGNORE INTO records SELECT 'chain/' || window, entry FROM heads WHERE window > 0")


# Ordered; never edit a released one, append a new one instead.
MIGRATIONS: tuple[Callable[[sqlite3.Connection, Path], None], ...] = (
    _v1_tables, _v2_import_record_files, _v3_chain_records_and_heads)


def _index_head(conn: sqlite3.Connection, value: bytes, *, replace: bool = True) -> None:
    """Add a chain entry record to ``heads``; a record that does not parse is left to the engine, which
    verifies what it reads back."""
    try:
        head, _ = decode_chain_entry(value)
    except DecodeError:
        return
    conn.execute(f"INSERT OR {'REPLACE' if replace else 'IGNORE'} INTO heads VALUES (?, ?, ?, ?)",
                 (head.window, head.id, value, time.time()))


def _put_record(conn: sqlite3.Connection, key: str, value: bytes) -> None:
    """Keep `value` under `key` and feed the typed view its record kind has (`core.records.parse` reads the key)."""
    now = time.time()
    match records.parse(key, value):
        case records.VoteRecord(window=window, round=round_, step=step):
            row = conn.execute("SELECT envelope FROM votes WHERE window=? AND round=? AND step=?",
                               (window, round_, step)).fetchone()
            if row is not None and bytes(row[0]) != value:
                raise DoubleVoteError(f"{key}: a different vote is already stored")
            if row is None:
                conn.execute("INSERT INTO votes VALUES (?, ?, ?, ?, ?)", (window, round_, step, value, now))
        case records.ClaimRecord(window=window, holder=None):
            conn.execute("INSERT OR REPLACE INTO claims VALUES (?, ?, ?)", (window, value, now))
        case records.HeadRecord() | records.ChainRecord():
            _index_head(conn, value)  # the raw record is kept regardless
    conn.execute("INSERT OR REPLACE INTO records VALUES (?, ?)", (key, value))


class Database:
    """The SQLite half of the node store. Every write method commits durably before it returns."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30.0)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        self._migrate()

    def _migrate(self) -> None:
        with self._lock:
            conn = self._conn
            if self._current(conn):
                return  # nothing to write (a node may start on a full disk)
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
                row = conn.execute("SELECT version FROM schema_version").fetchone()
                version = row[0] if row else 0
                if row is None:
                    conn.execute("INSERT INTO schema_version VALUES (0)")
                if version > len(MIGRATIONS):
                    raise RuntimeError(f"{self.path}: schema version {version} is newer than this peerloom "
                                       f"({len(MIGRATIONS)})")
                for migrate in MIGRATIONS[version:]:
                    migrate(conn, self.path.parent)
                conn.execute("UPDATE schema_version SET version=?", (len(MIGRATIONS),))
                conn.execute("COMMIT")
            except BaseException as exc:
                self._rollback()
                if disk.is_disk_full(exc):
                    raise disk.DiskFullError(self.path, f"database or disk is full ({exc})") from exc
                raise

    @staticmethod
    def _current(conn: sqlite3.Connection) -> bool:
        """True if the schema is already at the latest version (read only)."""
        try:
            row = conn.execute("SELECT version FROM schema_version").fetchone()
        except sqlite3.OperationalError:
            return False  # no such table: a new database
        return row is not None and row[0] == len(MIGRATIONS)

    def _rollback(self) -> None:
        """Roll back the open transaction, if SQLite has not already (it rolls back by itself after some
        errors, SQLITE_FULL among them: a ROLLBACK then raises "cannot rollback - no transaction is
        active", which used to hide the real error)."""
        if self._conn.in_transaction:
            self._conn.execute("ROLLBACK")

    def _inject_fault(self) -> None:
        """Test-only seam (`adapters.disk.inject`): fail the way SQLite fails on a full disk, with the
        transaction already rolled back and ``sqlite3.OperationalError`` raised."""
        try:
            disk.inject(self.path)
        except disk.DiskFullError:
            self._conn.execute("ROLLBACK")
            raise sqlite3.OperationalError("database or disk is full") from None

    def _write(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        """Run `fn` in one transaction and commit it durably. DiskFullError when the disk is full
        (nothing is committed then); other errors propagate after the rollback."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                result = fn(self._conn)
                self._inject_fault()
                self._conn.execute("COMMIT")
            except BaseException as exc:
                self._rollback()
                if disk.is_disk_full(exc):
                    raise disk.DiskFullError(self.path, f"database or disk is full ({exc})") from exc
                raise
            return result

    def _read(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._conn.execute(sql, params).fetchall()

    @property
    def schema_version(self) -> int:
        return int(self._read("SELECT version FROM schema_version")[0][0])

    # --- engine records ------------------------------------------------------------------------

    def put_record(self, key: str, value: bytes) -> None:
        """Durably store an engine record and its typed view. DoubleVoteError on a conflicting vote."""
        self._write(lambda conn: _put_record(conn, key, bytes(value)))

    def records(self) -> dict[str, bytes]:
        return {k: bytes(v) for k, v in self._read("SELECT key, value FROM records")}

    def heads(self, *, limit: int | None = None, before: int | None = None) -> list[tuple[int, bytes, bytes]]:
        """Certified heads as (window, head id, chain entry), newest first."""
        sql = "SELECT window, head_id, entry FROM heads"
        params: tuple[Any, ...] = ()
        if before is not None:
            sql, params = sql + " WHERE window < ?", (before,)
        sql += " ORDER BY window DESC"
        if limit is not None:
            sql, params = sql + " LIMIT ?", (*params, limit)
        return [(w, bytes(h), bytes(e)) for w, h, e in self._read(sql, params)]

    def head_entry(self, head_id: bytes) -> bytes | None:
        rows = self._read("SELECT entry FROM heads WHERE head_id=?", (head_id,))
        return bytes(rows[0][0]) if rows else None

    def votes(self) -> list[tuple[int, int, str, bytes]]:
        """Every vote this node signed as (window, round, step, envelope bytes)."""
        return [(w, r, s, bytes(e)) for w, r, s, e in
                self._read("SELECT window, round, step, envelope FROM votes ORDER BY window, round, step")]

    def claims(self) -> list[tuple[int, bytes]]:
        return [(w, bytes(e)) for w, e in self._read("SELECT window, envelope FROM claims ORDER BY window")]

    # --- peers and reputation ------------------------------------------------------------------

    def note_peer(self, peer: str, *, address: str | None = None, roles: str | None = None) -> None:
        self.note_peers([(peer, address, roles, time.time())])

    def note_peers(self, rows: list[tuple[str, str | None, str | None, float]]) -> None:
        """Record (peer, address, roles, last seen unix time) rows in one transaction (one fsync, however
        many rows: the runtime batches its peers per window, spec/transport.md §14)."""
        def write(conn: sqlite3.Connection) -> None:
            conn.executemany("INSERT INTO peers VALUES (?, ?, ?, ?) ON CONFLICT(peer) DO UPDATE SET "
                             "address=COALESCE(excluded.address, address), roles=COALESCE(excluded.roles, roles), "
                             "last_seen=MAX(last_seen, excluded.last_seen)", rows)
        if rows:
            self._write(write)

    def peers(self) -> list[tuple[str, str | None, str | None, float]]:
        """(peer id text, address, roles, last seen unix time), most recent first."""
        return self._read("SELECT peer, address, roles, last_seen FROM peers ORDER BY last_seen DESC")

    def charge(self, peer: str, reason: str, count: int = 1) -> None:
        """Add `count` rejections with `reason` to `peer`'s reputation."""
        self.charge_many([(peer, reason, count)])

    def charge_many(self, rows: list[tuple[str, str, int]]) -> None:
        """Add (peer, reason, count) rejections in one transaction (one fsync for a whole window's)."""
        if rows:
            self._write(lambda conn: conn.executemany(
                "INSERT INTO reputation VALUES (?, ?, ?) ON CONFLICT(peer, reason) DO UPDATE SET count=count+?",
                [(peer, reason, count, count) for peer, reason, count in rows]))

    def reputation(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for peer, reason, count in self._read("SELECT peer, reason, count FROM reputation"):
            out.setdefault(peer, {})[reason] = count
        return out

    # --- pins ------------------------------------------------------------------------------------

    def pin(self, label: str, digest: bytes) -> None:
        self._write(lambda conn: conn.execute("INSERT OR REPLACE INTO pins VALUES (?, ?)", (label, digest)))

    def unpin(self, label: str) -> None:
        self._write(lambda conn: conn.execute("DELETE FROM pins WHERE label=?", (label,)))

    def pins(self) -> dict[str, bytes]:
        return {label: bytes(d) for label, d in self._read("SELECT label, digest FROM pins")}

    # --- maintenance -----------------------------------------------------------------------------

    def integrity_check(self) -> str:
        """SQLite's ``PRAGMA integrity_check``: ``"ok"`` or the problems found."""
        return "\n".join(str(r[0]) for r in self._read("PRAGMA integrity_check"))

    def close(self) -> None:
        with self._lock:
            self._conn.close()

"""On-disk, content-addressed artifact store and durable record store (DESIGN §6).

Layout under `root`::

    artifacts/<hex digest>        the artifact bytes (verified against the digest on every read)
    artifacts/<hex digest>.ref    its canonical ArtifactRef (chunk size and chunk digests)
    partial/<hex digest>          an artifact being fetched, written chunk by chunk at its offsets
    node.db                       SQLite (WAL): engine records, heads, votes, claims, peers, pins
                                  (`adapters/database.py`; stores from before it kept ``records/<key>``
                                  files, imported by a schema migration)

Every artifact write goes to a temporary file, is fsynced, then renamed over the target and the directory
is fsynced, so a crash at any point leaves either the old state or the new one, never a torn file. Opening
the store removes what a crash can leave behind (temporary files, partial fetches, an artifact without its
ref); `check()` verifies everything.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from peerloom.core.encoding import content_id, decode, encode
from peerloom.core.errors import VerificationError
from peerloom.core.objects import ArtifactRef, make_artifact_ref

from .database import DB_NAME, Database


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes | memoryview) -> None:
    """Write `data` to `path` so that readers see the old file or the whole new one (temp, fsync, rename)."""
    # Unique per writer, so two threads storing the same artifact never share a temporary file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def read_artifact(root: str | Path, digest: bytes) -> bytes:
    """The bytes of artifact `digest` in the store at `root`, read without opening the store: no recovery
    sweep and no database, so it is safe beside a running node (e.g. `peerloom export`).

    FileNotFoundError when the store does not hold it; VerificationError("corrupt-artifact") when the
    bytes on disk do not hash to `digest` (a content id, DESIGN §6).
    """
    data = (Path(root) / "artifacts" / digest[2:].hex()).read_bytes()
    if content_id(data) != digest:
        raise VerificationError("corrupt-artifact", f"{digest.hex()} in {root}")
    return data


class ArtifactStore:
    """Artifacts by content id plus the node database, in one directory.

    Reads (`get`, `read_chunk`, `refs`) and `put` may come from any thread; chunked fetches
    (`write_chunk`/`commit`) come from the node's one engine loop.
    """

    def __init__(self, root: str | Path, *, chunk_size: int = 256 * 1024) -> None:
        self.root = Path(root)
        self.chunk_size = chunk_size
        self._artifacts = self.root / "artifacts"
        self._partial = self.root / "partial"
        for d in (self._artifacts, self._partial):
            d.mkdir(parents=True, exist_ok=True)
        self.db = Database(self.root / DB_NAME)
        self._recover()

    def _recover(self) -> None:
        """Load the refs of complete artifacts; remove what an interrupted write or fetch left behind."""
        self._refs: dict[bytes, ArtifactRef] = {}
        for leftover in [*self._artifacts.glob(".*.tmp"), *self._partial.iterdir()]:
            leftover.unlink(missing_ok=True)  # a fetch interrupted by a crash starts again
        for meta in self._artifacts.glob("*.ref"):
            ref = ArtifactRef.from_cbor(decode(meta.read_bytes(), max_bytes=1 << 24))
            if (self._artifacts / ref.digest[2:].hex()).exists():
                self._refs[ref.digest] = ref
        for path in self._artifacts.iterdir():
            if not path.name.startswith(".") and not path.suffix and not path.with_suffix(".ref").exists():
                path.unlink()  # renamed into place, crashed before its ref was written: not visible, drop it

    # --- artifacts -------------------------------------------------------------------------------

    def _path(self, digest: bytes) -> Path:
        return self._artifacts / digest[2:].hex()

    def path_of(self, digest: bytes) -> Path:
        """The file holding a complete artifact (immutable once visible; verified when it was stored)."""
        return self._path(digest)

    def refs(self) -> list[ArtifactRef]:
        """Every complete artifact in the store."""
        return list(self._refs.values())

    def has(self, digest: bytes) -> bool:
        return digest in self._refs

    def ref(self, digest: bytes) -> ArtifactRef:
        return self._refs[digest]

    def put(self, data: bytes | memoryview) -> ArtifactRef:
        """Store `data` (idempotent) and return its ArtifactRef."""
        ref = make_artifact_ref(data, self.chunk_size)
        if ref.digest not in self._refs:
            atomic_write(self._path(ref.digest), data)
            self._finish(ref)
        return ref

    def _finish(self, ref: ArtifactRef) -> None:
        atomic_write(self._path(ref.digest).with_suffix(".ref"), encode(ref.to_cbor()))
        self._refs[ref.digest] = ref

    def get(self, digest: bytes) -> bytes:
        """The artifact's bytes, verified against `digest`. KeyError if absent; VerificationError if corrupt."""
        if digest not in self._refs:
            raise KeyError(digest.hex())
        data = self._path(digest).read_bytes()
        if content_id(data) != digest:
            raise VerificationError("corrupt-artifact", digest.hex())
        return data

    def read_chunk(self, ref: ArtifactRef, index: int) -> bytes:
        """Chunk `index` of a stored artifact (bytes `index*chunk_size` onward)."""
        with open(self._path(ref.digest), "rb") as fh:
            fh.seek(index * ref.chunk_size)
            return fh.read(ref.chunk_length(index))

    def write_chunk(self, ref: ArtifactRef, index: int, data: bytes | memoryview) -> None:
        """Write one (already verified) chunk of an artifact being fetched at its offset."""
        path = self._partial / ref.digest[2:].hex()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, data, index * ref.chunk_size)
        finally:
            os.close(fd)

    def commit(self, ref: ArtifactRef) -> None:
        """Verify a fully fetched artifact and make it visible. VerificationError if the bytes are wrong."""
        if ref.digest in self._refs:
            return
        path = self._partial / ref.digest[2:].hex()
        data = path.read_bytes() if ref.size else b""
        if len(data) != ref.size or content_id(data) != ref.digest:
            path.unlink(missing_ok=True)
            raise VerificationError("corrupt-artifact", ref.digest.hex())
        with open(path, "rb+") if ref.size else open(path, "wb") as fh:
            os.fsync(fh.fileno())
        os.replace(path, self._path(ref.digest))
        _fsync_dir(self._artifacts)
        self._finish(ref)

    # --- garbage collection and checks -------------------------------------------------------------

    def pin(self, label: str, digest: bytes) -> None:
        """Keep artifact `digest` through `gc` under `label` (a label holds one digest; re-pinning moves it)."""
        self.db.pin(label, digest)

    def unpin(self, label: str) -> None:
        self.db.unpin(label)

    def gc(self) -> list[bytes]:
        """Delete every artifact that no pin names; returns the digests removed.

        Only call it when the engine no longer needs unpinned artifacts (e.g. between runs): the engine was
        told they are stored.
        """
        keep = set(self.db.pins().values())
        removed = []
        for digest in list(self._refs):
            if digest not in keep:
                del self._refs[digest]
                self._path(digest).with_suffix(".ref").unlink(missing_ok=True)
                self._path(digest).unlink(missing_ok=True)
                removed.append(digest)
        if removed:
            _fsync_dir(self._artifacts)
        return removed

    def check(self) -> list[str]:
        """Verify every artifact against its digest and the database's integrity; returns the problems."""
        problems = []
        for digest in list(self._refs):
            try:
                self.get(digest)
            except (OSError, VerificationError) as exc:
                problems.append(f"artifact {digest.hex()}: {exc}")
        integrity = self.db.integrity_check()
        if integrity != "ok":
            problems.append(f"database: {integrity}")
        return problems

    # --- records ---------------------------------------------------------------------------------

    def put_record(self, key: str, record: bytes) -> None:
        """Durably write an engine record (e.g. ``vote/3/0/prevote``); committed before this returns.

        DoubleVoteError (adapters.database) if it is a different vote for an already-voted slot.
        """
        self.db.put_record(key, record)

    def records(self) -> dict[str, bytes]:
        return self.db.records()

    def close(self) -> None:
        self.db.close()

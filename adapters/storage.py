"""On-disk, content-addressed artifact store and durable record store (spec/design.md §6).

Layout under `root`::

    artifacts/<hex digest>        the artifact bytes (verified against the digest once, when stored)
    artifacts/<hex digest>.ref    its canonical ArtifactRef (chunk size and chunk digests)
    artifacts/<hex digest>.vref   the same, for an artifact stored without fsync (``durable=False``):
                                  hashed again when the store next opens, before it is trusted
    partial/<hex digest>          an artifact being fetched, written chunk by chunk at its offsets
    node.db                       SQLite (WAL): engine records, heads, votes, claims, peers, pins
                                  (`adapters/database.py`; stores from before it kept ``records/<key>``
                                  files, imported by a schema migration)

Every artifact write goes to a temporary file, is fsynced, then renamed over the target and the directory
is fsynced, so a crash at any point leaves either the old state or the new one, never a torn file. Opening
the store removes what a crash can leave behind (temporary files, partial fetches, an artifact without its
ref); `check()` verifies everything.

An artifact stored with ``durable=False`` (`put_parts`, `commit`: what the node can fetch or compute again)
skips both fsyncs, so after a power loss its file may be missing, short or full of zeros (a preallocated
file keeps its size) while its name survives. Its ref is therefore written as ``.vref``, and opening the
store hashes every such artifact again (`_recover`): one whose bytes are its id's is made durable and
trusted like any other, the rest are deleted (spec/design.md §6, Storage).

An artifact is hashed once, chunk by chunk, when it enters the store: `put` and `open_writer` hash what
they write, and a fetched artifact's chunks were each verified on arrival, so `commit` checks only that
the ref names its chunks (`artifact_id`) and the size. Then it is trusted: `get` checks only the size, so
a task does not hash its inputs again (spec/design.md §6, Storage; at 10M parameters the re-hash on every
read was about a tenth of a reduce task). A damaged disk is `check()`'s to find (`peerloom inspect`). Chunk reads and
writes keep one open file per artifact (`_Handles`) instead of opening one per chunk.

`sim/disk.py` offers the same interface in memory for the simulator; the two share `make_artifact_ref` and
`artifact_id` (core) and nothing else, since what remains is how each medium stores bytes.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

from peerloom.core.encoding import decode, encode
from peerloom.core.errors import DecodeError, VerificationError
from peerloom.core.objects import ArtifactRef, artifact_id, make_artifact_ref

from . import disk
from .database import DB_NAME, Database


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _preallocate(fd: int, size: int) -> None:
    """Reserve `size` bytes for a file about to be written (1 MiB chunk writes into a preallocated
    file took about two thirds of their time into a growing one, on ext4 here); a file system that cannot
    is left as is."""
    if size > 0 and hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:
            pass


def atomic_write(path: Path, data: bytes | memoryview | Sequence[bytes | memoryview], *, durable: bool = True) -> None:
    """Write `data` (bytes, or pieces written one after the other) to `path` so that readers see the old file
    or the whole new one (temp, fsync, rename). ``durable=False`` skips both fsyncs: after a crash the file
    may be missing or empty, never torn under its name while the system runs."""
    disk.inject(path)  # test-only seam (adapters/disk.py)
    pieces = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
    # Unique per writer, so two threads storing the same artifact never share a temporary file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            _preallocate(fh.fileno(), sum(memoryview(p).nbytes for p in pieces))
            for piece in pieces:
                fh.write(piece)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # e.g. ENOSPC: leave no half-written temporary file behind
        raise
    os.replace(tmp, path)
    if durable:
        _fsync_dir(path.parent)


def read_artifact(root: str | Path, digest: bytes) -> bytes:
    """The bytes of artifact `digest` in the store at `root`, read without opening the store: no recovery
    sweep and no database, so it is safe beside a running node (e.g. `peerloom export`).

    FileNotFoundError when the store does not hold it; VerificationError("corrupt-artifact") when the
    bytes on disk are not the artifact `digest` names (`artifact_id`, spec/wire.md §5; the chunk size is
    read from its ``.ref`` file).
    """
    path = Path(root) / "artifacts" / digest[2:].hex()
    data = path.read_bytes()
    meta = path.with_suffix(".ref")
    if not meta.exists() and path.with_suffix(".vref").exists():
        meta = path.with_suffix(".vref")  # stored without fsync; the check below hashes it anyway
    try:
        ref = ArtifactRef.from_cbor(decode(meta.read_bytes(), max_bytes=1 << 24))
    except DecodeError as exc:
        raise VerificationError("corrupt-artifact", f"{digest.hex()} in {root}: bad ref file ({exc})") from None
    if ref.digest != digest or make_artifact_ref(data, ref.chunk_size) != ref:
        raise VerificationError("corrupt-artifact", f"{digest.hex()} in {root}")
    return data


DURABLE_REF = ".ref"  # the ref of an artifact fsynced before it became visible
VOLATILE_REF = ".vref"  # the ref of one stored without fsync: hashed again when the store opens (`_recover`)
HASH_BLOCK_BYTES = 4 << 20  # `commit` hashes a fetched artifact in blocks of this size
OPEN_FILES = 16  # open artifact files kept per direction (reads of stored ones, writes of fetches)


class _Handles:
    """At most `OPEN_FILES` open file descriptors by artifact digest, least recently used closed first.
    Thread-safe: a descriptor is used (`pread`, `pwrite`) and closed under one lock, so no thread ever
    reads through a descriptor another one closed (and the OS reused)."""

    def __init__(self, flags: int) -> None:
        self._flags = flags
        self._fds: OrderedDict[bytes, int] = OrderedDict()
        self._lock = threading.Lock()

    def _fd(self, digest: bytes, path: Path, size: int = 0) -> int:
        fd = self._fds.get(digest)
        if fd is not None:
            self._fds.move_to_end(digest)
            return fd
        fd = os.open(path, self._flags, 0o644)
        if size and self._flags & os.O_CREAT and os.fstat(fd).st_size == 0:
            _preallocate(fd, size)  # a fetch's partial file: reserve the artifact's size on first open
        self._fds[digest] = fd
        if len(self._fds) > OPEN_FILES:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def pread(self, digest: bytes, path: Path, size: int, offset: int) -> bytes:
        with self._lock:
            return os.pread(self._fd(digest, path), size, offset)

    def pwrite(self, digest: bytes, path: Path, data: bytes | memoryview, offset: int, size: int,
               skip: Callable[[], bool]) -> None:
        """Write `data` at `offset` of the file of `digest` (`size` bytes in all: preallocated when created),
        unless `skip()`, asked under the lock that `discard` takes too."""
        with self._lock:
            if not skip():
                disk.inject(path)  # test-only seam (adapters/disk.py)
                os.pwrite(self._fd(digest, path, size), data, offset)

    def discard(self, digest: bytes, path: Path) -> None:
        """Close the file of `digest` if open and remove `path`, under the lock (no write recreates it)."""
        with self._lock:
            fd = self._fds.pop(digest, None)
            if fd is not None:
                os.close(fd)
            path.unlink(missing_ok=True)

    def sync_whole(self, digest: bytes, path: Path, size: int, *, durable: bool = True) -> bool:
        """True iff the file is `size` bytes, then fsynced (unless not `durable`); the descriptor is closed.
        Its chunks were each verified against the ref when they arrived, so nothing is hashed again here."""
        with self._lock:
            fd = self._fd(digest, path)
            try:
                ok = os.fstat(fd).st_size == size
                if ok and durable:
                    os.fsync(fd)
                return ok
            finally:
                os.close(self._fds.pop(digest))

    def close(self, digest: bytes) -> None:
        with self._lock:
            fd = self._fds.pop(digest, None)
        if fd is not None:
            os.close(fd)

    def close_all(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), OrderedDict()
        for fd in fds:
            os.close(fd)


def _file_digest(fd: int, size: int, chunk_size: int) -> bytes:
    """The artifact id of the first `size` bytes of `fd` in `chunk_size` chunks, read in 4 MiB blocks; b""
    if the file is shorter."""
    hasher = _RefHasher(chunk_size)
    buffer = bytearray(max(1, min(size, HASH_BLOCK_BYTES)))
    view = memoryview(buffer)
    offset = 0
    while offset < size:
        got = os.preadv(fd, [view[:min(len(buffer), size - offset)]], offset)
        if got <= 0:
            break
        hasher.update(view[:got])
        offset += got
    return hasher.ref().digest if offset == size else b""


class _RefHasher:
    """The chunk digests and artifact id of bytes fed in order (`make_artifact_ref`'s, without holding them)."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.chunks: list[bytes] = []
        self.chunk, self.filled, self.size = hashlib.sha256(), 0, 0

    def update(self, part: bytes | memoryview) -> None:
        view = memoryview(part).cast("B")
        self.size += len(view)
        offset = 0
        while offset < len(view):
            take = min(self.chunk_size - self.filled, len(view) - offset)
            self.chunk.update(view[offset:offset + take])
            self.filled += take
            offset += take
            if self.filled == self.chunk_size:
                self.chunks.append(self.chunk.digest())
                self.chunk, self.filled = hashlib.sha256(), 0

    def ref(self) -> ArtifactRef:
        chunks = tuple(self.chunks + ([self.chunk.digest()] if self.filled else []))
        return ArtifactRef(digest=artifact_id(self.size, self.chunk_size, chunks), size=self.size,
                           chunk_size=self.chunk_size, chunks=chunks)


def _ref_of_parts(parts: Sequence[bytes | memoryview], chunk_size: int) -> ArtifactRef:
    """`make_artifact_ref` of the concatenation of `parts`, hashing each piece in place (no concatenation)."""
    hasher = _RefHasher(chunk_size)
    for part in parts:
        hasher.update(part)
    return hasher.ref()


class ArtifactWriter:
    """One artifact of `size` bytes written sequentially (`write`), hashed on the way, made visible by
    `commit` like `ArtifactStore.put` (fsync, rename, directory fsync) or dropped by `abort` (a
    reduction streams its outputs here block by block instead of building them in memory)."""

    def __init__(self, store: ArtifactStore, size: int) -> None:
        self.store, self.size = store, size
        self._tmp = store._artifacts / f".stream.{os.getpid()}.{threading.get_ident()}.{id(self)}.tmp"
        self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        _preallocate(self._fd, size)
        self._hasher = _RefHasher(store.chunk_size)

    def write(self, data: bytes | memoryview) -> None:
        """Append `data`. ValueError past `size`."""
        view = memoryview(data).cast("B")
        offset = self._hasher.size
        if offset + len(view) > self.size:
            raise ValueError(f"artifact writer: {offset + len(view)} bytes > {self.size}")
        disk.inject(self._tmp)  # test-only seam (adapters/disk.py)
        self._hasher.update(view)
        while len(view):
            written = os.pwrite(self._fd, view, offset)
            view, offset = view[written:], offset + written

    def commit(self) -> ArtifactRef:
        """Make the artifact visible (idempotent for bytes already stored); its ArtifactRef. ValueError when
        fewer than `size` bytes were written."""
        if self._hasher.size != self.size:
            self.abort()
            raise ValueError(f"artifact writer: {self._hasher.size} of {self.size} bytes written")
        ref = self._hasher.ref()
        store = self.store
        try:
            if ref.digest in store._refs:
                return ref
            os.fsync(self._fd)
            os.replace(self._tmp, store._path(ref.digest))
            _fsync_dir(store._artifacts)
            store._finish_computed(ref)
            return ref
        finally:
            self.abort()

    def abort(self) -> None:
        """Drop what was written (nothing once committed)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._tmp.unlink(missing_ok=True)


class ArtifactStore:
    """Artifacts by content id plus the node database, in one directory.

    Reads (`get`, `read_chunk`, `refs`) and `put` may come from any thread; chunked fetches
    (`write_chunk`/`commit`) come from one thread at a time, in order per artifact (the node runtime's
    `adapters.store_writer.StoreWriter`).
    """

    def __init__(self, root: str | Path, *, chunk_size: int = 256 * 1024) -> None:
        self.root = Path(root)
        self.chunk_size = chunk_size
        self._artifacts = self.root / "artifacts"
        self._partial = self.root / "partial"
        for d in (self._artifacts, self._partial):
            d.mkdir(parents=True, exist_ok=True)
        self.db = Database(self.root / DB_NAME)
        self._readers = _Handles(os.O_RDONLY)
        self._writers = _Handles(os.O_RDWR | os.O_CREAT)
        self._recover()

    def _recover(self) -> None:
        """Load the refs of complete artifacts; remove what an interrupted write or fetch left behind; hash
        the artifacts stored without fsync again (`VOLATILE_REF`) and keep only those still whole."""
        self._refs: dict[bytes, ArtifactRef] = {}
        for leftover in [*self._artifacts.glob(".*.tmp"), *self._partial.iterdir()]:
            leftover.unlink(missing_ok=True)  # a fetch interrupted by a crash starts again
        for meta in self._artifacts.glob("*" + DURABLE_REF):
            ref = ArtifactRef.from_cbor(decode(meta.read_bytes(), max_bytes=1 << 24))
            if (self._artifacts / ref.digest[2:].hex()).exists():
                self._refs[ref.digest] = ref
            meta.with_suffix(VOLATILE_REF).unlink(missing_ok=True)  # made durable since (`_keep_volatile`)
        for meta in self._artifacts.glob("*" + VOLATILE_REF):
            self._keep_volatile(meta)
        for path in self._artifacts.iterdir():
            if not path.name.startswith(".") and not path.suffix and not path.with_suffix(DURABLE_REF).exists() \
                    and not path.with_suffix(VOLATILE_REF).exists():
                path.unlink()  # renamed into place, crashed before its ref was written: not visible, drop it

    def _keep_volatile(self, meta: Path) -> None:
        """An artifact stored without fsync (its ref in `meta`, a ``.vref``), found when the store opens: a
        crash may have left its file or its ref torn. Hash it (`verify`); if whole, fsync it and write its
        ref durably as ``.ref`` (so it is not hashed at the next start), else delete both."""
        path = meta.with_suffix("")
        try:
            ref = ArtifactRef.from_cbor(decode(meta.read_bytes(), max_bytes=1 << 24))
        except (DecodeError, VerificationError):  # torn by the crash
            ref = None
        if ref is not None and ref.digest[2:].hex() == path.name and path.exists():
            fd = os.open(path, os.O_RDONLY)
            try:
                whole = os.fstat(fd).st_size == ref.size and _file_digest(fd, ref.size, ref.chunk_size) == ref.digest
                if whole:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if whole:
                self._refs[ref.digest] = ref
                try:
                    _fsync_dir(self._artifacts)
                    atomic_write(path.with_suffix(DURABLE_REF), encode(ref.to_cbor()))
                except OSError:
                    return  # a full disk (or a failing one): it stays volatile, checked again at the next start
        meta.unlink(missing_ok=True)
        if ref is None or ref.digest not in self._refs:
            path.unlink(missing_ok=True)

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
        return self.put_parts([data])

    def put_parts(self, parts: Sequence[bytes | memoryview], *, durable: bool = True) -> ArtifactRef:
        """`put` of the concatenation of `parts`, which is never built: the pieces (e.g. an array's own
        memory) are hashed and written one after the other. Returns its ArtifactRef. With
        ``durable=False`` nothing is fsynced: for what is worth less than the fsync's time, such as a
        trainer's checkpoints (spec/protocol.md §6.3), which a crash only costs an audit."""
        ref = _ref_of_parts(parts, self.chunk_size)
        if ref.digest not in self._refs:
            atomic_write(self._path(ref.digest), parts, durable=durable)
            self._finish_computed(ref, durable=durable)
        return ref

    def make_durable(self, digest: bytes) -> bool:
        """Fsync an artifact stored with ``durable=False`` and write its ref durably (``.ref``), so it
        survives a crash as one stored durably does: a trainer stores its delta without fsync and makes it
        durable only before the claim that names it (spec/design.md §6, Storage), off its critical path.
        True once durable (at once for one that already is); False if the store no longer holds it. Safe on
        a thread beside the store's other writes: it touches only this artifact's files."""
        ref = self._refs.get(digest)
        path = self._path(digest)
        volatile = path.with_suffix(VOLATILE_REF)
        if ref is None:
            return False
        if not volatile.exists():
            return path.with_suffix(DURABLE_REF).exists()
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return False  # removed by retention meanwhile
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_dir(self._artifacts)
        atomic_write(path.with_suffix(DURABLE_REF), encode(ref.to_cbor()))
        volatile.unlink(missing_ok=True)
        return True

    def open_writer(self, size: int) -> ArtifactWriter:
        """An `ArtifactWriter` for an artifact of `size` bytes, written in order and committed at the end."""
        return ArtifactWriter(self, size)

    def _drop_partial(self, digest: bytes) -> None:
        """A fetch of bytes this store has just computed itself is over (core `Engine.note_stored`): its
        partial file goes, and chunk writes still queued for it are skipped (`write_chunk`)."""
        self._writers.discard(digest, self._partial / digest[2:].hex())

    def _finish_computed(self, ref: ArtifactRef, *, durable: bool = True) -> None:
        """An artifact computed here is stored under its name: visible, and a fetch of it is over."""
        self._finish(ref, durable=durable)
        self._drop_partial(ref.digest)

    def _finish(self, ref: ArtifactRef, *, durable: bool = True) -> None:
        """Write the ref that makes the artifact visible: ``.ref``, or ``.vref`` when its bytes were not
        fsynced (hashed again when the store next opens, `_keep_volatile`)."""
        suffix = DURABLE_REF if durable else VOLATILE_REF
        atomic_write(self._path(ref.digest).with_suffix(suffix), encode(ref.to_cbor()), durable=durable)
        self._refs[ref.digest] = ref

    def get(self, digest: bytes) -> bytes:
        """The artifact's bytes, trusted as verified when they were stored (module docstring). KeyError if
        absent; VerificationError("corrupt-artifact") if the file's size is not the artifact's."""
        ref = self._refs.get(digest)
        if ref is None:
            raise KeyError(digest.hex())
        data = self._path(digest).read_bytes()
        if len(data) != ref.size:
            raise VerificationError("corrupt-artifact", f"{digest.hex()}: {len(data)} bytes, not {ref.size}")
        return data

    def map(self, digest: bytes) -> mmap.mmap:
        """The artifact's bytes as a read-only memory map of its file: nothing is read or allocated until used,
        and pages come from the page cache (`get` copies the whole file into fresh memory first, which costs
        more than the read on these machines). Trusted as `get` is. The mapping outlives a removal of the file
        (retention). KeyError if absent; VerificationError("corrupt-artifact") if the size is wrong."""
        ref = self._refs.get(digest)
        if ref is None:
            raise KeyError(digest.hex())
        with open(self._path(digest), "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size != ref.size or size == 0:
                raise VerificationError("corrupt-artifact", f"{digest.hex()}: {size} bytes, not {ref.size}")
            return mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ)

    def verify(self, digest: bytes) -> None:
        """Hash stored artifact `digest` again (in blocks). KeyError if absent; VerificationError if its
        bytes no longer hash to `digest`."""
        ref = self._refs[digest]
        fd = os.open(self._path(digest), os.O_RDONLY)
        try:
            ok = os.fstat(fd).st_size == ref.size and _file_digest(fd, ref.size, ref.chunk_size) == digest
        finally:
            os.close(fd)
        if not ok:
            raise VerificationError("corrupt-artifact", digest.hex())

    def read_chunk(self, ref: ArtifactRef, index: int) -> bytes:
        """Chunk `index` of a stored artifact (bytes `index*chunk_size` onward), from its open file."""
        return self._readers.pread(ref.digest, self._path(ref.digest), ref.chunk_length(index),
                                   index * ref.chunk_size)

    def write_chunk(self, ref: ArtifactRef, index: int, data: bytes | memoryview) -> None:
        """Write one (already verified) chunk of an artifact being fetched at its offset (nothing when the
        store already holds the artifact)."""
        path = self._partial / ref.digest[2:].hex()
        try:
            self._writers.pwrite(ref.digest, path, data, index * ref.chunk_size, ref.size,
                                 skip=lambda: ref.digest in self._refs)
        except OSError:
            # A chunk that did not reach the disk (ENOSPC): the partial file, preallocated to the artifact's
            # size, would pass `commit`'s size check with a hole in it. Drop it; the caller must not commit
            # this fetch (the node runtime holds it, adapters/runtime.py `store_chunk`).
            self._writers.discard(ref.digest, path)
            raise

    def commit(self, ref: ArtifactRef, *, durable: bool = True) -> None:
        """Make a fully fetched artifact visible, durably (fsync, rename, directory fsync). Its chunks were
        each verified against `ref` as they arrived (the engine's `chunk_ok`) and `ref.digest` names those
        chunks (`artifact_id`), so the bytes are not hashed again. VerificationError when the ref
        is not self-consistent or the file is not `ref.size` bytes. ``durable=False``
        (`core.effects.CommitArtifact.durable`) skips the fsyncs: the artifact is visible at once and hashed
        again when the store next opens (module docstring)."""
        if ref.digest in self._refs:
            return
        path = self._partial / ref.digest[2:].hex()
        if artifact_id(ref.size, ref.chunk_size, ref.chunks) != ref.digest:
            self._writers.discard(ref.digest, path)
            raise VerificationError("corrupt-artifact", f"{ref.digest.hex()} is not the id of its chunks")
        if not self._writers.sync_whole(ref.digest, path, ref.size, durable=durable):
            path.unlink(missing_ok=True)
            if ref.digest in self._refs:
                return  # computed and stored here meanwhile (`_drop_partial` took the partial file)
            raise VerificationError("corrupt-artifact", ref.digest.hex())
        try:
            os.replace(path, self._path(ref.digest))
        except FileNotFoundError:
            if ref.digest in self._refs:
                return  # as above, between the check and the rename
            raise
        if durable:
            _fsync_dir(self._artifacts)
        self._finish(ref, durable=durable)

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
        removed = [digest for digest in self._refs if digest not in keep]
        self.remove(removed)
        if removed:
            _fsync_dir(self._artifacts)
        return removed

    def remove(self, digests: Sequence[bytes]) -> int:
        """Delete these artifacts (retention, `peerloom.core.effects.DropArtifacts`); absent ones are skipped.
        Returns the bytes freed. A reader already holding one keeps its open file until it is done."""
        freed = 0
        for digest in digests:
            ref = self._refs.pop(digest, None)
            if ref is None:
                continue
            self._readers.close(digest)
            self._path(digest).with_suffix(DURABLE_REF).unlink(missing_ok=True)
            self._path(digest).with_suffix(VOLATILE_REF).unlink(missing_ok=True)
            self._path(digest).unlink(missing_ok=True)
            freed += ref.size
        return freed

    def check(self) -> list[str]:
        """Verify every artifact against its digest and the database's integrity; returns the problems."""
        problems = []
        for digest in list(self._refs):
            try:
                self.verify(digest)
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
        self._readers.close_all()
        self._writers.close_all()
        self.db.close()

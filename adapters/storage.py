"""On-disk, content-addressed artifact store and durable record store (DESIGN §6).

Layout under `root`::

    artifacts/<hex digest>        the artifact bytes (verified against the digest on every read)
    artifacts/<hex digest>.ref    its canonical ArtifactRef (chunk size and chunk digests)
    partial/<hex digest>          an artifact being fetched, written chunk by chunk at its offsets
    records/<key>                 engine records (votes, claims, the certified head)

Every write goes to a temporary file, is fsynced, then renamed over the target and the directory is
fsynced, so a crash at any point leaves either the old state or the new one, never a torn file.
"""

from __future__ import annotations

import os
from pathlib import Path

from peerloom.core.encoding import content_id, decode, encode
from peerloom.core.errors import VerificationError
from peerloom.core.objects import ArtifactRef, make_artifact_ref


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes | memoryview) -> None:
    """Write `data` to `path` so that readers see the old file or the whole new one (temp, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class ArtifactStore:
    """Artifacts by content id plus named records, in one directory. Not thread-safe by itself."""

    def __init__(self, root: str | Path, *, chunk_size: int = 256 * 1024) -> None:
        self.root = Path(root)
        self.chunk_size = chunk_size
        self._artifacts = self.root / "artifacts"
        self._partial = self.root / "partial"
        self._records = self.root / "records"
        for d in (self._artifacts, self._partial, self._records):
            d.mkdir(parents=True, exist_ok=True)
        self._refs: dict[bytes, ArtifactRef] = {}
        for meta in self._artifacts.glob("*.ref"):
            ref = ArtifactRef.from_cbor(decode(meta.read_bytes(), max_bytes=1 << 24))
            if (self._artifacts / ref.digest[2:].hex()).exists():
                self._refs[ref.digest] = ref

    # --- artifacts -------------------------------------------------------------------------------

    def _path(self, digest: bytes) -> Path:
        return self._artifacts / digest[2:].hex()

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

    # --- records ---------------------------------------------------------------------------------

    def put_record(self, key: str, record: bytes) -> None:
        """Durably write an engine record (e.g. ``vote/3``)."""
        atomic_write(self._records / key.replace("/", "~"), record)

    def records(self) -> dict[str, bytes]:
        return {p.name.replace("~", "/"): p.read_bytes() for p in self._records.iterdir()
                if not p.name.startswith(".")}

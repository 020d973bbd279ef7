"""Simulated disk: an in-memory artifact store and record store that can lose un-synced writes.

It offers the `ArtifactStore` surface the hosts use (`put`, `get`, `has`, `ref`, `refs`, `read_chunk`,
`write_chunk`, `commit`, `put_record`, `records`), so the real `ComputeExecutor` and the host driver
(`adapters/host.py`) run against it unchanged.

Durability model (spec/simulator.md §4): a record written by a `Persist` effect is *pending* until the
simulator syncs it (after the modelled fsync time), and only then is `Persisted` fed back to the engine.
A crash drops pending records (when `lose_unsynced`) and partial fetches; committed artifacts are durable,
except those committed with ``durable=False`` (an update's delta, `core.effects.CommitArtifact.durable`),
which a crash that loses unsynced writes drops too: the worst case of the real store, which hashes them
again at start and deletes what is torn (spec/design.md §6, Storage).
A crash "without its disk" wipes everything.

Why this does not share code with `adapters/storage.py`: the two implement one interface over
different media, files (temporary file, fsync, rename, open descriptors) here dicts with a modelled crash;
what they have in common, making a ref and checking a digest, is already shared (`make_artifact_ref`,
`content_id` in core).
"""

from __future__ import annotations

from collections.abc import Sequence

from peerloom.core.errors import VerificationError
from peerloom.core.objects import ArtifactRef, make_artifact_ref


class SimDisk:
    def __init__(self, *, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self._data: dict[bytes, bytes] = {}
        self._refs: dict[bytes, ArtifactRef] = {}
        self._partial: dict[bytes, dict[int, bytes]] = {}
        self._volatile: set[bytes] = set()  # committed with durable=False: lost by a crash (module docstring)
        self._records: dict[str, bytes] = {}
        self._pending: dict[int, tuple[str, bytes]] = {}
        self.bytes_written = 0

    # --- artifacts (durable once put or committed) ----------------------------------------------------

    def refs(self) -> list[ArtifactRef]:
        return list(self._refs.values())

    def has(self, digest: bytes) -> bool:
        return digest in self._refs

    def ref(self, digest: bytes) -> ArtifactRef:
        return self._refs[digest]

    def put(self, data: bytes | memoryview) -> ArtifactRef:
        data = bytes(data)
        ref = make_artifact_ref(data, self.chunk_size)
        if ref.digest not in self._refs:
            self._data[ref.digest] = data
            self._refs[ref.digest] = ref
            self.bytes_written += len(data)
        return ref

    def put_parts(self, parts: Sequence[bytes | memoryview], *, durable: bool = True) -> ArtifactRef:
        """`put` of the concatenation of `parts` (`adapters.compute.Store`); kept whatever `durable` says, as
        every `put` is."""
        return self.put(b"".join(parts))

    def make_durable(self, digest: bytes) -> bool:
        """`adapters.storage.ArtifactStore.make_durable`: a volatile commit survives crashes from now on; True
        while the disk holds the artifact."""
        self._volatile.discard(digest)
        return digest in self._refs

    def get(self, digest: bytes) -> bytes:
        if digest not in self._refs:
            raise KeyError(digest.hex())
        return self._data[digest]

    def remove(self, digests: Sequence[bytes]) -> int:
        """Forget these artifacts (retention); returns the bytes freed."""
        freed = 0
        for digest in digests:
            self._volatile.discard(digest)
            if self._refs.pop(digest, None) is not None:
                freed += len(self._data.pop(digest))
        return freed

    def read_chunk(self, ref: ArtifactRef, index: int) -> bytes:
        start = index * ref.chunk_size
        return self._data[ref.digest][start:start + ref.chunk_length(index)]

    def write_chunk(self, ref: ArtifactRef, index: int, data: bytes | memoryview) -> None:
        self._partial.setdefault(ref.digest, {})[index] = bytes(data)

    def commit(self, ref: ArtifactRef, *, durable: bool = True) -> None:
        if ref.digest in self._refs:
            return
        parts = self._partial.pop(ref.digest, {})
        data = b"".join(parts[i] for i in sorted(parts))
        if len(data) != ref.size or make_artifact_ref(data, ref.chunk_size) != ref:
            raise VerificationError("corrupt-artifact", ref.digest.hex())
        self._data[ref.digest] = data
        self._refs[ref.digest] = ref
        self.bytes_written += len(data)
        if not durable:
            self._volatile.add(ref.digest)

    # --- records: pending until synced -------------------------------------------------------------

    def put_record(self, key: str, record: bytes) -> None:
        """Direct durable write (for callers that sync at once)."""
        self._records[key] = record

    def write_pending(self, token: int, key: str, record: bytes) -> None:
        """A `Persist` effect's write: not durable until `sync(token)`."""
        self._pending[token] = (key, record)

    def sync(self, token: int) -> bool:
        """Make a pending write durable; False if it was lost (crash) in between."""
        item = self._pending.pop(token, None)
        if item is None:
            return False
        self._records[item[0]] = item[1]
        return True

    def records(self) -> dict[str, bytes]:
        """Durable records only (what a restarted engine reads back)."""
        return dict(self._records)

    def has_record(self, key: str) -> bool:
        """True if record `key` is durable (synced; a pending write does not count)."""
        return key in self._records

    # --- faults -----------------------------------------------------------------------------------

    def crash(self, *, lose_unsynced: bool = True) -> int:
        """Power loss: partial fetches vanish; pending records and artifacts committed without fsync too when
        `lose_unsynced`. Returns how many pending records were lost."""
        self._partial.clear()
        lost = len(self._pending) if lose_unsynced else 0
        if lose_unsynced:
            self._pending.clear()
            self.remove(sorted(self._volatile))
        else:
            for token in sorted(self._pending):
                self.sync(token)
        self._volatile.clear()
        return lost

    def wipe(self) -> None:
        """The node lost its disk entirely."""
        self._data.clear()
        self._refs.clear()
        self._partial.clear()
        self._volatile.clear()
        self._records.clear()
        self._pending.clear()

"""Tensors read from and written to safetensors files block by block, never whole in memory (spec/design.md §5, Memory).

A reduction at 100M parameters reads the parent's params, its optimizer state and every delta, and writes
new params and new state: loaded whole, that is five to seven model sizes in memory, each freshly
allocated (the kernel zeroes every page, which cost as much as the arithmetic here). The blocked kernels of
`peerloom.backends._robust` only ever touch one block of a tensor at a time, so they can run on:

* `FileTensor`: a read-only tensor in a stored safetensors file; ``t.reshape(-1)[a:b]`` reads elements
  ``a..b`` into a reused buffer of the calling thread and returns a numpy view of it (valid until that flat
  view is sliced again on that thread), so the kernels' threads read their own parts at their own offsets.
* `TensorFileWriter`: the safetensors serialization of a schema, written sequentially through a caller's
  ``write(bytes)`` (e.g. a store's artifact writer, which hashes on the way): its tensors are
  `FileTensorSink` objects whose flat slices are buffers the kernel fills, handed, in order, to a writer
  thread of its own when the next block is asked for (hashing and writing overlap the kernels; each sink
  alternates two buffers, so a block is never refilled while it is written). The bytes are those of
  `peerloom.backends.numpy.tensors.to_safetensors`, and `finish` returns the `tensor_digest`, hashed on the
  way too.

Memory is then a few blocks per tensor whatever the model size. Only the numpy backend streams (torch
kernels take torch tensors); `peerloom.adapters.compute.ComputeExecutor` picks this path for it.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from peerloom.core.encoding import SHA256_MULTIHASH_PREFIX, encode
from peerloom.core.errors import DecodeError

from .tensors import MAX_HEADER_BYTES, Schema, safetensors_header, safetensors_layout

DIGEST_BLOCK_BYTES = 1 << 20
"""Bytes per read when hashing or checking a `FileTensor` whole (one buffer, freed after the pass)."""


class _Blocked:
    """What `FileTensor` and `FileTensorSink` share: a shape, and only a flat view to slice."""

    shape: tuple[int, ...]
    size: int
    _flat: Any

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def reshape(self, *shape: Any, **_: Any) -> Any:
        """The flat view (``-1`` or ``(size,)``, cached); other shapes are refused (ValueError)."""
        want = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if tuple(want) not in ((-1,), (self.size,)):
            raise ValueError(f"a {type(self).__name__} only reshapes to flat, not {want}")
        if self.ndim == 1:
            return self
        if self._flat is None:
            self._flat = self._flat_view()
        return self._flat

    def _flat_view(self) -> Any:
        raise NotImplementedError


class FileTensor(_Blocked):
    """A read-only tensor of `shape` and `dtype` at byte `offset` of the open file `fd` (not owned: the
    `StoredTensors` that made it closes it). Slicing is only defined on the flat view (``reshape(-1)``) with
    a contiguous ``[start:stop]``; each flat view reads into a reused buffer of its own per thread
    (``os.preadv`` at the slice's offset: threads may slice one view at once)."""

    def __init__(self, fd: int, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self.fd, self.offset, self.dtype, self.shape = fd, offset, np.dtype(dtype), tuple(shape)
        self.size = int(np.prod(shape, dtype=np.int64)) if shape else 1
        self.nbytes = self.size * self.dtype.itemsize
        self._local = threading.local()  # .buffer: this thread's reused read buffer
        self._flat: FileTensor | None = None  # the cached flat view (not self: no reference cycle)

    def _flat_view(self) -> FileTensor:
        return FileTensor(self.fd, self.offset, self.dtype, (self.size,))

    def __getitem__(self, key: slice) -> np.ndarray:
        if self.ndim != 1 or not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a FileTensor is sliced flat and contiguously: t.reshape(-1)[a:b]")
        start, stop, _ = key.indices(self.size)
        count = max(0, stop - start)
        buffer = getattr(self._local, "buffer", None)
        if buffer is None or buffer.size < count:
            buffer = self._local.buffer = np.empty(count, dtype=self.dtype)
        out = buffer[:count]
        want = count * self.dtype.itemsize
        got = os.preadv(self.fd, [out.data.cast("B")], self.offset + start * self.dtype.itemsize)
        if got != want:
            raise DecodeError("bad-safetensors", f"stored tensor ends early: {got} of {want} bytes")
        return out

    def blocks(self, elements: int) -> Any:
        """The flat tensor as consecutive numpy blocks of at most `elements` (each valid until the next), read
        into a buffer of this pass alone (the kernels' cached flat view keeps its small block buffer)."""
        flat = FileTensor(self.fd, self.offset, self.dtype, (self.size,))
        for start in range(0, self.size, elements):
            yield flat[start:start + elements]

    def __array__(self, *_: Any, **__: Any) -> np.ndarray:
        # A whole load would defeat the point; kernels must slice. Fail loudly instead of allocating.
        raise TypeError("a FileTensor is read block by block; slice its flat view")


class StoredTensors(dict[str, FileTensor]):
    """The tensors of one safetensors file, by name; owns the open file (`close`, or use ``with``)."""

    def __init__(self, fd: int, tensors: dict[str, FileTensor]) -> None:
        super().__init__(tensors)
        self.fd = fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> StoredTensors:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()


def open_stored(path: str | os.PathLike[str], *, max_tensors: int = 4096) -> StoredTensors | None:
    """The tensors of the safetensors file at `path` as `FileTensor` objects, after the checks of
    `peerloom.backends.numpy.tensors.safetensors_views` on its prefix and header (the data is not read).
    None when a dtype numpy cannot view (load it whole instead). Raises DecodeError("bad-safetensors") for
    a malformed file and OSError when it cannot be opened."""
    fd = os.open(path, os.O_RDONLY)
    try:
        total = os.fstat(fd).st_size
        prefix = os.pread(fd, 8, 0)
        if len(prefix) < 8:
            raise DecodeError("bad-safetensors", f"{len(prefix)} bytes is shorter than the 8-byte length prefix")
        header_len = int.from_bytes(prefix, "little")
        if header_len > total - 8 or header_len > MAX_HEADER_BYTES:
            raise DecodeError("bad-safetensors", f"header length {header_len} does not fit {total} bytes")
        header = os.pread(fd, header_len, 8)
        if len(header) != header_len:
            raise DecodeError("bad-safetensors", "header ends early")
        spans = safetensors_layout(header, total, max_tensors=max_tensors)
        if spans is None:
            os.close(fd)
            return None
        base = 8 + header_len
        return StoredTensors(fd, {name: FileTensor(fd, base + begin, dtype, shape)
                                  for begin, _, name, dtype, shape, _ in spans})
    except BaseException:
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
        raise


def all_finite(tensor: FileTensor) -> bool:
    """True iff every element of a stored tensor is finite (read in blocks)."""
    elements = max(1, DIGEST_BLOCK_BYTES // tensor.dtype.itemsize)
    scratch = np.empty(min(elements, tensor.size), dtype=bool)
    return all(bool(np.isfinite(block, out=scratch[:block.size]).all()) for block in tensor.blocks(elements))


def feed_digest(hasher: Any, tensor: FileTensor) -> None:
    """Feed a stored tensor's raw bytes to `hasher` (its part of `tensor_digest`), in blocks."""
    elements = max(1, DIGEST_BLOCK_BYTES // tensor.dtype.itemsize)
    for block in tensor.blocks(elements):
        hasher.update(memoryview(block).cast("B"))


def digest_hasher(tensors: StoredTensors) -> Any:
    """A SHA-256 hasher fed the schema part of `tensor_digest` (the schema's canonical CBOR): feed it each
    tensor's little-endian bytes in sorted-name order, and the digest is `SHA256_MULTIHASH_PREFIX` + its own."""
    return hashlib.sha256(encode([[n, tensors[n].dtype.name, list(tensors[n].shape)] for n in sorted(tensors)]))


def stored_digest(tensors: StoredTensors) -> bytes:
    """`peerloom.backends.numpy.tensors.tensor_digest` of stored tensors, read in blocks (same definition:
    the schema's canonical CBOR, then each tensor's little-endian bytes in sorted-name order)."""
    hasher = digest_hasher(tensors)
    for name in sorted(tensors):
        feed_digest(hasher, tensors[name])
    return SHA256_MULTIHASH_PREFIX + hasher.digest()


class TensorFileWriter:
    """Writes the safetensors serialization of `schema` (``(name, numpy dtype name, shape)``, sorted by
    name, one dtype: `peerloom.backends.numpy.tensors.safetensors_header`) through `write`, block by block.

    ``writer.tensors[name]`` is a `FileTensorSink` the kernels write into through its flat view, in order
    (ValueError on a gap or a step back). A block is hashed and passed to `write` on the writer's own thread
    (one thread: in order) once the next block is asked for; an error there is raised from the next block
    asked for or from `finish`. `finish()` writes the last block, waits for every write, checks that every
    byte came, and returns the `tensor_digest` of what was written; `close()` (idempotent; `finish` calls
    it) waits for the writes still queued and ends the thread: call it before the target of `write` is
    closed. ValueError from the constructor when the schema has no fixed header (more than one dtype, an
    unusual name): serialize in memory instead.
    """

    def __init__(self, schema: Schema, write: Callable[[memoryview], None]) -> None:
        header = safetensors_header(schema)
        if header is None:
            raise ValueError("this schema's safetensors bytes are not streamed (several dtypes or odd names)")
        self._write = write
        self._digest = hashlib.sha256(encode([[n, dt, list(shape)] for n, dt, shape in schema]))
        self._write(memoryview(header))
        self._order = [name for name, _, _ in schema]
        self._next = 0  # index in _order of the tensor being written
        self._written = 0  # elements of that tensor written so far
        self._pending: tuple[str, int, np.ndarray] | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="peerloom-writer")
        self._queued: deque[Future[None]] = deque()  # writes handed to the thread, oldest first
        self.tensors = {name: FileTensorSink(self, name, np.dtype(dtype), tuple(shape))
                        for name, dtype, shape in schema}

    def _emit(self, data: memoryview) -> None:
        self._digest.update(data)
        self._write(data)

    def _settle(self, until: Future[None] | None = None) -> None:
        """Wait for the queued writes up to `until` (all when None; one thread runs them in order), raising
        the first error among them."""
        while self._queued:
            job = self._queued.popleft()
            job.result()
            if job is until:
                return

    def close(self) -> None:
        """Wait for the queued writes (their errors dropped) and end the writer thread."""
        wait(self._queued)
        self._queued.clear()
        self._thread.shutdown(wait=True)

    @staticmethod
    def file_size(schema: Schema) -> int | None:
        """Bytes of the file a writer of `schema` writes (header and data); None when the schema has no
        fixed header (the constructor's ValueError)."""
        header = safetensors_header(schema)
        if header is None:
            return None
        return len(header) + sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
                                 for _, dt, shape in schema)

    def _flush(self) -> None:
        if self._pending is None:
            return
        name, start, block = self._pending
        self._pending = None
        job = self._thread.submit(self._emit, block.data.cast("B"))
        self._queued.append(job)
        self.tensors[name].writing(job)
        self._written = start + block.size
        if self._written == self.tensors[name].size:
            self._next, self._written = self._next + 1, 0

    def _block(self, sink: FileTensorSink, start: int, stop: int) -> np.ndarray:
        self._flush()
        while self._next < len(self._order) and self.tensors[self._order[self._next]].size == 0:
            self._next += 1
        if self._next >= len(self._order) or self._order[self._next] != sink.name or start != self._written:
            raise ValueError(f"tensor {sink.name!r} block {start}:{stop} written out of order")
        block = sink.buffer(stop - start)
        self._pending = (sink.name, start, block)
        return block

    def finish(self) -> bytes:
        """Write the last block and wait for every write; returns the tensor digest (34-byte content id).
        ValueError if incomplete; the first error of a write, if any."""
        self._flush()
        try:
            self._settle()
        finally:
            self.close()
        while self._next < len(self._order) and self.tensors[self._order[self._next]].size == 0:
            self._next += 1
        if self._next != len(self._order):
            raise ValueError(f"tensor {self._order[self._next]!r} was not written whole")
        return SHA256_MULTIHASH_PREFIX + self._digest.digest()


class FileTensorSink(_Blocked):
    """One output tensor of a `TensorFileWriter`: its flat view's ``[start:stop]`` is a writable buffer for
    those elements, written when the next block (of any tensor of the writer) is asked for. Its blocks
    alternate between two buffers; one still being written is waited for before it is handed out again."""

    def __init__(self, writer: TensorFileWriter, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self.writer, self.name, self.dtype, self.shape = writer, name, dtype, shape
        self.size = int(np.prod(shape, dtype=np.int64)) if shape else 1
        self._buffers: list[np.ndarray | None] = [None, None]
        self._jobs: list[Future[None] | None] = [None, None]  # the write reading each buffer
        self._turn = 0
        self._flat: FileTensorSink | None = None

    def _flat_view(self) -> FileTensorSink:
        return FileTensorSink(self.writer, self.name, self.dtype, (self.size,))

    def buffer(self, count: int) -> np.ndarray:
        """A buffer for the next block of `count` elements, not read by any queued write."""
        sink = self.writer.tensors[self.name]  # the buffers live on the writer's sink, whichever view asks
        turn = sink._turn = 1 - sink._turn
        job = sink._jobs[turn]
        if job is not None:
            self.writer._settle(job)
            sink._jobs[turn] = None
        buffer = sink._buffers[turn]
        if buffer is None or buffer.size < count:
            buffer = sink._buffers[turn] = np.empty(max(count, 1), dtype=self.dtype)
        return buffer[:count]

    def writing(self, job: Future[None]) -> None:
        """`job` writes the block last handed out (`buffer`), so that buffer waits for it."""
        self._jobs[self._turn] = job

    def __getitem__(self, key: slice) -> np.ndarray:
        if self.ndim != 1 or not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a FileTensorSink is written flat and contiguously: t.reshape(-1)[a:b]")
        start, stop, _ = key.indices(self.size)
        return self.writer._block(self, start, stop)

    def __array__(self, *_: Any, **__: Any) -> np.ndarray:
        raise TypeError("a FileTensorSink is written block by block; slice its flat view")

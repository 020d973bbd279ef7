"""Bounds on what a node keeps about peers it has not admitted (spec/transport.md §14).

A stranger (a peer id that is neither a manifest validator nor in the current head's roster) costs this
node a handshake and a connection, and nothing that outlives them: no metrics series of its own, no
database row, no log line of its own once a kind of line is over its budget (`adapters.logs.LineLimiter`).
What the runtime does keep per peer is held in a `BoundedLru`, which forgets the least recently used
peer first. After many strangers have come and gone, `release_freed_memory` hands the memory their
connections used back to the operating system (the runtime does so every `LOG_INTERVAL_S` in which a stranger
left).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

MAX_PEER_SERIES = 256
"""Admitted peers with a ``peerloom_peer_bytes`` series pair after their connection closed (per open
connection of an admitted peer there is one anyway). Strangers share one pair, ``peer="other"``. 256 is
above any roster this version runs, and keeps ``/metrics`` under ~60 KB."""

MAX_SEEN_PEERS = 1024
"""Peers whose last contact waits in memory to be written to the ``peers`` table (once per window, in one
transaction); only admitted peers are written."""


class BoundedLru(Generic[K, V]):
    """A mapping of at most `max_entries` items; setting or touching a key makes it the most recent, and a
    new key over the cap evicts the least recent one, which is handed to `on_evict(key, value)`."""

    def __init__(self, max_entries: int, on_evict: Callable[[K, V], None] | None = None) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        self._items: OrderedDict[K, V] = OrderedDict()
        self._on_evict = on_evict

    def __setitem__(self, key: K, value: V) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.max_entries:
            old_key, old_value = self._items.popitem(last=False)
            if self._on_evict is not None:
                self._on_evict(old_key, old_value)

    def __getitem__(self, key: K) -> V:
        return self._items[key]

    def get(self, key: K, default: V | None = None) -> V | None:
        return self._items.get(key, default)

    def touch(self, key: K) -> None:
        """Make `key` the most recently used (KeyError if absent)."""
        self._items.move_to_end(key)

    def pop(self, key: K, default: V | None = None) -> V | None:
        return self._items.pop(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[K]:
        return iter(self._items)

    def items(self) -> list[tuple[K, V]]:
        return list(self._items.items())

    def clear(self) -> None:
        self._items.clear()


def _libc_function(name: str) -> Callable[..., int] | None:
    """glibc's function `name`, or None where the C library is not glibc (or has no such function)."""
    library = ctypes.util.find_library("c")
    if library is None:
        return None
    try:
        function: Callable[..., int] = getattr(ctypes.CDLL(library), name)
    except (OSError, AttributeError):
        return None
    return function


_TRIM = _libc_function("malloc_trim")

MMAP_THRESHOLD_BYTES = 128 << 10
"""Allocations from this size up get their own memory mapping, returned to the OS when freed
(`tune_allocator`). Each connection's receive (256 KiB) and send (128 KiB) buffers are that large."""


def tune_allocator() -> bool:
    """Fix glibc's mmap threshold at `MMAP_THRESHOLD_BYTES` (``mallopt(M_MMAP_THRESHOLD)``). By default glibc
    raises the threshold each time a mapped block is freed, after which every connection's buffers come from
    the heap, where a flood of short connections leaves them fragmented and the RSS high for good. Call once
    per process; False where the C library has no ``mallopt``."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    m_mmap_threshold = -3
    return bool(mallopt(m_mmap_threshold, MMAP_THRESHOLD_BYTES))


def release_freed_memory() -> bool:
    """Collect cyclic garbage, then return the heap memory the allocator holds free to the OS (glibc
    ``malloc_trim(0)``, which also releases free pages inside its arenas). Connections that end in an
    exception leave reference cycles that only a full collection frees, and a flood of short connections
    leaves their memory freed but mapped. Measured on a validator (1,500 strangers, 8 at a time): RSS
    172 -> 249 MB during the flood; 222 MB after a trim alone, 174 MB after a collection and a trim. False
    where the C library has no such call (the collection is done anyway)."""
    gc.collect()  # connections that ended in an exception leave reference cycles that pin the heap
    if _TRIM is None:
        return False
    _TRIM(0)
    return True

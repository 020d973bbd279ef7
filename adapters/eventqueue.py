"""The runtime's queue of events for its engine: admitted peers and the node itself first (spec/transport.md
§14, "Strangers wait").

Every event the engine handles (a message received, a peer connected or gone, a task finished, a light
peer's submission) waits here until the runtime's main loop takes it. A single first-in-first-out queue lets
a flood of strangers delay everything behind it: 10,000 fresh identities, each sending three messages the
engine rejects, queued an honest trainer's announcement for seconds, and windows went uncertified. So there
are two queues, and the main loop takes from the strangers' only while the other is empty:

- ``urgent``: events of admitted peers (the manifest's validators, the head's roster) and the node's own
  (task results, submissions the HTTP edge checked, the disk coming back);
- ``stranger``: events of every other peer.

A peer's events all go to one queue (chosen when its connection is adopted), so their order is kept. The
strangers' queue cannot grow without bound: each connection's reader stops while its own messages wait
(`adapters.runtime.NodeRuntime._inbox_room`), and the number of stranger connections is capped (§13).
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

import trio

T = TypeVar("T")


class EventQueue(Generic[T]):
    """Two FIFO queues, ``urgent`` before ``stranger`` (module docstring). `put` never blocks; `get` waits
    for an item. For one trio run: `put` from its tasks (not from other threads)."""

    def __init__(self) -> None:
        self._urgent: deque[T] = deque()
        self._stranger: deque[T] = deque()
        self._arrived = trio.lowlevel.ParkingLot()

    def put(self, item: T, *, stranger: bool = False) -> None:
        (self._stranger if stranger else self._urgent).append(item)
        self._arrived.unpark()

    async def get(self) -> T:
        """The oldest urgent item, else the oldest stranger's; waits while both are empty. Cancellable."""
        while not self._urgent and not self._stranger:
            await self._arrived.park()
        await trio.lowlevel.checkpoint()  # a steady stream of items must not starve the other tasks
        return self._urgent.popleft() if self._urgent else self._stranger.popleft()

    @property
    def waiting(self) -> tuple[int, int]:
        """(urgent, stranger) items waiting."""
        return len(self._urgent), len(self._stranger)

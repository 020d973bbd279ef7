"""The simulator's links: whole messages between peers of one discrete-event simulation (sim/kernel.py).

In order per link, no bytes on a wire, no handshake. Links are symmetric and must be connected before
messages flow; `send` on a missing link drops the message and returns False, like a socket that has gone
away. Real transports (tcp, http, in-memory trio streams) live in `peerloom.adapters` and implement
`adapters.transport.Transport`; this is not one of them.
"""

from __future__ import annotations

from collections import Counter, deque

from peerloom.core.identity import PeerId


class Links:
    """Whole-message queue between linked peers, with bytes counted per peer (see the module docstring)."""

    def __init__(self) -> None:
        self._links: set[frozenset[PeerId]] = set()
        self._queue: deque[tuple[PeerId, PeerId, bytes]] = deque()
        self.bytes_sent: Counter[PeerId] = Counter()
        self.bytes_received: Counter[PeerId] = Counter()

    def connect(self, a: PeerId, b: PeerId) -> None:
        self._links.add(frozenset((a, b)))

    def disconnect(self, a: PeerId, b: PeerId) -> None:
        self._links.discard(frozenset((a, b)))

    def connected(self, a: PeerId, b: PeerId) -> bool:
        return frozenset((a, b)) in self._links

    def neighbours(self, a: PeerId) -> list[PeerId]:
        return sorted(next(iter(link - {a})) for link in self._links if a in link)

    def send(self, src: PeerId, dst: PeerId, data: bytes) -> bool:
        if not self.connected(src, dst):
            return False
        self._queue.append((src, dst, data))
        self.bytes_sent[src] += len(data)
        self.bytes_received[dst] += len(data)
        return True

    def pop(self) -> tuple[PeerId, PeerId, bytes] | None:
        """Oldest undelivered message as (src, dst, data), or None."""
        return self._queue.popleft() if self._queue else None

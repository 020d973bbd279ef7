"""Which addresses to dial and when: dial backoff, connection limits and bans (spec/transport.md §5).

`AddressBook` is sans-IO like the engine: it never reads a clock, opens a socket or draws OS randomness.
Every call that depends on time takes `now` (seconds on the host's monotonic clock, never decreasing);
jitter comes from the injected `random.Random`. So the node runtime and the simulator drive it the same
way, and a test replays it exactly.

Typical dial loop (the runtime's)::

    book = AddressBook(random.Random(seed))
    book.add("/ip4/127.0.0.1/tcp/4001", now=now)            # bootstrap; peer id learnt on connect
    while True:
        for address in book.due(now):                       # not connected, not dialing, not banned,
            book.dial_started(address, now=now)             #   backoff over, under the limits
            ... connect ...
            book.connected(address, peer, now=now)          # False: over a limit or banned: hang up
            book.dial_failed(address, now=now,                   # on TransportError `exc`: identity and
                             handshake=exc.reason in HANDSHAKE_FAILURES)  # crypto failures count toward
        ...                                                 #   a ban; connect-failed/timeouts do not
        book.disconnected(address, now=now)                 # when that connection ends
        await sleep_until(book.next_due(now))               # None: nothing to dial until something changes

Inbound: ``serve(..., admit=lambda ip: book.admit_inbound(ip, now=trio.current_time()),
on_handshake_failed=lambda ip, exc: book.inbound_handshake_failed(ip, now=trio.current_time()))`` refuses
banned and over-limit IPs before the handshake; call `book.inbound_opened(ip)` / `book.inbound_closed(ip)`
(``ip = conn.remote_address[0]``) around a served connection so both directions count toward
`max_connections` and `max_connections_per_ip`.
(`serve` also has its own `max_connections` / `max_connections_per_ip` caps for nodes without a book.)

Backoff after the n-th consecutive failure of an address: ``min(max_backoff_s, base_backoff_s * 2**(n-1))``
scaled by a factor drawn uniformly from ``[1 - jitter, 1]`` ("equal jitter", AWS architecture blog,
"Exponential Backoff and Jitter"), so many nodes that lost the same seed do not redial in lock step. A
success resets the count. `ban_after_failures` consecutive *handshake* failures (the other end answered
but could not prove the identity we expect, or sent garbage) ban the address for `ban_s` seconds;
`ban_peer` bans a peer id (e.g. after the engine hung up on it for penalties) wherever it connects from.
Addresses are transport-qualified strings (``/ip4/H/tcp/P``, ``http://H:P``, ``memory://NAME``; use one
canonical spelling, `adapters.transport.canonical_address`) or, as before, ``(host, port)`` tuples (tcp);
per-IP limits count an address under its IP literal (``"memory"`` for in-process ones).
Addresses learnt from peers (``add(..., learned=True)``) are capped (`max_learned`) and forgotten after
`forget_after_failures` consecutive failed dials; configured (bootstrap) addresses are kept for good.
"""

from __future__ import annotations

import random
from collections import Counter

import attrs

from peerloom.core.identity import PeerId

from .transport import address_host

Address = str  # a transport address, canonical text (adapters/transport.py canonical_address)


def ip_of(address: Address) -> str:
    """What the per-IP limits count `address` under: its IP literal, or ``"memory"``."""
    return address_host(address)

# TransportError reasons that mean "someone answered but could not prove the identity we expect, or spoke
# garbage" (spec/transport.md §1, §6): these count toward a ban. connect-failed, handshake-timeout, truncated
# and reset do not (the peer may just be down or slow).
HANDSHAKE_FAILURES = frozenset({"bad-payload", "bad-identity-key", "bad-identity-signature", "peer-mismatch",
                                "decrypt-failed", "bad-message-length", "bad-dh-key"})


@attrs.define
class _Entry:
    peer: PeerId | None = None
    failures: int = 0  # consecutive failed dials (any reason)
    handshake_failures: int = 0  # consecutive failed handshakes
    next_attempt: float = float("-inf")
    dialing: bool = False
    connected: bool = False
    banned_until: float = float("-inf")
    learned: bool = False  # from peer exchange or discovery, not configured: forgotten when it keeps failing


class AddressBook:
    """Known addresses per peer, per-address exponential backoff with jitter, connection limits, bans.

    Times in seconds. Raises ValueError on bad settings or on an address it does not know (caller misuse).
    """

    def __init__(self, rng: random.Random, *, base_backoff_s: float = 0.5, max_backoff_s: float = 60.0,
                 jitter: float = 0.5, max_connections: int = 64, max_connections_per_ip: int = 8,
                 ban_after_failures: int = 5, ban_s: float = 600.0, ban_inbound_ips: bool = False,
                 forget_after_failures: int = 8, max_learned: int = 1024, max_peer_entries: int = 4096) -> None:
        if not (0 < base_backoff_s <= max_backoff_s and 0 <= jitter <= 1 and max_connections >= 1
                and max_connections_per_ip >= 1 and ban_after_failures >= 1 and ban_s >= 0
                and forget_after_failures >= 1 and max_learned >= 0):
            raise ValueError("bad AddressBook settings")
        self.forget_after_failures = forget_after_failures
        self.max_learned = max_learned
        # Violation counts and bans per peer id are kept for at most this many peers each, the least recently
        # charged (or the soonest to expire) forgotten first: fresh identities cost nothing that outlives
        # them (spec/transport.md §14).
        self.max_peer_entries = max(1, max_peer_entries)
        self.rng = rng
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s
        self.jitter = jitter
        self.max_connections = max_connections
        self.max_connections_per_ip = max_connections_per_ip
        self.ban_after_failures = ban_after_failures
        self.ban_s = ban_s
        self.ban_inbound_ips = ban_inbound_ips
        self._banned_ips: dict[str, float] = {}
        self._ip_failures: Counter[str] = Counter()
        self._peer_failures: Counter[PeerId] = Counter()  # protocol violations per peer since its last clean end
        self._entries: dict[Address, _Entry] = {}
        self._banned_peers: dict[PeerId, float] = {}
        self._per_ip: Counter[str] = Counter()  # open connections (both directions) per IP

    # -- what we know --

    def add(self, address: Address, peer: PeerId | None = None, *, now: float, learned: bool = False) -> bool:
        """Know `address` (optionally whose it is); a new address is dialable at once. Idempotent.

        `learned` addresses (peer exchange, discovery - not configured ones) are bounded: at most
        `max_learned` are kept (a new one beyond that is refused: returns False), and one is forgotten after
        `forget_after_failures` consecutive failed dials. Configuring a learned address makes it permanent.
        """
        entry = self._entries.get(address)
        if entry is None:
            if learned and sum(e.learned for e in self._entries.values()) >= self.max_learned:
                return False
            entry = self._entries[address] = _Entry(next_attempt=now, learned=learned)
        elif not learned:
            entry.learned = False
        if peer is not None:
            entry.peer = peer
        return True

    def __contains__(self, address: object) -> bool:
        return address in self._entries

    def addresses(self, peer: PeerId) -> list[Address]:
        """Known addresses of `peer`, sorted."""
        return sorted(a for a, e in self._entries.items() if e.peer == peer)

    def peer_of(self, address: Address) -> PeerId | None:
        return self._entry(address).peer

    @property
    def connections(self) -> int:
        """Open connections counted against the limits (dialed and accepted)."""
        return self._per_ip.total()

    # -- dialing --

    def due(self, now: float) -> list[Address]:
        """Addresses to dial now, sorted: known, not connected or being dialed, not banned (nor their
        peer), backoff over, and a connection to them would fit under both limits."""
        out = []
        per_ip = Counter(self._per_ip)  # open connections plus dials in progress, per IP
        per_ip.update(ip_of(a) for a, e in self._entries.items() if e.dialing)
        total = per_ip.total()
        for address in sorted(self._entries):
            entry = self._entries[address]
            if entry.dialing or entry.connected or entry.next_attempt > now or self._banned(entry, now):
                continue
            if total >= self.max_connections or per_ip[ip_of(address)] >= self.max_connections_per_ip:
                continue
            total += 1
            per_ip[ip_of(address)] += 1
            out.append(address)
        return out

    def next_due(self, now: float) -> float | None:
        """Earliest time (≥ now) at which `due` may return an address that it does not return now; None if
        no address is waiting on a timer (everything is connected, dialing or unknown)."""
        times = []
        for entry in self._entries.values():
            if entry.dialing or entry.connected:
                continue
            times.append(max(entry.next_attempt, entry.banned_until, self._peer_ban(entry), now))
        return min(times) if times else None

    def dial_started(self, address: Address, *, now: float) -> None:
        entry = self._entry(address)
        if entry.dialing or entry.connected:
            raise ValueError(f"{address} is already being dialed or connected")
        entry.dialing = True

    def dial_failed(self, address: Address, *, now: float, handshake: bool = False) -> float:
        """A dial of `address` failed; `handshake` if the other end answered but the Noise handshake or its
        identity check failed. Returns the time of the next attempt (inf while banned)."""
        entry = self._entry(address)
        entry.dialing = False
        entry.failures += 1
        if handshake:
            entry.handshake_failures += 1
            if entry.handshake_failures >= self.ban_after_failures:
                entry.banned_until = now + self.ban_s
                entry.handshake_failures = 0
        entry.next_attempt = now + self.backoff(entry.failures)
        if entry.learned and entry.failures >= self.forget_after_failures and not entry.connected:
            del self._entries[address]  # a stale tip from a peer: stop dialing it (learning it again is fine)
            return float("inf")
        return max(entry.next_attempt, entry.banned_until)

    def backoff(self, failures: int) -> float:
        """Seconds to wait after `failures` consecutive failures (draws one jitter sample)."""
        cap = min(self.max_backoff_s, self.base_backoff_s * 2 ** min(failures - 1, 62))
        return cap * (1.0 - self.jitter * self.rng.random())

    def connected(self, address: Address, peer: PeerId, *, now: float) -> bool:
        """A dial of `address` reached `peer`. False (hang up) if the peer is banned or a limit is full;
        otherwise the connection counts toward the limits until `disconnected`."""
        entry = self._entry(address)
        entry.dialing = False
        entry.peer = peer
        if self._banned(entry, now) or not self._fits(ip_of(address)):
            entry.next_attempt = now + self.backoff(max(entry.failures, 1))
            return False
        entry.connected = True
        entry.failures = entry.handshake_failures = 0
        self._per_ip[ip_of(address)] += 1
        return True

    def disconnected(self, address: Address, *, now: float) -> None:
        """The connection to `address` ended: redial after the base backoff (with jitter)."""
        entry = self._entry(address)
        if not entry.connected:
            return
        entry.connected = False
        self._release(ip_of(address))
        entry.next_attempt = now + self.backoff(1)

    # -- inbound --

    def admit_inbound(self, ip: str, *, now: float) -> bool:
        """May a connection from `ip` proceed to the handshake? False if the IP is banned or a limit is
        full."""
        return self._banned_ips.get(ip, float("-inf")) <= now and self._fits(ip)

    def inbound_handshake_failed(self, ip: str, *, now: float) -> None:
        """An inbound handshake from `ip` failed. With `ban_inbound_ips`, `ban_after_failures` of them in a
        row ban the IP for `ban_s` (off by default: behind NAT or on loopback honest peers share an IP)."""
        if not self.ban_inbound_ips:
            return
        self._ip_failures[ip] += 1
        if self._ip_failures[ip] >= self.ban_after_failures:
            self._banned_ips[ip] = now + self.ban_s
            del self._ip_failures[ip]

    def inbound_handshake_ok(self, ip: str) -> None:
        self._ip_failures.pop(ip, None)

    def inbound_opened(self, ip: str) -> bool:
        """Count an accepted connection; False (close it) if it does not fit under the limits."""
        if not self._fits(ip):
            return False
        self._per_ip[ip] += 1
        return True

    def inbound_closed(self, ip: str) -> None:
        self._release(ip)

    def connection_failed(self, peer: PeerId, *, now: float) -> bool:
        """`peer` ended a connection by a protocol violation (a bad frame, an undecryptable message...).
        `ban_after_failures` of them without a clean connection in between ban the peer for `ban_s`;
        returns True when this one did."""
        count = self._peer_failures.pop(peer, 0) + 1
        self._peer_failures[peer] = count  # most recently charged last
        while len(self._peer_failures) > self.max_peer_entries:
            del self._peer_failures[next(iter(self._peer_failures))]
        if count < self.ban_after_failures:
            return False
        del self._peer_failures[peer]
        self.ban_peer(peer, now=now)
        return True

    def connection_ok(self, peer: PeerId) -> None:
        """A connection with `peer` ended cleanly: its violations in a row start again from zero."""
        self._peer_failures.pop(peer, None)

    # -- bans --

    def ban_peer(self, peer: PeerId, *, now: float, seconds: float | None = None) -> None:
        """Refuse `peer` for `seconds` (default `ban_s`) wherever it connects from."""
        self._banned_peers[peer] = now + (self.ban_s if seconds is None else seconds)
        if len(self._banned_peers) > self.max_peer_entries:
            self._banned_peers = {p: t for p, t in self._banned_peers.items() if t > now}
            while len(self._banned_peers) > self.max_peer_entries:  # all live: the soonest to end goes
                del self._banned_peers[min(self._banned_peers, key=self._banned_peers.__getitem__)]

    def is_banned(self, peer: PeerId, *, now: float) -> bool:
        return self._banned_peers.get(peer, float("-inf")) > now

    # -- internals --

    def _entry(self, address: Address) -> _Entry:
        entry = self._entries.get(address)
        if entry is None:
            raise ValueError(f"unknown address {address}")
        return entry

    def _peer_ban(self, entry: _Entry) -> float:
        return self._banned_peers.get(entry.peer, float("-inf")) if entry.peer is not None else float("-inf")

    def _banned(self, entry: _Entry, now: float) -> bool:
        return entry.banned_until > now or self._peer_ban(entry) > now

    def _fits(self, ip: str) -> bool:
        return self._per_ip.total() < self.max_connections and self._per_ip[ip] < self.max_connections_per_ip

    def _release(self, ip: str) -> None:
        self._per_ip[ip] -= 1
        if self._per_ip[ip] <= 0:
            del self._per_ip[ip]

"""A node's connection limits as one concept (spec/transport.md §13), after libp2p's resource manager.

`Limits` is the one table of settings (node config ``[limits]``, `KEYS` its types; read by
`peerloom.node.limits_settings`); `ConnectionLimiter`
applies it to every inbound socket of a process, whatever listener accepted it (TCP, the HTTP transport,
the in-memory transport, the relay's listener, the HTTP edge), and counts each refusal by its typed reason.
It is thread-safe: the HTTP transport and the edge call it from their asyncio threads, the rest from trio.
Times are seconds on one monotonic clock passed in as `now` (callers use `time.monotonic()`).

An inbound socket's life, and where each limit applies (the cheap checks first; the stranger pays before
the node pays):

1. **accepted** (`open`): the descriptor budget (`fd_budget`: the soft ``RLIMIT_NOFILE`` less
   `Limits.fd_reserve` for files and less `Limits.max_peers` for outbound dials), inbound sockets in total
   and per address, then pending (not yet authenticated) sockets in total and per address. When a pending
   cap is full, the oldest *idle* pending socket (one that has not sent its first handshake message) is
   evicted to make room, so silent sockets cannot keep an honest newcomer out; only when no idle one is
   left is the newcomer refused.
2. **first handshake message received** (`started`), before the node does any public-key work: one token
   of the address's bucket (`Limits.handshake_rate` per second, `handshake_burst`), else
   ``handshake-rate``. A socket that sends nothing for `handshake_start_s` is closed (``start-timeout``).
3. **authenticated** (`established`): a peer that is not *known* (see `SecureOptions.protected`: the
   roster, the manifest's validators, certified peers, `Limits.protected_peers`) takes one of at most
   `max_strangers` stranger slots (``stranger-cap``), so known peers always find a slot.
4. **closed** (`close`, idempotent).

Refusal reasons (`REFUSALS`; ``peerloom_limit_refusals_total{reason}``): ``fd-budget``, ``inbound-cap``,
``inbound-cap-ip``, ``pending-cap``, ``pending-cap-ip``, ``idle-evicted``, ``handshake-rate``,
``start-timeout``, ``stranger-cap``, ``header-timeout`` (HTTP: request headers not complete in time),
``edge-cap``, ``edge-cap-ip``. None of them is a peer fault: a refusal never counts toward a ban.
"""

from __future__ import annotations

import logging
import math
import os
import resource
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import attrs
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from peerloom.core.identity import PeerId

log = logging.getLogger(__name__)

REFUSALS = ("fd-budget", "inbound-cap", "inbound-cap-ip", "pending-cap", "pending-cap-ip", "idle-evicted",
            "handshake-rate", "start-timeout", "stranger-cap", "header-timeout", "edge-cap", "edge-cap-ip")
PEER, EDGE = "peer", "edge"  # scopes: sockets of the peer transports, and of the HTTP edge


@attrs.frozen(kw_only=True)
class Limits:
    """Every connection limit of a node (spec/transport.md §13 gives each default and why). Counts are
    sockets or peers, times seconds, rates per second per remote address. Raises ValueError for a value
    out of range."""

    open_files: int = 65536  # at start the soft RLIMIT_NOFILE is raised toward this (never above the hard one)
    fd_reserve: int = 128  # descriptors never given to connections: store, logs, artifacts, threads
    max_inbound: int = 256  # inbound peer sockets open at once (pending and established), all listeners
    max_inbound_per_ip: int = 64
    max_pending: int = 64  # inbound sockets not yet authenticated, all listeners
    max_pending_per_ip: int = 8
    max_peers: int = 64  # connected peers, both directions (the address book)
    max_peers_per_ip: int = 64
    max_strangers: int = 32  # of max_peers: inbound peers that are not known
    handshake_rate: float = 20.0  # handshakes per second per address (token bucket) ...
    handshake_burst: int = 40  # ... and its depth
    handshake_start_s: float = 5.0  # first handshake message due this long after accept (or the upgrade)
    http_header_timeout_s: float = 10.0  # the HTTP transport: request line and headers complete within this
    max_edge_connections: int = 256  # sockets of the HTTP edge, all clients
    max_edge_connections_per_ip: int = 64
    tracked_addresses: int = 4096  # token buckets kept (least recently used evicted)
    protected_peers: tuple[str, ...] = ()  # peer ids that are always known (e.g. reducers)

    def __attrs_post_init__(self) -> None:
        for field in attrs.fields(Limits):
            value = getattr(self, field.name)
            if field.name != "protected_peers" and not value > 0:
                raise ValueError(f"limits.{field.name} must be positive, got {value!r}")
        for small, big in (("max_pending_per_ip", "max_pending"), ("max_inbound_per_ip", "max_inbound"),
                           ("max_pending", "max_inbound"), ("max_strangers", "max_peers"),
                           ("max_peers_per_ip", "max_peers"),
                           ("max_edge_connections_per_ip", "max_edge_connections")):
            if getattr(self, small) > getattr(self, big):
                raise ValueError(f"limits.{small} ({getattr(self, small)}) must not exceed {big} "
                                 f"({getattr(self, big)})")
        for text in self.protected_peers:
            try:
                PeerId.from_text(text)
            except Exception:
                raise ValueError(f"limits.protected_peers: {text!r} is not a peer id") from None


# The config keys of ``[limits]`` and the types each accepts (every field of `Limits`).
KEYS: dict[str, tuple[type, ...]] = {
    field.name: (list,) if field.name == "protected_peers" else (float, int) if field.type == "float" else (int,)
    for field in attrs.fields(Limits)}


def raise_nofile(target: int) -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE toward `target`, never above the hard limit (nor lower it).
    Returns (soft, hard) afterwards; an OS that refuses leaves the limit as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, want, exc)
    return soft, hard


def open_descriptors() -> int:
    """Descriptors this process has open now (-1 where /proc is missing)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


class TokenBuckets:
    """Per-client token buckets (`burst` tokens, refilled at `rate` per second), least recently seen evicted."""

    def __init__(self, rate: float, burst: int, max_clients: int) -> None:
        self.rate, self.burst, self.max_clients = rate, burst, max_clients
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, client: str, now: float) -> float:
        """Take one token; returns 0.0 if allowed, else the seconds until a token is available."""
        tokens, last = self._buckets.pop(client, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / self.rate
        self._buckets[client] = (tokens, now)
        while len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)
        return wait


@attrs.define(eq=False)
class Slot:
    """One inbound socket as the limiter counts it. `evict` (thread-safe, may be None) closes the socket;
    the limiter calls it to make room when this socket is pending and idle. `probe` (may be None) says,
    without reading, whether the peer has sent bytes that the handshake has not taken yet: such a socket is
    not idle, only not served yet (its task has not run), and is never evicted."""

    ip: str
    scope: str
    state: str = "pending"  # pending (idle), started, established, closed
    stranger: bool = False
    evict: Callable[[], object] | None = None
    probe: Callable[[], bool] | None = None


class ConnectionLimiter:
    """Applies `Limits` to the inbound sockets of one process (see the module docstring). `nofile` is the
    soft descriptor limit to budget against (default: the process's own, read now)."""

    def __init__(self, limits: Limits | None = None, *, nofile: int | None = None) -> None:
        self.limits = limits = limits or Limits()
        if nofile is None:
            nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            if nofile == resource.RLIM_INFINITY:
                nofile = 1 << 20
        self.nofile = nofile
        self.fd_budget = max(0, nofile - limits.fd_reserve - limits.max_peers)
        self.refusals: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._sockets: Counter[str] = Counter()  # per scope
        self._per_ip: dict[str, Counter[str]] = {PEER: Counter(), EDGE: Counter()}
        self._pending: Counter[str] = Counter()  # per ip
        self._idle: OrderedDict[Slot, None] = OrderedDict()  # pending peer sockets that have sent nothing
        self._strangers = 0
        self._buckets = TokenBuckets(limits.handshake_rate, limits.handshake_burst, limits.tracked_addresses)

    # -- counts --

    @property
    def sockets(self) -> int:
        return self._sockets.total()

    def counts(self) -> dict[str, int]:
        """Sockets by state, for the metrics: pending, established (peers), strangers, edge."""
        with self._lock:
            pending = self._pending.total()
            return {"pending": pending, "established": self._sockets[PEER] - pending, "strangers": self._strangers,
                    "edge": self._sockets[EDGE]}

    # -- the life of a socket --

    def open(self, ip: str, *, now: float, scope: str = PEER, evict: Callable[[], object] | None = None,
             probe: Callable[[], bool] | None = None) -> Slot | str:
        """Count a socket accepted from `ip`: its `Slot`, or the refusal reason (counted; close it at once)."""
        evicted: list[Slot] = []
        with self._lock:
            reason = self._admit(ip, scope, evicted)
            if reason is None:
                slot = Slot(ip=ip, scope=scope, evict=evict, probe=probe)
                self._sockets[scope] += 1
                self._per_ip[scope][ip] += 1
                if scope == PEER:
                    self._pending[ip] += 1
                    self._idle[slot] = None
            else:
                self.refusals[reason] += 1
        for victim in evicted:  # outside the lock: an evict callback may be slow to schedule
            assert victim.evict is not None
            victim.evict()
        return slot if reason is None else reason

    def _admit(self, ip: str, scope: str, evicted: list[Slot]) -> str | None:
        limits = self.limits
        if self.sockets >= self.fd_budget and not self._evict_idle(None, evicted):
            return "fd-budget"
        if scope == EDGE:
            if self._sockets[EDGE] >= limits.max_edge_connections:
                return "edge-cap"
            if self._per_ip[EDGE][ip] >= limits.max_edge_connections_per_ip:
                return "edge-cap-ip"
            return None
        if self._pending[ip] >= limits.max_pending_per_ip and not self._evict_idle(ip, evicted):
            return "pending-cap-ip"
        if self._pending.total() >= limits.max_pending and not self._evict_idle(None, evicted):
            return "pending-cap"
        if self._sockets[PEER] >= limits.max_inbound:
            return "inbound-cap"
        if self._per_ip[PEER][ip] >= limits.max_inbound_per_ip:
            return "inbound-cap-ip"
        return None

    def _evict_idle(self, ip: str | None, evicted: list[Slot]) -> bool:
        """Release the oldest idle pending socket (from `ip`, or any) that can be evicted; True if one was."""
        for slot in list(self._idle):
            if slot.evict is None or (ip is not None and slot.ip != ip):
                continue
            if slot.probe is not None and slot.probe():  # bytes wait for its task: it is not silent
                del self._idle[slot]
                continue
            self._release(slot)
            self.refusals["idle-evicted"] += 1
            evicted.append(slot)
            return True
        return False

    def started(self, slot: Slot, *, now: float) -> str | None:
        """The socket's first handshake message arrived: take a token of its address's bucket before any
        public-key work. Returns None, or ``handshake-rate`` (counted; close the socket)."""
        with self._lock:
            if slot.state != "pending":
                return None
            self._idle.pop(slot, None)
            slot.state = "started"
            if self._buckets.take(slot.ip, now) > 0:
                self.refusals["handshake-rate"] += 1
                return "handshake-rate"
            return None

    def established(self, slot: Slot, *, known: bool) -> str | None:
        """The socket's peer is authenticated: it leaves the pending count; a peer that is not `known`
        takes a stranger slot. Returns None, or ``stranger-cap`` (counted; close the connection)."""
        with self._lock:
            if slot.state not in ("pending", "started"):
                return None
            self._idle.pop(slot, None)
            self._pending[slot.ip] -= 1
            if not self._pending[slot.ip]:
                del self._pending[slot.ip]
            slot.state = "established"
            if not known:
                if self._strangers >= self.limits.max_strangers:
                    self.refusals["stranger-cap"] += 1
                    return "stranger-cap"
                slot.stranger = True
                self._strangers += 1
            return None

    def close(self, slot: Slot) -> None:
        """The socket is closed (idempotent)."""
        with self._lock:
            self._release(slot)

    def refuse(self, reason: str) -> None:
        """Count a refusal decided elsewhere (``start-timeout``, ``header-timeout``)."""
        with self._lock:
            self.refusals[reason] += 1

    def _release(self, slot: Slot) -> None:
        if slot.state == "closed":
            return
        if slot.state in ("pending", "started") and slot.scope == PEER:
            self._idle.pop(slot, None)
            self._pending[slot.ip] -= 1
            if not self._pending[slot.ip]:
                del self._pending[slot.ip]
        if slot.stranger:
            self._strangers -= 1
        per_ip = self._per_ip[slot.scope]
        per_ip[slot.ip] -= 1
        if not per_ip[slot.ip]:
            del per_ip[slot.ip]
        self._sockets[slot.scope] -= 1
        slot.state = "closed"


class LimitsCollector(Collector):
    """``/metrics`` for a `ConnectionLimiter` (register on the node's registry):

    - ``peerloom_limit{name}``: each configured limit, and ``fd_budget`` / ``nofile`` as computed at start;
    - ``peerloom_limit_refusals_total{reason}``: refusals by reason (`REFUSALS`);
    - ``peerloom_limited_sockets{state}``: pending, established, strangers, edge;
    - ``peerloom_open_fds``: descriptors the process has open (read at scrape time)."""

    def __init__(self, limiter: ConnectionLimiter) -> None:
        self._limiter = limiter

    def collect(self) -> Iterator[Any]:
        limiter = self._limiter
        limit = GaugeMetricFamily("peerloom_limit", "Configured limits (spec/transport.md §13)", labels=["name"])
        for field in attrs.fields(Limits):
            value = getattr(limiter.limits, field.name)
            if isinstance(value, (int, float)) and math.isfinite(value):
                limit.add_metric([field.name], float(value))
        limit.add_metric(["fd_budget"], float(limiter.fd_budget))
        limit.add_metric(["nofile"], float(limiter.nofile))
        yield limit
        refusals = CounterMetricFamily("peerloom_limit_refusals", "Connections refused by a limit, by reason",
                                       labels=["reason"])
        for reason, count in sorted(limiter.refusals.items()):
            refusals.add_metric([reason], count)
        yield refusals
        sockets = GaugeMetricFamily("peerloom_limited_sockets", "Inbound sockets by state", labels=["state"])
        for state, count in limiter.counts().items():
            sockets.add_metric([state], count)
        yield sockets
        yield GaugeMetricFamily("peerloom_open_fds", "Open file descriptors of the process",
                                value=open_descriptors())

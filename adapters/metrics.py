"""Prometheus metrics of one node, fed from the engine's notifications by the runtime (spec/design.md §6).

Each node owns a `prometheus_client.CollectorRegistry` (several nodes may share a process in tests); the
HTTP edge exposes it at ``/metrics``. The runtime calls `on_head` for every promoted head and `on_rejected` for
every rejection (it is the driver's `Observer`, adapters/host.py); wire bytes per peer, head age and votes (the
engine's ``votes_<step>`` stats) are read at scrape time from callbacks, so no metric depends on parsing log
lines.

==================================================== =======================================================
metric                                               meaning
==================================================== =======================================================
``peerloom_windows_total{outcome}``                  windows closed: ``certified`` or ``skipped``
``peerloom_updates_accepted_total``                  updates in promoted heads' cohorts
``peerloom_updates_rejected_total{reason}``          updates rejected by screening (``screen-*``, cohort
                                                     outliers), by reason
``peerloom_rejections_total{reason}``                every rejection the engine charged to a peer, by reason
``peerloom_votes_total{step}``                       votes this validator signed and sent
``peerloom_head_window``                             window of the latest certified head
``peerloom_head_lag_windows``                        highest head window a peer announced (its Hello) minus
                                                     ours
``peerloom_head_age_seconds``                        seconds since this node promoted its latest head
``peerloom_peer_bytes_total{peer,direction}``        wire bytes per admitted peer (``sent``/``received``);
                                                     peers not admitted share ``peer="other"``
                                                     (spec/transport.md §14)
``peerloom_peers``                                   connected peers
``peerloom_disk_full``                               1 while the store cannot be written (``disk-full``)
==================================================== =======================================================
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from peerloom.core.objects import PRECOMMIT, PREVOTE, Head

# Rejections that name an update that failed screening (spec/protocol.md §6) rather than a bad message.
_UPDATE_REASON_PREFIXES = ("screen-", "outlier", "cohort-")

PeerBytes = Callable[[], Iterable[tuple[str, int, int]]]
EngineStats = Callable[[], Mapping[str, int]]
VOTE_STEPS = (PREVOTE, PRECOMMIT)


class _WireCollector(Collector):
    def __init__(self, peer_bytes: PeerBytes, engine_stats: EngineStats, metrics: NodeMetrics,
                 connected: Callable[[], int] | None) -> None:
        self._peer_bytes = peer_bytes
        self._connected = connected
        self._engine_stats = engine_stats
        self._metrics = metrics

    def collect(self) -> Iterator[Any]:
        wire = CounterMetricFamily("peerloom_peer_bytes", "Wire bytes per peer", labels=["peer", "direction"])
        peers = 0
        for peer, sent, received in self._peer_bytes():
            peers += 1
            wire.add_metric([peer, "sent"], sent)
            wire.add_metric([peer, "received"], received)
        yield wire
        if self._connected is not None:
            peers = self._connected()
        yield GaugeMetricFamily("peerloom_peers", "Connected peers", value=peers)
        promoted = self._metrics.promoted_at
        age = time.time() - promoted if promoted is not None else float("nan")
        yield GaugeMetricFamily("peerloom_head_age_seconds", "Seconds since the latest head promotion", value=age)
        # The engine counts the votes it signed and sent per step (core/voting.py); read with .get, which is
        # safe while the engine thread adds keys.
        stats = self._engine_stats()
        votes = CounterMetricFamily("peerloom_votes", "Votes signed and sent", labels=["step"])
        for step in VOTE_STEPS:
            if count := stats.get(f"votes_{step}", 0):
                votes.add_metric([step], count)
        yield votes


class NodeMetrics:
    """The metrics of one node. `on_head` and `on_rejected` are called from the engine loop; scrapes from any
    thread."""

    def __init__(self, peer_bytes: PeerBytes = lambda: (), engine_stats: EngineStats = dict,
                 connected: Callable[[], int] | None = None) -> None:
        """`peer_bytes`: (peer label, sent, received) rows; `connected`: the number of connected peers (default:
        the number of `peer_bytes` rows)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.windows = Counter("peerloom_windows", "Windows closed by outcome", ["outcome"], registry=r)
        self.accepted = Counter("peerloom_updates_accepted", "Updates in certified cohorts", registry=r)
        self.rejected = Counter("peerloom_updates_rejected", "Updates rejected by screening", ["reason"],
                                registry=r)
        self.rejections = Counter("peerloom_rejections", "Rejections charged to peers", ["reason"], registry=r)
        self.connection_errors = Counter("peerloom_connection_errors", "Connections ended by an error, by reason "
                                         "(spec/transport.md §6)", ["reason"], registry=r)
        self.head_window = Gauge("peerloom_head_window", "Window of the latest certified head", registry=r)
        self.head_lag = Gauge("peerloom_head_lag_windows", "Best peer head window minus ours", registry=r)
        self.disk_full = Gauge("peerloom_disk_full", "1 while the store cannot be written", registry=r)
        self.promoted_at: float | None = None
        self._best_peer_window = 0
        r.register(_WireCollector(peer_bytes, engine_stats, self, connected))

    def on_head(self, head: Head) -> None:
        """A promoted head (`HeadPromoted`): windows, accepted updates, head window and lag."""
        self.windows.labels(outcome="skipped" if head.skipped else "certified").inc()
        self.accepted.inc(len(head.cohort))
        self.head_window.set(head.window)
        self.promoted_at = time.time()
        self.head_lag.set(max(0, self._best_peer_window - head.window))

    def on_rejected(self, reason: str) -> None:
        """A rejection the engine charged (`Rejected`); those of a screened update count as rejected updates."""
        self.rejections.labels(reason=reason).inc()
        if reason.startswith(_UPDATE_REASON_PREFIXES):
            self.rejected.labels(reason=reason).inc()

    def note_peer_head(self, window: int, own_window: int) -> None:
        """A peer announced its head window (Hello); updates the head lag."""
        self._best_peer_window = max(self._best_peer_window, window)
        self.head_lag.set(max(0, self._best_peer_window - own_window))

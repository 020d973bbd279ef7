"""A validator's window clock (spec/protocol.md §6): when a window's collection closes at this validator.

The clock starts (`arm`) once a leaseholder is reachable or a join waits, and in any case at most
`WAIT_WINDOWS * window_s` after the window opened; it runs `deadline_s` (adapted each window to the slowest
accepted update, `adapt`), and a window short of `min_updates` waits on in half-`window_s` steps (`extend`)
up to `MAX_DEADLINE_WINDOWS * window_s`. Local timing only: heads never depend on it.

Timer keys: ``("close", "validator", window)`` and, with `lease_s > 0`, ``("claims", "validator", window)``.
"""

from __future__ import annotations

from typing import Protocol

from .collector import Collector
from .services import CancelsTimers, FindsPeers, HasManifest, HasNow, Logs, SetsTimers

# A window whose leaseholders are all unreachable closes at most this many window_s after it opened.
WAIT_WINDOWS = 3
# A window's deadline never runs past this many window_s after its clock started (adapted or extended).
MAX_DEADLINE_WINDOWS = 3


def close_key(window: int) -> tuple[str, str, int]:
    return ("close", "validator", window)


def claims_key(window: int) -> tuple[str, str, int]:
    return ("claims", "validator", window)


class ClockServices(HasManifest, HasNow, Logs, FindsPeers, SetsTimers, CancelsTimers, Protocol):
    """What a `WindowClock` uses of the engine (core/engine.py implements it)."""


class WindowClock:
    """The close deadline of the window being collected. `armed_at`: when its clock started (None: not yet,
    the one record of whether it runs); `wait_deadline`: set while the window waits for a reachable
    leaseholder; `deadline_s`: how long the clock runs (seconds), carried from window to window."""

    def __init__(self, engine: ClockServices) -> None:
        self.engine = engine
        self.wait_deadline: float | None = None
        self.armed_at: float | None = None
        self.deadline_s = engine.manifest.window_s

    def open(self) -> None:
        """A new window: its clock is not started."""
        self.wait_deadline = self.armed_at = None

    def arm(self, c: Collector, joining: bool) -> None:
        """Start the window's clock: `deadline_s` once a trainer holding a lease (or, with lease expiry, a
        next-ranked claimant) is reachable or a join is waiting (`joining`), and in any case at most
        `WAIT_WINDOWS * window_s` after the window opened here (spec/protocol.md §6). Does nothing once
        started.

        A window that no leaseholder can reach would only be skipped, so it first waits for one - but never
        for ever: leaseholders that never come (Sybil joiners, say) must not stall the chain, and the
        skipped head is also what rosters a waiting joiner.
        """
        e = self.engine
        if self.armed_at is not None:
            return
        workers = set(c.leases) | (set(c.claims) if e.manifest.lease_s > 0 else set())
        if not workers & set(e.peers_with("trainer")) and not joining:
            if self.wait_deadline is None:
                self.wait_deadline = e.now + WAIT_WINDOWS * e.manifest.window_s
                e.set_timer(close_key(c.window), self.wait_deadline)
                e.log("window-waiting", window=c.window, until=self.wait_deadline)
            return
        self.armed_at = e.now
        deadline = e.now + self.deadline_s
        e.set_timer(close_key(c.window), deadline if self.wait_deadline is None else min(deadline, self.wait_deadline))
        if e.manifest.lease_s > 0:
            e.set_timer(claims_key(c.window), e.now + e.manifest.lease_s)

    def extend(self, c: Collector) -> bool:
        """At the deadline, a window with fewer than `min_updates` accepted updates waits on (in steps of
        half a `window_s`) while a leaseholder is reachable, up to `MAX_DEADLINE_WINDOWS * window_s` after
        its clock started: a loaded machine's slow honest cohort is not skipped (spec/protocol.md §6).
        True if the deadline moved."""
        e, m = self.engine, self.engine.manifest
        if self.armed_at is None:
            return False  # the wait deadline (no leaseholder reachable): nothing to wait for
        limit = self.armed_at + MAX_DEADLINE_WINDOWS * m.window_s
        accepted = sum(1 for x in c.entries.values() if x.state == "accepted")
        reachable = set(c.leases) & set(e.peers_with("trainer"))
        if accepted >= m.min_updates or not reachable or e.now >= limit:
            return False
        e.log("window-extended", window=c.window, accepted=accepted, needed=m.min_updates)
        e.set_timer(close_key(c.window), min(limit, e.now + m.window_s / 2))
        return True

    def adapt(self, c: Collector) -> None:
        """The next window's deadline from this one's slowest accepted update (spec/protocol.md §6): 1.5 times
        its time since the clock started, within [window_s, MAX_DEADLINE_WINDOWS * window_s]; after a window
        that closed at its deadline with leases unreported, 1.25 times the current deadline."""
        e, m = self.engine, self.engine.manifest
        if self.armed_at is None:
            return
        slowest = max((t - self.armed_at for t in c.accepted_at.values()), default=0.0)
        target = 1.25 * self.deadline_s if not c.complete() else 1.5 * slowest
        deadline_s = min(max(target, m.window_s), MAX_DEADLINE_WINDOWS * m.window_s)
        if abs(deadline_s - self.deadline_s) > 1e-9:
            e.log("deadline-adapted", window=c.window, deadline_s=round(deadline_s, 3),
                  slowest_s=round(slowest, 3))
        self.deadline_s = deadline_s

    def close(self, c: Collector) -> None:
        """The window closed (all leases reported, or its deadline): adapt the next deadline, stop the timer."""
        self.adapt(c)
        self.engine.cancel_timer(close_key(c.window))

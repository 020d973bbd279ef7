"""Reducer role: an optional accelerator that proposes a window's aggregate (spec/protocol.md §6).

A reducer collects and screens like a validator, closes earlier (at `reducer_close_fraction` of the
window), reduces the cohort in canonical order and sends a signed ReductionProposal to validators and
serves the aggregate. It is never an authority: validators recompute and compare, and a wrong proposal
is a rejection charged to the reducer.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs

from .collector import (
    Collector,
    CollectorServices,
    FetchAuditParams,
    FetchBase,
    FetchDelta,
    Screen,
    resume_collector,
)
from .envelope import SignedEnvelope
from .fsm import Table, step
from .identity import PeerId
from .messages import Signed
from .objects import Head, ReductionProposal, SignedBody, UpdateAnnouncement, seal
from .pending import Failed, Outcome
from .roles import RoleBase
from .services import Broadcasts, CancelsTimers, HasIdentity, NotesStored, SetsTimers
from .tasks import ReduceResult

TABLE: Table = {
    ("collecting", "close"): "reducing",
    ("collecting", "close-skip"): "idle",
    ("reducing", "reduced"): "proposed",
    ("reducing", "reduce-failed"): "idle",
    ("collecting", "head"): "collecting",
    ("reducing", "head"): "collecting",
    ("proposed", "head"): "collecting",
    ("idle", "head"): "collecting",
}


@attrs.frozen(kw_only=True)
class Reduce:
    """The ``reduce`` task of `window` is in flight over `cohort` (update ids, canonical order)."""

    window: int
    cohort: tuple[bytes, ...]


class ReducerServices(CollectorServices, HasIdentity, Broadcasts, SetsTimers, CancelsTimers, NotesStored, Protocol):
    """What `ReducerRole` uses of the engine: its collector's members and these (core/engine.py implements it)."""


class ReducerRole(RoleBase):
    def __init__(self, engine: ReducerServices) -> None:
        self.engine = engine
        self.state = "idle"
        self.collector: Collector | None = None

    def _step(self, event: str) -> None:
        self.state = step("reducer", TABLE, self.state, event)

    def on_head(self, head: Head) -> None:
        e = self.engine
        self._step("head")
        self.collector = Collector(e, head, self._maybe_close, owner="reducer")
        deadline = e.now + e.manifest.window_s * e.config.reducer_close_fraction
        e.set_timer(("close", "reducer", self.collector.window), deadline)
        if e.manifest.lease_s > 0:
            e.set_timer(("claims", "reducer", self.collector.window), e.now + e.manifest.lease_s)

    def _maybe_close(self) -> None:
        if self.collector is not None and self.state == "collecting" and self.collector.complete():
            self._close()

    def on_timer(self, key: tuple[Any, ...]) -> None:
        c = self.collector
        if key[:2] == ("claims", "reducer") and c is not None and key[2] == c.window:
            c.claims_open = True
            self._maybe_close()
            return
        if key[:2] == ("close", "reducer") and c is not None and key[2] == c.window and self.state == "collecting":
            self._close()

    def _close(self) -> None:
        e, c = self.engine, self.collector
        assert c is not None
        c.closed = True
        e.cancel_timer(("close", "reducer", c.window))
        cohort = c.cohort()
        if len(cohort) < e.manifest.min_updates:
            self._step("close-skip")
            return
        self._step("close")
        work = Reduce(window=c.window, cohort=tuple(x.envelope.id for x in cohort))
        e.run_task(c.reduce_task(cohort), "reducer", work)

    def resume(self, work: Any, outcome: Outcome) -> None:
        """Go on with work of ours the engine held (a task, fetch or write) once it ended with `outcome`."""
        match work:
            case Reduce():
                self._reduced(work, outcome)
            case Screen() | FetchBase() | FetchDelta() | FetchAuditParams():
                resume_collector(self.engine.log, self.collector, work, outcome)
            case _:
                raise TypeError(f"not reducer work: {work!r}")

    def _reduced(self, work: Reduce, outcome: Outcome) -> None:
        e, c = self.engine, self.collector
        if isinstance(outcome, Failed):
            if c is not None and c.window == work.window and self.state == "reducing":
                self._step("reduce-failed")
            return
        result = outcome.result
        assert isinstance(result, ReduceResult)
        e.note_stored(result.params)
        if result.outer_state is not None:  # the head's optimizer state: never fetched again
            e.note_stored(result.outer_state)
        if c is None or c.window != work.window or self.state != "reducing":
            return
        for outlier in result.outliers:
            c.reject_outlier(work.cohort[outlier.index], f"screen-{outlier.reason}", outlier.detail)
        ids = tuple(work.cohort[i] for i in result.kept)
        if len(ids) < e.manifest.min_updates:
            self._step("reduce-failed")
            return
        self._step("reduced")
        proposal = seal(e.identity, ReductionProposal(
            revision=e.revision.id, window=work.window, base=c.head.id, cohort=ids, params=result.params,
            params_digest=result.params_digest))
        e.stats["proposals_sent"] += 1
        e.log("proposal", window=work.window, cohort=len(ids))
        e.broadcast(Signed(envelope=proposal), roles=("validator",))

    def on_signed(self, peer: PeerId, envelope: SignedEnvelope, body: SignedBody) -> None:
        match body:
            case UpdateAnnouncement():
                if self.collector is not None:
                    self.collector.offer(peer, envelope, body)
            case _:
                pass

    def on_undecodable(self, peer: PeerId, envelope: SignedEnvelope) -> bool:
        return envelope.kind == UpdateAnnouncement.KIND and self.collector is not None and \
            self.collector.charges_undecodable(peer, envelope)

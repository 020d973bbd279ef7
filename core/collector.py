"""Update collection for one window, shared by validators and reducers (spec/protocol.md §6).

Per announcement: check it (signature, revision, window, base head, lease), fetch the delta with
verify-on-arrival, then screen it on the real tensors (a ``screen`` compute task). Every rejection has a
stable reason code. Each update moves through this table:

    announced --fetched--> screening --screened-ok--> accepted
                                     --screened-bad-> rejected
    announced --fetch-failed-> rejected
    accepted  --outlier-----> rejected     (cohort screening inside the reduce task)

Per-update screening (the ``screen`` task): decodable, schema, finite, the signed tensor digest, and the
manifest's absolute norm bound. Replay: a delta whose tensor digest another author already announced in
this window, or that an accepted update of a recent window carried, is ``screen-replay``. Cohort-relative
screening (norm against the cohort median, cosine to the robust centre) runs in the ``reduce`` task over
all individually accepted updates, because it needs the whole cohort.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from .envelope import SignedEnvelope
from .errors import DecodeError, VerificationError
from .fsm import Table, step
from .identity import PeerId
from .leases import lease_weight, leases_of
from .objects import PROTOCOL_VERSION, Head, UpdateAnnouncement

if TYPE_CHECKING:
    from .engine import Engine

TABLE: Table = {
    ("announced", "fetched"): "screening",
    ("announced", "fetch-failed"): "rejected",
    ("screening", "screened-ok"): "accepted",
    ("screening", "screened-bad"): "rejected",
    ("screening", "screen-failed"): "rejected",
    ("announced", "replay"): "rejected",
    ("accepted", "outlier"): "rejected",
}
REPLAY_WINDOWS = 8  # how many windows of accepted delta digests a collector remembers


@attrs.define
class Entry:
    envelope: SignedEnvelope
    announcement: UpdateAnnouncement
    state: str = "announced"
    reason: str = ""


class Collector:
    """Collects the updates of window `head.window + 1`; `on_change` runs after every state change."""

    def __init__(self, engine: Engine, head: Head, on_change: Any) -> None:
        self.engine = engine
        self.head = head
        self.window = head.window + 1
        self.leases = leases_of(head, engine.manifest)
        self.entries: dict[PeerId, Entry] = {}
        self.on_change = on_change
        self.closed = False
        self.offers: dict[PeerId, int] = {}
        self.digests: dict[bytes, PeerId] = {}  # delta digest -> first author announcing it this window
        quarantined = head.quarantined
        self.quarantined = quarantined

    def offer(self, sender: PeerId, envelope: SignedEnvelope, *, force: bool = False) -> None:
        """Take one signed update announcement from `sender` (who may relay someone else's).

        `force` is for updates named by a head proposal: checked the same way, but after the window
        closed and outside the sender's quota (a proposal's size is bounded by the cohort limit).
        """
        e = self.engine
        if not force:
            # Quota before any signature check: a sender may offer one update per lease plus slack.
            offers = self.offers.get(sender, 0) + 1
            self.offers[sender] = offers
            if offers > len(self.leases) + e.config.announcement_slack:
                e.reject(sender, "announce-quota")
                return
        try:
            ann = UpdateAnnouncement.from_cbor(envelope.open(UpdateAnnouncement.KIND, PROTOCOL_VERSION))
        except (DecodeError, VerificationError) as exc:
            e.reject(sender, exc.reason, exc.detail)
            return
        author = envelope.signer
        if ann.revision != e.revision.id:
            e.reject(sender, "wrong-revision")
        elif ann.window < self.window:
            e.stats["stale_updates"] += 1  # a slow honest trainer; no penalty
        elif ann.window > self.window:
            e.stats["future_updates"] += 1  # we are behind; the head will reach us
        elif self.closed and not force:
            e.rejected_by_reason["late"] += 1
        elif ann.base != self.head.id:
            e.reject(sender, "wrong-base")
        elif author in self.quarantined:
            e.reject(sender, "quarantined")
        elif author not in self.leases:
            e.reject(sender, "no-lease")
        elif ann.shards != self.leases[author]:
            e.reject(sender, "bad-lease")
        elif author in self.entries:
            if self.entries[author].envelope.id != envelope.id:
                e.reject(sender, "duplicate-update", str(author))
        else:
            entry = Entry(envelope=envelope, announcement=ann)
            self.entries[author] = entry
            window = self.window
            first = self.digests.setdefault(ann.delta_digest, author)
            seen = e.seen_deltas.get(ann.delta_digest)
            if first != author or (seen is not None and seen < window):
                self._move(entry, "replay", "screen-replay")
                return
            e.fetch(ann.delta, [author, sender], lambda: self._fetched(window, author),
                    lambda reason: self._fetch_failed(window, author, reason))

    def _move(self, entry: Entry, event: str, reason: str = "") -> None:
        entry.state = step("collector", TABLE, entry.state, event)
        entry.reason = reason
        if entry.state == "rejected":
            self.engine.reject(entry.envelope.signer, reason)
        self.on_change()

    def _fetched(self, window: int, author: PeerId) -> None:
        entry = self.entries.get(author)
        if window != self.window or entry is None or entry.state != "announced":
            return
        entry.state = step("collector", TABLE, entry.state, "fetched")
        ann = entry.announcement
        self.engine.run_task("screen", {"delta": ann.delta, "delta_digest": ann.delta_digest,
                                        "max_norm": self.engine.manifest.max_update_norm},
                             lambda r: self._screened(author, r), lambda why: self._screen_failed(author, why))

    def _fetch_failed(self, window: int, author: PeerId, reason: str) -> None:
        entry = self.entries.get(author)
        if window == self.window and entry is not None and entry.state == "announced":
            self._move(entry, "fetch-failed", f"fetch-{reason}")

    def _screened(self, author: PeerId, result: dict[str, Any]) -> None:
        entry = self.entries[author]
        if entry.state != "screening":
            return
        if result["ok"]:
            seen = self.engine.seen_deltas
            seen.setdefault(entry.announcement.delta_digest, self.window)
            self._move(entry, "screened-ok")
        else:
            self._move(entry, "screened-bad", f"screen-{result['reason']}")

    def _screen_failed(self, author: PeerId, reason: str) -> None:
        if self.entries[author].state == "screening":
            self._move(self.entries[author], "screen-failed", "screen-error")

    def reject_outlier(self, author: PeerId, reason: str) -> None:
        """Cohort screening found `author`'s accepted update an outlier (`reason` a ``screen-*`` code)."""
        entry = self.entries[author]
        if entry.state == "accepted":
            self._move(entry, "outlier", reason)

    def struck(self) -> list[Entry]:
        """Updates rejected for a reason every honest validator reproduces (strikes), by update id."""
        from .quarantine import STRIKE_REASONS
        return sorted((x for x in self.entries.values() if x.state == "rejected" and x.reason in STRIKE_REASONS),
                      key=lambda x: x.envelope.id)

    def complete(self) -> bool:
        """Every leased trainer has an update that is accepted or rejected."""
        return all(a in self.entries and self.entries[a].state in ("accepted", "rejected") for a in self.leases)

    def cohort(self) -> list[Entry]:
        """Accepted updates in canonical order (by update id), the order every reducer must use."""
        accepted = [x for x in self.entries.values() if x.state == "accepted"]
        return sorted(accepted, key=lambda x: x.envelope.id)

    def weights(self, cohort: list[Entry]) -> tuple[int, ...]:
        return tuple(lease_weight(self.engine.manifest, x.announcement.shards) for x in cohort)

    def reduce_args(self, cohort: list[Entry]) -> dict[str, Any]:
        """Arguments of the ``reduce`` task for candidates `cohort` (canonical order) onto this window's base:
        cohort screening thresholds and the outer optimizer with the parent head's state."""
        m = self.engine.manifest
        return {"params": self.head.params, "deltas": tuple(x.announcement.delta for x in cohort),
                "weights": self.weights(cohort), "rule": m.aggregation, "outer_optimizer": m.outer_optimizer,
                "outer_lr": m.outer_lr, "outer_momentum": m.outer_momentum, "outer_state": self.head.outer_state,
                "norm_ratio": m.norm_ratio, "min_cosine": m.min_cosine}

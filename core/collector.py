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

from typing import Any, Protocol

import attrs

from .audit import loss_batch_seed, start_args, train_seed
from .encoding import decode
from .envelope import MAX_BODY_BYTES, SignedEnvelope
from .errors import DecodeError, VerificationError
from .fsm import Table, step
from .identity import PeerId
from .leases import claims_of, lease_fault, lease_weight, leases_of
from .objects import PROTOCOL_VERSION, ArtifactRef, Head, Manifest, UpdateAnnouncement, unauditable_fault
from .pending import Done, Failed, Outcome
from .privacy import budget_fault
from .quarantine import STRIKE_REASONS
from .roles import Log
from .services import (
    BaseHeads,
    ChecksStored,
    Fetches,
    FindsPeers,
    HasConfig,
    HasManifest,
    HasNow,
    HasRejectedByReason,
    HasRevision,
    HasStats,
    LeaseHeads,
    Logs,
    Rejects,
    RunsTasks,
)
from .tasks import LossCheck, Recomputation, ReduceTask, ScreenResult, ScreenTask

TABLE: Table = {
    ("announced", "fetched"): "screening",
    ("announced", "fetch-failed"): "rejected",
    ("screening", "screened-ok"): "accepted",
    ("screening", "screened-bad"): "rejected",
    ("screening", "screen-failed"): "rejected",
    ("announced", "replay"): "rejected",
    ("accepted", "outlier"): "rejected",
    ("rejected", "retry"): "announced",  # a transient failure here, and a proposal names the update
}
# Rejections that say nothing about the update itself, only about this node's luck fetching or screening it:
# when a head proposal names such an update, it is fetched (from the proposer too) and screened once more.
TRANSIENT_PREFIXES = ("fetch-", "screen-error")
REPLAY_WINDOWS = 8  # how many windows of accepted delta digests a collector remembers


@attrs.define
class Entry:
    envelope: SignedEnvelope
    announcement: UpdateAnnouncement
    base: Head  # the certified head the update names as its base: the window's parent, or older (§5.2)
    prior_delta: ArtifactRef | None = None  # the delta of the update's `prior`, which its start subtracts (§5.2)
    state: str = "announced"
    reason: str = ""

    @property
    def slot(self) -> Slot:
        return slot_of(self.envelope.signer, self.announcement)


Slot = PeerId | tuple[PeerId, PeerId]  # a lease: its holder, or (claimant, leaseholder) for a claim


def slot_of(author: PeerId, ann: UpdateAnnouncement) -> Slot:
    """The lease an update fills: one update per slot."""
    return author if ann.claim is None else (author, ann.claim)


@attrs.frozen(kw_only=True)
class Screen:
    """The ``screen`` task of the update filling `slot` of `window` is in flight."""

    window: int
    slot: Slot


@attrs.frozen(kw_only=True)
class FetchBase:
    """The base head's params (or optimizer state) are being fetched for `window` (failure is logged)."""

    window: int


@attrs.frozen(kw_only=True)
class FetchDelta:
    """The delta of the update filling `slot` of `window` is being fetched (then screened)."""

    window: int
    slot: Slot


@attrs.frozen(kw_only=True)
class FetchAuditParams:
    """The base params the screen of the update filling `slot` of `window` needs (an inline audit or the
    loss check) are being fetched (then its delta, from its author and `sender`)."""

    window: int
    slot: Slot
    sender: PeerId


CollectorWork = Screen | FetchBase | FetchDelta | FetchAuditParams


def _peek_window(envelope: SignedEnvelope) -> int | None:
    """The `window` field of an update announcement's body, read before its signature is checked (None
    when the body is not a map with an integer window: the full checks then say why)."""
    try:
        body = decode(envelope.body, max_bytes=MAX_BODY_BYTES)
    except DecodeError:
        return None
    window = body.get("window") if isinstance(body, dict) else None
    return window if isinstance(window, int) and not isinstance(window, bool) else None


def screen_needs_base(manifest: Manifest) -> bool:
    """Whether an update's ``screen`` task reads the base head's params: for an inline audit (`audit`
    without `audit_rate`) or the loss check."""
    return (manifest.audit and not manifest.audit_rate) or manifest.loss_check_samples > 0


def audit_args(manifest: Manifest, base: Head, author: PeerId, ann: UpdateAnnouncement,
               prior_delta: ArtifactRef | None = None) -> Recomputation:
    """The recomputation of `author`'s update `ann` trained on `base` that an audit runs (core/audit.py): the
    training exactly as the author had to run it (its window fixes the global step, spec/protocol.md §5.1; an
    overlapped update with a prior starts from `start_args`, §5.2), and the cosine it must reach."""
    return Recomputation(params=base.params, shards=ann.shards,
                         seed=train_seed(ann.base, ann.window, ann.shards, author), window=ann.window,
                         inner_steps=manifest.inner_steps, min_cosine=manifest.audit_min_cosine,
                         start=start_args(manifest, base, prior_delta))


class CollectorServices(HasConfig, HasRevision, HasManifest, HasNow, HasStats, HasRejectedByReason, Logs, FindsPeers,
                        RunsTasks, Fetches, ChecksStored, Rejects, LeaseHeads, BaseHeads, Protocol):
    """What a `Collector` uses of the engine (core/engine.py implements it)."""

    @property
    def seen_deltas(self) -> dict[bytes, int]: ...
    @property
    def recent_updates(self) -> dict[bytes, tuple[PeerId, UpdateAnnouncement]]: ...


def resume_collector(log: Log, collector: Collector | None, work: CollectorWork, outcome: Outcome) -> None:
    """Hand collector work the engine held back to `collector`, the owning role's current one (None: it has
    none yet). A base fetch may end while its collector is still being built, so its failure is logged
    here."""
    if isinstance(work, FetchBase):
        if isinstance(outcome, Failed):
            log("base-fetch-failed", window=work.window, reason=outcome.reason)
    elif collector is not None:
        collector.resume(work, outcome)


class Collector:
    """Collects the updates of window `head.window + 1`; `on_change` runs after every state change. `owner`
    names the role holding it (``validator`` or ``reducer``): the engine hands that role the collector's
    pending work (`CollectorWork`), which it passes on to `resume`.

    The window's leases are drawn from its lease head, `head` itself unless the manifest overlaps windows;
    an update may name as its base any certified head of `engine.base_heads(window)` (spec/protocol.md
    §5.2). A node that does not hold the lease head (it jumped windows, `chain-gap`) has no leases this
    window: every update is `no-lease` here, and the head is decided by the validators that hold it."""

    def __init__(self, engine: CollectorServices, head: Head, on_change: Any, *, owner: str) -> None:
        self.engine = engine
        self.owner = owner
        self.head = head
        self.window = head.window + 1
        lease_head = head if engine.manifest.overlap == 0 else engine.lease_head(self.window)
        if lease_head is None:
            engine.log("lease-head-missing", window=self.window)
        self.leases = {} if lease_head is None else leases_of(lease_head, engine.manifest, self.window)
        self.claims = {} if lease_head is None else claims_of(lease_head, engine.manifest, self.window)
        # base head id -> head: the parent and, with overlap, the heads before it that this node holds
        self.bases = {head.id: head, **engine.base_heads(self.window)}
        self.entries: dict[Slot, Entry] = {}
        self.by_id: dict[bytes, Entry] = {}
        self.claims_on: dict[PeerId, list[Entry]] = {}  # leaseholder -> claims on its lease
        self.final_own = 0  # leaseholders whose own update is accepted or rejected (complete() fast path)
        self.retried: set[bytes] = set()  # update ids fetched and screened a second time (once each)
        self.accepted_at: dict[Slot, float] = {}  # engine time at which each accepted update was accepted
        self.on_change = on_change
        self.closed = False
        self.claims_open = False  # set by the host role when the window's leases expire (`lease_s`)
        self.offers: dict[PeerId, int] = {}
        self.digests: dict[bytes, PeerId] = {}  # delta digest -> first author announcing it this window
        self.quarantined = head.quarantined
        # One update per lease and per possible claim, plus slack for honest retries.
        claim_slots = sum(len(v) for v in self.claims.values()) if engine.manifest.lease_s > 0 else 0
        self.max_offers = len(self.leases) + claim_slots + engine.config.announcement_slack
        self._fetch_base()

    def _fetch_base(self) -> None:
        """Screening, audits and the reduce task all start from the base head's params (and DiLoCo state).
        A node that adopted the head from others' certificate, without computing it, fetches them now from
        the peers that hold them, so it can take part in this window instead of lagging for good."""
        e = self.engine
        providers = [*e.peers_with("validator"), *e.peers_with("reducer"), *e.peers_with("trainer")]
        for ref in (self.head.params, self.head.outer_state):
            if ref is not None and not e.is_stored(ref.digest):
                e.fetch(ref, providers, self.owner, FetchBase(window=self.window))

    def charges_undecodable(self, sender: PeerId, envelope: SignedEnvelope) -> bool:
        """An update announcement from `sender` whose body does not decode: True if `sender` is charged for
        it (the engine rejects it with the decoding's reason), False if it is dropped uncharged like any
        announcement for another window, or refused past the sender's quota."""
        return self._admit(sender, _peek_window(envelope))

    def _admit(self, sender: PeerId, window: int | None) -> bool:
        """The checks an announcement for `window` (None: unknown) passes before its signature is checked:
        False if it is dropped or refused here."""
        e = self.engine
        if window is not None and window != self.window:
            # Before the quota, and before any signature check: an announcement for another window costs its
            # sender nothing, because a node that is behind (or ahead) must not charge honest trainers for its
            # own state. It is dropped: an older one is stale, and a node that is behind learns the window's
            # cohort from the head (spec/protocol.md §6).
            e.stats["stale_updates" if window < self.window else "future_updates"] += 1
            if window > self.window:
                e.rejected_by_reason["ahead"] += 1
            return False
        # Quota before any signature check: a sender may offer one update per lease plus slack.
        offers = self.offers.get(sender, 0) + 1
        self.offers[sender] = offers
        if offers > self.max_offers:
            e.reject(sender, "announce-quota")
            return False
        return True

    def entry_for(self, envelope: SignedEnvelope) -> Entry | None:
        """This collector's entry for exactly `envelope`, if it took it."""
        return self.by_id.get(envelope.id)

    def offer(self, sender: PeerId, envelope: SignedEnvelope, ann: UpdateAnnouncement, *,
              force: bool = False) -> None:
        """Take one signed update announcement `envelope` (its body `ann`, decoded by the engine or the
        caller: `core.bodies.decode_body`) from `sender` (who may relay someone else's).

        `force` is for updates named by a head proposal: checked the same way, but after the window
        closed and outside the sender's quota (a proposal's size is bounded by the cohort limit); a
        leaseholder's update and a claim on its lease may then both be held - a cohort takes one of them.
        """
        e = self.engine
        if not force and not self._admit(sender, ann.window):
            return
        try:
            envelope.verify(UpdateAnnouncement.KIND, PROTOCOL_VERSION)
        except VerificationError as exc:
            e.reject(sender, exc.reason, exc.detail)
            return
        author = envelope.signer
        slot = slot_of(author, ann)
        if ann.revision != e.revision.id:
            e.reject(sender, "wrong-revision")
        elif ann.window < self.window:
            e.stats["stale_updates"] += 1  # a slow honest trainer; no penalty
        elif ann.window > self.window:
            e.stats["future_updates"] += 1  # we are behind; the head will reach us
        elif self.closed and not force:
            e.rejected_by_reason["late"] += 1
        elif ann.base not in self.bases:
            e.reject(sender, "wrong-base")
        elif ann.prior is not None and not self._prior_known(sender, author, ann):
            pass  # refused (and counted) by `_prior_known`
        elif (ann.trajectory is not None) != (e.manifest.audit_segments > 0):
            e.reject(sender, "bad-trajectory", "segment audits need one, and only they")
        elif author in self.quarantined:
            e.reject(sender, "quarantined")
        elif fault := budget_fault(e.manifest, self.head, author, ann.privacy_steps, e.config.accountant):
            e.reject(sender, fault)  # spec/protocol.md §10: no spend declared, or past the author's budget
        elif fault := unauditable_fault(e.manifest, ann.unauditable):
            e.reject(sender, fault, "the manifest audits and admits no unauditable trainers")
        elif ann.claim is None and (no_lease := lease_fault(author, ann.shards, self.leases)):
            e.reject(sender, no_lease)
        elif ann.claim is not None and self.claims.get(author, {}).get(ann.claim) != ann.shards:
            e.reject(sender, "bad-claim")
        elif ann.claim is not None and not (self.claims_open or force):
            e.rejected_by_reason["claim-early"] += 1  # the lease has not expired here (yet)
        elif not force and self._taken(ann, author):
            e.rejected_by_reason["lease-taken"] += 1  # one update per lease: the other one came first
        elif slot in self.entries:
            if self.entries[slot].envelope.id != envelope.id:
                e.reject(sender, "duplicate-update", str(author))
        else:
            prior = None if ann.prior is None else e.recent_updates[ann.prior][1].delta
            entry = Entry(envelope=envelope, announcement=ann, base=self.bases[ann.base], prior_delta=prior)
            e.recent_updates[envelope.id] = (author, ann)
            self.entries[slot] = entry
            self.by_id[envelope.id] = entry
            if ann.claim is not None:
                self.claims_on.setdefault(ann.claim, []).append(entry)
            window = self.window
            first = self.digests.setdefault(ann.delta_digest, author)
            seen = e.seen_deltas.get(ann.delta_digest)
            if first != author or (seen is not None and seen < window):
                self._move(entry, "replay", "screen-replay")
                return
            self._fetch_inputs(entry, sender)

    def _prior_known(self, sender: PeerId, author: PeerId, ann: UpdateAnnouncement) -> bool:
        """Whether an update's `prior` is what overlapped windows allow (spec/protocol.md §5.2): only with a base
        one window older than the parent, the author's own update of the window before (else ``bad-prior``,
        charged), certified in the parent's cohort and known here (else dropped uncharged, ``prior-uncertified``
        or ``prior-unknown``: an honest trainer cannot know the parent's cohort when it starts)."""
        e = self.engine
        known = e.recent_updates.get(ann.prior) if ann.prior is not None else None
        if self.bases[ann.base].window != self.window - 2 or \
                (known is not None and (known[0] != author or known[1].window != self.window - 1)):
            e.reject(sender, "bad-prior")
            return False
        if ann.prior not in self.head.cohort:
            e.rejected_by_reason["prior-uncertified"] += 1
            return False
        if known is None:
            e.rejected_by_reason["prior-unknown"] += 1
            return False
        return True

    def _inputs(self, entry: Entry) -> list[ArtifactRef]:
        """What the update's screen reads besides its delta and this node lacks: the params of its base (and
        where its start needs them, the base's momentum and its prior's delta) for an inline audit or the loss
        check (`screen_needs_base`)."""
        if not screen_needs_base(self.engine.manifest):
            return []
        start = start_args(self.engine.manifest, entry.base, entry.prior_delta)
        refs = [entry.base.params] + ([] if start is None else [start.outer_state, start.prior])
        return [r for r in refs if r is not None and not self.engine.is_stored(r.digest)]

    def _fetch_inputs(self, entry: Entry, sender: PeerId) -> None:
        """Fetch what the update's screen needs, one artifact after another, then its delta. A validator that
        adopted the base from others' certificate may lack its params; the author trained on them (and on its
        prior), so it can serve them."""
        e, author, window, slot = self.engine, entry.envelope.signer, self.window, entry.slot
        missing = self._inputs(entry)
        if missing:
            providers = [author, sender, *e.peers_with("validator"), *e.peers_with("reducer")]
            e.fetch(missing[0], providers, self.owner, FetchAuditParams(window=window, slot=slot, sender=sender))
        else:
            e.fetch(entry.announcement.delta, [author, sender], self.owner, FetchDelta(window=window, slot=slot))

    def retry(self, update_id: bytes, providers: list[PeerId]) -> bool:
        """Fetch (from `providers`, then the author) and screen again an update rejected here for a transient
        reason (`TRANSIENT_PREFIXES`): a head proposal names it, so its proposer holds the delta, and a
        transient failure must not make this validator refuse that head for good (Tendermint needs a valid
        value to become valid at every honest validator). Once per update per window; True if retrying."""
        entry = self.by_id.get(update_id)
        if entry is None or entry.state != "rejected" or update_id in self.retried or \
                not entry.reason.startswith(TRANSIENT_PREFIXES):
            return False
        self.retried.add(update_id)
        if entry.announcement.claim is None:
            self.final_own -= 1  # counted again when it ends accepted or rejected
        entry.state = step("collector", TABLE, entry.state, "retry")
        entry.reason = ""
        e, ann, slot, window = self.engine, entry.announcement, entry.slot, self.window
        e.log("update-retry", window=window, author=str(entry.envelope.signer))
        e.stats["update_retries"] += 1
        sources = [*providers, entry.envelope.signer]
        e.fetch(ann.delta, list(dict.fromkeys(sources)), self.owner, FetchDelta(window=window, slot=slot))
        return True

    def _taken(self, ann: UpdateAnnouncement, author: PeerId) -> bool:
        """A live update already fills this lease: the holder's own for a claim, any claim for the holder."""
        live = ("announced", "screening", "accepted")
        if ann.claim is not None:
            own = self.entries.get(ann.claim)
            return own is not None and own.state in live
        return any(x.state in live for x in self.claims_on.get(author, ()))

    def _move(self, entry: Entry, event: str, reason: str = "", detail: str = "") -> None:
        before = entry.state
        entry.state = step("collector", TABLE, entry.state, event)
        if entry.announcement.claim is None and before not in ("accepted", "rejected"):
            self.final_own += 1  # every move of an own-lease update here ends accepted or rejected
        entry.reason = reason
        if entry.state == "rejected":
            self.engine.reject(entry.envelope.signer, reason, detail)
        elif entry.state == "accepted":
            self.accepted_at.setdefault(entry.slot, self.engine.now)
        self.on_change()

    def _fetched(self, window: int, slot: Slot) -> None:
        entry = self.entries.get(slot)
        if window != self.window or entry is None or entry.state != "announced":
            return
        entry.state = step("collector", TABLE, entry.state, "fetched")
        ann = entry.announcement
        manifest = self.engine.manifest
        loss_check = None
        if manifest.loss_check_samples:
            # The loss before and after the update on a batch of the author's leased samples (§6.1).
            loss_check = LossCheck(params=entry.base.params, shards=ann.shards, seed=loss_batch_seed(entry.envelope.id),
                                   samples=manifest.loss_check_samples, min_drop=manifest.loss_min_drop,
                                   start=start_args(manifest, entry.base, entry.prior_delta))
        audit = None
        if manifest.audit and not manifest.audit_rate and entry.envelope.signer not in self.head.private_peers \
                and not ann.unauditable:
            # Re-run the author's training exactly as it had to run it (core/audit.py); nobody else holds a
            # private-data trainer's samples (spec/protocol.md §10); an unauditable update is never replayed
            # (§6.4).
            audit = audit_args(manifest, entry.base, entry.envelope.signer, ann, entry.prior_delta)
        task = ScreenTask(delta=ann.delta, delta_digest=ann.delta_digest, max_norm=manifest.max_update_norm,
                          loss_check=loss_check, audit=audit)
        self.engine.run_task(task, self.owner, Screen(window=window, slot=slot))

    def resume(self, work: Screen | FetchDelta | FetchAuditParams, outcome: Outcome) -> None:
        """Go on with `work` of this collector's window once it ended with `outcome`; work of an earlier
        window is dropped."""
        if work.window != self.window:
            return
        match work, outcome:
            case FetchDelta(), Done():
                self._fetched(work.window, work.slot)
            case FetchDelta(), Failed(reason=reason):
                self._fetch_failed(work.window, work.slot, reason)
            case FetchAuditParams(), Done():
                entry = self.entries.get(work.slot)
                if entry is not None:
                    self._fetch_inputs(entry, work.sender)
            case FetchAuditParams(), Failed(reason=reason):
                self._fetch_failed(work.window, work.slot, f"params-{reason}")
            case Screen(), Done(result=result):
                assert isinstance(result, ScreenResult)
                self._screened(work.slot, result)
            case Screen(), Failed(reason=reason):
                self._screen_failed(work.slot, reason)

    def _fetch_failed(self, window: int, slot: Slot, reason: str) -> None:
        entry = self.entries.get(slot)
        if window == self.window and entry is not None and entry.state == "announced":
            self._move(entry, "fetch-failed", f"fetch-{reason}")

    def _screened(self, slot: Slot, result: ScreenResult) -> None:
        entry = self.entries[slot]
        if entry.state != "screening":
            return
        if result.ok:
            seen = self.engine.seen_deltas
            seen.setdefault(entry.announcement.delta_digest, self.window)
            self._move(entry, "screened-ok")
        else:
            self._move(entry, "screened-bad", f"screen-{result.reason}", result.detail)

    def _screen_failed(self, slot: Slot, reason: str) -> None:
        if self.entries[slot].state == "screening":
            self._move(self.entries[slot], "screen-failed", "screen-error")

    def reject_outlier(self, update_id: bytes, reason: str, detail: str = "") -> None:
        """Cohort screening found this accepted update an outlier (`reason` a ``screen-*`` code; `detail` its
        numbers: the norm, the cohort's median, the ratio and the threshold)."""
        entry = self.by_id.get(update_id)
        if entry is not None and entry.state == "accepted":
            self._move(entry, "outlier", reason, detail)

    def struck(self) -> list[Entry]:
        """Updates rejected for a reason every honest validator reproduces (strikes), by update id."""
        return sorted((x for x in self.entries.values() if x.state == "rejected" and x.reason in STRIKE_REASONS),
                      key=lambda x: x.envelope.id)

    def complete(self) -> bool:
        """Every lease has an update that is accepted or rejected - its holder's, or once leases expired,
        claims covering all its shards."""
        if self.final_own >= len(self.leases):
            return True
        if not self.claims_open:
            return False
        final = ("accepted", "rejected")
        covered: dict[PeerId, set[int]] = {}
        for holder, claims in self.claims_on.items():
            for x in claims:
                if x.state in final:
                    covered.setdefault(holder, set()).update(x.announcement.shards)
        for holder, shards in self.leases.items():
            own = self.entries.get(holder)
            if own is not None and own.state in final:
                continue
            if not (self.claims_open and covered.get(holder, set()) >= set(shards)):
                return False
        return True

    def cohort(self) -> list[Entry]:
        """Accepted updates in canonical order (by update id), the order every reducer must use. A claim
        is left out when its leaseholder's own update was accepted (one update per lease)."""
        accepted = [x for x in self.entries.values() if x.state == "accepted"]
        own = {x.envelope.signer for x in accepted if x.announcement.claim is None}
        return sorted((x for x in accepted if x.announcement.claim not in own), key=lambda x: x.envelope.id)

    def weights(self, cohort: list[Entry]) -> tuple[int, ...]:
        return tuple(lease_weight(self.engine.manifest, x.announcement.shards) for x in cohort)

    def reduce_task(self, cohort: list[Entry]) -> ReduceTask:
        """The ``reduce`` task of candidates `cohort` (canonical order) onto this window's base: cohort
        screening thresholds and the outer optimizer with the parent head's state."""
        m = self.engine.manifest
        return ReduceTask(params=self.head.params, deltas=tuple(x.announcement.delta for x in cohort),
                          weights=self.weights(cohort), rule=m.aggregation, outer_optimizer=m.outer_optimizer,
                          outer_lr=m.outer_lr, outer_momentum=m.outer_momentum, outer_state=self.head.outer_state,
                          norm_ratio=m.norm_ratio, min_cosine=m.min_cosine, norm_mads=m.norm_mads)

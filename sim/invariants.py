"""Invariant checkers, run continuously while a simulation runs (spec/design.md §7, spec/simulator.md §7).

Safety (checked on every head an honest node promotes):

- ``one-final-head``: at most one certified head per window across honest nodes, and each carries a
  quorum certificate that verifies against the manifest's validator set.
- ``prefix-consistent``: honest final chains agree: every final head's parent is the final head of the
  window before it.
- ``valid-leases``: every update in a final head's cohort was announced for that window, on that head's
  parent, for shards the signer leased from the parent (`leases_of`), or - for a next-ranked claim -
  for shards of the named leaseholder that the signer ranks second for (`claims_of`). (Whether the
  claimed lease had expired is a timing question the engine decides; it is not re-checked here.)
- ``no-quarantined-cohort``: no cohort slot and no lease for a peer in the parent's quarantine set
  (`Head.quarantined`; the summary says when no head carried a quarantine set).
- ``no-double-vote``: an honest validator never signs two different votes for one (window, round, step),
  across crashes and restarts (spec/design.md §2, durable before visible). Checked on what it sends.
- ``roster-changes``: a final head's roster is its parent's less exactly its `left` and `expired` (peers
  of the parent's roster), plus joiners; kept peers keep their capacity.
- ``contiguous-chain``: an honest node that keeps the chain (`EngineConfig.keep_chain`, the default)
  promotes the head of window `w` only with the certified heads of windows 1..w durable on its disk
  (``chain/<w>`` records): no hole after a crash, a restart, a lost disk or a partition (spec/protocol.md
  §8).

Liveness (checked as virtual time passes): ``liveness``: once the faults end (`heal_at`), honest
validators certify at least `min_windows` new windows within `bound_s` seconds.

Under attack (only when the scenario's [liveness] table sets them; spec/protocol.md §4.1):

- ``certified-often``: no more than `max_skipped_run` final heads in a row are skipped.
- ``honest-shards``: in every window, honest trainers lease at least `honest_share` of the shards that
  are leased at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from peerloom.core.chainsync import chain_key
from peerloom.core.errors import DecodeError, VerificationError
from peerloom.core.identity import PeerId
from peerloom.core.leases import claims_of, lease_window
from peerloom.core.messages import Signed, decode_message
from peerloom.core.objects import PROTOCOL_VERSION, VOTE_KIND, Head, QuorumCertificate

if TYPE_CHECKING:
    from .kernel import SimNode, Simulation


@attrs.define
class Verdict:
    ok: bool = True
    detail: str = ""
    checked: int = 0

    def fail(self, detail: str) -> None:
        if self.ok:
            self.ok, self.detail = False, detail

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "detail": self.detail or f"{self.checked} checks passed"}


class Checkers:
    """All invariants over one simulation. Register with `sim.observers.append(checkers)`."""

    SAFETY = ("one-final-head", "prefix-consistent", "valid-leases", "no-quarantined-cohort", "no-double-vote",
              "roster-changes", "contiguous-chain")

    def __init__(self, *, heal_at: float | None = None, bound_s: float | None = None, min_windows: int = 1,
                 stop_on_violation: bool = True, on_final: Callable[[int, float], None] | None = None,
                 max_skipped_run: int | None = None, honest_share: float | None = None) -> None:
        self.on_final = on_final  # called (window, virtual time) when a window first becomes final
        self.verdicts = {name: Verdict() for name in (*self.SAFETY, "liveness")}
        self.max_skipped_run, self.honest_share = max_skipped_run, honest_share
        if max_skipped_run is not None:
            self.verdicts["certified-often"] = Verdict()
        if honest_share is not None:
            self.verdicts["honest-shards"] = Verdict()
        self.final: dict[int, Head] = {}  # window -> the final head
        self.left_seen: set[PeerId] = set()  # peers some final head recorded as left / expired
        self.expired_seen: set[PeerId] = set()
        self.final_ids: dict[int, bytes] = {}
        self.final_certs: dict[int, QuorumCertificate] = {}  # the first verified certificate of each final head
        self.final_at: dict[int, float] = {}
        self.by_id: dict[bytes, Head] = {}  # verified heads by id
        self.checked_cohorts: set[bytes] = set()
        self.heal_at = heal_at
        self.bound_s = bound_s
        self.min_windows = min_windows
        self.stop_on_violation = stop_on_violation
        self.height_at_heal: int | None = None
        self.quarantine_seen = False
        self.first_violation: tuple[float, str, str] | None = None
        self._genesis_id: bytes | None = None
        self.votes: dict[tuple[Any, ...], bytes | None] = {}
        self.held: dict[str, tuple[int, int]] = {}  # node -> (incarnation, n): its disk holds windows 1..n

    @property
    def ok(self) -> bool:
        return all(v.ok for v in self.verdicts.values())

    def summary(self) -> dict[str, dict[str, Any]]:
        out = {name: v.as_dict() for name, v in self.verdicts.items()}
        if self.verdicts["no-quarantined-cohort"].ok and not self.quarantine_seen:
            out["no-quarantined-cohort"]["detail"] += " (no head carried a quarantine set)"
        if self.heal_at is None:
            out["liveness"]["detail"] = "not checked (scenario has no liveness phase)"
        return out

    def _fail(self, sim: Simulation, name: str, detail: str) -> None:
        verdict = self.verdicts[name]
        if verdict.ok:
            verdict.fail(detail)
            sim.record("", "violation", invariant=name, detail=detail)
            if self.first_violation is None:
                self.first_violation = (sim.now, name, detail)
        if self.stop_on_violation:
            sim.stopped = True

    # --- safety ------------------------------------------------------------------------------------

    def on_head(self, sim: Simulation, node: SimNode, head: Head, cert: QuorumCertificate) -> None:
        if not node.honest or head.window == 0:
            return
        self._check_contiguous(sim, node, head)
        one = self.verdicts["one-final-head"]
        one.checked += 1
        hid = cert.head
        seen = self.by_id.get(hid)
        if seen is None or (seen is not head and seen != head):
            try:  # verifies cert.head == head.id too
                cert.verify(sim.revision, head)
            except VerificationError as exc:
                self._fail(sim, "one-final-head", f"{node.name} promoted window {head.window} with a bad "
                                                  f"certificate: {exc.reason}")
                return
            self.by_id[hid] = head
        known = self.final.get(head.window)
        if known is None:
            self.final[head.window] = head
            self.final_ids[head.window] = hid
            self.final_certs[head.window] = cert
            self.final_at[head.window] = sim.now
            if self.on_final is not None:
                self.on_final(head.window, sim.now)
        elif self.final_ids[head.window] != hid:
            self._fail(sim, "one-final-head", f"window {head.window}: two final heads "
                                              f"{self.final_ids[head.window].hex()[:16]} and {hid.hex()[:16]} "
                                              f"(second at {node.name})")
            return
        self._check_prefix(sim, head, hid)
        self._check_cohort(sim, head, hid)

    def _check_contiguous(self, sim: Simulation, node: SimNode, head: Head) -> None:
        """The node's disk holds the certified heads of windows 1..head.window as durable chain records."""
        if node.engine is None or not node.engine.config.keeps_chain:
            return
        verdict = self.verdicts["contiguous-chain"]
        verdict.checked += 1
        incarnation, n = self.held.get(node.name, (node.incarnation, 0))
        if incarnation != node.incarnation:
            n = 0  # restarted, perhaps without its disk: look again from window 1
        while n < head.window and node.disk.has_record(chain_key(n + 1)):
            n += 1
        self.held[node.name] = (node.incarnation, n)
        if n < head.window:
            self._fail(sim, "contiguous-chain", f"{node.name} promoted window {head.window} without window {n + 1} "
                                                "in its store")

    def _check_prefix(self, sim: Simulation, head: Head, hid: bytes) -> None:
        verdict = self.verdicts["prefix-consistent"]
        verdict.checked += 1
        expected = self.genesis_id(sim) if head.window == 1 else self.final_ids.get(head.window - 1)
        if expected is not None and head.parent != expected:
            self._fail(sim, "prefix-consistent", f"window {head.window}: parent {head.parent!r:.20} is not the "
                                                 f"final head of window {head.window - 1}")
        child = self.final.get(head.window + 1)
        if child is not None and child.parent != hid:
            self._fail(sim, "prefix-consistent", f"window {head.window + 1} does not extend window {head.window}")

    def genesis_id(self, sim: Simulation) -> bytes:
        if self._genesis_id is None:
            self._genesis_id = sim.revision.genesis().id
        return self._genesis_id

    def _parent_head(self, sim: Simulation, head: Head) -> tuple[Head, bytes] | None:
        if head.window == 1:
            return sim.revision.genesis(), self.genesis_id(sim)
        parent = self.final.get(head.window - 1)
        pid = self.final_ids.get(head.window - 1)
        return (parent, pid) if parent is not None and pid is not None and pid == head.parent else None

    def _check_roster(self, sim: Simulation, parent: Head, head: Head) -> None:
        """The roster shrinks by exactly the head's `left` and `expired` (peers of the parent's roster),
        and the peers it keeps keep their capacity (spec/protocol.md §5)."""
        verdict = self.verdicts["roster-changes"]
        verdict.checked += 1
        before, after = dict(parent.roster), dict(head.roster)
        gone = set(head.left) | set(head.expired)
        if not gone <= set(before):
            self._fail(sim, "roster-changes", f"window {head.window}: left/expired names a peer not in the "
                                              "parent's roster")
        elif set(before) - set(after) != gone:
            self._fail(sim, "roster-changes", f"window {head.window}: the roster dropped "
                                              f"{len(set(before) - set(after))} peer(s) but left/expired name "
                                              f"{len(gone)}")
        elif any(after[p] != c for p, c in before.items() if p in after):
            self._fail(sim, "roster-changes", f"window {head.window}: a kept peer's capacity changed")
        if head.left:
            self.left_seen.update(head.left)
        if head.expired:
            self.expired_seen.update(head.expired)

    def _check_cohort(self, sim: Simulation, head: Head, hid: bytes) -> None:
        if hid in self.checked_cohorts:
            return
        found = self._parent_head(sim, head)
        if found is None:
            return  # checked when the parent is known (a node jumped ahead); re-tried below
        parent, pid = found
        self.checked_cohorts.add(hid)
        self._check_roster(sim, parent, head)
        if head.quarantine or parent.quarantine:
            self.quarantine_seen = True
        # With overlapped windows the leases come from an older head, and an update's base may be one of the
        # heads up to `overlap` windows before its parent (spec/protocol.md §5.2).
        lease_w = lease_window(head.window, sim.manifest)
        lease_head = parent if lease_w == parent.window else \
            (sim.revision.genesis() if lease_w == 0 else self.final.get(lease_w))
        if lease_head is None:
            self.checked_cohorts.discard(hid)
            return
        leases = sim.leases(lease_head, head.window)
        self._check_under_attack(sim, head, leases)
        claims = claims_of(parent, sim.manifest)
        bases = {pid} | {self.genesis_id(sim) if w == 0 else self.final_ids.get(w)
                         for w in range(max(0, head.window - 1 - sim.manifest.overlap), head.window - 1)}
        quarantined: set[PeerId] = set(parent.quarantined)
        lease_v, quar_v = self.verdicts["valid-leases"], self.verdicts["no-quarantined-cohort"]
        for peer in leases:
            quar_v.checked += 1
            if peer in quarantined:
                self._fail(sim, "no-quarantined-cohort", f"window {head.window}: quarantined {peer} holds a lease")
        for update_id in head.cohort:
            lease_v.checked += 1
            known = sim.updates.get(update_id)
            if known is None:
                self._fail(sim, "valid-leases", f"window {head.window}: cohort update {update_id.hex()[:16]} was "
                                                "never announced")
                continue
            signer, ann = known
            if signer in quarantined:
                self._fail(sim, "no-quarantined-cohort", f"window {head.window}: update of quarantined {signer}")
            claim = getattr(ann, "claim", None)
            lease = leases.get(signer) if claim is None else claims.get(signer, {}).get(claim)
            if ann.window != head.window or ann.base not in bases or lease is None or not set(ann.shards) <= set(lease):
                self._fail(sim, "valid-leases", f"window {head.window}: update {update_id.hex()[:16]} of {signer} "
                                                f"for shards {list(ann.shards)} has no valid lease")
        child = self.final.get(head.window + 1)
        if child is not None:
            self._check_cohort(sim, child, self.final_ids[head.window + 1])

    def _check_under_attack(self, sim: Simulation, head: Head, leases: dict[PeerId, tuple[int, ...]]) -> None:
        if self.max_skipped_run is not None:
            verdict = self.verdicts["certified-often"]
            verdict.checked += 1
            run = 0
            while head.window - run in self.final and self.final[head.window - run].skipped:
                run += 1
            if run > self.max_skipped_run:
                self._fail(sim, "certified-often", f"windows {head.window - run + 1}..{head.window} all skipped "
                                                   f"(at most {self.max_skipped_run} in a row)")
        if self.honest_share is not None and leases:
            verdict = self.verdicts["honest-shards"]
            verdict.checked += 1
            total = sum(len(s) for s in leases.values())
            honest = sum(len(s) for p, s in leases.items() if p in sim.by_peer and sim.by_peer[p].honest)
            if honest < self.honest_share * total:
                self._fail(sim, "honest-shards", f"window {head.window}: honest trainers lease {honest} of {total} "
                                                 f"shards (need {self.honest_share:.0%})")

    def on_validator_message(self, sim: Simulation, node: SimNode, data: bytes) -> None:
        if not node.honest or b"signed" not in data[:16]:
            return
        try:
            message = decode_message(data, max_bytes=1 << 24)
        except DecodeError:
            return
        if not isinstance(message, Signed) or message.envelope.kind != VOTE_KIND:
            return
        envelope = message.envelope
        if envelope.signer != node.peer_id:
            return  # a relayed vote of someone else
        body = envelope.open(VOTE_KIND, PROTOCOL_VERSION)
        key = (node.name, body["window"], body["round"], body["step"])
        verdict = self.verdicts["no-double-vote"]
        if key not in self.votes:
            verdict.checked += 1
            self.votes[key] = body["head"]
        elif self.votes[key] != body["head"]:
            self._fail(sim, "no-double-vote", f"{node.name} signed two {body['step']}s for window {body['window']} "
                                              f"round {body['round']}")

    # --- liveness ----------------------------------------------------------------------------------

    def height(self) -> int:
        return max(self.final, default=0)

    def on_tick(self, sim: Simulation) -> None:
        if self.heal_at is None or self.bound_s is None or sim.now < self.heal_at:
            return
        if self.height_at_heal is None:
            self.height_at_heal = self.height()
        verdict = self.verdicts["liveness"]
        if verdict.ok and not verdict.checked and sim.now > self.heal_at + self.bound_s:
            verdict.checked = 1
            progressed = self.height() - self.height_at_heal
            if progressed < self.min_windows:
                self._fail(sim, "liveness", f"{progressed} window(s) certified within {self.bound_s} s after the "
                                            f"heal at {self.heal_at} s (need {self.min_windows})")

    def finish(self, sim: Simulation) -> None:
        """End of run: a liveness bound that the run did not reach is judged on what happened."""
        verdict = self.verdicts["liveness"]
        if self.heal_at is None or self.bound_s is None or verdict.checked or not verdict.ok:
            return
        if self.height_at_heal is None:
            self.height_at_heal = self.height()
        progressed = self.height() - self.height_at_heal
        if progressed >= self.min_windows:
            verdict.checked = 1
        elif sim.now >= self.heal_at + self.bound_s:
            self._fail(sim, "liveness", f"{progressed} window(s) certified after the heal (need {self.min_windows})")

"""Validator role: collect, screen, reduce, evaluate, vote, certify (spec/protocol.md §6-7).

A validator recomputes everything it votes on: it screens every delta itself, reduces the cohort in
canonical order, evaluates the result and only then signs a vote. Its vote for a window is persisted
before it is sent and it never signs a second, different head for a window it already voted in, even
after a crash (the vote record survives). A quorum of votes over one head id is a quorum certificate.

A window closes when every lease has reported or at its deadline (`window_s` after the window opened
here). With fewer than `min_updates` accepted updates the window is *skipped*, loudly: the certified
head says ``skipped`` and keeps its parent's params.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .collector import Collector
from .envelope import SignedEnvelope
from .errors import DecodeError, VerificationError
from .fsm import Table, step
from .identity import PeerId
from .messages import Signed
from .objects import (
    PROTOCOL_VERSION,
    VOTE_KIND,
    Head,
    JoinRequest,
    QuorumCertificate,
    ReductionProposal,
    sign_vote,
)

if TYPE_CHECKING:
    from .engine import Engine

TABLE: Table = {
    ("collecting", "close"): "reducing",
    ("collecting", "close-skip"): "voting",
    ("reducing", "reduced"): "evaluating",
    ("reducing", "reduce-failed"): "voting",
    ("evaluating", "evaluated"): "voting",
    ("evaluating", "evaluate-failed"): "voting",
    ("voting", "head"): "collecting",
    ("collecting", "head"): "collecting",
    ("reducing", "head"): "collecting",
    ("evaluating", "head"): "collecting",
}

VOTE_WINDOW_AHEAD = 2


def vote_key(window: int) -> str:
    return f"vote/{window}"


class ValidatorRole:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.state = "collecting"
        self.collector: Collector | None = None
        self.built: dict[bytes, Head] = {}
        self.votes: dict[int, dict[bytes, dict[PeerId, bytes]]] = {}
        self.vote_of: dict[tuple[int, PeerId], bytes] = {}
        self.joins: dict[PeerId, int] = {}
        self.proposals: dict[int, dict[PeerId, ReductionProposal]] = {}
        self.results: dict[int, tuple[tuple[bytes, ...], bytes]] = {}  # window -> own (cohort, digest)
        self.deadline_armed = False

    def _step(self, event: str) -> None:
        self.state = step("validator", TABLE, self.state, event)

    # --- window lifecycle ------------------------------------------------------------------------

    def on_head(self, head: Head) -> None:
        e = self.engine
        self._step("head")
        self.collector = Collector(e, head, self._maybe_close)
        self.deadline_armed = False
        window = self.collector.window
        self.built = {k: v for k, v in self.built.items() if v.window >= window}
        self.votes = {w: v for w, v in self.votes.items() if w >= window}
        self.proposals = {w: v for w, v in self.proposals.items() if w >= window}
        self.results = {w: v for w, v in self.results.items() if w >= window}
        e.log("window-open", window=window, leases=len(self.collector.leases))
        self._arm_deadline()
        old = e.records.get(vote_key(window))
        if old is not None:  # restarted after voting: stand by that vote, never sign another
            self.state = "voting"
            e.log("resume-vote", window=window)
            self._count_vote(SignedEnvelope.from_bytes(old), from_self=True)

    def _arm_deadline(self) -> None:
        """Start the window's clock once a trainer holding a lease is reachable; until then it waits.

        A window that no leaseholder can reach would only be skipped, so its deadline does not run.
        """
        e, c = self.engine, self.collector
        if c is None or self.state != "collecting" or self.deadline_armed:
            return
        if not set(c.leases) & set(e.peers_with("trainer")):
            e.log("window-waiting", window=c.window)
            return
        self.deadline_armed = True
        e.set_timer(("close", "validator", c.window), e.now + e.manifest.window_s)

    def _maybe_close(self) -> None:
        c = self.collector
        if c is not None and self.state == "collecting" and c.complete():
            self._close()

    def on_timer(self, key: tuple[Any, ...]) -> None:
        c = self.collector
        if key[:2] == ("close", "validator") and c is not None and key[2] == c.window and \
                self.state == "collecting":
            self.engine.log("window-deadline", window=c.window, reported=len(c.entries), leases=len(c.leases))
            self._close()

    def _close(self) -> None:
        e, c = self.engine, self.collector
        assert c is not None
        c.closed = True
        e.cancel_timer(("close", "validator", c.window))
        cohort = c.cohort()
        if len(cohort) < e.manifest.min_updates:
            self._step("close-skip")
            e.log("window-skipped", window=c.window, accepted=len(cohort), needed=e.manifest.min_updates)
            self._vote(self._skip_head(c))
            return
        self._step("close")
        window = c.window
        args = {"params": c.head.params, "deltas": tuple(x.announcement.delta for x in cohort),
                "weights": c.weights(cohort), "rule": e.manifest.aggregation,
                "outer_optimizer": e.manifest.outer_optimizer, "outer_lr": e.manifest.outer_lr}
        e.run_task("reduce", args, lambda r: self._reduced(window, cohort, r),
                   lambda why: self._reduce_failed(window, why))

    def _skip_head(self, c: Collector) -> Head:
        h = c.head
        return Head(revision=h.revision, parent=h.id, window=c.window, skipped=True, params=h.params,
                    params_digest=h.params_digest, cohort=(), roster=self._next_roster(h),
                    quarantine=h.quarantine, metrics=h.metrics)

    def _reduce_failed(self, window: int, reason: str) -> None:
        c = self.collector
        if c is not None and c.window == window and self.state == "reducing":
            self._step("reduce-failed")
            self._vote(self._skip_head(c))

    def _reduced(self, window: int, cohort: list[Any], result: dict[str, Any]) -> None:
        e, c = self.engine, self.collector
        e.note_stored(result["params"])
        if c is None or c.window != window or self.state != "reducing":
            return
        self._step("reduced")
        ids = tuple(x.envelope.id for x in cohort)
        self._check_proposals(window, ids, result["params_digest"])
        train_loss = sum(x.announcement.train_loss for x in cohort) / len(cohort)

        def evaluated(metrics: dict[str, Any]) -> None:
            if c is not self.collector or self.state != "evaluating":
                return
            self._step("evaluated")
            self._vote(Head(
                revision=e.revision.id, parent=c.head.id, window=window, skipped=False, params=result["params"],
                params_digest=result["params_digest"], cohort=ids, roster=self._next_roster(c.head),
                quarantine=c.head.quarantine,
                metrics={"test_loss": float(metrics["loss"]), "test_accuracy": float(metrics["accuracy"]),
                         "train_loss": float(train_loss)}))

        def evaluate_failed(reason: str) -> None:
            if c is self.collector and self.state == "evaluating":
                self._step("evaluate-failed")
                self._vote(self._skip_head(c))

        e.run_task("evaluate", {"params": result["params"]}, evaluated, evaluate_failed)

    def _check_proposals(self, window: int, ids: tuple[bytes, ...], digest: bytes) -> None:
        self.results[window] = (ids, digest)
        for reducer, proposal in self.proposals.get(window, {}).items():
            self._compare(reducer, proposal)

    def _compare(self, reducer: PeerId, proposal: ReductionProposal) -> None:
        """Once both our own result and a reducer's proposal for a window exist, judge the proposal."""
        e = self.engine
        own = self.results.get(proposal.window)
        if own is None:
            return
        if (proposal.cohort, proposal.params_digest) == own:
            e.stats["proposals_confirmed"] += 1
            e.log("proposal-confirmed", window=proposal.window, reducer=str(reducer))
        else:
            e.reject(reducer, "proposal-mismatch", f"window {proposal.window}")

    def _next_roster(self, head: Head) -> tuple[tuple[PeerId, int], ...]:
        roster = dict(head.roster)
        quarantined = set(head.quarantine)
        for peer, capacity in self.joins.items():
            if peer not in quarantined:
                roster[peer] = min(capacity, self.engine.manifest.max_capacity)
        self.joins.clear()
        return tuple(sorted(roster.items()))

    # --- voting ----------------------------------------------------------------------------------

    def _vote(self, head: Head) -> None:
        e = self.engine
        key = vote_key(head.window)
        if key in e.records:
            e.log("double-vote-refused", window=head.window)
            return
        self.built[head.id] = head
        vote = sign_vote(e.identity, e.revision.id, head.window, head.id)

        def cast() -> None:
            e.stats["votes_cast"] += 1
            e.log("vote", window=head.window, head=head.id.hex())
            e.broadcast(Signed(envelope=vote), roles=("validator",))
            self._count_vote(vote, from_self=True)

        e.persist_then(key, vote.to_bytes(), cast)

    def _count_vote(self, vote: SignedEnvelope, *, from_self: bool = False, sender: PeerId | None = None) -> None:
        e = self.engine
        body = vote.open(VOTE_KIND, PROTOCOL_VERSION)
        if set(body) != {"revision", "window", "head"}:
            raise DecodeError("bad-fields", "vote")
        window, head_id = body["window"], body["head"]
        if body["revision"] != e.revision.id:
            raise VerificationError("wrong-revision", "vote")
        if vote.signer not in e.manifest.validators:
            raise VerificationError("not-a-validator", str(vote.signer))
        if not isinstance(window, int) or not isinstance(head_id, bytes):
            raise DecodeError("bad-field", "vote")
        if not e.head.window < window <= e.head.window + VOTE_WINDOW_AHEAD:
            return  # old, or too far ahead to hold
        previous = self.vote_of.get((window, vote.signer))
        if previous is not None and previous != head_id:
            e.stats["equivocations"] += 1
            e.reject(sender, "equivocation", str(vote.signer))
            return
        self.vote_of[(window, vote.signer)] = head_id
        self.votes.setdefault(window, {}).setdefault(head_id, {})[vote.signer] = vote.signature
        self._maybe_certify(window, head_id)

    def _maybe_certify(self, window: int, head_id: bytes) -> None:
        e = self.engine
        head = self.built.get(head_id)
        signatures = self.votes.get(window, {}).get(head_id, {})
        if head is None or len(signatures) < e.manifest.quorum:
            return
        cert = QuorumCertificate.from_votes(head_id, window, signatures)
        e.verify_certified(head, cert)
        e.adopt(head, cert)

    # --- messages --------------------------------------------------------------------------------

    def on_signed(self, peer: PeerId, envelope: SignedEnvelope) -> None:
        e = self.engine
        if envelope.kind == "update":
            if self.collector is not None:
                self.collector.offer(peer, envelope)
        elif envelope.kind == VOTE_KIND:
            self._count_vote(envelope, sender=peer)
        elif envelope.kind == JoinRequest.KIND:
            join = JoinRequest.from_cbor(envelope.open(JoinRequest.KIND, PROTOCOL_VERSION))
            if join.revision != e.revision.id:
                raise VerificationError("wrong-revision", "join")
            if envelope.signer not in self.joins:
                e.log("join", peer=str(envelope.signer), capacity=join.capacity)
            self.joins[envelope.signer] = max(1, join.capacity)
        elif envelope.kind == ReductionProposal.KIND:
            proposal = ReductionProposal.from_cbor(envelope.open(ReductionProposal.KIND, PROTOCOL_VERSION))
            if proposal.revision != e.revision.id:
                raise VerificationError("wrong-revision", "proposal")
            known = self.proposals.setdefault(proposal.window, {})
            if e.head.window < proposal.window <= e.head.window + VOTE_WINDOW_AHEAD and envelope.signer not in known:
                known[envelope.signer] = proposal
                self._compare(envelope.signer, proposal)
        else:
            e.reject(peer, "unexpected-envelope", envelope.kind)

    def on_peer_ready(self, peer: PeerId, roles: tuple[str, ...]) -> None:
        if "trainer" in roles:
            self._arm_deadline()

    def on_head_source(self, peer: PeerId, head: Head) -> None:
        pass

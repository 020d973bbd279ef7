"""Head agreement for one window: Tendermint (Buchman, Kwon, Milosevic, "The latest gossip on BFT
consensus", arXiv:1807.04938, Algorithm 1), one height per window (spec/agreement.md).

Safe with f < n/3 Byzantine validators under arbitrary message delay (never two certified heads for one
window), live once messages arrive within the timeouts. A quorum is the manifest's `quorum` (3q > 2n);
the round-skip threshold is f + 1 = n - q + 1.

This module holds the protocol's rules only. Its host (the validator role) decides validity of a head
by recomputing it, signs and persists votes before sending them, and broadcasts proposals. Step
transitions:
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .envelope import SignedEnvelope
from .fsm import Table, step
from .identity import PeerId
from .objects import PRECOMMIT, PREVOTE, Head

TABLE: Table = {
    ("propose", "prevote-cast"): "prevote",
    ("prevote", "precommit-cast"): "precommit",
    ("propose", "new-round"): "propose",
    ("prevote", "new-round"): "propose",
    ("precommit", "new-round"): "propose",
    ("propose", "decide"): "decided",
    ("prevote", "decide"): "decided",
    ("precommit", "decide"): "decided",
}


class AgreementHost(Protocol):
    """What the agreement needs from the validator that runs it."""

    def proposer(self, round_: int) -> PeerId: ...
    def own_value(self) -> tuple[Head, tuple[SignedEnvelope, ...]] | None: ...
    def validity(self, head: Head, updates: tuple[SignedEnvelope, ...]) -> bool | None: ...
    def cast(self, vote_step: str, round_: int, head_id: bytes | None) -> None: ...
    def propose(self, round_: int, head: Head, updates: tuple[SignedEnvelope, ...],
                valid_round: int | None) -> None: ...
    def schedule(self, timeout: str, round_: int, delay_s: float) -> None: ...
    def decide(self, head: Head, round_: int, precommits: dict[PeerId, bytes]) -> None: ...


class WindowAgreement:
    """Tendermint state for one window. Feed it proposals, votes and timeouts; it calls back its host."""

    def __init__(self, host: AgreementHost, me: PeerId, validators: Sequence[PeerId], quorum: int, *,
                 timeout_s: float, first_propose_extra_s: float) -> None:
        self.host = host
        self.me = me
        self.validators = frozenset(validators)
        self.quorum = quorum
        self.skip_threshold = len(self.validators) - quorum + 1  # f + 1
        self.timeout_s = timeout_s
        self.first_propose_extra_s = first_propose_extra_s
        self.round = -1
        self.step = "propose"
        self.locked: tuple[Head, tuple[SignedEnvelope, ...]] | None = None
        self.locked_round = -1
        self.valid: tuple[Head, tuple[SignedEnvelope, ...]] | None = None
        self.valid_round = -1
        self.decided = False
        # The first proposal of each round decides this validator's prevote (lines 22-33); every proposal
        # of the round (an equivocating proposer may send several) can be the one a quorum prevotes or
        # precommits, which the polka and decide rules need in hand (lines 36-43, 49-54).
        self.proposals: dict[int, tuple[Head, tuple[SignedEnvelope, ...], int | None]] = {}
        self.candidates: dict[int, dict[bytes, tuple[Head, tuple[SignedEnvelope, ...]]]] = {}
        # Votes per round and signer. An honest validator signs one vote per (round, step); an equivocator's
        # votes all count, each for its own value (see on_vote).
        self.prevotes: dict[int, dict[PeerId, set[bytes | None]]] = {}
        self.precommits: dict[int, dict[PeerId, dict[bytes | None, bytes]]] = {}
        self.seen: dict[int, set[PeerId]] = {}
        self._once: set[tuple[str, int]] = set()
        self._proposed: set[int] = set()
        self._busy = False
        self._again = False

    def _step(self, event: str) -> None:
        self.step = step("agreement", TABLE, self.step, event)

    # --- inputs ----------------------------------------------------------------------------------

    def start(self, round_: int = 0) -> None:
        self._start_round(round_)
        self.progress()

    def first_proposal_due(self, delay_s: float) -> None:
        """Round 0 still waits for its proposal: arm its propose timeout again, `delay_s` from now. The host
        calls it when its window's collection closes (spec/agreement.md §4): before that no proposal of
        this window can be checked here, so a timeout counted from the window's opening would prevote nil
        on a collection that merely ran long."""
        if self.round == 0 and self.step == "propose" and not self.decided:
            self.host.schedule("propose", 0, delay_s)

    def on_proposal(self, round_: int, head: Head, updates: tuple[SignedEnvelope, ...],
                    valid_round: int | None, proposer: PeerId) -> None:
        """A proposal already checked to come from `proposer(round_)`. The first one per round decides
        our prevote; every one is kept for the polka and decide rules (the host bounds how many)."""
        self.proposals.setdefault(round_, (head, updates, valid_round))
        self.candidates.setdefault(round_, {}).setdefault(head.id, (head, updates))
        self.seen.setdefault(round_, set()).add(proposer)
        self.progress()

    def on_vote(self, signer: PeerId, vote_step: str, round_: int, head_id: bytes | None, signature: bytes) -> None:
        """A verified vote of a validator. Conflicting votes of one signer (equivocation: evidence is the
        host's business) each count for their own value: a Byzantine validator could have shown either
        vote to any honest one, so counting both is no weaker than the protocol already assumes, and it
        lets every honest validator see the polka that others saw (liveness, Tendermint's gossip)."""
        if vote_step == PREVOTE:
            self.prevotes.setdefault(round_, {}).setdefault(signer, set()).add(head_id)
        else:
            self.precommits.setdefault(round_, {}).setdefault(signer, {}).setdefault(head_id, signature)
        self.seen.setdefault(round_, set()).add(signer)
        self.progress()

    def on_timeout(self, timeout: str, round_: int) -> None:
        if self.decided or round_ != self.round:
            return
        if timeout == "propose" and self.step == "propose":
            self._cast(PREVOTE, None)
        elif timeout == "prevote" and self.step == "prevote":
            self._cast(PRECOMMIT, None)
        elif timeout == "precommit":
            self._start_round(round_ + 1)
        self.progress()

    # --- the upon-rules of Algorithm 1 -----------------------------------------------------------

    def progress(self) -> None:
        """Apply every rule whose condition holds now; call again after any new input or verdict.

        Re-entrant calls (a verdict reached synchronously while a rule asks the host for validity) only
        mark that another pass is due: the rules never run nested, so no step is taken twice.
        """
        if self._busy:
            self._again = True
            return
        self._busy = True
        try:
            changed = True
            while (changed or self._again) and not self.decided:
                self._again = False
                changed = self._rules()
        finally:
            self._busy = False

    def _count(self, votes: dict[PeerId, set[bytes | None]], head_id: bytes | None) -> int:
        return sum(1 for v in votes.values() if head_id in v)

    def _rules(self) -> bool:
        r = self.round
        # Decide in any round: a proposal v and a quorum of precommits for id(v) (lines 49-54).
        for round_, candidates in sorted(self.candidates.items()):
            for head, updates in candidates.values():
                commits = {p: votes[head.id] for p, votes in self.precommits.get(round_, {}).items()
                           if head.id in votes}
                if len(commits) >= self.quorum and self.host.validity(head, updates):
                    self._step("decide")
                    self.decided = True
                    self.host.decide(head, round_, commits)
                    return False
        # Skip ahead: f + 1 validators are at a higher round (lines 55-56).
        for round_ in sorted(self.seen):
            if round_ > r and len(self.seen[round_]) >= self.skip_threshold:
                self._start_round(round_)
                return True
        # As proposer, propose once the value is ready (lines 14-19).
        if self.host.proposer(r) == self.me and r not in self._proposed:
            value = self.valid or self.host.own_value()
            if value is not None:
                self._proposed.add(r)
                self.host.propose(r, value[0], value[1], self.valid_round if self.valid else None)
        proposal = self.proposals.get(r)
        prevotes = self.prevotes.get(r, {})
        if self.step == "propose" and proposal is not None:
            head, updates, vr = proposal
            if vr is None:  # lines 22-27
                verdict = self.host.validity(head, updates)
                if verdict is None:
                    return False
                ok = verdict and (self.locked_round == -1 or (self.locked is not None and self.locked[0].id == head.id))
                self._cast(PREVOTE, head.id if ok else None)
                return True
            if vr < r and self._count(self.prevotes.get(vr, {}), head.id) >= self.quorum:  # lines 28-33
                verdict = self.host.validity(head, updates)
                if verdict is None:
                    return False
                ok = verdict and (self.locked_round <= vr or (self.locked is not None and self.locked[0].id == head.id))
                self._cast(PREVOTE, head.id if ok else None)
                return True
        if self.step == "prevote" and len(prevotes) >= self.quorum and ("prevote", r) not in self._once:
            self._once.add(("prevote", r))  # lines 34-35
            self.host.schedule("prevote", r, self._delay(r))
        if self.step in ("prevote", "precommit") and ("polka", r) not in self._once:
            for head, updates in self.candidates.get(r, {}).values():  # lines 36-43
                if self._count(prevotes, head.id) >= self.quorum and self.host.validity(head, updates):
                    self._once.add(("polka", r))
                    self.valid, self.valid_round = (head, updates), r
                    if self.step == "prevote":
                        self.locked, self.locked_round = (head, updates), r
                        self._cast(PRECOMMIT, head.id)
                    return True
        if self.step == "prevote" and self._count(prevotes, None) >= self.quorum:  # lines 44-46
            self._cast(PRECOMMIT, None)
            return True
        if len(self.precommits.get(r, {})) >= self.quorum and ("precommit", r) not in self._once:
            self._once.add(("precommit", r))  # lines 47-48
            self.host.schedule("precommit", r, self._delay(r))
        return False

    # --- helpers ---------------------------------------------------------------------------------

    def _delay(self, round_: int) -> float:
        return self.timeout_s * (1 + round_)

    def _start_round(self, round_: int) -> None:
        self.round = round_
        self._step("new-round")
        extra = self.first_propose_extra_s if round_ == 0 else 0.0
        self.host.schedule("propose", round_, extra + self._delay(round_))

    def _cast(self, vote_step: str, head_id: bytes | None) -> None:
        self._step("prevote-cast" if vote_step == PREVOTE else "precommit-cast")
        self.host.cast(vote_step, self.round, head_id)

    def restore(self, round_: int, vote_step: str | None, locked: tuple[Head, tuple[SignedEnvelope, ...]] | None,
                locked_round: int) -> None:
        """Resume after a restart from persisted votes: never sign anything that contradicts them."""
        self.round = round_
        self.step = {None: "propose", PREVOTE: "prevote", PRECOMMIT: "precommit"}[vote_step]
        self.locked, self.locked_round = locked, locked_round
        if locked is not None:
            self.valid, self.valid_round = locked, locked_round
        self.host.schedule("propose" if vote_step is None else vote_step, round_, self._delay(round_))

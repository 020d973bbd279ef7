"""The validator's side of head agreement (spec/agreement.md): `core/agreement.py` holds the Tendermint
rules; this module signs, persists and sends what they decide, and takes the votes of others.

Every vote - and the lock that a non-nil precommit implies - is persisted before it is sent, and after a
restart the validator resumes from those records (`restore`), so it never signs two different votes for
one (window, round, step). A second vote of a signer for the same (window, round, step) is equivocation:
charged, and kept as transferable evidence that the next head this validator proposes records.

Writes waiting for durability are plain records (`SendVote`, `PersistVote`, `SendProposal`) held in
`Voting.writes` (the engine holds a `VotingWrite` naming one) and resumed by `resume` once the engine reports
them persisted.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs

from .encoding import decode, encode
from .envelope import MAX_BODY_BYTES, SignedEnvelope
from .errors import VerificationError
from .identity import PeerId
from .messages import Signed
from .objects import (
    PRECOMMIT,
    PREVOTE,
    PROTOCOL_VERSION,
    VOTE_KIND,
    Head,
    HeadProposal,
    QuorumCertificate,
    Vote,
    decode_as,
    seal,
    sign_vote,
)
from .quarantine import make_evidence
from .records import LockRecord, ProposalRecord, Record, VoteRecord, parse
from .records import lock_key as lock_key
from .records import proposal_key as proposal_key
from .records import vote_key as vote_key
from .services import (
    Broadcasts,
    HasConfig,
    HasIdentity,
    HasManifest,
    HasMe,
    HasRecords,
    HasRevision,
    HasStats,
    Logs,
    Persists,
    Rejects,
    Sends,
)
from .validating import ValidatorParts

VoteKey = tuple[int, int, str, PeerId]  # (window, round, step, signer)


@attrs.frozen(kw_only=True)
class SendVote:
    """Once the vote record `key` is durable: make it visible, send it, count it as our own vote."""
    key: str
    vote: SignedEnvelope
    window: int
    round: int
    step: str
    head_id: bytes | None


@attrs.frozen(kw_only=True)
class PersistVote:
    """Once the lock record is durable: persist the vote (then `SendVote`)."""
    send: SendVote


@attrs.frozen(kw_only=True)
class SendProposal:
    """Once the proposal record `key` is durable: make it visible, send it, take it as our own."""
    key: str
    envelope: SignedEnvelope
    window: int
    round: int
    head: Head


PendingWrite = SendVote | PersistVote | SendProposal


@attrs.frozen(kw_only=True)
class VotingWrite:
    """What the engine holds for a write of ours being persisted: its next step is `Voting.writes[seq]`."""

    seq: int


class VotingServices(HasConfig, HasIdentity, HasMe, HasRevision, HasManifest, HasStats, HasRecords, Logs, Sends,
                     Broadcasts, Persists, Rejects, Protocol):
    """What `Voting` uses of the engine (core/engine.py implements it)."""

    def verify_certified(self, head: Head, cert: QuorumCertificate) -> None: ...
    def adopt(self, head: Head, cert: QuorumCertificate) -> None: ...


class Voting:
    """Votes and proposals of the window being collected by `role`.

    `vote_of`: (window, round, step, signer) -> the head id voted (None: nil); `vote_envelopes`: the same
    key -> the signed vote; `extra_votes`: equivocators' other votes; `visible`: record keys of this
    window's votes and proposals already sent; `evidence`: equivocation evidence per signer, until a
    certified head quarantines it (in the engine snapshot); `writes`: what to do once each record being
    persisted is durable, by a local sequence number.
    """

    def __init__(self, role: ValidatorParts, engine: VotingServices) -> None:
        self.role = role
        self.engine = engine
        self.vote_of: dict[VoteKey, bytes | None] = {}
        self.vote_envelopes: dict[VoteKey, SignedEnvelope] = {}
        self.extra_votes: set[tuple[VoteKey, bytes | None]] = set()
        self.visible: set[str] = set()
        self.evidence: dict[PeerId, tuple[SignedEnvelope, SignedEnvelope]] = {}
        self.writes: dict[int, PendingWrite] = {}
        self._seq = 0

    def open(self, head: Head) -> None:
        """The window after `head` opens: forget older votes and the evidence `head` recorded."""
        window = head.window + 1
        self.evidence = {p: x for p, x in self.evidence.items() if p not in head.quarantined}
        self.vote_envelopes = {k: v for k, v in self.vote_envelopes.items() if k[0] >= window}
        self.vote_of = {k: v for k, v in self.vote_of.items() if k[0] >= window}
        self.extra_votes = {x for x in self.extra_votes if x[0][0] >= window}
        self.visible = set()

    def pending_evidence(self, parent: Head) -> tuple[tuple[SignedEnvelope, SignedEnvelope], ...]:
        """Evidence the head after `parent` records: of signers `parent` does not quarantine, by signer."""
        quarantined = parent.quarantined
        return tuple(x for p, x in sorted(self.evidence.items()) if p not in quarantined)

    def restore(self, window: int) -> bool:
        """After a restart, resume the agreement from this window's persisted votes. True if any."""
        e, role = self.engine, self.role
        cast = [(r.round, r.step) for key, data in e.records.items()
                if isinstance(r := parse(key, data), VoteRecord) and r.window == window]
        if not cast:
            return False
        round_ = max(r for r, _ in cast)
        steps = {s for r, s in cast if r == round_}
        locked, locked_round = None, -1
        if lock_key(window) in e.records:
            record = decode(e.records[lock_key(window)], max_bytes=e.config.max_message_bytes)
            proposal = HeadProposal.from_cbor(record["proposal"])
            locked, locked_round = (proposal.head, proposal.updates + proposal.rejected), record["round"]
            role.screening.verdicts[proposal.head.id] = True  # we checked it before we locked on it
        assert role.agreement is not None
        role.agreement.restore(round_, PRECOMMIT if PRECOMMIT in steps else PREVOTE, locked, locked_round)
        e.log("resume-agreement", window=window, round=round_)
        ours = (vote_key(window, r, s) for r, s in cast)
        for key in sorted(ours):  # re-announce what we signed
            self.visible.add(key)
            envelope = SignedEnvelope.from_bytes(e.records[key])
            e.broadcast(Signed(envelope=envelope), roles=("validator",))
            self.on_vote(e.me, envelope, decode_as(envelope, Vote))
        return True

    def resend(self, peer: PeerId) -> None:
        """A validator (re)connected: send it what we signed and sent this window (nothing new is signed)."""
        e = self.engine
        for key in sorted(self.visible):  # only what is durable and was already sent once
            e.send(peer, Signed(envelope=SignedEnvelope.from_bytes(e.records[key])))

    # --- our votes and proposals -------------------------------------------------------------------

    def cast(self, vote_step: str, round_: int, head_id: bytes | None) -> None:
        """Sign, persist (after the lock, for a non-nil precommit) and then send our vote."""
        e, window = self.engine, self.role.window
        key = vote_key(window, round_, vote_step)
        if key in e.records:  # restarted: stand by what we signed, never sign anything else
            e.log("double-vote-refused", window=window, round=round_, step=vote_step)
            return
        vote = sign_vote(e.identity, e.revision.id, window, round_, vote_step, head_id)
        send = SendVote(key=key, vote=vote, window=window, round=round_, step=vote_step, head_id=head_id)
        agreement = self.role.agreement
        locked = agreement.locked if agreement is not None else None
        if vote_step == PRECOMMIT and head_id is not None and locked is not None:
            # The lock record keeps every envelope, whatever the size: a restart re-checks nothing from it.
            proposal = self.head_proposal(window, round_, None, locked[0], locked[1], carry=True)
            self._persist(LockRecord(window=window, data=encode({"round": round_, "proposal": proposal.to_cbor()})),
                          PersistVote(send=send))
        else:
            self.resume(PersistVote(send=send))

    def propose(self, round_: int, head: Head, updates: tuple[SignedEnvelope, ...], valid_round: int | None) -> None:
        """Sign (or, restarted, reuse) our proposal of `head` for `round_`, persist it, then send it."""
        e, window = self.engine, self.role.window
        key = proposal_key(window, round_)
        if key in e.records:
            self.resume(SendProposal(key=key, envelope=SignedEnvelope.from_bytes(e.records[key]), window=window,
                                     round=round_, head=head))
            return
        envelope = seal(e.identity, self.head_proposal(window, round_, valid_round, head, updates))
        if len(envelope.body) > MAX_BODY_BYTES:  # even by id (a huge roster): nobody could open it
            e.log("proposal-too-large", window=window, round=round_, bytes=len(envelope.body))
            return  # the round times out as a silent proposer's would
        self._persist(ProposalRecord(window=window, round=round_, data=envelope.to_bytes()),
                      SendProposal(key=key, envelope=envelope, window=window,
                                                             round=round_, head=head))

    def _persist(self, record: Record, then: PendingWrite) -> None:
        """Persist `record`; `then` is resumed once it is durable."""
        self._seq += 1
        self.writes[self._seq] = then
        self.engine.persist_then(record, "validator", VotingWrite(seq=self._seq))

    def durable(self, seq: int) -> None:
        """The write `seq` (`writes[seq]`) is durable: carry out its next step."""
        self.resume(self.writes.pop(seq))

    def resume(self, pending: PendingWrite) -> None:
        """Carry out a write's next step once what it waited for is durable."""
        e = self.engine
        match pending:
            case PersistVote(send=send):
                self._persist(VoteRecord(window=send.window, round=send.round, step=send.step,
                                         data=send.vote.to_bytes()), send)
            case SendVote():
                self.visible.add(pending.key)
                e.stats["votes_cast"] += 1
                e.stats[f"votes_{pending.step}"] += 1  # per step, for hosts' metrics (adapters/metrics.py)
                e.log("vote", window=pending.window, round=pending.round, step=pending.step,
                      head=pending.head_id.hex() if pending.head_id else None)
                e.broadcast(Signed(envelope=pending.vote), roles=("validator",))
                self.on_vote(e.me, pending.vote, decode_as(pending.vote, Vote))
            case SendProposal():
                self.visible.add(pending.key)
                e.log("head-proposal", window=pending.window, round=pending.round, head=pending.head.id.hex(),
                      skipped=pending.head.skipped)
                e.broadcast(Signed(envelope=pending.envelope), roles=("validator",))
                self.role.proposals.on_proposal(e.me, pending.envelope, decode_as(pending.envelope, HeadProposal))

    def head_proposal(self, window: int, round_: int, valid_round: int | None, head: Head,
                      updates: tuple[SignedEnvelope, ...], *, carry: bool | None = None) -> HeadProposal:
        """The proposal of `head`. It carries the named announcements when `carry`, or (None) while they
        and the head fit in `proposal_carry_bytes`; otherwise it names them by id only, through the head's
        `cohort` and `rejected` (spec/agreement.md §3)."""
        if carry is None:
            size = len(head.to_bytes()) + sum(len(u.to_bytes()) for u in updates)
            # Never past what an envelope body may hold, whatever the setting (4 KiB for the other fields).
            carry = size <= min(self.engine.config.proposal_carry_bytes, MAX_BODY_BYTES - 4096)
        if not carry:
            updates = ()
        rejected = set(head.rejected)
        return HeadProposal(revision=self.engine.revision.id, window=window, round=round_, valid_round=valid_round,
                            head=head, updates=tuple(u for u in updates if u.id not in rejected),
                            rejected=tuple(u for u in updates if u.id in rejected))

    def decide(self, head: Head, round_: int, precommits: dict[PeerId, bytes]) -> None:
        """A quorum precommitted `head`: certify it and make it canonical here."""
        e = self.engine
        cert = QuorumCertificate.from_votes(head.id, head.window, round_, precommits)
        e.verify_certified(head, cert)
        e.log("decide", window=head.window, round=round_, head=head.id.hex())
        e.adopt(head, cert)

    # --- votes of others ---------------------------------------------------------------------------

    def on_vote(self, peer: PeerId, vote: SignedEnvelope, body: Vote) -> None:
        """A signed vote from `peer` (its signer or a relay; ourselves for our own), its body decoded
        (`core.bodies.decode_body`). Raises VerificationError for a bad one (charged to `peer`)."""
        e, role = self.engine, self.role
        vote.verify(VOTE_KIND, PROTOCOL_VERSION)
        window, round_, vote_step, head_id = body.window, body.round, body.step, body.head
        if body.revision != e.revision.id:
            raise VerificationError("wrong-revision", "vote")
        if vote.signer not in e.manifest.validators:
            raise VerificationError("not-a-validator", str(vote.signer))
        if role.hold(peer, vote, body):
            return
        assert window is not None  # `hold` consumed a vote for no window
        key = (window, round_, vote_step, vote.signer)
        if key in self.vote_of:
            if self.vote_of[key] == head_id:
                return  # a duplicate
            if (key, head_id) not in self.extra_votes:
                self.extra_votes.add((key, head_id))
                e.stats["equivocations"] += 1
                e.reject(vote.signer, "equivocation", f"{vote.signer} {vote_step} window {window} round {round_}")
                if vote.signer not in self.evidence and vote.signer != e.me:
                    # Transferable evidence: the next head this validator proposes quarantines the signer.
                    self.evidence[vote.signer] = make_evidence(self.vote_envelopes[key], vote)
                    e.log("evidence", validator=str(vote.signer), window=window, round=round_, step=vote_step)
                if peer == vote.signer:
                    e.broadcast(Signed(envelope=vote), roles=("validator",))
                assert role.agreement is not None
                role.agreement.on_vote(vote.signer, vote_step, round_, head_id, vote.signature)
            return
        self.vote_of[key] = head_id
        self.vote_envelopes[key] = vote
        if peer == vote.signer and peer != e.me:
            # Relay votes heard from their signer (Tendermint gossips votes): every honest validator sees
            # each vote that reached one of them, so a validator that signs different votes for different
            # recipients is caught with transferable evidence. One hop only: no loops.
            e.broadcast(Signed(envelope=vote), roles=("validator",))
        assert role.agreement is not None
        role.agreement.on_vote(vote.signer, vote_step, round_, head_id, vote.signature)

    def quorum_backs(self, head_id: bytes) -> bool:
        """A quorum of prevotes (or precommits) for `head_id` in some round of this window: at least f + 1
        honest validators found the head valid, its expiries included (spec/agreement.md §6)."""
        a = self.role.agreement
        if a is None:
            return False
        tallies: list[Any] = [*a.prevotes.values(), *a.precommits.values()]
        return any(sum(head_id in v for v in votes.values()) >= a.quorum for votes in tallies)

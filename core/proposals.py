"""Head proposals at a validator (spec/agreement.md §3): take each proposal once (relays dropped, one head
per round from each peer, the first relayed one hop), and when a proposal names its announcements by id
only, fetch the ones this validator lacks with `UpdatesRequest` - of the peer that gave it, then its
proposer, then the other validators - before it goes to the agreement. Also serves such requests.

Timer key: ``("updates", window, head id, attempt)``.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs

from .envelope import SignedEnvelope
from .errors import VerificationError
from .identity import PeerId
from .messages import MAX_UPDATE_IDS, Signed, UpdatesRequest
from .objects import PROTOCOL_VERSION, Head, HeadProposal
from .services import Broadcasts, FindsPeers, HasMe, HasNow, HasRevision, HasStats, Logs, Rejects, Sends, SetsTimers
from .validating import ValidatorParts

# Announcements a head proposal names by id: asked MAX_UPDATE_IDS at a time from one provider; a batch that
# is not complete after UPDATES_RETRY_S is asked of the next provider, and after UPDATES_ROUNDS passes over
# the providers the proposal is given up (its round then times out as without it).
UPDATES_RETRY_S = 1.0
UPDATES_ROUNDS = 2
# updates-get requests one peer may make of us per window: enough to fetch a whole cohort (MAX_COHORT ids)
# four times over, so an honest validator retrying never hits it.
MAX_UPDATES_REQUESTS = 512


@attrs.define
class Awaiting:
    """A head proposal whose named announcements are being fetched before it goes to the agreement."""

    rounds: list[HeadProposal]  # every proposal of this head taken while fetching (re-proposals in later rounds)
    signer: PeerId
    providers: list[PeerId]
    found: dict[bytes, SignedEnvelope]
    missing: list[bytes]  # named ids not found yet, in the order they are asked for
    asked: tuple[bytes, ...] = ()
    attempt: int = 0


class ProposalServices(HasMe, HasRevision, HasNow, HasStats, Logs, Sends, Broadcasts, FindsPeers, SetsTimers,
                       Rejects, Protocol):
    """What `ProposalTracker` uses of the engine (core/engine.py implements it)."""


class ProposalTracker:
    """The head proposals of the window being collected by `role`, and the announcements fetched for them.

    `proposals_in`: head ids proposed per (window, round), in arrival order (more than one: the proposer
    equivocates); `proposal_givers`: peers that gave a head, per (window, round); `proposal_envelopes`: ids
    of proposal envelopes taken; `proposal_signer`: head id -> its proposer; `awaiting`: proposals still
    fetching, by head id; `wanted`: update id -> heads waiting for it; `requested`: every update id asked
    for this window; `known_updates`: announcements carried by proposals or fetched this window;
    `updates_served`: updates-get requests served per peer this window.
    """

    def __init__(self, role: ValidatorParts, engine: ProposalServices) -> None:
        self.role = role
        self.engine = engine
        self.proposals_in: dict[tuple[int, int], list[bytes]] = {}
        self.proposal_givers: dict[tuple[int, int], set[PeerId]] = {}
        self.proposal_envelopes: set[bytes] = set()
        self.proposal_signer: dict[bytes, PeerId] = {}
        self.awaiting: dict[bytes, Awaiting] = {}
        self.wanted: dict[bytes, set[bytes]] = {}
        self.requested: set[bytes] = set()
        self.known_updates: dict[bytes, SignedEnvelope] = {}
        self.updates_served: dict[PeerId, int] = {}

    def open(self, window: int) -> None:
        """Window `window` opens: forget earlier windows' proposals and this one's fetches."""
        self.proposals_in = {k: v for k, v in self.proposals_in.items() if k[0] >= window}
        self.proposal_givers = {k: v for k, v in self.proposal_givers.items() if k[0] >= window}
        self.proposal_envelopes = set()
        self.awaiting, self.wanted, self.known_updates, self.updates_served = {}, {}, {}, {}
        self.requested = set()

    def proposer_of_head(self, head: Head) -> PeerId:
        """Who proposed `head` (charged for its bad updates); this validator for its own head."""
        return self.proposal_signer.get(head.id, self.engine.me)

    def on_proposal(self, peer: PeerId, envelope: SignedEnvelope, proposal: HeadProposal) -> None:
        """A signed head proposal from `peer` (its proposer or a relay), its body decoded
        (`core.bodies.decode_body`). Raises VerificationError for a bad one (charged to `peer`)."""
        e, role = self.engine, self.role
        if envelope.id in self.proposal_envelopes:
            return  # a relay of a proposal we already took
        envelope.verify(HeadProposal.KIND, PROTOCOL_VERSION)
        if proposal.revision != e.revision.id:
            raise VerificationError("wrong-revision", "head-proposal")
        if role.hold(peer, envelope, proposal):
            return
        if envelope.signer != role.proposer(proposal.round):
            e.reject(peer, "not-proposer", f"round {proposal.round}")
            return
        key = (proposal.window, proposal.round)
        heads = self.proposals_in.setdefault(key, [])
        if proposal.head.id in heads:
            return
        givers = self.proposal_givers.setdefault(key, set())
        if peer in givers:
            # One head per round from each peer: the proposer sent us two (equivocation), or a relayer
            # relayed more than the one it took first (honest ones never do).
            e.stats["equivocations"] += 1
            e.reject(peer, "proposal-equivocation", f"{envelope.signer} round {proposal.round}")
            return
        if heads:
            # The proposer showed others another head. Keep it: the polka and decide rules need in hand
            # whichever head a quorum votes for (spec/agreement.md §5).
            e.stats["equivocations"] += 1
            e.log("proposal-conflict", window=proposal.window, round=proposal.round, via=str(peer))
        givers.add(peer)
        heads.append(proposal.head.id)
        self.proposal_envelopes.add(envelope.id)
        self.proposal_signer.setdefault(proposal.head.id, envelope.signer)
        if len(heads) == 1 and peer == envelope.signer and peer != e.me:
            # Relay the proposal we take first (the one we prevote), one hop, like votes: a validator shown
            # another head by an equivocating proposer still gets the one a quorum prevotes (Tendermint
            # gossips proposals). Each peer gives at most one head per round, so at most one per validator
            # is kept.
            e.broadcast(Signed(envelope=envelope), roles=("validator",))
        carried = proposal.updates + proposal.rejected
        for u in carried:
            self.known_updates.setdefault(u.id, u)
        named = proposal.head.cohort + proposal.head.rejected
        if len(carried) == len(named) or not {u.id for u in carried} <= set(named):
            # Everything carried, or a carried envelope the head does not name: `validity` judges it as is.
            self._to_agreement(proposal, carried, envelope.signer)
            return
        found = {u.id: u for u in carried}
        for update_id in named:
            if update_id not in found and (known := self.known_update(update_id)) is not None:
                found[update_id] = known
        if len(found) == len(named):
            self._to_agreement(proposal, tuple(found[i] for i in named), envelope.signer)
            return
        self._fetch_named(peer, envelope.signer, proposal, found)

    def _to_agreement(self, proposal: HeadProposal, updates: tuple[SignedEnvelope, ...], signer: PeerId) -> None:
        agreement = self.role.agreement
        assert agreement is not None
        agreement.on_proposal(proposal.round, proposal.head, updates, proposal.valid_round, signer)

    def known_update(self, update_id: bytes) -> SignedEnvelope | None:
        """An announcement of this window we hold: taken by the collector, carried by a proposal, or fetched."""
        c = self.role.collector
        entry = c.by_id.get(update_id) if c is not None else None
        return entry.envelope if entry is not None else self.known_updates.get(update_id)

    def _fetch_named(self, giver: PeerId, signer: PeerId, proposal: HeadProposal,
                     found: dict[bytes, SignedEnvelope]) -> None:
        """Ask for the announcements `proposal` names and we lack - first of the peer that gave it, then its
        proposer, then the other validators - and hand it to the agreement once all are here."""
        e, head = self.engine, proposal.head
        if head.id in self.awaiting:
            self.awaiting[head.id].rounds.append(proposal)
            return
        providers = list(dict.fromkeys(p for p in (giver, signer, *sorted(e.peers_with("validator")))
                                       if p != e.me))
        missing = [i for i in head.cohort + head.rejected if i not in found]
        waiting = self.awaiting[head.id] = Awaiting(rounds=[proposal], signer=signer, providers=providers,
                                                     found=found, missing=missing)
        for update_id in missing:
            self.wanted.setdefault(update_id, set()).add(head.id)
        e.log("proposal-fetching", window=proposal.window, round=proposal.round, missing=len(missing))
        self._ask(head.id, waiting)

    def _ask(self, head_id: bytes, waiting: Awaiting) -> None:
        """Ask the current provider for the next batch of missing announcements (re-armed retry timer)."""
        e, window = self.engine, self.role.window
        if not waiting.providers:
            return
        provider = waiting.providers[waiting.attempt % len(waiting.providers)]
        waiting.asked = tuple(waiting.missing[:MAX_UPDATE_IDS])
        self.requested.update(waiting.asked)
        e.send(provider, UpdatesRequest(window=window, ids=waiting.asked))
        e.set_timer(("updates", window, head_id, waiting.attempt), e.now + UPDATES_RETRY_S)

    def on_timer(self, key: tuple[Any, ...]) -> None:
        """``("updates", window, head id, attempt)``: that batch is still incomplete; ask the next provider."""
        waiting = self.awaiting.get(key[2])
        if waiting is None or waiting.attempt != key[3]:
            return
        head_id = key[2]
        waiting.attempt += 1
        if waiting.attempt >= UPDATES_ROUNDS * max(1, len(waiting.providers)):
            del self.awaiting[head_id]
            for update_id in waiting.missing:
                heads = self.wanted.get(update_id, set())
                heads.discard(head_id)
                if not heads:
                    self.wanted.pop(update_id, None)
            self.engine.stats["proposals_unavailable"] += 1
            first = waiting.rounds[0]
            self.engine.log("proposal-unavailable", window=first.window, round=first.round,
                            missing=len(waiting.missing))
            return
        self._ask(head_id, waiting)

    def on_update(self, peer: PeerId, envelope: SignedEnvelope) -> bool:
        """An update announcement from `peer`: True if it answers one of our updates-get requests (then it
        is taken here, and never counted against the sender's announcement quota; a late or duplicate
        answer is simply dropped), False if it is an ordinary announcement for the collector."""
        if envelope.id not in self.wanted and envelope.id not in self.requested:
            return False
        if envelope.id in self.wanted:
            self._on_named_update(envelope)
        return True

    def _on_named_update(self, envelope: SignedEnvelope) -> None:
        """An announcement a waiting proposal names: its id is the hash of these very bytes, so whoever sent
        it, it is the named one (its signature and content are checked by `validity`, charged to the
        proposer)."""
        self.known_updates.setdefault(envelope.id, envelope)
        self.engine.stats["updates_fetched"] += 1
        for head_id in self.wanted.pop(envelope.id, set()):
            waiting = self.awaiting.get(head_id)
            if waiting is None:
                continue
            waiting.found[envelope.id] = envelope
            head = waiting.rounds[0].head
            named = head.cohort + head.rejected
            if len(waiting.found) == len(named):
                del self.awaiting[head_id]
                updates = tuple(waiting.found[i] for i in named)
                for proposal in waiting.rounds:
                    self._to_agreement(proposal, updates, waiting.signer)
            elif all(i in waiting.found for i in waiting.asked):
                # The batch is complete: the next one, of the same provider.
                waiting.missing = [i for i in waiting.missing if i not in waiting.found]
                self._ask(head_id, waiting)

    def on_updates_request(self, peer: PeerId, request: UpdatesRequest) -> None:
        """Serve announcements by id (one `Signed` each) for our current window; unknown ids are skipped. At
        most `MAX_UPDATES_REQUESTS` requests per peer and window (more: ``updates-quota``)."""
        e, window = self.engine, self.role.window
        if request.window != window:
            return
        served = self.updates_served.get(peer, 0) + 1
        self.updates_served[peer] = served
        if served > MAX_UPDATES_REQUESTS:
            e.reject(peer, "updates-quota", f"window {window}")
            return
        for update_id in request.ids:
            envelope = self.known_update(update_id)
            if envelope is not None:
                e.stats["updates_served"] += 1
                e.send(peer, Signed(envelope=envelope))

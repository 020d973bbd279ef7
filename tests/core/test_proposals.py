"""core/proposals.py: head proposals taken once and from their proposer only, announcements named by id
fetched from the giver then the other validators (retried, then given up), and served to others within a
quota."""

import attrs

from peerloom.core import effects as fx
from peerloom.core.messages import Signed, UpdatesRequest, decode_message
from peerloom.core.objects import HeadProposal, seal
from peerloom.core.proposals import MAX_UPDATES_REQUESTS, UPDATES_RETRY_S, UPDATES_ROUNDS
from peerloom.core.validator import proposer_of
from tests.helpers import ident
from tests.validator_harness import Lone

ME, V2, V3 = ident(1), ident(2), ident(3)


def three():
    """A validator of three (quorum 3), connected to the other two and to its trainers."""
    v = Lone(trainers=2, validators=(ME, V2, V3), quorum=3)
    v.start()
    for peer in (V2, V3):
        v.greet(peer, ("validator",))
    for t in v.trainers:
        v.greet(t, ("trainer",))
    v.take()
    return v


def round_of(v, proposer):
    """A round of window 1 whose proposer is `proposer`."""
    head, validators = v.engine.head, v.revision.manifest.validators
    return next(r for r in range(64) if proposer_of(head.id, 1, r, validators) == proposer.peer_id)


def by_id_proposal(v, proposer, round_):
    """`proposer`'s proposal of a head naming both trainers' updates, carried by id only."""
    updates = tuple(v.announcement(t) for t in v.trainers)
    skip = v.role.screening.skip_head(v.engine.head, ())
    head = attrs.evolve(skip, skipped=False, cohort=tuple(sorted(u.id for u in updates)))
    proposal = HeadProposal(revision=v.revision.id, window=1, round=round_, valid_round=None, head=head,
                            updates=(), rejected=())
    return seal(proposer, proposal), updates


def requests(effects):
    out = []
    for e in effects:
        if isinstance(e, fx.Send):
            message = decode_message(e.data, max_bytes=1 << 20)
            if isinstance(message, UpdatesRequest):
                out.append((e.peer, message.ids))
    return out


def test_a_proposal_from_another_than_the_rounds_proposer_is_charged_to_its_sender():
    v = three()
    envelope, _ = by_id_proposal(v, V3, round_of(v, V2))
    v.deliver(V3, Signed(envelope=envelope))
    assert v.engine.rejected_by_reason["not-proposer"] == 1 and v.engine.peers[V3.peer_id].penalty == 1
    assert not v.role.proposals.proposals_in


def test_named_updates_are_fetched_from_the_giver_then_handed_to_the_agreement():
    v = three()
    round_ = round_of(v, V2)
    envelope, updates = by_id_proposal(v, V2, round_)
    v.deliver(V3, Signed(envelope=envelope))  # relayed by V3: asked of V3 first
    asked = requests(v.take())
    assert asked == [(V3.peer_id, tuple(sorted(u.id for u in updates)))]
    tracker = v.role.proposals
    assert tracker.awaiting and round_ not in v.role.agreement.proposals
    for u in updates:
        v.deliver(V3, Signed(envelope=u))
    assert not tracker.awaiting and v.engine.stats["updates_fetched"] == 2
    assert round_ in v.role.agreement.proposals  # the whole proposal went to the agreement
    assert v.engine.rejected_by_reason["announce-quota"] == 0


def test_an_unanswered_batch_is_asked_of_the_next_provider_then_given_up():
    v = three()
    envelope, _ = by_id_proposal(v, V2, round_of(v, V2))
    v.deliver(V2, Signed(envelope=envelope))
    asked = [requests(v.take())[0][0]]
    while v.role.proposals.awaiting:
        v.at(v.now + UPDATES_RETRY_S)
        asked += [p for p, _ in requests(v.take())]
    assert asked == [V2.peer_id, V3.peer_id] * UPDATES_ROUNDS  # giver (its proposer), then the other
    assert v.engine.stats["proposals_unavailable"] == 1 and not v.role.proposals.wanted


def test_announcements_are_served_by_id_within_a_quota():
    v = three()
    t0 = v.trainers[0]
    v.announce(t0)
    uid = v.announcement(t0).id
    v.take()
    v.deliver(V2, UpdatesRequest(window=1, ids=(uid, b"\x12\x20" + bytes(32))))
    served = [e for e in v.take() if isinstance(e, fx.Send) and e.peer == V2.peer_id]
    assert len(served) == 1 and decode_message(served[0].data, max_bytes=1 << 20).envelope.id == uid
    v.deliver(V2, UpdatesRequest(window=2, ids=(uid,)))  # not our window: nothing
    assert not [e for e in v.take() if isinstance(e, fx.Send)]
    for _ in range(MAX_UPDATES_REQUESTS):  # within the engine's per-peer request bucket (1024)
        v.deliver(V2, UpdatesRequest(window=1, ids=(uid,)))
    assert v.engine.rejected_by_reason["updates-quota"] == 1

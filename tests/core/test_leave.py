"""Leave (spec/protocol.md §5): a rostered trainer signs a leave; the next head drops it from the roster and
records it in `left`; a roster shrinks by no other peer (validators and `peerloom verify` check it); a
peer that left may join again, and its old leave cannot be replayed against it."""

import random

import attrs
import pytest

from peerloom.backends.registry import build_workload
from peerloom.core import events as ev
from peerloom.core.chain import verify_chain
from peerloom.core.errors import DecodeError, VerificationError
from peerloom.core.leases import leases_of
from peerloom.core.messages import Signed, encode_message
from peerloom.core.objects import Head, LeaveRequest, seal
from peerloom.core.validator import ValidatorRole
from peerloom.verify import check_rules
from tests.engine_cluster import N_SHARDS, SEED, build, build_until, first_head_without, head_window
from tests.helpers import ident


@pytest.fixture(scope="module")
def digits():
    return build_workload("digits-numpy", SEED, N_SHARDS)


def command(cluster, name, event_type):
    cluster.feed(name, event_type(now=cluster.now))  # the simulator has no operator commands: by hand


def validator_role(cluster, name="validator"):
    return next(r for r in cluster.nodes[name].engine.roles if isinstance(r, ValidatorRole))


def roster(cluster, name="validator"):
    return {p for p, _ in cluster.nodes[name].engine.head.roster}


def test_head_left_round_trips_and_must_be_sorted(tmp_path, digits):
    cluster = build(tmp_path, digits, trainers=2)
    genesis = cluster.revision.genesis()
    peers = sorted(p for p, _ in genesis.roster)
    head = attrs.evolve(genesis, left=tuple(peers))
    assert Head.from_cbor(head.to_cbor()) == head and head.id != genesis.id
    body = head.to_cbor()
    body["left"] = [p.to_bytes() for p in reversed(peers)]
    with pytest.raises(DecodeError):
        Head.from_cbor(body)
    leave = LeaveRequest(revision=cluster.revision.id, window=3)
    assert LeaveRequest.from_cbor(leave.to_cbor()) == leave


def test_trainer_leaves_and_joins_again(tmp_path, digits):
    cluster = build(tmp_path, digits, trainers=3, validators=4, quorum=3)
    t0 = cluster.nodes["t0"].identity.peer_id
    assert cluster.run_until(lambda c: head_window(c) >= 1, max_time=60.0)
    command(cluster, "t0", ev.LeaveRequested)
    assert cluster.run_until(lambda c: t0 not in roster(c), max_time=cluster.now + 60.0)
    heads = [h for _, h, _ in cluster.nodes["validator"].heads]
    gone = heads[-1]
    assert gone.left == (t0,) and all(not h.left for h in heads[:-1])
    assert t0 not in leases_of(gone, cluster.revision.manifest)
    # it stays out (no automatic re-join) while the others keep training
    w = gone.window
    assert cluster.run_until(lambda c: head_window(c) >= w + 2, max_time=cluster.now + 60.0)
    assert t0 not in roster(cluster)
    assert not any(e == "proposal-invalid" for _, _, e, _ in cluster.logs)
    # an old leave replayed after the peer joins again has no effect
    old_leave = seal(cluster.nodes["t0"].identity, LeaveRequest(revision=cluster.revision.id, window=w))
    command(cluster, "t0", ev.JoinRequested)
    assert cluster.run_until(lambda c: all(t0 in roster(c, n) for n in ("validator", "v1", "v2", "v3")),
                             max_time=cluster.now + 60.0)
    v = cluster.nodes["validator"].engine
    stale = v.stats["stale_leaves"]
    v.handle(ev.MessageReceived(now=cluster.now, peer=cluster.nodes["v1"].identity.peer_id,
                                data=encode_message(Signed(envelope=old_leave))))
    assert v.stats["stale_leaves"] == stale + 1 and not validator_role(cluster).admission.leaves
    w2 = head_window(cluster)
    assert cluster.run_until(lambda c: head_window(c) >= w2 + 1, max_time=cluster.now + 60.0)
    assert t0 in roster(cluster)
    chain = [(h, c) for _, h, c in cluster.nodes["validator"].heads]
    verify_chain(cluster.revision, chain)
    assert check_rules(cluster.revision, chain)


def test_an_old_join_replayed_after_the_trainer_left_has_no_effect(tmp_path, digits):
    """Joins carry their window: once t0 has joined and left again, a copy of its join - the same signed
    bytes, as anyone who relayed it holds - is stale and cannot put it back in the roster."""
    from peerloom.core.objects import JoinRequest

    cluster = build(tmp_path, digits, trainers=3, validators=4, quorum=3)
    t0 = cluster.nodes["t0"].identity
    assert cluster.run_until(lambda c: head_window(c) >= 1, max_time=60.0)
    command(cluster, "t0", ev.LeaveRequested)
    assert cluster.run_until(lambda c: t0.peer_id not in roster(c), max_time=cluster.now + 60.0)
    join_window = head_window(cluster) + 1
    command(cluster, "t0", ev.JoinRequested)
    join = seal(t0, JoinRequest(revision=cluster.revision.id, window=join_window, capacity=1))  # what it sent
    assert cluster.run_until(lambda c: t0.peer_id in roster(c), max_time=cluster.now + 60.0)
    command(cluster, "t0", ev.LeaveRequested)
    assert cluster.run_until(lambda c: all(t0.peer_id not in roster(c, n) for n in ("validator", "v1", "v2", "v3")),
                             max_time=cluster.now + 60.0)
    for name in ("validator", "v1", "v2", "v3"):  # the replay reaches every validator
        v = cluster.nodes[name].engine
        stale = v.stats["stale_joins"]
        v.handle(ev.MessageReceived(now=cluster.now, peer=cluster.nodes["reducer"].identity.peer_id,
                                    data=encode_message(Signed(envelope=join))))
        assert v.stats["stale_joins"] == stale + 1 and t0.peer_id not in validator_role(cluster, name).admission.joins
    w = head_window(cluster)
    assert cluster.run_until(lambda c: head_window(c) >= w + 2, max_time=cluster.now + 60.0)
    assert t0.peer_id not in roster(cluster)


def test_check_rules_refuses_a_roster_that_shrinks_without_left(tmp_path, digits):
    cluster = build_until(2, tmp_path, digits, trainers=2)
    chain, t0, shrunk = first_head_without(cluster)
    first, cert = chain[0]
    with pytest.raises(VerificationError) as info:
        check_rules(cluster.revision, [(shrunk, cert), chain[1]])
    assert info.value.reason == "roster-shrunk"
    # recorded as left, the same shrink is allowed (but a later head must not drop it silently either)
    recorded = attrs.evolve(shrunk, left=(t0,))
    assert check_rules(cluster.revision, [(recorded, cert)])
    second = attrs.evolve(chain[1][0], roster=shrunk.roster)
    assert check_rules(cluster.revision, [(recorded, cert), (second, chain[1][1])])
    with pytest.raises(VerificationError):  # left names a peer that is still in the roster
        check_rules(cluster.revision, [(attrs.evolve(first, left=(t0,)), cert)])


def test_proposal_check_refuses_departures_without_a_leave(tmp_path, digits):
    cluster = build_until(1, tmp_path, digits, trainers=2)
    role = validator_role(cluster)
    parent = role.collector.head
    t0 = cluster.nodes["t0"].identity.peer_id
    skip = role.screening.skip_head(parent, ())
    assert role.screening.structural_fault(skip, ()) == ""
    dropped = attrs.evolve(skip, roster=tuple(x for x in skip.roster if x[0] != t0))
    assert role.screening.structural_fault(dropped, ()) == "roster-shrunk"
    claimed = attrs.evolve(dropped, left=(t0,))
    assert role.screening.structural_fault(claimed, ()) == "left-unknown"  # no signed leave held here
    # the trainer's own signed leave, from the trainer: held, relayed, and the departure is now valid
    leave = seal(cluster.nodes["t0"].identity, LeaveRequest(revision=cluster.revision.id, window=parent.window + 1))
    role.engine.handle(ev.MessageReceived(now=cluster.now, peer=t0, data=encode_message(Signed(envelope=leave))))
    assert role.admission.leaves == {t0: parent.window + 1}
    # held leaves survive a snapshot / restore of the validator
    engine = role.engine
    restored = type(engine).restore(engine.snapshot(), engine.config, engine.identity, random.Random(0))
    assert next(r for r in restored.roles if isinstance(r, ValidatorRole)).admission.leaves == role.admission.leaves
    assert role.screening.structural_fault(claimed, ()) == ""
    assert role.screening.skip_head(parent, ()).left == (t0,)  # and this validator's own head records it
    # a leave signed and sent by a peer outside the roster is refused and charged
    reducer = cluster.nodes["reducer"].identity
    bogus = seal(reducer, LeaveRequest(revision=cluster.revision.id, window=parent.window + 1))
    penalty = role.engine.peers[reducer.peer_id].penalty
    role.engine.handle(ev.MessageReceived(now=cluster.now, peer=reducer.peer_id,
                                          data=encode_message(Signed(envelope=bogus))))
    assert reducer.peer_id not in role.admission.leaves
    assert role.engine.rejected_by_reason["leave-not-rostered"] == 1
    assert role.engine.peers[reducer.peer_id].penalty > penalty
    # ... and one relayed by someone else is ignored without charging the relayer
    stranger = seal(ident(40), LeaveRequest(revision=cluster.revision.id, window=parent.window + 1))
    t1 = cluster.nodes["t1"].identity.peer_id
    role.engine.handle(ev.MessageReceived(now=cluster.now, peer=t1, data=encode_message(Signed(envelope=stranger))))
    assert ident(40).peer_id not in role.admission.leaves and role.engine.peers[t1].penalty == 0

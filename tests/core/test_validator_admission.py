"""core/admission.py: joins (bounded, kept by priority), leaves and withdrawals, heartbeats, idle expiry and
the roster rules of the next head, driven through a validator engine (tests/validator_harness.py)."""

import random

import attrs
import pytest

from peerloom.core import admission
from peerloom.core import effects as fx
from peerloom.core.admission import join_priority
from peerloom.core.messages import Signed, decode_message
from peerloom.core.objects import Heartbeat, JoinRequest, LeaveRequest
from tests.helpers import ident
from tests.validator_harness import Lone

OTHER_VALIDATOR = ident(2)


def lone(**kw):
    v = Lone(validators=(ident(1), OTHER_VALIDATOR), quorum=2, **kw)
    v.start()
    v.greet(OTHER_VALIDATOR, ("validator",))
    for t in v.trainers:
        v.greet(t, ("trainer",))
    v.take()
    return v


def connect(v, peer):
    if peer.peer_id not in v.engine.peers:
        v.greet(peer, ("trainer",))


def join(v, who, sender=None, window=1, capacity=1):
    connect(v, sender or who)
    v.signed(sender or who, JoinRequest(revision=v.revision.id, window=window, capacity=capacity), signer=who)


def relayed(v):
    out = []
    for e in v.take():
        if isinstance(e, fx.Send) and e.peer == OTHER_VALIDATOR.peer_id:
            message = decode_message(e.data, max_bytes=1 << 20)
            if isinstance(message, Signed):
                out.append(message.envelope.kind)
    return out


def test_join_priority_is_a_fresh_deterministic_order_per_head():
    a, b = ident(50).peer_id, ident(51).peer_id
    assert join_priority(b"h" * 34, a) == join_priority(b"h" * 34, a)
    orders = {tuple(sorted((a, b), key=lambda p: join_priority(bytes([n]) * 34, p))) for n in range(16)}
    assert len(orders) == 2  # neither peer is always first


def test_a_join_is_held_relayed_once_and_heard():
    v = lone()
    newcomer = ident(50)
    join(v, newcomer)
    assert v.role.admission.joins == {newcomer.peer_id: 1}
    assert v.role.admission.heard[newcomer.peer_id] == 1 and v.role.admission.joining()
    assert len(v.logs("join")) == 1 and relayed(v) == ["join"]
    join(v, newcomer, sender=OTHER_VALIDATOR)  # the other validator's relay: known, not relayed back
    assert not v.logs("join") and relayed(v) == []
    roster = v.role.admission.next_roster(v.engine.head, (), ())
    assert (newcomer.peer_id, 1) in roster


def test_stale_and_far_ahead_joins_change_nothing():
    v = lone()
    join(v, ident(50), window=0)
    join(v, ident(51), window=1 + admission.WINDOWS_AHEAD + 1)
    assert not v.role.admission.joins and v.engine.stats["stale_joins"] == 2
    assert v.engine.peers[ident(50).peer_id].penalty == v.engine.peers[ident(51).peer_id].penalty == 0


def test_the_join_backlog_keeps_the_same_joins_whatever_their_order(monkeypatch):
    """Six joins for a backlog of three: whatever the order they arrive in, the three that rank first by
    `join_priority` are kept. The orders are built, not drawn: best first (each later join refused), worst
    first (each later join evicts one), and a shuffle."""
    monkeypatch.setattr(admission, "MIN_JOIN_BACKLOG", 3)
    joiners = [ident(60 + n) for n in range(6)]
    head = lone(manifest={"max_joins": 0}).engine.head  # the same revision, hence the same genesis head
    ranked = sorted(joiners, key=lambda j: join_priority(head.id, j.peer_id))
    shuffled = list(joiners)
    random.Random(1).shuffle(shuffled)
    kept, refused = [], []
    for order in (ranked, ranked[::-1], shuffled):
        v = lone(manifest={"max_joins": 0})
        for j in order:
            join(v, j)
        kept.append(set(v.role.admission.joins))
        refused.append(v.engine.rejected_by_reason["join-backlog-full"])
    assert kept[0] == kept[1] == kept[2] == {j.peer_id for j in ranked[:3]}
    assert refused[:2] == [3, 0]  # refused outright, or admitted and later evicted


def test_a_leave_of_a_rostered_trainer_is_a_departure_of_the_next_head():
    v = lone(trainers=2)
    t0 = v.trainers[0]
    v.signed(t0, LeaveRequest(revision=v.revision.id, window=1))
    assert v.role.admission.leaves == {t0.peer_id: 1} and relayed(v) == ["leave"]
    assert v.role.admission.departures(v.engine.head) == (t0.peer_id,)
    assert t0.peer_id not in {p for p, _ in v.role.admission.next_roster(v.engine.head, (), (t0.peer_id,))}


def test_a_leave_before_being_rostered_withdraws_the_join():
    v = lone()
    newcomer = ident(50)
    join(v, newcomer)
    v.signed(newcomer, LeaveRequest(revision=v.revision.id, window=1))
    assert v.role.admission.withdrawn == {newcomer.peer_id: 1} and not v.role.admission.joining()
    assert newcomer.peer_id not in {p for p, _ in v.role.admission.next_roster(v.engine.head, (), ())}
    join(v, newcomer, window=1)  # the withdrawn join again (a replay): ignored
    assert v.engine.stats["withdrawn_joins_ignored"] == 1
    stranger = ident(51)
    connect(v, stranger)
    v.signed(stranger, LeaveRequest(revision=v.revision.id, window=1))  # no join known: costs a point
    assert v.engine.rejected_by_reason["leave-not-rostered"] == 1


def test_one_heartbeat_per_sender_signer_and_window():
    v = lone(trainers=1)
    t0 = v.trainers[0]
    beat = Heartbeat(revision=v.revision.id, window=1)
    v.signed(t0, beat)
    assert v.role.admission.heard[t0.peer_id] == 1 and relayed(v) == ["heartbeat"]
    v.signed(t0, beat)
    assert v.engine.rejected_by_reason["heartbeat-quota"] == 1
    v.signed(OTHER_VALIDATOR, beat, signer=t0)  # the relay is another sender: taken
    assert v.engine.rejected_by_reason["heartbeat-quota"] == 1


@pytest.mark.parametrize("idle_windows", [0, 2])
def test_idle_expiry_counts_windows_unheard_from_the_first_window_seen(idle_windows):
    v = lone(trainers=2, manifest={"idle_windows": idle_windows})
    a = v.role.admission
    t0, t1 = (t.peer_id for t in v.trainers)
    assert a.first_window == 1
    a.hear(t0, 3)
    assert not a.idle(t0, 4) and not a.idle(t1, 2)
    assert a.idle(t1, 3) == (idle_windows == 2)  # unheard since window 1: two windows
    assert a.idle(t0, 5) == (idle_windows == 2)
    parent = attrs.evolve(v.engine.head, window=2)
    assert a.expirations(parent, ()) == ((t1,) if idle_windows else ())


def test_roster_faults_name_what_this_validator_did_not_hear():
    v = lone(trainers=2, manifest={"idle_windows": 0})
    a, head = v.role.admission, v.engine.head
    skip = v.role.screening.skip_head(head, ())
    never = lambda: False  # noqa: E731
    assert a.roster_fault(skip, frozenset(), frozenset(), never) == ""
    stranger = ident(50).peer_id
    added = attrs.evolve(skip, roster=tuple(sorted((*skip.roster, (stranger, 1)))))
    assert a.roster_fault(added, frozenset(), frozenset(), never) == "roster-unknown-join"
    t0 = v.trainers[0].peer_id
    gone = attrs.evolve(skip, roster=tuple(x for x in skip.roster if x[0] != t0), left=(t0,))
    assert a.roster_fault(gone, frozenset(), frozenset(), never) == "left-unknown"  # no leave held here
    shrunk = attrs.evolve(skip, roster=tuple(x for x in skip.roster if x[0] != t0))
    assert a.roster_fault(shrunk, frozenset(), frozenset(), never) == "roster-shrunk"

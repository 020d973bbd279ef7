"""core/voting.py: votes and proposals are durable before they are visible, a restarted validator stands by
what it signed, and a validator's second vote for one (window, round, step) becomes evidence."""

import random

from peerloom.core import effects as fx
from peerloom.core import events as ev
from peerloom.core.engine import Engine
from peerloom.core.messages import Signed, decode_message
from peerloom.core.objects import PRECOMMIT, PREVOTE, sign_vote
from peerloom.core.voting import PersistVote, SendVote, lock_key, vote_key
from tests.helpers import ident
from tests.validator_harness import Lone

ME, V2, V3 = ident(1), ident(2), ident(3)


def three(**kw):
    v = Lone(trainers=1, validators=(ME, V2, V3), quorum=3, **kw)
    v.start()
    for peer in (V2, V3):
        v.greet(peer, ("validator",))
    v.take()
    return v


def sent_votes(effects):
    out = []
    for e in effects:
        if isinstance(e, fx.Send):
            message = decode_message(e.data, max_bytes=1 << 20)
            if isinstance(message, Signed) and message.envelope.kind == "vote":
                out.append(e.peer)
    return out


def test_a_vote_is_sent_only_once_its_record_is_durable():
    v = three(hold_persists=True)
    v.role.voting.cast(PREVOTE, 0, None)
    v.drain()
    (persist,) = v.persists
    assert persist.key == vote_key(1, 0, PREVOTE) and not sent_votes(v.take())
    (pending,) = v.role.voting.writes.values()  # what happens once it is durable, as plain data
    assert isinstance(pending, SendVote)
    assert (pending.key, pending.step, pending.head_id) == (persist.key, PREVOTE, None)
    v.handle(ev.Persisted(now=v.now, token=persist.token))
    assert not v.role.voting.writes
    assert sorted(sent_votes(v.take())) == sorted([V2.peer_id, V3.peer_id])
    assert v.role.voting.visible == {persist.key} and v.engine.stats["votes_cast"] == 1
    assert v.role.voting.vote_of[(1, 0, PREVOTE, ME.peer_id)] is None  # counted as our own vote


def test_a_non_nil_precommit_persists_the_lock_first():
    v = three(hold_persists=True)
    head = v.role.screening.skip_head(v.engine.head, ())
    v.role.agreement.locked = (head, ())
    v.role.voting.cast(PRECOMMIT, 0, head.id)
    v.drain()
    assert [p.key for p in v.persists] == [lock_key(1)]
    v.handle(ev.Persisted(now=v.now, token=v.persists[0].token))
    assert [p.key for p in v.persists] == [lock_key(1), vote_key(1, 0, PRECOMMIT)]
    assert not sent_votes(v.take())


def test_pending_writes_compare_as_values_across_engines():
    a, b = three(hold_persists=True), three(hold_persists=True)
    for v in (a, b):
        v.role.agreement.locked = (v.role.screening.skip_head(v.engine.head, ()), ())
        v.role.voting.cast(PRECOMMIT, 0, v.role.agreement.locked[0].id)
        v.drain()
    (pending,) = a.role.voting.writes.values()
    assert isinstance(pending, PersistVote) and pending.send.step == PRECOMMIT  # waiting on the lock record
    assert a.role.voting.writes == b.role.voting.writes  # same inputs, same pending work (signatures too)


def test_a_restarted_validator_resumes_and_never_signs_another_vote():
    v = three()
    v.role.voting.cast(PREVOTE, 0, None)
    v.drain()
    assert vote_key(1, 0, PREVOTE) in v.engine.records
    restarted = Engine(v.config, ME, random.Random(1), records=v.engine.records)
    restarted.handle(ev.Start(now=5.0))
    effects = []
    while (e := restarted.next_effect()) is not None:
        effects.append(e)
    role = restarted.roles[0]
    assert role.voting.visible == {vote_key(1, 0, PREVOTE)}
    assert any(isinstance(e, fx.Log) and e.event == "resume-agreement" for e in effects)
    role.voting.cast(PREVOTE, 0, b"\x12\x20" + bytes(32))  # a different prevote for the same round: refused
    assert any(e.event == "double-vote-refused" for e in iter(restarted.next_effect, None) if isinstance(e, fx.Log))


def test_a_second_vote_of_a_validator_is_charged_and_kept_as_evidence():
    v = three()
    revision = v.revision.id
    first = sign_vote(V2, revision, 1, 0, PREVOTE, None)
    other = sign_vote(V2, revision, 1, 0, PREVOTE, b"\x12\x20" + bytes(32))
    v.deliver(V2, Signed(envelope=first))
    v.deliver(V2, Signed(envelope=first))  # a duplicate is no equivocation
    assert v.engine.stats["equivocations"] == 0
    v.deliver(V2, Signed(envelope=other))
    assert v.engine.rejected_by_reason["equivocation"] == 1 and v.engine.peers[V2.peer_id].penalty == 1
    assert set(v.role.voting.evidence) == {V2.peer_id}
    (pair,) = v.role.voting.pending_evidence(v.engine.head)
    assert {pair[0].id, pair[1].id} == {first.id, other.id}
    assert v.role.screening.skip_head(v.engine.head, (pair,)).evidence == (pair,)

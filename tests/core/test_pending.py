"""Engine.pending(): the work an engine holds in flight - a compute task, a fetch, a record not yet durable -
is plain data (core/pending.py), so it compares by value: two engines fed the same events hold equal
pending work, a node restarted from a snapshot and fed the same events again reaches the same, and other
events give other work (spec/design.md §2)."""

from peerloom.core import events as ev
from peerloom.core.collector import FetchDelta, Screen
from peerloom.core.encoding import content_id
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.identity import Identity
from peerloom.core.leases import leases_of
from peerloom.core.messages import Signed
from peerloom.core.objects import PREVOTE, ArtifactRef, UpdateAnnouncement, make_artifact_ref, seal
from peerloom.core.pending import Pending, PendingState
from peerloom.core.voting import SendVote, VotingWrite, vote_key
from tests.validator_harness import Lone


def held_elsewhere(trainer: Identity) -> ArtifactRef:
    return make_artifact_ref(b"a delta held elsewhere " + trainer.peer_id.to_bytes(), 4096)


def elsewhere(v: Lone, trainer: Identity) -> SignedEnvelope:
    """`trainer`'s update for the current window, naming a delta that this validator does not hold (so it
    fetches it from the trainer)."""
    head = v.engine.head
    delta = held_elsewhere(trainer)
    return seal(trainer, UpdateAnnouncement(
        revision=v.revision.id, window=head.window + 1, base=head.id,
        shards=leases_of(head, v.revision.manifest)[trainer.peer_id], delta=delta,
        delta_digest=content_id(b"tensors elsewhere"), train_loss=0.5))


def mid_window(v: Lone, screened: int = 0, fetched: int = 1) -> None:
    """Feed `v` the events that leave one task, one fetch and one write in flight: every trainer connects,
    trainer `screened` announces an update it holds (its screen task is not answered), trainer `fetched`
    one whose delta only it holds (its chunks are not answered), and the validator prevotes nil in round 0
    (its vote record is not made durable)."""
    for t in v.trainers:
        v.greet(t, ("trainer",))
    v.announce(v.trainers[screened])
    v.deliver(v.trainers[fetched], Signed(envelope=elsewhere(v, v.trainers[fetched])))
    v.role.voting.cast(PREVOTE, 0, None)
    v.drain()


def started() -> Lone:
    v = Lone(trainers=2, hold_persists=True)
    v.start()
    return v


def test_a_task_a_fetch_and_a_write_in_flight_are_plain_records():
    v = started()
    mid_window(v)
    pending = v.engine.pending()
    t0, t1 = (t.peer_id for t in v.trainers)
    assert pending.tasks == (Pending(owner="validator", work=Screen(window=1, slot=t0)),)
    ((ref, waiters),) = pending.fetches
    assert ref == held_elsewhere(v.trainers[1])
    assert waiters == (Pending(owner="validator", work=FetchDelta(window=1, slot=t1)),)
    ((key, write),) = pending.writes
    assert key == vote_key(1, 0, PREVOTE) and write.owner == "validator" and isinstance(write.work, VotingWrite)
    (then,) = v.role.voting.writes.values()
    assert isinstance(then, SendVote) and then.key == key
    # Resuming the records carries the work on; the fetch stays in flight.
    v.screen_all()
    (persist,) = v.persists
    v.handle(ev.Persisted(now=v.now, token=persist.token))
    after = v.engine.pending()
    assert after.tasks == () and after.writes == () and after.fetches == pending.fetches
    assert not v.role.voting.writes and v.role.collector.entries[t0].state == "accepted"


def test_engines_fed_the_same_events_hold_equal_pending_work_and_other_events_do_not():
    a, b = started(), started()
    for v in (a, b):
        mid_window(v)
    assert a.engine.pending() == b.engine.pending() and a.engine.pending().tasks
    assert a.role.voting.writes == b.role.voting.writes
    other = started()
    mid_window(other, screened=1, fetched=0)  # the trainers swap parts
    assert other.engine.pending() != a.engine.pending()


def test_a_node_restarted_from_a_snapshot_and_fed_the_same_events_reaches_the_same_pending_work():
    v = started()
    again = v.restarted(now=1.0)  # from the snapshot taken before the window's events
    assert again.engine.pending() == PendingState(tasks=(), fetches=(), writes=())
    for node in (v, again):
        mid_window(node)
    assert again.engine.pending() == v.engine.pending()
    assert again.role.voting.writes == v.role.voting.writes
    # A snapshot keeps no work in flight: a node restored mid-window holds none until events come again.
    assert v.restarted(now=2.0).engine.pending().tasks == ()

"""ValidatorRole driven directly through an Engine with synthetic events (tests/validator_harness.py): one
window from open to certified head, the close rules, skips and recomputation failures."""

from peerloom.core import effects as fx
from peerloom.core.objects import PRECOMMIT, PREVOTE, Vote
from tests.validator_harness import Lone, reduced_params


def run_window(v: Lone, trainers=None) -> None:
    for t in v.trainers if trainers is None else trainers:
        v.announce(t)
    v.screen_all()


def test_a_window_from_open_to_certified_head():
    v = Lone(trainers=2)
    v.start()
    assert v.role.window == 1 and v.role.state == "collecting"
    for t in v.trainers:
        v.greet(t, ("trainer",))
    run_window(v)
    assert v.role.state == "closed"  # every lease reported: closed before its deadline
    v.reduce()
    v.evaluate(loss=0.25, accuracy=0.75)
    promoted = [e for e in v.effects if isinstance(e, fx.HeadPromoted)]
    assert len(promoted) == 1
    head = promoted[0].head
    params, digest = reduced_params()
    assert head.window == 1 and not head.skipped and len(head.cohort) == 2
    assert (head.params, head.params_digest) == (params, digest)
    assert head.metrics == {"test_loss": 0.25, "test_accuracy": 0.75, "train_loss": 0.5}
    assert [(f["step"], f["head"]) for f in v.logs("vote")] == [(PREVOTE, head.id.hex()), (PRECOMMIT, head.id.hex())]
    # durable before visible: the proposal, each vote and the lock were persisted before anything was sent
    keys = [e.key for e in v.effects if isinstance(e, fx.Persist)]
    assert keys[:4] == ["proposal/1/0", "vote/1/0/prevote", "lock/1", "vote/1/0/precommit"]
    assert v.engine.head == head and v.role.window == 2  # the next window opened on it


def test_a_window_without_reachable_leaseholders_waits_then_skips():
    v = Lone(trainers=2, window_s=5.0)
    v.start()
    assert v.logs("window-waiting") == [{"window": 1, "until": 15.0}]
    v.at(14.9)
    assert v.role.state == "collecting"
    v.at(15.0)
    assert v.logs("window-skipped")
    (head,) = v.promoted()  # at once, in round 0: its propose timeout runs from the close (agreement.md §4)
    assert head.skipped and head.params == v.revision.genesis().params and head.window == 1
    assert {vote["round"] for vote in v.logs("vote")} == {0}


def test_deadline_closes_a_window_that_got_some_updates():
    v = Lone(trainers=3, window_s=5.0, min_updates=1)
    v.start(now=1.0)
    for t in v.trainers:
        v.greet(t, ("trainer",))
    run_window(v, v.trainers[:2])
    assert v.role.state == "collecting"  # one lease unreported
    v.at(6.0)  # armed at 1.0 + window_s
    assert v.role.state == "closed" and v.logs("window-deadline")[0]["reported"] == 2
    v.reduce()
    v.evaluate()
    (head,) = [e.head for e in v.effects if isinstance(e, fx.HeadPromoted)]
    assert len(head.cohort) == 2


def test_a_failed_recomputation_builds_no_head_and_agreement_moves_on():
    v = Lone(trainers=2)
    v.start_with_trainers()
    run_window(v)
    (task,) = v.pending("reduce")
    v.fail(task)
    assert v.role.screening.own is None and not v.role.screening.building and not v.role.screening.tasks
    assert not [e for e in v.effects if isinstance(e, fx.HeadPromoted)]


def test_updates_rejected_by_screening_leave_a_short_window_skipped():
    v = Lone(trainers=2, min_updates=2)
    v.start_with_trainers()
    for t in v.trainers:
        v.announce(t)
    v.screen_all(ok=False)
    assert v.engine.rejected_by_reason["screen-norm"] == 2
    assert v.logs("window-short") == [{"window": 1, "accepted": 0, "needed": 2}]
    (head,) = v.promoted()
    assert head.skipped and not v.pending("reduce")
    assert head.rejected == () and head.strikes == ()  # a skipped head records no rejected update


def test_messages_for_windows_ahead_are_held_within_bounds():
    v = Lone(trainers=1)
    v.start()
    v.greet(v.trainers[0], ("trainer",))
    run_window(v)
    v.reduce()
    v.evaluate()
    assert v.role.window == 2
    peer, envelope = v.trainers[0].peer_id, v.announcement(v.trainers[0])
    def vote(window):
        return Vote(revision=b"", window=window, round=0, step="prevote", head=None)

    assert v.role.hold(peer, envelope, vote(5)) and not v.role.held  # beyond WINDOWS_AHEAD: consumed, dropped
    assert v.role.hold(peer, envelope, vote(4)) and v.role.held == [(peer, envelope, vote(4))]
    assert not v.role.hold(peer, envelope, vote(2))  # the current window: handle it now
    assert v.role.hold(peer, envelope, vote(1)) and len(v.role.held) == 1  # an older window: dropped
    assert v.role.hold(peer, envelope, vote(None)) and len(v.role.held) == 1  # no window (not an int): dropped

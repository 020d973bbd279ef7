"""core/deadlines.py: when a window's collection closes at a validator - waiting for a reachable
leaseholder, the deadline, its extension for a short window, and its adaptation to the slowest update."""

import pytest

from peerloom.core.deadlines import MAX_DEADLINE_WINDOWS, WAIT_WINDOWS, close_key
from peerloom.core.objects import JoinRequest
from tests.helpers import ident
from tests.validator_harness import Lone

WINDOW_S = 4.0


def test_the_clock_waits_for_a_reachable_leaseholder_but_not_for_ever():
    v = Lone(trainers=2, window_s=WINDOW_S)
    v.start(now=10.0)
    clock = v.role.clock
    assert clock.armed_at is None and clock.wait_deadline == 10.0 + WAIT_WINDOWS * WINDOW_S
    v.now = 11.0
    v.greet(v.trainers[0], ("trainer",))  # a leaseholder: the clock starts
    assert clock.armed_at == 11.0
    assert v.engine._timer_deadline[close_key(1)] == 11.0 + WINDOW_S
    v.now = 12.0
    v.greet(v.trainers[1], ("trainer",))  # started once only
    assert clock.armed_at == 11.0


def test_a_waiting_join_starts_the_clock():
    other = ident(2)
    v = Lone(trainers=1, window_s=WINDOW_S, validators=(ident(1), other), quorum=2)
    v.start()
    v.now = 1.0
    v.greet(other, ("validator",))  # not a trainer: nothing starts yet
    assert v.role.clock.armed_at is None
    v.signed(other, JoinRequest(revision=v.revision.id, window=1, capacity=1), signer=ident(50))  # relayed
    assert v.role.clock.armed_at == 1.0


def test_a_short_window_waits_on_in_half_steps_up_to_the_limit():
    v = Lone(trainers=2, window_s=WINDOW_S, min_updates=1)
    v.start_with_trainers()
    v.at(WINDOW_S)
    extended = v.logs("window-extended")
    assert extended and v.role.state == "collecting"
    v.until_head(100.0)
    closes = v.logs("window-deadline")
    assert len(closes) == 1 and v.now >= MAX_DEADLINE_WINDOWS * WINDOW_S - 1e-9
    assert len(v.logs("window-extended")) == int((MAX_DEADLINE_WINDOWS - 1) * 2)  # 8 s in steps of 2 s


def test_a_window_that_reached_its_minimum_is_not_extended():
    v = Lone(trainers=2, window_s=WINDOW_S, min_updates=1)
    v.start_with_trainers()
    v.announce(v.trainers[0])
    v.screen_all()
    v.at(WINDOW_S)
    assert not v.logs("window-extended") and v.logs("window-deadline") and v.role.state == "closed"


@pytest.mark.parametrize("slowest, expected", [(1.0, WINDOW_S), (3.0, 4.5), (10.0, MAX_DEADLINE_WINDOWS * WINDOW_S)])
def test_the_next_deadline_is_one_and_a_half_times_the_slowest_update_within_bounds(slowest, expected):
    v = Lone(trainers=2, window_s=WINDOW_S)
    v.start_with_trainers()
    v.now = 0.5
    v.announce(v.trainers[0])
    v.screen_all()
    v.now = slowest
    v.announce(v.trainers[1])
    v.screen_all()  # both leases reported: the window closes now, not at a deadline
    assert v.role.state == "closed" and not v.logs("window-deadline")
    assert v.role.clock.deadline_s == pytest.approx(min(expected, MAX_DEADLINE_WINDOWS * WINDOW_S))


def test_a_window_closed_at_its_deadline_with_leases_unreported_lengthens_the_next():
    v = Lone(trainers=2, window_s=WINDOW_S)
    v.start_with_trainers()
    v.announce(v.trainers[0])
    v.screen_all()
    v.at(WINDOW_S)
    assert v.logs("window-deadline") and v.role.clock.deadline_s == pytest.approx(1.25 * WINDOW_S)


def test_a_window_closed_late_is_still_agreed_in_round_0():
    """Round 0's propose timeout is `agreement_timeout_s` after the window's close when the collection ran
    past `window_s` (adapted or extended, spec/agreement.md §4): a validator does not prevote nil while
    its own collection, and so any proposal's check, is still running, which cost every late window a
    round (a round's timeouts) before the head came."""
    v = Lone(trainers=2, window_s=WINDOW_S, min_updates=1)
    v.start_with_trainers()
    v.at(WINDOW_S)  # short: extended in half-window steps
    v.at(2.5 * WINDOW_S)
    v.announce(v.trainers[0])  # at last an update, long after window_s + agreement_timeout_s
    v.screen_all()
    while v.role.state == "collecting":  # the next half step closes it
        v.at(v.engine.next_deadline())
    assert v.now > WINDOW_S + v.engine.config.agreement_timeout_s and not v.logs("vote")
    v.at(v.now + 0.5)  # the reduction takes a while: the window's own timeout has long passed
    v.reduce()
    v.evaluate()
    v.until_head(100.0)
    votes = v.logs("vote")
    assert v.promoted() and votes and all(vote["round"] == 0 and vote["head"] is not None for vote in votes), votes

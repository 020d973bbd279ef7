"""Hypothesis stateful test of the Tendermint rules (core/agreement.py) under an adversarial network.

Four validators, quorum 3, one Byzantine. Messages are delivered in any order, dropped or duplicated;
timeouts fire whenever Hypothesis likes (asynchrony); the Byzantine validator sends any vote or
proposal it wants, to anyone, including contradictory ones. After every step: no two honest validators
decide different heads (safety), and no honest validator ever signs two different votes for one
(round, step).
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from peerloom.core.agreement import WindowAgreement
from peerloom.core.objects import PRECOMMIT, PREVOTE, Head, make_artifact_ref
from tests.helpers import ident

N, QUORUM = 4, 3
VALIDATORS = [ident(i + 1).peer_id for i in range(N)]
BYZANTINE = 3
REF = make_artifact_ref(b"params", 1024)


def make_head(tag: int, valid: bool) -> Head:
    return Head(revision=REF.digest, parent=REF.digest, window=1, skipped=False, params=REF,
                params_digest=REF.digest, cohort=(REF.digest,), roster=(), quarantine=(),
                metrics={"tag": float(tag), "valid": float(valid)})


VALID_HEADS = [make_head(i, True) for i in range(3)]
INVALID_HEAD = make_head(9, False)
ALL_HEADS = [*VALID_HEADS, INVALID_HEAD]


class Host:
    """An honest validator's side of the agreement, recording what it signs."""

    def __init__(self, index: int, net: "AgreementMachine") -> None:
        self.index, self.net = index, net
        self.me = VALIDATORS[index]
        self.own = VALID_HEADS[index % len(VALID_HEADS)]  # honest validators may prefer different heads
        self.signed: dict[tuple[int, str], bytes | None] = {}
        self.timers: set[tuple[str, int]] = set()
        self.decided: Head | None = None
        self.agreement = WindowAgreement(self, self.me, VALIDATORS, QUORUM, timeout_s=1.0, first_propose_extra_s=0.0)

    def proposer(self, round_: int):
        return VALIDATORS[round_ % N]

    def own_value(self):
        return (self.own, ())

    def validity(self, head, updates):
        return bool(head.metrics["valid"])

    def cast(self, vote_step, round_, head_id):
        key = (round_, vote_step)
        assert key not in self.signed or self.signed[key] == head_id, f"{self.index} signed twice {key}"
        self.signed[key] = head_id
        self.net.broadcast(("vote", self.index, vote_step, round_, head_id))

    def propose(self, round_, head, updates, valid_round):
        self.net.broadcast(("proposal", self.index, round_, head, valid_round))

    def schedule(self, timeout, round_, delay_s):
        self.timers.add((timeout, round_))

    def decide(self, head, round_, precommits):
        assert len(precommits) >= QUORUM
        self.decided = head
        self.net.decisions.append((self.index, head.id))


class AgreementMachine(RuleBasedStateMachine):
    @initialize()
    def start(self):
        self.pool: list[tuple[int, tuple]] = []  # (destination, message)
        self.decisions: list[tuple[int, bytes]] = []
        self.hosts = [Host(i, self) for i in range(N) if i != BYZANTINE]
        for host in self.hosts:
            host.agreement.start(0)

    def broadcast(self, message):
        for host in self.hosts:
            self.pool.append((host.index, message))

    def _host(self, index):
        return next(h for h in self.hosts if h.index == index)

    def _deliver(self, destination, message):
        host = self._host(destination)
        if message[0] == "vote":
            _, sender, vote_step, round_, head_id = message
            host.agreement.on_vote(VALIDATORS[sender], vote_step, round_, head_id, b"sig")
        else:
            _, sender, round_, head, valid_round = message
            if VALIDATORS[sender] == host.proposer(round_):  # the host refuses anyone else's proposal
                host.agreement.on_proposal(round_, head, (), valid_round, VALIDATORS[sender])

    @precondition(lambda self: self.pool)
    @rule(data=st.data(), keep=st.booleans())
    def deliver(self, data, keep):
        """Deliver any pending message, out of order; `keep` leaves it in the pool (a duplicate)."""
        index = data.draw(st.integers(0, len(self.pool) - 1))
        destination, message = self.pool[index] if keep else self.pool.pop(index)
        self._deliver(destination, message)

    @precondition(lambda self: self.pool)
    @rule(destination=st.sampled_from([i for i in range(N) if i != BYZANTINE]))
    def flush(self, destination):
        """Deliver everything pending for one validator, in order (makes quorums, and decisions, common)."""
        for item in [x for x in self.pool if x[0] == destination]:
            self.pool.remove(item)
            self._deliver(*item)

    @precondition(lambda self: self.pool)
    @rule(data=st.data())
    def drop(self, data):
        self.pool.pop(data.draw(st.integers(0, len(self.pool) - 1)))

    @rule(data=st.data())
    def fire_timeout(self, data):
        host = data.draw(st.sampled_from(self.hosts))
        if host.timers:
            timeout, round_ = data.draw(st.sampled_from(sorted(host.timers)))
            host.timers.discard((timeout, round_))
            host.agreement.on_timeout(timeout, round_)

    @rule(to=st.integers(0, N - 1), vote_step=st.sampled_from([PREVOTE, PRECOMMIT]), round_=st.integers(0, 4),
          head=st.sampled_from([*ALL_HEADS, None]))
    def byzantine_vote(self, to, vote_step, round_, head):
        if to != BYZANTINE:
            self._deliver(to, ("vote", BYZANTINE, vote_step, round_, head.id if head else None))

    @rule(to=st.integers(0, N - 1), round_=st.integers(0, 4), head=st.sampled_from(ALL_HEADS),
          valid_round=st.none() | st.integers(0, 3))
    def byzantine_proposal(self, to, round_, head, valid_round):
        if to != BYZANTINE:
            self._deliver(to, ("proposal", BYZANTINE, round_, head, valid_round))

    @invariant()
    def at_most_one_decided_head(self):
        if hasattr(self, "decisions"):
            assert len({head_id for _, head_id in self.decisions}) <= 1, self.decisions

    @invariant()
    def nothing_invalid_decided(self):
        if hasattr(self, "decisions"):
            assert INVALID_HEAD.id not in {head_id for _, head_id in self.decisions}


AgreementMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
test_agreement_is_safe_under_asynchrony_and_a_byzantine_validator = AgreementMachine.TestCase


def test_honest_validators_decide_when_the_network_is_kind():
    """Liveness sanity check: deliver everything in order and fire timeouts only when nothing is left."""
    machine = AgreementMachine()
    machine.start()
    for _ in range(2000):
        if machine.pool:
            destination, message = machine.pool.pop(0)
            machine._deliver(destination, message)
        elif any(h.timers for h in machine.hosts):
            host = next(h for h in machine.hosts if h.timers)
            timeout, round_ = min(host.timers, key=lambda t: (t[1], t[0]))
            host.timers.discard((timeout, round_))
            host.agreement.on_timeout(timeout, round_)
        if all(h.decided for h in machine.hosts):
            break
    assert all(h.decided for h in machine.hosts)
    assert len({h.decided.id for h in machine.hosts}) == 1


def _take(machine, destination, match):
    """Deliver (and remove) every pending message for `destination` that `match` accepts."""
    for item in [x for x in machine.pool if x[0] == destination and match(x[1])]:
        machine.pool.remove(item)
        machine._deliver(*item)


def _fire(machine, index, timeout, round_):
    host = machine._host(index)
    assert (timeout, round_) in host.timers, host.timers
    host.timers.discard((timeout, round_))
    host.agreement.on_timeout(timeout, round_)


def test_locks_prevent_a_conflicting_decision_in_a_later_round():
    """The schedule that breaks any variant ignoring Tendermint's lock (lines 22-33 of Algorithm 1).

    Round 0: validators 0 and 1 see the proposal h0, lock it and precommit it; with the Byzantine
    validator's precommit, validator 0 decides h0. Validator 2 never saw h0. Round 2's proposer is
    validator 2 and proposes its own h2; were validator 1 to prevote h2 despite its lock, h2 would
    gather a quorum and validator 2 would decide a second head for the same window.
    """
    m = AgreementMachine()
    m.start()
    h0 = VALID_HEADS[0]
    vote = lambda step, rnd, senders: (lambda msg: msg[0] == "vote" and msg[2] == step  # noqa: E731
                                       and msg[3] == rnd and msg[1] in senders)
    # round 0: proposal reaches 0 and 1 only
    _take(m, 0, lambda msg: msg[0] == "proposal")
    _take(m, 1, lambda msg: msg[0] == "proposal")
    m.pool = [x for x in m.pool if x[1][0] != "proposal"]
    for dest in (0, 1):
        _take(m, dest, vote(PREVOTE, 0, {0, 1}))
        m._deliver(dest, ("vote", BYZANTINE, PREVOTE, 0, h0.id))
    assert all(m._host(i).agreement.locked_round == 0 for i in (0, 1))
    _take(m, 0, vote(PRECOMMIT, 0, {0, 1}))
    m._deliver(0, ("vote", BYZANTINE, PRECOMMIT, 0, h0.id))
    assert m._host(0).decided == h0
    # validator 2 times out in round 0; 1 and 2 move on to round 1, then round 2, on nil votes
    _fire(m, 2, "propose", 0)
    for dest in (1, 2):
        _take(m, dest, vote(PRECOMMIT, 0, {0, 1}))
        m._deliver(dest, ("vote", BYZANTINE, PRECOMMIT, 0, None))
        _fire(m, dest, "precommit", 0)
    m.pool = [x for x in m.pool if x[1][0] != "proposal"]  # round 1's proposal (h0 again) is lost
    for dest in (1, 2):
        _fire(m, dest, "propose", 1)
    for dest in (1, 2):
        _take(m, dest, vote(PREVOTE, 1, {1, 2}))
        m._deliver(dest, ("vote", BYZANTINE, PREVOTE, 1, None))
    for dest in (1, 2):
        _take(m, dest, vote(PRECOMMIT, 1, {1, 2}))
        m._deliver(dest, ("vote", BYZANTINE, PRECOMMIT, 1, None))
        _fire(m, dest, "precommit", 1)
    assert m._host(2).agreement.round == 2 and m._host(1).agreement.round == 2
    # round 2: validator 2 proposes h2; the Byzantine validator pushes it too
    for dest in (1, 2):
        _take(m, dest, lambda msg: msg[0] == "proposal" and msg[2] == 2)
    assert m._host(1).signed[(2, PREVOTE)] is None  # locked on h0: refuses h2
    for dest in (1, 2):
        _take(m, dest, vote(PREVOTE, 2, {1, 2}))
        m._deliver(dest, ("vote", BYZANTINE, PREVOTE, 2, VALID_HEADS[2].id))
        _take(m, dest, vote(PRECOMMIT, 2, {1, 2}))
        m._deliver(dest, ("vote", BYZANTINE, PRECOMMIT, 2, VALID_HEADS[2].id))
    assert {h.decided.id for h in m.hosts if h.decided} == {h0.id}


class _Sink:
    """A network that only records what one host broadcasts."""

    def __init__(self) -> None:
        self.sent: list[tuple] = []
        self.decisions: list[tuple[int, bytes]] = []

    def broadcast(self, message: tuple) -> None:
        self.sent.append(message)


def test_polka_on_a_second_proposal_of_the_round_locks_it():
    """An equivocating proposer showed this validator head A and the others head B, which a quorum then
    prevoted. With B relayed to it, the validator locks and precommits B, although it prevoted A
    (spec/agreement.md §3; Algorithm 1 lines 36-43 need the proposal in hand)."""
    net = _Sink()
    host = Host(0, net)
    a, b = VALID_HEADS[1], VALID_HEADS[2]
    byzantine = VALIDATORS[BYZANTINE]
    host.agreement.start(BYZANTINE)  # round 3: the Byzantine validator proposes
    host.agreement.on_proposal(BYZANTINE, a, (), None, byzantine)
    assert host.signed[(BYZANTINE, PREVOTE)] == a.id  # the first proposal decides the prevote
    host.agreement.on_proposal(BYZANTINE, b, (), None, byzantine)  # the relayed other head
    for signer in (VALIDATORS[1], VALIDATORS[2], byzantine):
        host.agreement.on_vote(signer, PREVOTE, BYZANTINE, b.id, b"sig")
    assert host.signed[(BYZANTINE, PRECOMMIT)] == b.id
    assert host.agreement.locked[0] == b and host.agreement.valid_round == BYZANTINE
    for signer in (host.me, VALIDATORS[1], VALIDATORS[2]):  # its own precommit comes back like any vote
        host.agreement.on_vote(signer, PRECOMMIT, BYZANTINE, b.id, b"sig")
    assert host.decided == b

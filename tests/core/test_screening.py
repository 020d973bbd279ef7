"""core/screening.py: metric comparison, the validator's own head from its recomputation, the check of a
proposed head by recomputation, and the recomputation in flight as plain data that can be compared across
engines and survives a snapshot and restart (the restarted node recomputes the same work)."""

import math

import attrs
import pytest

from peerloom.core import effects as fx
from peerloom.core.messages import Signed
from peerloom.core.objects import HeadProposal, seal
from peerloom.core.screening import METRIC_TOLERANCE, Evaluate, Recompute, head_metrics, metrics_match
from peerloom.core.tasks import EvaluateResult, ReduceResult
from peerloom.core.validator import proposer_of
from tests.helpers import ident
from tests.validator_harness import Lone, reduced_params

ME, V2 = ident(1), ident(2)


def collected(trainers=2, **kw):
    """A lone validator whose window 1 closed with every trainer's update accepted (reduce task pending)."""
    v = Lone(trainers=trainers, **kw)
    v.start_with_trainers()
    for n, t in enumerate(v.trainers):
        v.announce(t, train_loss=0.25 * (n + 1))
    v.screen_all()
    return v


@pytest.mark.parametrize("mine, claimed, ok", [
    ({"a": 1.0}, {"a": 1.0 + METRIC_TOLERANCE / 2}, True),
    ({"a": 1.0}, {"a": 1.0 + 2 * METRIC_TOLERANCE}, False),
    ({"a": 1.0}, {"b": 1.0}, False),
    ({"a": math.nan}, {"a": math.nan}, True),
    ({"a": math.nan}, {"a": 1.0}, False),
    ({"a": 1.0}, {"a": math.nan}, False),
    ({"a": math.inf}, {"a": math.inf}, True),
    ({"a": math.inf}, {"a": -math.inf}, False),
])
def test_metrics_match_is_exact_for_nan_and_infinity(mine, claimed, ok):
    assert metrics_match(mine, claimed) is ok


def test_head_metrics_names_evaluated_metrics_test_and_adds_train_loss():
    assert head_metrics({"loss": 1, "accuracy": 0.5}, 0.25) == {"test_loss": 1.0, "test_accuracy": 0.5,
                                                                 "train_loss": 0.25}


def test_own_head_recomputation_is_plain_data_until_it_finishes():
    v = collected()
    (work,) = v.role.screening.tasks.values()
    assert isinstance(work, Recompute) and work.window == 1 and work.check is None
    assert [u.id for u in work.candidates] == sorted(u.id for u in work.candidates)
    assert sorted(work.train_losses) == [0.25, 0.5]
    detail = "norm 31 is 12.4 x the cohort's median norm 2.5; threshold 10 x = 25"
    v.reduce(kept=(1,), outliers=((0, "norm-outlier", detail),))
    (work,) = v.role.screening.tasks.values()
    assert isinstance(work, Evaluate) and work.kept == (work.recompute.candidates[1].id,)
    assert work.outliers == ((work.recompute.candidates[0].id, "screen-norm-outlier", detail),)
    assert work.train_loss == work.recompute.train_losses[1]
    v.evaluate()
    assert not v.role.screening.tasks
    (head,) = v.promoted()
    assert head.cohort == work.kept and head.rejected == (work.recompute.candidates[0].id,)
    # the rejection says why, with the numbers (the event a user reads)
    assert [(e.reason, e.detail) for e in v.effects if isinstance(e, fx.Rejected)] == [("screen-norm-outlier", detail)]


def test_the_same_inputs_give_equal_pending_work_and_other_inputs_do_not():
    a, b = collected(), collected()
    assert list(a.role.screening.tasks.values()) == list(b.role.screening.tasks.values())
    c = Lone(trainers=2)
    c.start_with_trainers()
    for t in c.trainers:
        c.announce(t, train_loss=0.75)
    c.screen_all()
    assert list(c.role.screening.tasks.values()) != list(a.role.screening.tasks.values())


def test_a_node_restarted_mid_window_recomputes_the_same_work_and_head():
    v = collected()
    pending = list(v.role.screening.tasks.values())
    assert len(pending) == 1 and len(v.tasks) == 1  # a reduce task is outstanding
    again = v.restarted(now=1.0)
    assert not again.role.screening.tasks and again.role.window == 1  # in-flight work is not in a snapshot
    for t in again.trainers:  # its trainers reconnect and announce again
        again.greet(t, ("trainer",))
    for n, t in enumerate(again.trainers):
        again.announce(t, train_loss=0.25 * (n + 1))
    again.screen_all()
    assert list(again.role.screening.tasks.values()) == pending
    for node in (v, again):
        node.reduce()
        node.evaluate()
    assert [h.id for h in v.promoted()] == [h.id for h in again.promoted()]


def proposed_by_v2(v, metrics=None):
    """V2's proposal of the head our own recomputation would give (or with other `metrics`)."""
    screening = v.role.screening
    params, digest = reduced_params()
    updates = tuple(sorted((x.envelope for x in v.role.collector.cohort()), key=lambda u: u.id))
    result = {"window": 1, "kept": [u.id for u in updates], "candidates": updates, "params": params,
              "params_digest": digest, "outer_state": None, "outer_state_digest": None,
              "metrics": metrics or head_metrics({"loss": 1.0, "accuracy": 0.5}, 0.375)}
    head = screening.make_head(result, (), ())
    round_ = next(r for r in range(64) if proposer_of(v.engine.head.id, 1, r, v.revision.manifest.validators)
                  == V2.peer_id)
    return head, seal(V2, HeadProposal(revision=v.revision.id, window=1, round=round_, valid_round=None,
                                       head=head, updates=updates, rejected=()))


@pytest.mark.parametrize("claimed, verdict", [(None, True), ({"test_loss": 9.0}, False)])
def test_a_proposed_head_is_valid_only_if_its_recomputation_matches(claimed, verdict):
    v = collected(validators=(ME, V2), quorum=2)
    v.greet(V2, ("validator",))
    head, envelope = proposed_by_v2(v, None if claimed is None else
                                    {**head_metrics({"loss": 1.0, "accuracy": 0.5}, 0.375), **claimed})
    v.deliver(V2, Signed(envelope=envelope))
    checks = [w for w in v.role.screening.tasks.values() if w.check is not None]
    assert len(checks) == 1 and checks[0].check.head == head
    params, digest = reduced_params()
    for task in v.pending("reduce"):  # our own head's and the check's: the same candidates, the same result
        v.finish(task, ReduceResult(params=params, params_digest=digest, kept=tuple(range(len(task.task.deltas)))))
    for task in v.pending("evaluate"):
        v.finish(task, EvaluateResult(metrics={"loss": 1.0, "accuracy": 0.5}))
    assert v.role.screening.verdicts[head.id] is verdict
    checked = v.logs("proposal-checked")
    assert any(f["head"] == head.id.hex() and f["ok"] is verdict for f in checked)
    if not verdict:
        assert any(f["reason"] == "metrics-mismatch" for f in checked)


def test_structural_faults_are_found_before_any_recomputation():
    v = collected()
    skip = v.role.screening.skip_head(v.engine.head, ())
    assert v.role.screening.structural_fault(attrs.evolve(skip, window=5), ()) == "wrong-parent"
    assert v.role.screening.structural_fault(attrs.evolve(skip, metrics={"x": 1.0}), ()) == "bad-skip"
    struck = attrs.evolve(skip, strikes=((v.trainers[0].peer_id, 1, 1),))
    assert v.role.screening.structural_fault(struck, ()) == "quarantine-mismatch"

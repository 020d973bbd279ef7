"""Compute tasks are typed (core/tasks.py): one frozen class per kind, each kind named once, the `Task` and
`TaskResult` unions name them all, and `RunTask` carries one and reports its kind."""

from __future__ import annotations

import inspect
import re
import typing

import attrs
import pytest

from peerloom.core import effects as fx
from peerloom.core import tasks
from peerloom.core.objects import make_artifact_ref

REF = make_artifact_ref(b"params", 4)


def _public_classes() -> set[type]:
    return {obj for _, obj in inspect.getmembers(tasks, inspect.isclass)
            if obj.__module__ == tasks.__name__ and not obj.__name__.startswith("_")}


def test_every_task_has_a_unique_kind_and_a_result_class_in_the_table() -> None:
    task_classes = typing.get_args(tasks.Task)
    kinds = [cls.kind for cls in task_classes]
    assert len(set(kinds)) == len(kinds) == 6
    assert set(kinds) == {"train", "screen", "audit", "audit-plan", "reduce", "evaluate"}
    doc = tasks.__doc__ or ""
    rows = dict(re.findall(r"\| `(\w+Task)` \| ``[\w-]+`` \| `(\w+Result)` \|", doc))
    assert set(rows) == {cls.__name__ for cls in task_classes}
    assert set(rows.values()) == {cls.__name__ for cls in typing.get_args(tasks.TaskResult)}
    for cls in task_classes:
        assert f"`{cls.__name__}` | ``{cls.kind}``" in doc


def test_every_class_is_a_documented_frozen_keyword_only_value() -> None:
    union = set(typing.get_args(tasks.Task)) | set(typing.get_args(tasks.TaskResult))
    for cls in _public_classes():
        assert attrs.has(cls) and cls.__doc__, cls
        assert all(f.kw_only for f in attrs.fields(cls)), cls
        assert cls.__setattr__ is not object.__setattr__, cls  # frozen
    assert union <= _public_classes()
    task = tasks.TrainTask(params=REF, shards=(1,), seed=3)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        task.seed = 4  # type: ignore[misc]  # the point: frozen
    with pytest.raises(TypeError):
        tasks.TrainTask(REF, (1,), 3)  # type: ignore[misc]  # keyword-only


def test_run_task_carries_the_task_and_reports_its_kind() -> None:
    plan = tasks.AuditPlanTask(trajectory=REF, segment=1, segments=4)
    effect = fx.RunTask(task_id="audit-plan-7", task=plan)
    assert effect.kind == "audit-plan" and effect.task is plan
    assert fx.RunTask(task_id="t", task=tasks.EvaluateTask(params=REF)).kind == "evaluate"


def test_a_segment_plan_names_its_artifacts_in_order_without_the_missing_ones() -> None:
    other = make_artifact_ref(b"stop", 4)
    plan = tasks.SegmentPlan(start=None, stop=other, final=other, residual=REF)
    assert plan.refs() == (other, other, REF)
    assert tasks.SegmentPlan(start=REF, stop=other, final=REF, residual=None).refs() == (REF, other, REF)


def test_results_compare_by_value() -> None:
    a = tasks.ReduceResult(params=REF, params_digest=REF.digest, outliers=(tasks.Outlier(index=2, reason="cosine"),),
                           kept=(0, 1))
    assert a == attrs.evolve(a) and a != attrs.evolve(a, kept=(0,))
    assert tasks.AuditResult(ok=True) == tasks.AuditResult(ok=True, reason="")

"""The Event and Effect unions name every event and effect class, and `peerloom.core` exports them all
(spec/design.md §2): a host that matches the unions exhaustively then handles everything the engine can say."""

from __future__ import annotations

import inspect
import typing

import attrs

import peerloom.core as core
from peerloom.core import effects, events


def _classes(module: object) -> set[type]:
    return {obj for _, obj in inspect.getmembers(module, inspect.isclass)
            # the ignore: `module` is a module (typed object)
            if obj.__module__ == module.__name__ and not obj.__name__.startswith("_")}  # type: ignore[attr-defined]


def test_every_event_class_is_in_the_event_union() -> None:
    classes = _classes(events)
    assert classes and set(typing.get_args(events.Event)) == classes


def test_every_effect_class_is_in_the_effect_union() -> None:
    classes = _classes(effects)
    assert classes and set(typing.get_args(effects.Effect)) == classes


def test_events_carry_now_and_all_are_frozen_value_objects() -> None:
    for cls in typing.get_args(events.Event):
        assert attrs.has(cls) and "now" in attrs.fields_dict(cls), cls
        assert cls.__setattr__ is not object.__setattr__, cls  # frozen
    for cls in typing.get_args(effects.Effect):
        assert attrs.has(cls) and cls.__doc__, cls


def test_package_exports_every_event_and_effect() -> None:
    public = set(core.__all__)
    for cls in _classes(events) | _classes(effects):
        assert cls.__name__ in public, cls.__name__
        assert getattr(core, cls.__name__) is cls
    assert {"Event", "Effect", "Engine", "EngineConfig", "Role"} <= public


def test_all_names_exist_once() -> None:
    assert len(core.__all__) == len(set(core.__all__))
    for name in core.__all__:
        assert hasattr(core, name), name

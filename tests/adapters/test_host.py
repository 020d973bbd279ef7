"""The one host driver (`adapters/host.py`, spec/design.md §6): every member of the `Effect` union is dispatched
to the `Host` method named after it, nothing else is, and `drain` executes effects in the engine's order,
including those a host method causes by feeding an event back."""

import inspect
import re
import typing
from collections import deque
from pathlib import Path

import attrs
import pytest

from peerloom.adapters.host import Host, dispatch, drain
from peerloom.core import effects as fx
from tests.helpers import ident

MEMBERS = typing.get_args(fx.Effect)


def method_name(cls: type) -> str:
    """``HangUp`` -> ``hang_up``: the Host method an effect class is dispatched to."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()


class Recorder:
    """A host with one method per effect class in the union; each records (method name, effect)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda effect: self.calls.append((name, effect))


def bare(cls):
    """An instance of an effect class without field values (enough for `match` on its class)."""
    return object.__new__(cls)


def test_every_effect_class_is_a_member_of_the_union():
    defined = {obj for obj in vars(fx).values() if inspect.isclass(obj) and attrs.has(obj)
               and obj.__module__ == fx.__name__}
    assert defined == set(MEMBERS)


@pytest.mark.parametrize("cls", MEMBERS, ids=lambda c: c.__name__)
def test_each_member_is_dispatched_to_the_method_named_after_it(cls):
    recorder, effect = Recorder(), bare(cls)
    dispatch(effect, recorder)
    assert recorder.calls == [(method_name(cls), effect)]


def test_the_host_protocol_has_one_method_per_member_and_no_other():
    methods = {name for name, _ in inspect.getmembers(Host, inspect.isfunction) if not name.startswith("_")}
    assert methods == {method_name(cls) for cls in MEMBERS}


def test_dispatch_refuses_what_is_not_an_effect():
    with pytest.raises(AssertionError):
        dispatch(object(), Recorder())  # type: ignore[arg-type]  # not an effect, on purpose


def test_a_union_member_without_a_case_fails(monkeypatch):
    """What this suite relies on: were an effect added to the union without a `case`, dispatching it would
    reach `assert_never` (the parametrized test above then fails for it)."""

    @attrs.frozen(kw_only=True)
    class Unhandled:
        pass

    monkeypatch.setattr(fx, "Effect", fx.Effect | Unhandled)
    with pytest.raises(AssertionError):
        dispatch(Unhandled(), Recorder())


class FakeEngine:
    def __init__(self, effects):
        self.effects = deque(effects)

    def next_effect(self):
        return self.effects.popleft() if self.effects else None


def test_drain_runs_every_effect_in_order_with_those_fed_back_meanwhile():
    peer = ident(1).peer_id
    persist = fx.Persist(token=1, key="k", record=b"r")
    send = fx.Send(peer=peer, data=b"held until persisted")
    log = fx.Log(event="e", fields={})
    engine = FakeEngine([persist, log])

    class PersistingHost(Recorder):
        def persist(self, effect):  # durable now: the engine releases what waited on it
            self.calls.append(("persist", effect))
            engine.effects.append(send)

    recorder = PersistingHost()
    drain(engine, recorder)  # type: ignore[arg-type]  # implements only persist
    assert recorder.calls == [("persist", persist), ("log", log), ("send", send)]
    assert engine.next_effect() is None


def test_no_other_library_module_pulls_effects():
    """The runtime, the simulator and the testing cluster all go through `drain`: no second interpreter of
    effects in the library (examples/embed_engine_loop.py shows a hand-written one on purpose)."""
    root = Path(__file__).resolve().parents[2]
    pulling = sorted(str(p.relative_to(root)) for folder in ("adapters", "sim", "peerloom", "backends")
                     for p in (root / folder).rglob("*.py") if "next_effect(" in p.read_text())
    assert pulling == ["adapters/host.py"]

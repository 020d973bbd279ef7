"""The engine's roles follow the `Role` protocol (core/roles.py): every role is a `RoleBase`, implements
each hook the engine calls, and the engine needs no `hasattr` to find them."""

import inspect
import random

from peerloom.core.chainsync import ChainSync
from peerloom.core.engine import Engine, EngineConfig
from peerloom.core.fetching import Fetcher
from peerloom.core.messages import ROLES
from peerloom.core.reducer import ReducerRole
from peerloom.core.roles import Role, RoleBase
from peerloom.core.sessions import Sessions
from peerloom.core.trainer import TrainerRole
from peerloom.core.validator import ValidatorRole
from tests.helpers import ident, make_revision

HOOKS = [name for name, _ in inspect.getmembers(Role, inspect.isfunction) if name.startswith("on_")]


def test_the_protocol_names_every_hook_the_engine_calls():
    source = "".join(inspect.getsource(cls) for cls in (Engine, ChainSync, Fetcher, Sessions))  # and its parts
    called = {name for name in HOOKS if f"role.{name}(" in source}
    assert called == set(HOOKS) and {"on_head", "on_timer", "on_signed", "on_peer_ready", "on_head_source"} <= called
    assert "hasattr(" not in source


def test_every_role_implements_every_hook_with_the_protocols_signature():
    for cls in (ValidatorRole, ReducerRole, TrainerRole):
        assert issubclass(cls, RoleBase)
        for name in HOOKS:
            ours, theirs = inspect.signature(getattr(Role, name)), inspect.signature(getattr(cls, name))
            assert list(ours.parameters) == list(theirs.parameters), (cls, name)


def test_an_engine_holds_one_typed_role_per_configured_role():
    rev = make_revision(trainers=[ident(10)])
    engine = Engine(EngineConfig(roles=set(ROLES), revision=rev), ident(1),
                    random.Random(0))
    assert [type(r) for r in engine.roles] == [ValidatorRole, ReducerRole, TrainerRole]
    assert engine._validator is engine.roles[0] and engine._trainer is engine.roles[2]

"""The engine's roles follow the `Role` protocol (core/roles.py): every role is a `RoleBase`, implements
each hook the engine calls, and the engine needs no `hasattr` to find them."""

import inspect
import random
from unittest import mock

from peerloom.core import effects as fx
from peerloom.core.chainsync import ChainSync
from peerloom.core.engine import Engine, EngineConfig
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.fetching import Fetcher
from peerloom.core.messages import ROLES, Signed
from peerloom.core.objects import PROTOCOL_VERSION, VOTE_KIND, UpdateAnnouncement, decode_body
from peerloom.core.reducer import ReducerRole
from peerloom.core.roles import Role, RoleBase
from peerloom.core.sessions import Sessions
from peerloom.core.trainer import TrainerRole
from peerloom.core.validator import ValidatorRole
from tests.helpers import ident, make_revision
from tests.validator_harness import Lone

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


def _rejections(lone):
    return [e for e in lone.take() if isinstance(e, fx.Rejected)]


def test_a_malformed_signed_body_is_decoded_and_rejected_once_not_once_per_role():
    """The engine decodes a signed envelope's body once, by its kind (`core.bodies.decode_body`): an update
    whose body does not decode is one rejection of its sender, though both the validator's and the reducer's
    collectors would charge it; a kind no peer sends is one ``unexpected-envelope``."""
    v = Lone(trainers=1, roles=frozenset({"validator", "reducer"}))
    v.start_with_trainers()
    assert {type(r) for r in v.engine.roles} == {ValidatorRole, ReducerRole}
    trainer = v.trainers[0]
    v.take()
    bad = SignedEnvelope.seal(trainer, UpdateAnnouncement.KIND, PROTOCOL_VERSION, {"revision": v.revision.id})
    with mock.patch("peerloom.core.engine.decode_body", side_effect=decode_body) as decoded:
        v.deliver(trainer, Signed(envelope=bad))
    assert decoded.call_count == 1
    rejected = _rejections(v)
    assert [(r.peer, r.reason) for r in rejected] == [(trainer.peer_id, "bad-fields")]
    v.deliver(trainer, Signed(envelope=SignedEnvelope.seal(trainer, "no-such-kind", PROTOCOL_VERSION, {})))
    assert [(r.peer, r.reason) for r in _rejections(v)] == [(trainer.peer_id, "unexpected-envelope")]
    # a well-formed update still reaches both roles' collectors
    v.announce(trainer)
    assert not _rejections(v)
    assert all(r.collector is not None and len(r.collector.by_id) == 1 for r in v.engine.roles)


def test_a_role_that_would_not_charge_an_undecodable_body_leaves_its_sender_uncharged():
    """A reducer takes only updates: a malformed vote (or a kind no peer sends) costs its sender nothing
    there, as before the engine decoded bodies itself."""
    v = Lone(trainers=1, roles=frozenset({"reducer"}))
    v.start_with_trainers()
    trainer = v.trainers[0]
    v.take()
    v.deliver(trainer, Signed(envelope=SignedEnvelope.seal(trainer, VOTE_KIND, PROTOCOL_VERSION, {"x": 1})))
    v.deliver(trainer, Signed(envelope=SignedEnvelope.seal(trainer, "no-such-kind", PROTOCOL_VERSION, {})))
    assert not _rejections(v) and not v.engine.rejected_by_reason

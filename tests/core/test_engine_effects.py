"""Typed outcomes of the engine (spec/design.md §2): `Rejected` for every refusal of a peer's input, `Ban` at
the penalty limit, and `SubmitReply` for an envelope a host hands in with `events.Submit`. No host has to read
a log line or diff counters to learn what the engine decided."""

import random

import attrs

from peerloom.core import effects as fx
from peerloom.core import events as ev
from peerloom.core.engine import Engine, EngineConfig
from peerloom.core.leases import leases_of
from peerloom.core.messages import ChunkRequest, Signed
from peerloom.core.objects import UpdateAnnouncement, make_artifact_ref, seal
from tests.core.test_engine_attacks import GENESIS, MALLORY, TRAINER, VALIDATOR, deliver, drain, greet
from tests.helpers import ident, make_revision

LIGHT = ident(11)


def validator(penalty_limit=20):
    rev = make_revision(trainers=[TRAINER, LIGHT], genesis=GENESIS, chunk_size=4096)
    ref = make_artifact_ref(GENESIS, 4096)
    config = EngineConfig(roles={"validator"}, revision=rev, penalty_limit=penalty_limit, ban_s=30.0)
    engine = Engine(config, VALIDATOR, random.Random(0), stored=[ref])
    engine.handle(ev.Start(now=0.0))
    greet(engine, MALLORY, ("trainer",))
    greet(engine, TRAINER, ("trainer",))
    drain(engine)
    return engine, rev, ref


def update(engine, rev, ref, signer, shards=None):
    """`signer`'s update for window 1 on its own lease (or on `shards`)."""
    shards = leases_of(engine.head, rev.manifest)[signer.peer_id] if shards is None else shards
    return seal(signer, UpdateAnnouncement(revision=rev.id, window=1, base=engine.head.id, shards=shards,
                                           delta=ref, delta_digest=ref.digest, train_loss=0.0))


def test_every_rejection_is_a_rejected_effect_naming_peer_and_reason():
    engine, _rev, ref = validator()
    deliver(engine, MALLORY, b"\xff not cbor")
    deliver(engine, TRAINER, ChunkRequest(artifact=ref.digest, index=0))  # served: not a rejection
    rejected = [e for e in drain(engine) if isinstance(e, fx.Rejected)]
    assert [(e.peer, e.reason) for e in rejected] == [(MALLORY.peer_id, "decode-malformed")]
    assert engine.rejected_by_reason["decode-malformed"] == 1


def test_penalty_limit_bans_then_hangs_up_once():
    engine, _rev, _ref = validator(penalty_limit=3)
    for n in range(5):
        deliver(engine, MALLORY, b"\xff", now=1.0 + n)
    effects = drain(engine)
    bans = [e for e in effects if isinstance(e, fx.Ban)]
    assert bans == [fx.Ban(peer=MALLORY.peer_id, until=3.0 + 30.0)]  # the third rejection, at now=3.0
    after = effects[effects.index(bans[0]) + 1]
    assert after == fx.HangUp(peer=MALLORY.peer_id, reason="penalty-limit")
    assert len([e for e in effects if isinstance(e, fx.Rejected)]) == 5
    assert not [e for e in effects if isinstance(e, fx.Ban | fx.HangUp) and e.peer != MALLORY.peer_id]


def test_submit_from_an_unconnected_signer_is_judged_and_answered():
    engine, rev, ref = validator()
    envelope = update(engine, rev, ref, LIGHT)
    engine.handle(ev.Submit(now=1.0, request_id=7, envelope=envelope))
    effects = drain(engine)
    assert [e for e in effects if isinstance(e, fx.SubmitReply)] == [fx.SubmitReply(request_id=7, accepted=True)]
    assert LIGHT.peer_id in engine.roles[0].collector.entries
    assert LIGHT.peer_id not in engine.peers  # the one-envelope session is over


def test_submit_with_a_bad_signature_is_refused_with_the_reason():
    engine, rev, ref = validator()
    envelope = update(engine, rev, ref, LIGHT)
    forged = attrs.evolve(envelope, signature=bytes(64))
    engine.handle(ev.Submit(now=1.0, request_id=1, envelope=forged))
    replies = [e for e in drain(engine) if isinstance(e, fx.SubmitReply)]
    assert replies == [fx.SubmitReply(request_id=1, accepted=False, reason="bad-signature")]
    assert LIGHT.peer_id not in engine.roles[0].collector.entries


def test_submit_from_a_connected_signer_charges_its_own_session():
    engine, rev, ref = validator()
    deliver(engine, TRAINER, Signed(envelope=update(engine, rev, ref, TRAINER)))
    # a second, different update from the same trainer in the same window: a duplicate
    again = seal(TRAINER, UpdateAnnouncement(revision=rev.id, window=1, base=engine.head.id,
                                             shards=leases_of(engine.head, rev.manifest)[TRAINER.peer_id],
                                             delta=ref, delta_digest=ref.digest, train_loss=1.0))
    engine.handle(ev.Submit(now=1.0, request_id=2, envelope=again))
    replies = [e for e in drain(engine) if isinstance(e, fx.SubmitReply)]
    assert replies == [fx.SubmitReply(request_id=2, accepted=False, reason="duplicate-update")]
    assert TRAINER.peer_id in engine.peers and engine.peers[TRAINER.peer_id].penalty >= 1


def test_submit_notes_the_artifact_the_host_stored_for_it():
    engine, rev, _ref = validator()
    delta = make_artifact_ref(b"delta bytes" * 100, 4096)
    shards = leases_of(engine.head, rev.manifest)[LIGHT.peer_id]
    envelope = seal(LIGHT, UpdateAnnouncement(revision=rev.id, window=1, base=engine.head.id, shards=shards,
                                              delta=delta, delta_digest=delta.digest, train_loss=0.0))
    engine.handle(ev.Submit(now=1.0, request_id=3, envelope=envelope, stored=delta))
    assert engine.is_stored(delta.digest)
    assert next(e for e in drain(engine) if isinstance(e, fx.SubmitReply)).accepted

"""Engine.snapshot() / Engine.restore(): canonical CBOR round trip, and a node restored from a snapshot
carries on with the chain without signing anything twice (spec/design.md §2)."""

import random

import pytest

from peerloom.backends.registry import build_workload
from peerloom.core import events as ev
from peerloom.core.encoding import decode
from peerloom.core.engine import Engine, EngineConfig
from peerloom.core.errors import DecodeError, LocalProtocolError
from tests.engine_cluster import N_SHARDS, SEED, build_until, head_window
from tests.helpers import make_revision


@pytest.fixture(scope="module")
def workload():
    return build_workload("digits-mlp", SEED, N_SHARDS)


def test_snapshot_round_trips_and_restored_validator_continues(tmp_path, workload):
    cluster = build_until(2, tmp_path, workload, trainers=2)
    node = cluster.nodes["validator"]
    engine = node.engine
    snap = engine.snapshot()
    assert decode(snap, max_bytes=1 << 30)["records"]  # canonical CBOR (decode refuses anything else)
    config = EngineConfig(roles=node.roles, revision=cluster.revision)
    restored = Engine.restore(snap, config, node.identity, random.Random(1))
    assert restored.snapshot() == snap
    assert restored.head == engine.head and restored.certificate == engine.certificate
    assert restored.records == engine.records and restored.stats == engine.stats
    assert all(restored.is_stored(d) for d in engine.fetching.stored)
    # what idle expiry needs (heartbeats heard, the first window it counted from) survives the round trip
    v, rv = (e._validator.admission for e in (engine, restored))
    assert v.heard and rv.heard == v.heard and rv.first_window == v.first_window is not None
    with pytest.raises(LocalProtocolError):  # time of the snapshot is kept: no going back
        restored.handle(ev.Start(now=engine.now - 1.0))

    # Kill the validator and bring it back from the snapshot instead of its store.
    window = engine.head.window
    cluster.crash("validator")
    cluster.restart("validator", ("reducer", "t0", "t1"),
                    engine=Engine.restore(snap, config, node.identity, random.Random(1)))
    assert cluster.run_until(lambda c: head_window(c) >= window + 2, max_time=cluster.now + 60.0)
    ids = [h.id for _, h, _ in node.heads]
    assert len(ids) == len(set(ids))  # each window certified once
    trainer = [h.id for _, h, _ in cluster.nodes["t0"].heads]
    assert trainer == ids[:len(trainer)] and len(trainer) >= window + 1  # the trainers follow the same chain


def test_restore_refuses_foreign_or_garbage_snapshots():
    rev, other = make_revision(), make_revision(window_s=7.0)
    from tests.helpers import ident
    engine = Engine(EngineConfig(roles={"validator"}, revision=rev), ident(1), random.Random(0))
    engine.handle(ev.Start(now=3.0))
    snap = engine.snapshot()
    with pytest.raises(LocalProtocolError):
        Engine.restore(snap, EngineConfig(roles={"validator"}, revision=other), ident(1), random.Random(0))
    with pytest.raises(DecodeError):
        Engine.restore(b"\xa0", EngineConfig(roles={"validator"}, revision=rev), ident(1), random.Random(0))
    again = Engine.restore(snap, EngineConfig(roles={"validator"}, revision=rev), ident(1), random.Random(0))
    assert again.snapshot() == snap and again.now == 3.0

"""Connected engines over the memory transport on a virtual clock (h11/aioquic-style pair tests).

Everything runs for real — training, screening, reduction, evaluation, signatures, storage — only time
is virtual, driven by the simulator's event heap (no wall clock is read).
"""

import random
from pathlib import Path

import pytest

from peerloom.backends.numpy.tensors import tensor_digest, to_safetensors
from peerloom.backends.registry import build_workload
from peerloom.core import events as ev
from peerloom.core.chain import verify_chain
from peerloom.core.encoding import encode
from peerloom.core.engine import Engine, EngineConfig
from peerloom.core.errors import LocalProtocolError
from peerloom.core.identity import Identity
from peerloom.core.leases import leases_of
from peerloom.core.messages import Signed, encode_message
from peerloom.core.objects import Manifest, Revision, UpdateAnnouncement, make_artifact_ref, seal
from peerloom.testing import Cluster

SEED = 3
N_SHARDS = 4


@pytest.fixture(scope="module")
def workload():
    return build_workload("digits-mlp", SEED, N_SHARDS)


def ident(n: int) -> Identity:
    return Identity(bytes([n]) * 32)


def build(tmp_path: Path, workload, *, trainers=2, min_updates=1, window_s=5.0, validators=1, quorum=1,
          rule="mean", compute="numpy", engine_options=None, **manifest_fields):
    """A validator (or `validators` of them), a reducer and `trainers` trainers, connected, on `workload`'s
    (workload, shards); validators and the reducer screen and reduce with the `compute` backend, either one
    name for all or a list (validators, then the reducer)."""
    wl, shards = workload
    params = wl.initial_params(SEED)
    genesis = to_safetensors(params)
    vals = [ident(1)] + [ident(30 + i) for i in range(validators - 1)]
    reducer = ident(2)
    tr = [ident(10 + i) for i in range(trainers)]
    authority = ident(99)
    manifest = Manifest(
        experiment="pair", workload="digits-mlp", workload_seed=SEED, schema=_schema(params),
        shards=tuple(len(s) for s in shards), validators=tuple(v.peer_id for v in vals), quorum=quorum,
        window_s=window_s,
        min_updates=min_updates, max_capacity=4, aggregation=rule,
        **dict({"outer_optimizer": "fedavg", "outer_lr": 1.0}, **manifest_fields),
        chunk_size=16 * 1024, genesis_params=make_artifact_ref(genesis, 16 * 1024),
        genesis_params_digest=tensor_digest(params), roster=tuple(sorted((t.peer_id, 1) for t in tr)))
    revision = Revision.verify(manifest.seal(authority), authority.peer_id)
    cluster = Cluster(revision, seed=SEED, engine_options=engine_options)
    names = ["validator"] + [f"v{i}" for i in range(1, validators)]
    computes = [compute] * (validators + 1) if isinstance(compute, str) else list(compute)
    for name, identity, backend in zip(names, vals, computes[:-1], strict=True):
        cluster.add_node(name, identity, {"validator"}, tmp_path / name, wl, shards, compute=backend).store.put(genesis)
    reducer_node = cluster.add_node("reducer", reducer, {"reducer"}, tmp_path / "r", wl, shards, compute=computes[-1])
    reducer_node.store.put(genesis)
    for i, t in enumerate(tr):
        cluster.add_node(f"t{i}", t, {"trainer"}, tmp_path / f"t{i}", wl, shards)
    cluster.start()
    for i in range(trainers):
        for name in names:
            cluster.connect(f"t{i}", name)
        cluster.connect(f"t{i}", "reducer")
    for j, name in enumerate(names):
        cluster.connect("reducer", name)
        for other in names[j + 1:]:
            cluster.connect(name, other)
    return cluster


def _schema(params):
    from peerloom.backends.numpy.tensors import schema_of
    return schema_of(params)


def head_window(cluster, name="validator"):
    return cluster.nodes[name].engine.head.window


def test_pair_certifies_three_windows_and_chain_verifies(tmp_path, workload):
    cluster = build(tmp_path, workload)
    assert cluster.run_until(lambda c: all(head_window(c, n) >= 3 for n in c.nodes), max_time=60.0)
    v = cluster.nodes["validator"]
    chain = [(h, c) for _, h, c in v.heads]
    assert [h.window for h in (x for x, _ in chain)] == [1, 2, 3]
    previous = cluster.revision.genesis()
    for head, _ in chain:  # every trainer holding a lease contributed
        assert not head.skipped and len(head.cohort) == len(leases_of(previous, cluster.revision.manifest))
        previous = head
    verify_chain(cluster.revision, chain)
    # every trainer followed the same certified chain
    for name in ("t0", "t1", "reducer"):
        assert [h.id for _, h, _ in cluster.nodes[name].heads][:3] == [h.id for h, _ in chain]
    # the model learned: accuracy rose from chance level
    assert chain[-1][0].metrics["test_accuracy"] > 0.5
    assert v.engine.stats["proposals_confirmed"] >= 1  # the reducer's proposals matched the recomputation
    # votes were durable before they were visible
    assert {f"vote/{w}/0/{s}" for w in (1, 2, 3) for s in ("prevote", "precommit")} <= set(v.store.records())


def test_same_seed_same_heads(tmp_path, workload):
    ids = []
    for run in ("a", "b"):
        cluster = build(tmp_path / run, workload)
        assert cluster.run_until(lambda c: head_window(c) >= 2, max_time=60.0)
        ids.append([h.id for _, h, _ in cluster.nodes["validator"].heads])
    assert ids[0] == ids[1]


def test_crashed_trainer_window_closes_on_deadline(tmp_path, workload):
    cluster = build(tmp_path, workload, trainers=3, min_updates=1, window_s=5.0)
    assert cluster.run_until(lambda c: head_window(c) >= 1, max_time=60.0)
    t_crash = cluster.now
    cluster.crash("t0")
    assert cluster.run_until(lambda c: head_window(c) >= 3, max_time=t_crash + 60.0)
    logs = [e for _, n, e, _ in cluster.logs if n == "validator"]
    assert "window-deadline" in logs
    head = cluster.nodes["validator"].engine.head
    assert not head.skipped
    # a restarted trainer (same disk) syncs the latest head and trains again
    cluster.restart("t0", ["validator", "reducer"])
    w = head_window(cluster)
    assert cluster.run_until(lambda c: head_window(c, "t0") >= w, max_time=cluster.now + 30.0)


def test_too_few_updates_skips_window_loudly(tmp_path, workload):
    cluster = build(tmp_path, workload, trainers=2, min_updates=3, window_s=2.0)
    assert cluster.run_until(lambda c: head_window(c) >= 1, max_time=30.0)
    head = cluster.nodes["validator"].engine.head
    assert head.skipped and head.cohort == () and head.params == cluster.revision.genesis().params
    assert any(e == "window-skipped" for _, _, e, _ in cluster.logs)


def test_update_with_wrong_lease_is_rejected_and_charged(tmp_path, workload):
    cluster = build(tmp_path, workload, trainers=2)
    assert cluster.run_until(lambda c: head_window(c) >= 1, max_time=60.0)
    v = cluster.nodes["validator"].engine
    t0 = cluster.nodes["t0"]
    head = v.head
    bogus = seal(t0.identity, UpdateAnnouncement(
        revision=cluster.revision.id, window=head.window + 1, base=head.id, shards=(0, 1, 2, 3),
        delta=head.params, delta_digest=head.params_digest, train_loss=0.0))
    v.handle(ev.MessageReceived(now=cluster.now, peer=t0.identity.peer_id,
                                data=encode_message(Signed(envelope=bogus))))
    assert v.rejected_by_reason["bad-lease"] + v.rejected_by_reason["duplicate-update"] >= 1
    assert v.peers[t0.identity.peer_id].penalty >= 1
    v.handle(ev.MessageReceived(now=cluster.now, peer=t0.identity.peer_id, data=b"\xff\x00garbage"))
    assert v.rejected_by_reason["decode-malformed"] == 1


def test_engine_refuses_misuse(tmp_path, workload):
    cluster = build(tmp_path, workload)
    node = cluster.nodes["validator"]
    config = EngineConfig(roles={"validator"}, revision=cluster.revision)
    engine = Engine(config, node.identity, random.Random(0))
    with pytest.raises(LocalProtocolError):
        engine.handle(ev.TimerDue(now=1.0))  # before Start
    engine.handle(ev.Start(now=5.0))
    with pytest.raises(LocalProtocolError):
        engine.handle(ev.TimerDue(now=4.0))  # time went backwards
    engine.handle(ev.TimerDue(now=5.0))  # spurious timer: no-op
    assert encode(engine.head.to_cbor()) == encode(cluster.revision.genesis().to_cbor())


@pytest.mark.parametrize("rule", ["median", "trimmed_mean", "centered_clip"])
def test_robust_rules_certify_and_learn(tmp_path, workload, rule):
    cluster = build(tmp_path, workload, trainers=3, rule=rule)
    assert cluster.run_until(lambda c: head_window(c) >= 3, max_time=60.0)
    heads = [h for _, h, _ in cluster.nodes["validator"].heads]
    assert all(not h.skipped for h in heads[:3])
    assert heads[2].metrics["test_accuracy"] > 0.5
    assert cluster.nodes["validator"].engine.stats["proposals_confirmed"] >= 1  # reducer got the same bytes

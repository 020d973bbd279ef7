"""Connected engines over the memory transport on a virtual clock (h11/aioquic-style pair tests).

Everything runs for real — training, screening, reduction, evaluation, signatures, storage — only time
is virtual, driven by the simulator's event heap (no wall clock is read).
"""

import random

import pytest

from peerloom.core import events as ev
from peerloom.core.chain import verify_chain
from peerloom.core.encoding import encode
from peerloom.core.engine import Engine, EngineConfig
from peerloom.core.errors import LocalProtocolError
from peerloom.core.leases import leases_of
from peerloom.core.messages import Signed, encode_message
from peerloom.core.objects import UpdateAnnouncement, seal
from tests.engine_cluster import build, build_until, head_window
from tests.engine_cluster import workload as workload  # the fixture


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
        cluster = build_until(2, tmp_path / run, workload)
        ids.append([h.id for _, h, _ in cluster.nodes["validator"].heads])
    assert ids[0] == ids[1]


def test_crashed_trainer_window_closes_on_deadline(tmp_path, workload):
    cluster = build_until(1, tmp_path, workload, trainers=3, min_updates=1, window_s=5.0)
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
    cluster = build_until(1, tmp_path, workload, trainers=2, min_updates=3, window_s=2.0, max_time=30.0)
    head = cluster.nodes["validator"].engine.head
    assert head.skipped and head.cohort == () and head.params == cluster.revision.genesis().params
    assert any(e == "window-skipped" for _, _, e, _ in cluster.logs)


def test_update_with_wrong_lease_is_rejected_and_charged(tmp_path, workload):
    cluster = build_until(1, tmp_path, workload, trainers=2)
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
    cluster = build_until(3, tmp_path, workload, trainers=3, rule=rule)
    heads = [h for _, h, _ in cluster.nodes["validator"].heads]
    assert all(not h.skipped for h in heads[:3])
    assert heads[2].metrics["test_accuracy"] > 0.5
    assert cluster.nodes["validator"].engine.stats["proposals_confirmed"] >= 1  # reducer got the same bytes

"""Screening on real tensors with reason codes, strikes, quarantine and equivocation evidence
(spec/protocol.md §6 and §9)."""

import attrs
import numpy as np
import pytest

from peerloom.adapters.compute import ComputeExecutor
from peerloom.adapters.storage import ArtifactStore
from peerloom.backends.numpy.tensors import tensor_digest, to_safetensors
from peerloom.backends.registry import build_workload
from peerloom.core import events as ev
from peerloom.core.chain import verify_chain
from peerloom.core.errors import VerificationError
from peerloom.core.messages import Signed, encode_message
from peerloom.core.objects import PRECOMMIT, PREVOTE, Head, Manifest, sign_vote
from peerloom.core.quarantine import check_evidence, make_evidence, next_records
from peerloom.core.tasks import ReduceTask, ScreenTask
from tests.engine_cluster import N_SHARDS, SEED, build, build_until, head_window
from tests.helpers import ident, make_revision

SCHEMA = (("a", "float32", (3,)), ("b", "float32", (2, 2)))


@pytest.fixture(scope="module")
def workload():
    return build_workload("digits-mlp", SEED, N_SHARDS)


def executor(tmp_path, **fields):
    rev = make_revision(schema=SCHEMA)
    manifest = attrs.evolve(rev.manifest, **fields)
    return ComputeExecutor(ArtifactStore(tmp_path, chunk_size=1024), manifest, None, [])


def tensors(rng, scale=1.0):
    return {"a": (rng.standard_normal(3) * scale).astype(np.float32),
            "b": (rng.standard_normal((2, 2)) * scale).astype(np.float32)}


# --- screening in the compute task ------------------------------------------------------------------

def test_screen_task_reports_schema_non_finite_digest_and_norm_bound(tmp_path):
    ex = executor(tmp_path)
    rng = np.random.default_rng(0)
    good = tensors(rng)
    ref, digest = ex.save(good)
    assert ex.run(ScreenTask(delta=ref, delta_digest=digest)).ok
    norm = ex.run(ScreenTask(delta=ref, delta_digest=digest)).norm
    assert norm == pytest.approx(float(np.sqrt(sum(float((t.astype(np.float64) ** 2).sum()) for t in good.values()))))
    over = ex.run(ScreenTask(delta=ref, delta_digest=digest, max_norm=norm * 0.99))
    assert (over.ok, over.reason) == (False, "norm-bound")
    assert ex.run(ScreenTask(delta=ref, delta_digest=digest, max_norm=norm * 1.01)).ok
    bad = dict(good, a=np.array([1.0, np.inf, 0.0], dtype=np.float32))
    ref2, digest2 = ex.save(bad)
    assert ex.run(ScreenTask(delta=ref2, delta_digest=digest2)).reason == "non-finite"
    assert ex.run(ScreenTask(delta=ref, delta_digest=digest2)).reason == "digest-mismatch"
    ref3, digest3 = ex.save({"a": good["a"]})
    assert ex.run(ScreenTask(delta=ref3, delta_digest=digest3)).reason == "schema"
    junk = ex.store.put(b"not safetensors at all")
    assert ex.run(ScreenTask(delta=junk, delta_digest=digest)).reason == "undecodable"


def reduce_task(ex, params, deltas, **extra):
    return ReduceTask(**{"params": ex.save(params)[0], "deltas": tuple(ex.save(d)[0] for d in deltas),
                         "weights": (1,) * len(deltas), "rule": "mean", "outer_optimizer": "fedavg", "outer_lr": 1.0,
                         "norm_ratio": 10.0, "min_cosine": -1.0, **extra})


def test_reduce_task_drops_cohort_relative_outliers_before_aggregating(tmp_path):
    ex = executor(tmp_path)
    rng = np.random.default_rng(1)
    params = tensors(rng)
    honest = [tensors(rng) for _ in range(3)]
    scaled = {k: v * 1000.0 for k, v in honest[0].items()}  # scaling attack: same direction, huge norm
    result = ex.run(reduce_task(ex, params, [*honest[:2], scaled, *honest[2:]]))
    assert [(o.index, o.reason) for o in result.outliers] == [(2, "norm-outlier")] and result.kept == (0, 1, 3)
    assert "threshold 10 x" in result.outliers[0].detail  # the detail gives the numbers
    clean = ex.run(reduce_task(ex, params, honest))
    assert result.params_digest == clean.params_digest  # the outlier had no influence at all
    # Cosine to the robust centre: a sign-flipped update points away from the coordinate median.
    base = tensors(rng)
    similar = [{k: v + 0.05 * rng.standard_normal(v.shape).astype(np.float32) for k, v in base.items()}
               for _ in range(3)]
    flipped = {k: -v for k, v in base.items()}
    result = ex.run(reduce_task(ex, params, [*similar, flipped], min_cosine=0.0))
    assert [(o.index, o.reason) for o in result.outliers] == [(3, "cosine")]
    assert ex.run(reduce_task(ex, params, [*similar, flipped])).outliers == ()  # cosine test off


def test_reduce_task_diloco_matches_nesterov_and_carries_state(tmp_path):
    from peerloom.backends.numpy.aggregate import aggregate, outer_step

    ex = executor(tmp_path)
    rng = np.random.default_rng(2)
    params, deltas = tensors(rng), [tensors(rng) for _ in range(2)]
    task = reduce_task(ex, params, deltas, outer_optimizer="diloco", outer_lr=0.7, outer_momentum=0.9,
                       outer_state=None)
    first = ex.run(task)
    centre = aggregate("mean", deltas, [1, 1])
    want, state = outer_step("diloco", params, centre, None, lr=0.7, momentum=0.9)
    assert first.params_digest == tensor_digest(want) and first.outer_state_digest == tensor_digest(state)
    second = ex.run(attrs.evolve(task, params=first.params, outer_state=first.outer_state))
    want2, state2 = outer_step("diloco", want, centre, state, lr=0.7, momentum=0.9)
    assert second.params_digest == tensor_digest(want2) and second.outer_state_digest == tensor_digest(state2)
    # momentum changes the step: the second step is not the plain SGD one
    plain, _ = outer_step("fedavg", want, centre, None, lr=0.7, momentum=0.0)
    assert tensor_digest(plain) != second.params_digest


# --- pure quarantine records -------------------------------------------------------------------------

def test_strikes_accumulate_expire_and_quarantine_is_released():
    rev = make_revision()
    m = attrs.evolve(rev.manifest, quarantine_strikes=2, strike_windows=3, quarantine_windows=4)
    p, q = ident(10).peer_id, ident(11).peer_id
    head = rev.genesis()

    def step(window, struck=(), equivocators=()):
        nonlocal head
        quarantine, strikes = next_records(head, window, struck, equivocators, m)
        head = attrs.evolve(head, window=window, quarantine=quarantine, strikes=strikes)
        return head

    assert step(1, [p]).strikes == ((p, 1, 1),)
    assert step(2).strikes == ((p, 1, 1),)
    assert step(4).strikes == ()  # window 1's strike expired (strike_windows = 3)
    step(5, [p])
    h = step(6, [p, q])
    assert h.quarantine == ((p, 6 + 1 + 4),) and h.strikes == ((q, 1, 6),) and p in h.quarantined
    assert p in step(9).quarantined
    assert p not in step(10).quarantined and step(10).quarantine == ()  # released: leases again from window 11
    assert step(11, equivocators=[q]).quarantine == ((q, 16),)


def test_equivocation_evidence_is_transferable_and_checked():
    vals = [ident(1), ident(2), ident(3), ident(4)]
    rev = make_revision(validators=vals, quorum=3)
    h1, h2 = b"\x12\x20" + b"\1" * 32, b"\x12\x20" + b"\2" * 32
    a = sign_vote(vals[3], rev.id, 5, 0, PREVOTE, h1)
    b = sign_vote(vals[3], rev.id, 5, 0, PREVOTE, h2)
    assert check_evidence(make_evidence(a, b), rev.id, rev.manifest) == vals[3].peer_id
    with pytest.raises(VerificationError):  # same head twice is no equivocation
        check_evidence(make_evidence(a, sign_vote(vals[3], rev.id, 5, 0, PREVOTE, h1)), rev.id, rev.manifest)
    with pytest.raises(VerificationError):  # different steps are different slots
        check_evidence(make_evidence(a, sign_vote(vals[3], rev.id, 5, 0, PRECOMMIT, h2)), rev.id, rev.manifest)
    with pytest.raises(VerificationError):  # votes of two signers frame nobody
        check_evidence(make_evidence(a, sign_vote(vals[2], rev.id, 5, 0, PREVOTE, h2)), rev.id, rev.manifest)
    forged = attrs.evolve(b, signature=bytes(64))
    with pytest.raises(VerificationError):
        check_evidence(make_evidence(a, forged), rev.id, rev.manifest)
    outsider = ident(50)
    with pytest.raises(VerificationError):
        check_evidence(make_evidence(sign_vote(outsider, rev.id, 5, 0, PREVOTE, h1),
                                     sign_vote(outsider, rev.id, 5, 0, PREVOTE, h2)), rev.id, rev.manifest)


def test_head_and_manifest_round_trip_new_fields():
    vals = [ident(1), ident(2), ident(3), ident(4)]
    rev = make_revision(validators=vals, quorum=3)
    m = attrs.evolve(rev.manifest, outer_optimizer="diloco", outer_lr=0.7, outer_momentum=0.9, inner_steps=50,
                     max_update_norm=5.0, min_cosine=0.1)
    assert Manifest.from_cbor(m.to_cbor()) == m
    a = sign_vote(vals[3], rev.id, 5, 0, PREVOTE, b"\x12\x20" + b"\1" * 32)
    b = sign_vote(vals[3], rev.id, 5, 0, PREVOTE, b"\x12\x20" + b"\2" * 32)
    head = attrs.evolve(rev.genesis(), window=3, parent=rev.genesis().id, quarantine=((vals[3].peer_id, 9),),
                        strikes=((ident(10).peer_id, 2, 3),), rejected=(b"\x12\x20" + b"\3" * 32,),
                        evidence=(make_evidence(a, b),), outer_state=rev.manifest.genesis_params,
                        outer_state_digest=rev.manifest.genesis_params_digest)
    assert Head.from_cbor(head.to_cbor()) == head
    # DiLoCo defaults: momentum 0.9 unless given; FedAvg has none
    assert attrs.evolve(rev.manifest, outer_optimizer="diloco").outer_momentum == 0.0  # evolve keeps the value
    fresh = Manifest(**{**{f.name: getattr(rev.manifest, f.name) for f in attrs.fields(Manifest)
                           if f.name != "outer_momentum"}, "outer_optimizer": "diloco"})
    assert fresh.outer_momentum == 0.9 and rev.manifest.outer_momentum == 0.0


# --- whole engines -----------------------------------------------------------------------------------

class ScalingAttack:
    """Wraps a workload: trains honestly, then multiplies the delta (a model-poisoning scaling attack)."""

    TAKES_STEP = False  # its own schedule (`peerloom.backends.workload.TakesStep`)

    def __init__(self, inner, factor):
        self.inner, self.factor = inner, factor

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def train(self, params, indices, seed, **kw):
        delta, metrics = self.inner.train(params, indices, seed, **kw)
        return {k: (v * self.factor).astype(v.dtype) for k, v in delta.items()}, metrics


def test_scaling_attacker_is_screened_struck_and_quarantined(tmp_path, workload):
    cluster = build(tmp_path, workload, trainers=3, min_updates=1, window_s=3.0, quarantine_strikes=2,
                    strike_windows=4, quarantine_windows=3)
    attacker = cluster.nodes["t2"]
    attacker.executor.workload = ScalingAttack(attacker.executor.workload, 1000.0)
    me = attacker.identity.peer_id
    quarantined = lambda c: me in c.nodes["validator"].engine.head.quarantined  # noqa: E731
    assert cluster.run_until(quarantined, max_time=200.0)
    v = cluster.nodes["validator"]
    heads = [h for _, h, _ in v.heads]
    assert v.engine.rejected_by_reason["screen-norm-outlier"] >= 2
    # the rejections are in the certified heads, so every node derives the same strikes and quarantine
    struck = [h for h in heads if h.rejected]
    assert len(struck) >= 2 and all(me not in dict(h.roster) or h.cohort for h in struck)
    q_head = heads[-1]
    assert q_head.quarantine == ((me, q_head.window + 1 + 3),) and not any(p == me for p, _, _ in q_head.strikes)
    # a quarantined trainer holds no lease, so no cohort slot, until released
    from peerloom.core.leases import leases_of
    assert me not in leases_of(q_head, cluster.revision.manifest)
    assert cluster.run_until(lambda c: head_window(c) >= q_head.window + 1, max_time=cluster.now + 60.0)
    assert all(me not in leases_of(h, cluster.revision.manifest)
               for _, h, _ in v.heads if h.window >= q_head.window and me in h.quarantined)
    for name in ("t0", "t1", "reducer"):  # every node followed the same chain, quarantine included
        ids = [h.id for _, h, _ in cluster.nodes[name].heads]
        assert ids[:len(heads)] == [h.id for h in heads]
    verify_chain(cluster.revision, [(h, c) for _, h, c in v.heads])


def test_equivocating_validator_is_quarantined_by_evidence_in_a_head(tmp_path, workload):
    cluster = build_until(1, tmp_path, workload, trainers=2, validators=4, quorum=3, max_time=120.0)
    byzantine = cluster.nodes["v3"]
    bad = byzantine.identity.peer_id
    window = cluster.nodes["validator"].engine.head.window + 1
    votes = [sign_vote(byzantine.identity, cluster.revision.id, window, 0, PREVOTE, b"\x12\x20" + bytes([i]) * 32)
             for i in (1, 2)]
    # The Byzantine validator shows each of two honest validators a different vote; neither sees both
    # directly - relaying brings them together and either can build the evidence.
    for name, vote in (("validator", votes[0]), ("v1", votes[1])):
        cluster.feed(name, ev.MessageReceived(now=cluster.now, peer=bad, data=encode_message(Signed(envelope=vote))))
    assert cluster.run_until(lambda c: bad in c.nodes["validator"].engine.head.quarantined, max_time=cluster.now + 120)
    heads = [h for _, h, _ in cluster.nodes["validator"].heads]
    with_evidence = [h for h in heads if h.evidence]
    assert len(with_evidence) == 1 and with_evidence[0].evidence[0][0].signer == bad
    assert check_evidence(with_evidence[0].evidence[0], cluster.revision.id, cluster.revision.manifest) == bad
    for name in ("v1", "v2"):  # every honest validator holds the same certified record
        assert bad in cluster.nodes[name].engine.head.quarantined or \
            cluster.run_until(lambda c, n=name: bad in c.nodes[n].engine.head.quarantined, max_time=cluster.now + 30)
    verify_chain(cluster.revision, [(h, c) for _, h, c in cluster.nodes["validator"].heads])


def test_diloco_cluster_commits_outer_state_and_validators_agree(tmp_path, workload):
    cluster = build(tmp_path, workload, trainers=3, validators=4, quorum=3, outer_optimizer="diloco",
                    outer_lr=0.7, inner_steps=20)
    assert cluster.run_until(lambda c: all(head_window(c, n) >= 3 for n in ("validator", "v1", "v2", "v3")),
                             max_time=200.0)
    heads = [h for _, h, _ in cluster.nodes["validator"].heads][:3]
    assert all(not h.skipped and h.outer_state is not None for h in heads)
    assert len({h.outer_state_digest for h in heads}) == 3  # the momentum moves every window
    for name in ("v1", "v2", "v3"):
        assert [h.id for _, h, _ in cluster.nodes[name].heads][:3] == [h.id for h in heads]
    # the committed state is the momentum buffer a fresh recomputation gives
    from peerloom.backends.numpy.tensors import from_safetensors
    store = cluster.nodes["validator"].store
    state = from_safetensors(store.get(heads[0].outer_state.digest))
    assert tensor_digest(state) == heads[0].outer_state_digest
    assert heads[-1].metrics["test_accuracy"] > 0.3
    _ = to_safetensors


def test_metrics_must_match_including_nan_and_infinity():
    """A plain |a - b| > tol test passes whenever either side is NaN; claimed metrics must match ours
    exactly in kind (NaN for NaN, the same infinity) and within METRIC_TOLERANCE otherwise."""
    from peerloom.core.screening import METRIC_TOLERANCE, metrics_match

    nan, inf = float("nan"), float("inf")
    assert metrics_match({"test_loss": 0.5}, {"test_loss": 0.5 + METRIC_TOLERANCE / 2})
    assert not metrics_match({"test_loss": 0.5}, {"test_loss": 0.5 + 2 * METRIC_TOLERANCE})
    assert not metrics_match({"test_loss": 0.5}, {"test_loss": nan})  # a proposer may not hide a value
    assert not metrics_match({"test_loss": nan}, {"test_loss": 0.5})  # nor invent one for a diverged model
    assert metrics_match({"test_loss": nan}, {"test_loss": nan})  # an honest diverged head stays certifiable
    assert metrics_match({"test_loss": inf}, {"test_loss": inf})
    assert not metrics_match({"test_loss": inf}, {"test_loss": -inf})
    assert not metrics_match({"test_loss": inf}, {"test_loss": 1e308})
    assert not metrics_match({"test_loss": 0.5}, {"test_loss": 0.5, "extra": 1.0})

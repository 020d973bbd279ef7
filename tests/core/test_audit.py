"""Recomputation audits (core/audit.py, spec/protocol.md §6): a trainer's update must be what its training
produces; an update crafted to look typical (ALIE) passes statistical screening but not the audit."""

import itertools

import attrs
import pytest

from peerloom.adapters.compute import ComputeExecutor
from peerloom.adapters.storage import ArtifactStore
from peerloom.backends.behaviours import ByzantineWorkload
from peerloom.backends.numpy.tensors import to_safetensors
from peerloom.backends.registry import build_workload
from peerloom.core.audit import train_seed
from peerloom.core.chain import verify_chain
from peerloom.core.leases import leases_of
from peerloom.core.tasks import Recomputation, ReduceTask, ScreenResult, ScreenTask, TrainTask
from tests.engine_cluster import N_SHARDS, SEED, build, head_window
from tests.helpers import ident, make_revision


def test_train_seed_is_a_public_function_of_base_window_shards_and_author():
    a, b = ident(1).peer_id, ident(2).peer_id
    base = b"\x12\x20" + bytes(32)
    seed = train_seed(base, 3, (1, 4), a)
    assert seed == train_seed(base, 3, (1, 4), a) and 0 <= seed < 2**32
    variants = {train_seed(base, 4, (1, 4), a), train_seed(base, 3, (1, 5), a), train_seed(base, 3, (1, 4), b),
                train_seed(b"\x12\x20" + bytes(31) + b"\x01", 3, (1, 4), a)}
    assert seed not in variants and len(variants) == 4


@pytest.fixture(scope="module")
def digits():
    return build_workload("digits-numpy", SEED, N_SHARDS)


def test_screen_audit_passes_the_honest_update_and_rejects_a_crafted_one(tmp_path, digits):
    workload, shards = digits
    params = workload.initial_params(SEED)
    rev = make_revision(schema=tuple((k, "float32", v.shape) for k, v in params.items()))
    manifest = attrs.evolve(rev.manifest, audit=True)
    ex = ComputeExecutor(ArtifactStore(tmp_path, chunk_size=1 << 16), manifest, workload, shards)
    params_ref = ex.store.put(to_safetensors(params))
    author = ident(7).peer_id
    seed = train_seed(b"\x12\x20" + bytes(32), 1, (2,), author)
    trained = ex.run(TrainTask(params=params_ref, shards=(2,), seed=seed, inner_steps=0))
    audit = Recomputation(params=params_ref, shards=(2,), seed=seed, inner_steps=0, min_cosine=0.99)

    honest = ex.run(ScreenTask(delta=trained.delta, delta_digest=trained.delta_digest, audit=audit))
    assert honest == ScreenResult(ok=True, reason="", norm=honest.norm, detail="")

    # ALIE from a lone attacker: statistically typical, computationally false.
    alie = ByzantineWorkload(workload, "alie").train(params, [i for i in shards[2]], seed)[0]
    forged_ref, forged_digest = ex.save(alie)
    forged = ex.run(ScreenTask(delta=forged_ref, delta_digest=forged_digest, audit=audit))
    assert forged.ok is False and forged.reason == "audit"
    # The same forged update passes screening when audits are off: the audit is what catches it.
    assert ex.run(ScreenTask(delta=forged_ref, delta_digest=forged_digest)).ok is True
    # A delta trained on other shards is not this lease's computation either.
    other = ex.run(TrainTask(params=params_ref, shards=(3,), seed=seed, inner_steps=0))
    wrong = ex.run(ScreenTask(delta=other.delta, delta_digest=other.delta_digest, audit=audit))
    assert wrong.ok is False and wrong.reason == "audit"


def test_alie_trainer_is_audited_struck_and_quarantined(tmp_path, digits):
    """Connected engines over the in-memory transport: an ALIE trainer's updates fail the audit at the
    validator and the reducer, become strikes in the certified heads and quarantine it."""
    cluster = build(tmp_path, digits, trainers=3, min_updates=1, window_s=3.0, quarantine_strikes=2,
                    strike_windows=4, quarantine_windows=3, audit=True)
    attacker = cluster.nodes["t2"]
    attacker.executor.workload = ByzantineWorkload(attacker.executor.workload, "alie")
    me = attacker.identity.peer_id
    assert cluster.run_until(lambda c: me in c.nodes["validator"].engine.head.quarantined, max_time=200.0)
    v = cluster.nodes["validator"]
    heads = [h for _, h, _ in v.heads]
    assert v.engine.rejected_by_reason["screen-audit"] >= 2
    assert all(n not in v.engine.rejected_by_reason for n in ("screen-norm-outlier", "screen-cosine"))
    assert me not in leases_of(heads[-1], cluster.revision.manifest)
    # honest trainers' updates all pass their audits and keep the model training: a window is skipped
    # only when every lease in it was the attacker's (leases hash the head, so that is luck of the draw)
    assert cluster.run_until(lambda c: head_window(c) >= heads[-1].window + 1, max_time=cluster.now + 60.0)
    chain = [cluster.revision.genesis()] + [h for _, h, _ in v.heads]
    for parent, head in itertools.pairwise(chain):
        if head.skipped:
            assert set(leases_of(parent, cluster.revision.manifest)) == {me}
        else:
            assert len(head.cohort) >= 1
    verify_chain(cluster.revision, [(h, c) for _, h, c in v.heads])


def test_a_validator_that_adopts_a_head_it_did_not_compute_fetches_its_params(tmp_path, digits):
    """A validator whose reduction failed adopts the head the others certified without its params; the next
    window's collector fetches them from its peers, so its audits run instead of failing for good."""
    cluster = build(tmp_path, digits, trainers=3, validators=4, quorum=3, min_updates=1, window_s=3.0, audit=True)
    lagging = cluster.nodes["v3"]
    run = lagging.executor.run

    def reduce_fails_in_window_1(task):
        if isinstance(task, ReduceTask) and lagging.engine.head.window == 0:
            raise RuntimeError("this validator's reduction failed")
        return run(task)

    lagging.executor.run = reduce_fails_in_window_1
    assert cluster.run_until(lambda c: head_window(c, "v3") >= 3, max_time=200.0)
    first = next(h for _, h, _ in lagging.heads if h.window == 1)
    assert lagging.store.has(first.params.digest)
    assert lagging.engine.rejected_by_reason.get("screen-error", 0) == 0

"""Inner steps and update codecs in the protocol (spec/protocol.md §6-7): the train task runs exactly the
manifest's H optimizer steps; trainers announce deltas encoded with the manifest's codec; validators and
reducers decode them to screen, audit and reduce."""

import attrs
import numpy as np
import pytest

from peerloom.adapters.compute import ComputeExecutor
from peerloom.adapters.storage import ArtifactStore
from peerloom.backends._codecs import CODECS as BACKEND_CODECS
from peerloom.backends.numpy import codecs as np_codecs
from peerloom.backends.numpy.tensors import tensor_digest, to_safetensors
from peerloom.backends.registry import build_workload
from peerloom.core.audit import train_seed
from peerloom.core.chain import verify_chain
from peerloom.core.errors import DecodeError
from peerloom.core.objects import CODECS, Manifest
from peerloom.core.tasks import Recomputation, ScreenTask, TrainTask
from tests.engine_cluster import N_SHARDS, SEED, build, build_until
from tests.helpers import ident, make_revision


@pytest.fixture(scope="module")
def digits():
    return build_workload("digits-numpy", SEED, N_SHARDS)


def _executor(tmp_path, digits, **manifest_fields):
    workload, shards = digits
    params = workload.initial_params(SEED)
    rev = make_revision(schema=tuple((k, "float32", v.shape) for k, v in params.items()))
    manifest = attrs.evolve(rev.manifest, **manifest_fields)
    ex = ComputeExecutor(ArtifactStore(tmp_path, chunk_size=1 << 16), manifest, workload, shards)
    return ex, params, ex.store.put(to_safetensors(params))


def test_core_codec_names_are_the_backends():
    assert CODECS == BACKEND_CODECS


def test_train_task_runs_exactly_the_manifests_inner_steps(tmp_path, digits):
    workload, shards = digits
    ex, params, ref = _executor(tmp_path, digits, inner_steps=3)
    seed = train_seed(b"\x12\x20" + bytes(32), 1, (1,), ident(7).peer_id)
    out = ex.run(TrainTask(params=ref, shards=(1,), seed=seed, inner_steps=3))
    got = ex.load(out.delta)
    indices = list(shards[1])
    assert len(indices) > 3 * workload.batch_size  # 3 steps is well short of one pass over the lease
    three, _ = workload.train(params, indices, seed, inner_steps=3)
    assert tensor_digest(got) == tensor_digest(three) == out.delta_digest
    epoch, _ = workload.train(params, indices, seed, epochs=1)
    four, _ = workload.train(params, indices, seed, inner_steps=4)
    assert tensor_digest(got) not in (tensor_digest(epoch), tensor_digest(four))
    # inner_steps 0 keeps the workload's own local epochs
    default = ex.run(TrainTask(params=ref, shards=(1,), seed=seed, inner_steps=0))
    assert default.delta_digest == tensor_digest(workload.train(params, indices, seed)[0])


def test_manifest_refuses_unknown_codecs_and_audits_with_error_feedback():
    m = make_revision().manifest
    assert (m.codec, m.codec_fraction) == ("none", 0.01)
    for bad in ({"codec": "zip"}, {"codec": "topk", "codec_fraction": 0.0}, {"codec_fraction": 1.5},
                {"codec": "topk", "audit": True}, {"codec": "sign", "audit": True}):
        with pytest.raises(DecodeError):
            attrs.evolve(m, **bad)
    ok = attrs.evolve(m, codec="int8", audit=True)
    assert Manifest.from_cbor(ok.to_cbor()) == ok
    topk = attrs.evolve(m, codec="topk", codec_fraction=0.25)
    assert Manifest.from_cbor(topk.to_cbor()) == topk


def test_train_encodes_screen_decodes_and_topk_keeps_error_feedback(tmp_path, digits):
    ex, params, ref = _executor(tmp_path, digits, codec="topk", codec_fraction=0.1)
    author = ident(7).peer_id
    first = ex.run(TrainTask(params=ref, shards=(1,), seed=5, inner_steps=2, author=author))
    encoded = ex.load(first.delta)
    assert set(encoded) != set(params)  # the artifact is the encoded form, and its digest was announced
    assert tensor_digest(encoded) == first.delta_digest
    raw, _ = ex.workload.train(params, list(ex.shards[1]), 5, inner_steps=2)
    decoded = np_codecs.decode("topk", encoded)
    residual = ex.residuals[author].residual
    for k in raw:  # top-k with error feedback: kept + residual is exactly the delta (first window)
        assert np.array_equal(decoded[k] + residual[k], raw[k])
    screened = ex.run(ScreenTask(delta=first.delta, delta_digest=first.delta_digest))
    assert screened.ok is True
    # the next window's update carries the residual: it differs from a fresh encoding of its own delta
    second = ex.run(TrainTask(params=ref, shards=(1,), seed=5, inner_steps=2, author=author))
    assert second.delta_digest != first.delta_digest
    # the raw (unencoded) delta is not a decodable top-k artifact
    raw_ref, raw_digest = ex.save(raw)
    bad = ex.run(ScreenTask(delta=raw_ref, delta_digest=raw_digest))
    assert (bad.ok, bad.reason) == (False, "undecodable")
    # the digest announced must be the encoded tensors'
    mismatch = ex.run(ScreenTask(delta=first.delta, delta_digest=tensor_digest(decoded)))
    assert (mismatch.ok, mismatch.reason) == (False, "digest-mismatch")


def test_int8_audit_passes_an_honest_update_and_rejects_another(tmp_path, digits):
    ex, _, ref = _executor(tmp_path, digits, codec="int8", audit=True)
    seed = train_seed(b"\x12\x20" + bytes(32), 1, (2,), ident(7).peer_id)
    trained = ex.run(TrainTask(params=ref, shards=(2,), seed=seed, inner_steps=0))
    audit = Recomputation(params=ref, shards=(2,), seed=seed, inner_steps=0, min_cosine=0.999)
    honest = ex.run(ScreenTask(delta=trained.delta, delta_digest=trained.delta_digest, audit=audit))
    assert honest.ok is True
    other = ex.run(TrainTask(params=ref, shards=(3,), seed=seed, inner_steps=0))
    wrong = ex.run(ScreenTask(delta=other.delta, delta_digest=other.delta_digest, audit=audit))
    assert (wrong.ok, wrong.reason) == (False, "audit")


@pytest.mark.parametrize("codec", ["int8", "topk"])
def test_cluster_with_codec_certifies_and_trains(tmp_path, digits, codec):
    cluster = build_until(3, tmp_path, digits, trainers=3, codec=codec, codec_fraction=0.2, max_time=90.0)
    v = cluster.nodes["validator"]
    heads = [h for _, h, _ in v.heads]
    assert all(not h.skipped and len(h.cohort) >= 1 for h in heads[:3])
    verify_chain(cluster.revision, [(h, c) for _, h, c in v.heads])
    assert not any(r.startswith("screen-") for r in v.engine.rejected_by_reason)
    first = heads[0].metrics["test_accuracy"]
    assert heads[2].metrics["test_accuracy"] > first and heads[2].metrics["test_accuracy"] > 0.3
    assert v.engine.stats["proposals_confirmed"] >= 1  # the reducer decoded and reduced to the same bytes
    # trainers keep an error-feedback residual only for the biased codec
    assert bool(cluster.nodes["t0"].executor.residuals) == (codec == "topk")


def test_undecodable_update_is_a_strike(tmp_path, digits):
    """A trainer that announces its raw float32 delta in an int8 revision: validators cannot decode it, so
    it is rejected as screen-undecodable, recorded in the head and struck."""
    cluster = build(tmp_path, digits, trainers=3, codec="int8", quarantine_strikes=2)
    rogue = cluster.nodes["t2"]
    rogue.executor.manifest = attrs.evolve(cluster.revision.manifest, codec="none")
    me = rogue.identity.peer_id
    assert cluster.run_until(lambda c: any(p == me for p, _, _ in c.nodes["validator"].engine.head.strikes)
                             or me in c.nodes["validator"].engine.head.quarantined, max_time=120.0)
    v = cluster.nodes["validator"]
    assert v.engine.rejected_by_reason["screen-undecodable"] >= 1
    assert any(h.rejected for _, h, _ in v.heads)
    assert cluster.nodes["reducer"].engine.rejected_by_reason["screen-undecodable"] >= 1
    assert v.engine.peers[me].penalty >= 1  # charged to the trainer that sent it
    honest = {cluster.nodes[n].identity.peer_id for n in ("t0", "t1")}
    assert not any(p in honest for _, h, _ in v.heads for p, _, _ in h.strikes)


def test_error_feedback_residual_survives_a_restart(tmp_path, digits):
    """With a state_dir (a node's store) the top-k residual is kept on disk: a restarted executor encodes
    window 2 exactly as one that never stopped; without it the residual starts from zero again."""
    workload, shards = digits
    author = ident(7).peer_id
    fields = {"codec": "topk", "codec_fraction": 0.05}
    steady, _, ref = _executor(tmp_path / "steady", digits, **fields)
    first, _, ref1 = _executor(tmp_path / "node", digits, **fields)
    first.state_dir = tmp_path / "node"
    seed = train_seed(b"\x12\x20" + bytes(32), 1, (1,), author)
    task = {"shards": (1,), "seed": seed, "author": author}
    steady.run(TrainTask(params=ref, **task))
    first.run(TrainTask(params=ref1, **task))
    assert any(p.name.startswith("residual-") for p in (tmp_path / "node").iterdir())
    restarted = ComputeExecutor(first.store, first.manifest, workload, shards, state_dir=tmp_path / "node")
    forgetful = ComputeExecutor(first.store, first.manifest, workload, shards)
    want = steady.run(TrainTask(params=ref, **task)).delta_digest
    assert restarted.run(TrainTask(params=ref1, **task)).delta_digest == want
    assert forgetful.run(TrainTask(params=ref1, **task)).delta_digest != want
    # a residual file of another schema is ignored, not trusted
    for p in (tmp_path / "node").glob("residual-*"):
        p.write_bytes(to_safetensors({"w": np.zeros(3, np.float32)}))
    other = ComputeExecutor(first.store, first.manifest, workload, shards, state_dir=tmp_path / "node")
    fresh = ComputeExecutor(first.store, first.manifest, workload, shards)  # a zero residual
    assert other.run(TrainTask(params=ref1, **task)).delta_digest == \
        fresh.run(TrainTask(params=ref1, **task)).delta_digest

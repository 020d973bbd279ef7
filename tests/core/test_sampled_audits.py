"""Sampled audits after the fact and the loss check (spec/protocol.md §6.1, §6.2).

- the manifest fields encode only when on, and refuse settings that cannot work;
- `audit_selected` is a public, deterministic draw at the manifest's rate;
- the ``screen`` task's loss check passes an honest update and rejects one that does not lower the loss;
- connected engines: a trainer whose update fails a sampled audit is quarantined by a later head that
  carries the validators' verdicts, and `peerloom verify` checks those verdicts against the chain;
- tampered audit evidence is refused by validators and by `peerloom verify`.
"""

import attrs
import numpy as np
import pytest

from peerloom.adapters.compute import ComputeExecutor
from peerloom.adapters.storage import ArtifactStore
from peerloom.backends.behaviours import ByzantineWorkload
from peerloom.backends.numpy.tensors import to_safetensors
from peerloom.backends.registry import build_workload
from peerloom.core.audit import (
    audit_segment,
    audit_selected,
    check_audit_evidence,
    loss_batch_seed,
    train_seed,
    verdicts_needed,
)
from peerloom.core.errors import DecodeError, VerificationError
from peerloom.core.objects import AuditFailure, Manifest, make_artifact_ref, seal
from peerloom.core.tasks import (
    AuditPlanResult,
    AuditPlanTask,
    AuditResult,
    AuditTask,
    LossCheck,
    Recomputation,
    ScreenTask,
    SegmentAudit,
    TrainTask,
)
from peerloom.verify import check_audits, check_rules
from tests.engine_cluster import N_SHARDS, SEED, build
from tests.helpers import ident, make_revision


@pytest.fixture(scope="module")
def digits():
    return build_workload("digits-numpy", SEED, N_SHARDS)


# --- manifest -------------------------------------------------------------------------------------------

def test_new_manifest_fields_are_absent_when_off_and_round_trip_when_on():
    m = make_revision().manifest
    assert not {"audit_rate", "loss_check_samples", "loss_min_drop"} & set(m.to_cbor())
    on = attrs.evolve(m, audit=True, audit_rate=0.25, loss_check_samples=128, loss_min_drop=0.02)
    body = on.to_cbor()
    assert (body["audit_rate"], body["loss_check_samples"], body["loss_min_drop"]) == (0.25, 128, 0.02)
    assert Manifest.from_cbor(body) == on


@pytest.mark.parametrize("fields", [
    {"audit_rate": 0.5},  # sampled audits need audit = true
    {"audit": True, "audit_rate": 1.5},
    {"audit": True, "audit_rate": float("nan")},
    {"loss_min_drop": 0.1},  # a drop threshold without a loss check
    {"loss_check_samples": 8, "loss_min_drop": 1.0},
    {"loss_check_samples": -1},
])
def test_manifest_refuses_sampling_and_loss_settings_that_cannot_work(fields):
    with pytest.raises(DecodeError):
        attrs.evolve(make_revision().manifest, **fields)


@pytest.mark.parametrize("key, value", [("audit_rate", 0.0), ("loss_check_samples", 0), ("loss_min_drop", 0.0)])
def test_an_explicit_off_value_is_not_a_second_encoding(key, value):
    body = attrs.evolve(make_revision().manifest, audit=True).to_cbor() | {key: value}
    with pytest.raises(DecodeError):
        Manifest.from_cbor(body)


# --- selection ------------------------------------------------------------------------------------------

def test_audit_selection_is_deterministic_and_draws_at_the_rate():
    head = b"\x12\x20" + bytes(range(32))
    ids = [b"\x12\x20" + i.to_bytes(32, "big") for i in range(4000)]
    picked = [u for u in ids if audit_selected(head, u, 0.25)]
    assert picked == [u for u in ids if audit_selected(head, u, 0.25)]
    assert 1000 - 150 < len(picked) < 1000 + 150  # binomial(4000, 0.25): sd 27
    other = [u for u in ids if audit_selected(b"\x12\x20" + bytes(32), u, 0.25)]
    assert set(other) != set(picked)  # another head picks another sample
    assert not any(audit_selected(head, u, 0.0) for u in ids) and all(audit_selected(head, u, 1.0) for u in ids)


def test_loss_batch_seed_is_a_64_bit_function_of_the_update_id():
    a, b = b"\x12\x20" + bytes(32), b"\x12\x20" + bytes(31) + b"\x01"
    assert loss_batch_seed(a) == loss_batch_seed(a) != loss_batch_seed(b) and 0 <= loss_batch_seed(a) < 2**64


# --- the loss check in the screen task ------------------------------------------------------------------

def _executor(tmp_path, digits, **fields):
    workload, shards = digits
    params = workload.initial_params(SEED)
    rev = make_revision(schema=tuple((k, "float32", v.shape) for k, v in params.items()))
    ex = ComputeExecutor(ArtifactStore(tmp_path, chunk_size=1 << 16), attrs.evolve(rev.manifest, **fields),
                         workload, shards)
    return ex, params, ex.store.put(to_safetensors(params))


def test_loss_check_passes_an_honest_update_and_rejects_one_that_points_uphill(tmp_path, digits):
    ex, _params, params_ref = _executor(tmp_path, digits, loss_check_samples=64)
    seed = train_seed(b"\x12\x20" + bytes(32), 1, (2,), ident(7).peer_id)
    trained = ex.run(TrainTask(params=params_ref, shards=(2,), seed=seed, inner_steps=0))
    check = LossCheck(params=params_ref, shards=(2,), seed=5, samples=64, min_drop=0.0)
    honest = ex.run(ScreenTask(delta=trained.delta, delta_digest=trained.delta_digest, loss_check=check))
    assert honest.ok is True and "applied" in honest.detail
    flipped = {k: -v for k, v in ex.load(trained.delta).items()}
    ref, digest = ex.save(flipped)
    bad = ex.run(ScreenTask(delta=ref, delta_digest=digest, loss_check=check))
    assert (bad.ok, bad.reason) == (False, "loss")
    applied, opposite = (float(x) for x in bad.detail.split()[1:4:2])
    assert applied > opposite  # the detail says what the validator measured: the flip points uphill
    # A drop threshold the honest update does not reach rejects it too: the threshold is what decides.
    strict = ex.run(ScreenTask(delta=trained.delta, delta_digest=trained.delta_digest,
                               loss_check=attrs.evolve(check, min_drop=0.99)))
    assert (strict.ok, strict.reason) == (False, "loss")


def test_a_streamed_screen_reads_once_and_decides_as_an_in_memory_one(tmp_path, digits):
    """Where the backend streams, the screen reads the stored update once for its statistics, digest and the
    update applied (`screen_stored`): every verdict, norm and loss detail equals the in-memory screen's."""
    ex, _params, params_ref = _executor(tmp_path / "streamed", digits, loss_check_samples=64)
    whole, _, whole_params = _executor(tmp_path / "whole", digits, loss_check_samples=64)
    whole.compute.streams = False  # loaded whole: `compute.stats`, `tensor_digest`, `_applied` twice
    assert ex._streams() and not whole._streams() and whole_params == params_ref
    seed = train_seed(b"\x12\x20" + bytes(32), 1, (2,), ident(7).peer_id)
    delta = ex.load(ex.run(TrainTask(params=params_ref, shards=(2,), seed=seed, inner_steps=0)).delta)
    broken = {k: v.copy() for k, v in delta.items()}
    next(iter(broken.values())).reshape(-1)[3] = np.inf
    check = LossCheck(params=params_ref, shards=(2,), seed=5, samples=64, min_drop=0.0)
    cases = []
    for tensors, lie, extra in [(delta, False, {}), ({k: -v for k, v in delta.items()}, False, {}),
                                (delta, True, {}), (broken, False, {}), (delta, False, {"max_norm": 1e-9}),
                                (delta, False, {"loss_check": None})]:
        results = []
        for executor in (ex, whole):
            ref, digest = executor.save(tensors)
            args = {"delta": ref, "delta_digest": b"\x12\x20" + bytes(32) if lie else digest, "loss_check": check}
            results.append(executor.run(ScreenTask(**{**args, **extra})))
        assert results[0] == results[1] or (results[0].reason == results[1].reason == "non-finite")
        cases.append(results[0].reason)
    assert cases == ["", "loss", "digest-mismatch", "non-finite", "norm-bound", ""]


def test_loss_check_batch_is_the_seeded_subset_of_the_lease(tmp_path, digits):
    """Validators must agree: the same seed picks the same samples, another seed others."""
    ex, params, params_ref = _executor(tmp_path, digits, loss_check_samples=16)
    seen = []

    class Spy:
        def __init__(self, inner):
            self.inner = inner

        def loss(self, p, indices):
            seen.append(tuple(indices))
            return self.inner.loss(p, indices)

    ex.workload = Spy(ex.workload)
    zero = {k: np.zeros_like(v) for k, v in params.items()}
    for seed in (1, 1, 2):
        ok, _, _ = ex._loss_check(zero, LossCheck(params=params_ref, shards=(1,), seed=seed, samples=16,
                                                  min_drop=0.0))
        assert not ok  # an update that moves nothing does not point downhill
    lease = set(ex.shards[1])
    assert len(seen[0]) == 16 and set(seen[0]) <= lease and seen[0] == seen[1] == seen[2] == seen[3]
    assert seen[4] != seen[0] and set(seen[4]) <= lease


# --- sampled audits between connected engines ---------------------------------------------------------

def _audited_cluster(tmp_path, digits, **fields):
    cluster = build(tmp_path, digits, trainers=3, min_updates=1, window_s=3.0, quarantine_windows=3,
                    audit=True, audit_rate=1.0, **fields)
    attacker = cluster.nodes["t2"]
    attacker.executor.workload = ByzantineWorkload(attacker.executor.workload, "alie")
    return cluster, attacker.identity.peer_id


def test_a_failed_sampled_audit_quarantines_its_author_with_verdicts_in_the_head(tmp_path, digits):
    cluster, me = _audited_cluster(tmp_path, digits)
    assert cluster.run_until(lambda c: me in c.nodes["validator"].engine.head.quarantined, max_time=200.0)
    v = cluster.nodes["validator"]
    chain = [(h, c) for _, h, c in v.heads]
    carrying = [h for h, _ in chain if h.audits]
    assert len(carrying) == 1
    update, ann = check_audit_evidence(carrying[0].audits[0], cluster.revision.id, cluster.revision.manifest)
    assert update.signer == me and ann.window < carrying[0].window
    # ALIE passes statistical screening: only the audit caught it, after the head certified it.
    assert v.engine.rejected_by_reason["screen-audit"] == 0 and v.engine.stats["audits_failed"] >= 1
    assert v.engine.stats["audits_passed"] >= 1  # the honest trainers' updates reproduce
    assert "2 failed" not in " ".join(check_rules(cluster.revision, chain))
    assert any("1 failed sampled audit" in line for line in check_rules(cluster.revision, chain))
    # the reducer never replays training when audits are sampled
    assert not any(k.startswith("audits_") for k in cluster.nodes["reducer"].engine.stats)


def test_an_update_the_loss_check_rejects_is_still_audited_and_its_author_quarantined(tmp_path, digits):
    """A sign-flipped update points uphill: the loss check keeps it out of every cohort with no strike, and
    only the sampled audit of that rejected update quarantines its author (spec/protocol.md §6.2)."""
    cluster = build(tmp_path, digits, trainers=3, min_updates=1, window_s=3.0, quarantine_windows=3,
                    audit=True, audit_rate=1.0, loss_check_samples=64)
    attacker = cluster.nodes["t2"]
    attacker.executor.workload = ByzantineWorkload(attacker.executor.workload, "sign-flip")
    me = attacker.identity.peer_id
    assert cluster.run_until(lambda c: me in c.nodes["validator"].engine.head.quarantined, max_time=200.0)
    v = cluster.nodes["validator"]
    chain = [(h, c) for _, h, c in v.heads]
    by_window = {h.window: h for h, _ in chain}
    k = next(i for i, (h, _) in enumerate(chain) if h.audits)
    update, _ = check_audit_evidence(chain[k][0].audits[0], cluster.revision.id, cluster.revision.manifest)
    assert update.signer == me
    assert v.engine.rejected_by_reason["screen-loss"] >= 1
    assert not any(update.id in h.cohort for h, _ in chain)  # never certified: the loss check kept it out
    assert not any(me == peer for h, _ in chain for peer, *_ in h.strikes)  # and struck it never
    assert check_audits(cluster.revision, chain[k][0], chain[k - 1][0], by_window) == 1


def test_tampered_audit_evidence_is_refused_by_validators_and_verify(tmp_path, digits):
    cluster, me = _audited_cluster(tmp_path, digits)
    assert cluster.run_until(lambda c: me in c.nodes["validator"].engine.head.quarantined, max_time=200.0)
    v = cluster.nodes["validator"]
    chain = [(h, c) for _, h, c in v.heads]
    k = next(i for i, (h, _) in enumerate(chain) if h.audits)
    head, previous = chain[k][0], chain[k - 1][0]
    by_window = {h.window: h for h, _ in chain}
    revision, manifest = cluster.revision, cluster.revision.manifest
    assert check_audits(revision, head, previous, by_window) == 1
    verdict = head.audits[0][0]
    failure = AuditFailure.from_cbor(verdict.open(AuditFailure.KIND, 1))
    forged_by_trainer = seal(cluster.nodes["t0"].identity, failure)  # not a validator
    audits_role = v.engine._validator.audits
    bad_heads = {
        "not-a-validator": attrs.evolve(head, audits=((forged_by_trainer,),)),
        "too-few": attrs.evolve(head, audits=((),)),
        "twice": attrs.evolve(head, audits=(head.audits[0], head.audits[0])),
    }
    for name, bad in bad_heads.items():
        with pytest.raises(VerificationError):
            check_audits(revision, bad, previous, by_window)
        assert audits_role.fault(bad, previous) == "bad-audit", name
    # an update not trained on its window's base (the parent of that window's certified head)
    ann_window = check_audit_evidence(head.audits[0], revision.id, manifest)[1].window
    rebased = {**by_window, ann_window: attrs.evolve(by_window[ann_window], parent=bytes(32))}
    with pytest.raises(VerificationError, match="base"):
        check_audits(revision, head, previous, rebased)
    # an update the certified head's draw did not select
    rare = attrs.evolve(revision, manifest=attrs.evolve(manifest, audit_rate=1e-12))
    with pytest.raises(VerificationError, match="selected"):
        check_audits(rare, head, previous, by_window)
    # an author not quarantined by the head that carries its failure
    with pytest.raises(VerificationError, match="quarantined"):
        check_audits(revision, attrs.evolve(head, quarantine=()), previous, by_window)
    # a revision that does not sample audits has no audits to carry
    plain = attrs.evolve(revision, manifest=attrs.evolve(manifest, audit_rate=0.0))
    with pytest.raises(VerificationError):
        check_audits(plain, head, previous, by_window)
    assert verdicts_needed(manifest) == 1


def test_verdicts_needed_is_one_more_than_the_tolerated_faults():
    m = make_revision(validators=[ident(i) for i in range(1, 5)], quorum=3).manifest
    assert verdicts_needed(m) == 2


# --- segment audits (spec/protocol.md §6.3) ---------------------------------------------------------------

def test_segment_manifest_settings_need_sampling_and_enough_inner_steps():
    m = attrs.evolve(make_revision().manifest, audit=True, audit_rate=0.5, inner_steps=8)
    on = attrs.evolve(m, audit_segments=4, codec="topk")  # error feedback is auditable with segments
    assert Manifest.from_cbor(on.to_cbor()) == on and on.to_cbor()["audit_segments"] == 4
    for bad in ({"audit_segments": 9}, {"audit_segments": 4, "audit_rate": 0.0},
                {"audit_segments": 0, "codec": "topk"}):
        with pytest.raises(DecodeError):
            attrs.evolve(m, **bad)


def test_segment_bounds_and_choice():
    from peerloom.core.audit import audit_segment, segment_bounds
    assert segment_bounds(13, 4) == (0, 3, 6, 9, 13) and segment_bounds(4, 4) == (0, 1, 2, 3, 4)
    with pytest.raises(ValueError):
        segment_bounds(3, 4)
    head = b"\x12\x20" + bytes(32)
    picks = [audit_segment(head, b"\x12\x20" + i.to_bytes(32, "big"), 4) for i in range(400)]
    assert set(picks) == {0, 1, 2, 3} and all(60 < picks.count(j) < 140 for j in range(4))


def _trained_with_segments(tmp_path, digits, codec="none"):
    ex, _params, params_ref = _executor(tmp_path, digits, audit=True, audit_rate=1.0, inner_steps=8,
                                       audit_segments=4, codec=codec)
    author = ident(7).peer_id
    seed = train_seed(b"\x12\x20" + bytes(32), 1, (2,), author)
    out = ex.run(TrainTask(params=params_ref, shards=(2,), seed=seed, inner_steps=8, segments=4, author=author))
    audit = Recomputation(params=params_ref, shards=(2,), seed=seed, inner_steps=8, min_cosine=0.99)
    return ex, out, audit


def _segment_task(ex, out, audit, j):
    plan = ex.run(AuditPlanTask(trajectory=out.trajectory, segment=j, segments=4))
    assert plan.ok and plan.plan is not None
    bounds = (0, 2, 4, 6, 8)
    return AuditTask(delta=out.delta, audit=audit,
                     segment=SegmentAudit(plan=plan.plan, from_step=bounds[j], to_step=bounds[j + 1]))


PASSED, SEGMENT = AuditResult(ok=True, reason=""), AuditResult(ok=False, reason="segment")


@pytest.mark.parametrize("codec", ["none", "topk", "int8"])
def test_every_segment_of_an_honest_trajectory_passes(tmp_path, digits, codec):
    ex, out, audit = _trained_with_segments(tmp_path, digits, codec)
    assert len(out.committed) == 4 + (codec == "topk") + 1  # checkpoints, the residual, the trajectory
    for j in range(4):
        assert ex.run(_segment_task(ex, out, audit, j)) == PASSED


def test_a_tampered_checkpoint_or_a_delta_off_the_trajectory_fails(tmp_path, digits):
    from peerloom.backends.numpy.tensors import safetensors_views
    ex, out, audit = _trained_with_segments(tmp_path, digits)
    task = _segment_task(ex, out, audit, 1)
    assert task.segment is not None
    plan = task.segment.plan
    stop = {k: np.array(v) for k, v in safetensors_views(ex.store.get(plan.stop.digest)).items()}
    name = next(n for n in stop if not n.startswith("train_state."))
    stop[name] = stop[name] + np.float32(0.5)  # the committed state after the segment is not its replay
    fake, _ = ex.save(stop)
    bad = attrs.evolve(task, segment=attrs.evolve(task.segment, plan=attrs.evolve(plan, stop=fake)))
    assert ex.run(bad) == SEGMENT
    other = ex.run(TrainTask(params=audit.params, shards=(3,), seed=1, inner_steps=8))
    assert ex.run(attrs.evolve(task, delta=other.delta)) == AuditResult(ok=False, reason="inconsistent")
    junk = ex.store.put(b"\xa0")  # an empty map: not a trajectory
    assert ex.run(AuditPlanTask(trajectory=junk, segment=0, segments=4)) == \
        AuditPlanResult(ok=False, reason="bad-trajectory")
    not_a_state = ex.store.put(to_safetensors({"x": np.zeros(3, np.float32)}))
    assert ex.run(attrs.evolve(task, segment=attrs.evolve(task.segment, plan=attrs.evolve(plan, start=not_a_state)))) \
        == AuditResult(ok=False, reason="bad-checkpoint")


@pytest.mark.parametrize("behaviour, codec", [("lazy", "none"), ("lazy", "topk"), ("free-rider-noise", "int8"),
                                              ("replayer", "none")])
def test_segment_audits_quarantine_cheaters_and_pass_honest_trainers(tmp_path, digits, behaviour, codec):
    cluster = build(tmp_path, digits, trainers=3, min_updates=1, window_s=3.0, quarantine_windows=3, audit=True,
                    audit_rate=1.0, audit_segments=4, inner_steps=8, codec=codec)
    attacker = cluster.nodes["t2"]
    attacker.executor.workload = ByzantineWorkload(attacker.executor.workload, behaviour)
    me = attacker.identity.peer_id
    assert cluster.run_until(lambda c: me in c.nodes["validator"].engine.head.quarantined, max_time=120.0)
    v = cluster.nodes["validator"].engine
    assert v.stats["audits_failed"] >= 1 and v.stats["audits_passed"] >= 1
    audited = [check_audit_evidence(a, cluster.revision.id, cluster.revision.manifest)[0].signer
               for _, h, _ in cluster.nodes["validator"].heads for a in h.audits]
    assert audited and set(audited) == {me}  # only the cheater; every honest segment replayed true
    # honest trainers keep only what a selected audit still needs: no unselected checkpoint stays served
    t0 = cluster.nodes["t0"].engine
    trainer = t0._trainer
    kept = {ref.digest for _, refs in trainer.kept.values() for ref in refs}
    assert len(trainer.kept) <= 8 and kept <= set(t0.fetching.stored)


def test_an_author_that_does_not_serve_its_checkpoints_fails_the_audit(tmp_path, digits):
    cluster = build(tmp_path, digits, trainers=3, min_updates=1, window_s=3.0, quarantine_windows=3, audit=True,
                    audit_rate=1.0, audit_segments=4, inner_steps=8)
    withholder = cluster.nodes["t1"]
    trainer = withholder.engine._trainer
    commit = trainer._commit

    def forget_at_once(window, envelope, result):
        commit(window, envelope, result)
        withholder.engine.drop_stored(ref.digest for ref in result.committed[:-1])  # all but the trajectory

    trainer._commit = forget_at_once
    me = withholder.identity.peer_id
    assert cluster.run_until(lambda c: me in c.nodes["validator"].engine.head.quarantined, max_time=120.0)


def test_a_committed_lazy_trainer_is_caught_by_a_fabricated_segment_not_by_its_delta(tmp_path, digits):
    """The lazy trainer's trajectory ends exactly in its delta, and its first quarter is real: audits of its
    first segment pass and of the fabricated ones fail as ``segment`` (spec/protocol.md §6.3)."""
    ex, _params, params_ref = _executor(tmp_path, digits, audit=True, audit_rate=1.0, inner_steps=8,
                                        audit_segments=4)
    ex.workload = ByzantineWorkload(ex.workload, "lazy")
    seed = train_seed(b"\x12\x20" + bytes(32), 1, (2,), ident(7).peer_id)
    out = ex.run(TrainTask(params=params_ref, shards=(2,), seed=seed, inner_steps=8, segments=4))
    audit = Recomputation(params=params_ref, shards=(2,), seed=seed, inner_steps=8, min_cosine=0.99)
    verdicts = [ex.run(_segment_task(ex, out, audit, j)) for j in range(4)]
    assert verdicts[0] == PASSED
    assert verdicts[1:] == [SEGMENT] * 3


def test_an_honest_trainer_down_when_audited_is_audited_once_it_is_back(tmp_path, digits):
    """A segment audit needs the author's checkpoints; an author that is unreachable then (a crash) gets
    `UNSERVED_GRACE_WINDOWS` heads to come back before the audit fails (spec/protocol.md §6.3)."""
    cluster = build(tmp_path, digits, trainers=3, min_updates=1, window_s=3.0, audit=True, audit_rate=1.0,
                    audit_segments=4, inner_steps=8)
    v = cluster.nodes["validator"]
    assert cluster.run_until(lambda c: v.engine.head.window >= 1, max_time=60.0)
    cluster.crash("t1")  # right as the head that selects its update for audit arrives
    window = v.engine.head.window
    assert cluster.run_until(lambda c: v.engine.head.window >= window + 1, max_time=cluster.now + 60.0)
    cluster.restart("t1")
    assert cluster.run_until(lambda c: v.engine.head.window >= window + 4, max_time=cluster.now + 120.0)
    me = cluster.nodes["t1"].identity.peer_id
    stalled = [f for _, node, event, f in cluster.logs if node == "validator" and event == "audit-stalled"]
    assert stalled and all(f["author"] == str(me) for f in stalled)
    assert v.engine.stats["audits_passed"] >= 1 and "audits_failed" not in v.engine.stats
    assert all(me not in h.quarantined and not h.audits for _, h, _ in v.heads)


def test_a_trainer_keeps_the_checkpoints_of_a_selected_update_that_is_not_in_the_cohort(tmp_path, digits):
    """Validators audit the updates their loss check rejected too (spec/protocol.md §6.2), and a head does
    not say which those were: a trainer keeps what the audit of each of its selected updates needs, in the
    cohort or not, or an honest trainer whose update the loss check rejected would fail its audit."""
    cluster = build(tmp_path, digits, trainers=2, min_updates=1, window_s=3.0, audit=True, audit_rate=1.0,
                    audit_segments=4, inner_steps=8)
    assert cluster.run_until(lambda c: c.nodes["t0"].engine.head.window >= 1, max_time=60.0)
    engine = cluster.nodes["t0"].engine
    trainer, head = engine._trainer, engine.head
    refs = tuple(make_artifact_ref(bytes([i]) * 64, 16 * 1024) for i in range(5))  # 4 checkpoints, trajectory
    outside = bytes(32)
    assert outside not in head.cohort and not head.skipped
    trainer.committed[outside] = (head.window, refs)
    trainer._retire_commitments(head)
    j = audit_segment(head.id, outside, 4)
    assert trainer.kept[outside] == (head.window, tuple(refs[i] for i in sorted({*(k for k in (j - 1, j) if k >= 0),
                                                                                  3, 4})))

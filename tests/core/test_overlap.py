"""Overlapped windows (spec/protocol.md §5.2): with the manifest's `overlap` k a trainer trains window w from
a certified head up to k windows older than w's parent, starting as soon as it has published the window
before; leases of window w come from the head of window w - 1 - k; validators screen each update against its
own base and reduce onto the window's parent. Also: an announcement for a window the node has not reached
costs its sender nothing (no quota, no penalty)."""

import attrs
import pytest

from peerloom.backends.registry import build_workload
from peerloom.core.chain import verify_chain
from peerloom.core.encoding import content_id
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.errors import DecodeError
from peerloom.core.leases import lease_window, leases_of
from peerloom.core.messages import Signed
from peerloom.core.objects import MAX_OVERLAP, PROTOCOL_VERSION, Manifest, UpdateAnnouncement, seal
from peerloom.verify import check_rules
from tests.engine_cluster import N_SHARDS, SEED, build, head_window
from tests.helpers import ident, make_revision
from tests.validator_harness import Lone, delta_of


@pytest.fixture(scope="module")
def workload():
    return build_workload("digits-mlp", SEED, N_SHARDS)


def announcements(cluster, name):
    """The update announcements trainer `name` made durable (its `claim/<window>` records), by window."""
    node = cluster.nodes[name]
    out = {}
    for key, record in node.store.records().items():
        parts = key.split("/")
        if parts[0] == "claim" and len(parts) == 2:
            envelope = SignedEnvelope.from_bytes(record)
            out[int(parts[1])] = UpdateAnnouncement.from_cbor(envelope.open(UpdateAnnouncement.KIND, PROTOCOL_VERSION))
    return out


def test_manifest_overlap_is_absent_when_off_and_bounded():
    m = make_revision(trainers=[ident(10)]).manifest
    assert "overlap" not in m.to_cbor()  # revisions before the field keep their ids
    on = attrs.evolve(m, overlap=1)
    assert on.to_cbor()["overlap"] == 1 and Manifest.from_cbor(on.to_cbor()).overlap == 1
    with pytest.raises(DecodeError, match="absent when off"):
        Manifest.from_cbor(m.to_cbor() | {"overlap": 0})
    with pytest.raises(DecodeError, match="overlap"):
        attrs.evolve(m, overlap=MAX_OVERLAP + 1)
    with pytest.raises(DecodeError, match="lease_s"):
        attrs.evolve(m, overlap=1, lease_s=0.5 * m.window_s)  # claims need the window open: no overlap


def test_lease_window():
    m = make_revision(trainers=[ident(10)]).manifest
    assert [lease_window(w, m) for w in (1, 2, 3)] == [0, 1, 2]
    k1 = attrs.evolve(m, overlap=1)
    assert [lease_window(w, k1) for w in (1, 2, 3, 4)] == [0, 0, 1, 2]
    genesis = make_revision(trainers=[ident(10), ident(11)], shards=(10,) * 8).genesis()
    # the window is part of each slot's key: one head draws different leases for two windows
    assert leases_of(genesis, m) == leases_of(genesis, m, 1)
    assert leases_of(genesis, m, 1) != leases_of(genesis, m, 2) or len(genesis.roster) < 2


@pytest.fixture(scope="module")
def overlapped_fleet(tmp_path_factory, workload):
    """One overlapped fleet (2 trainers, window 5 s, overlap 1) run until the validator holds window 5, shared
    by the tests below that only read it (a simulated run is deterministic: its first windows are those of
    a shorter run): (cluster, whether it got there within 120 s of virtual time)."""
    cluster = build(tmp_path_factory.mktemp("overlap"), workload, trainers=2, window_s=5.0, overlap=1)
    return cluster, cluster.run_until(lambda c: head_window(c) >= 5, max_time=120.0)


def test_overlapped_fleet_trains_ahead_on_older_bases_and_its_chain_verifies(overlapped_fleet):
    cluster, reached = overlapped_fleet
    m = cluster.revision.manifest
    assert reached
    v = cluster.nodes["validator"]
    chain = [(h, c) for _, h, c in v.heads]
    verify_chain(cluster.revision, chain)
    assert check_rules(cluster.revision, chain)
    by_window = {0: cluster.revision.genesis()} | {h.window: h for h, _ in chain}
    ids = {h.id: h.window for h in by_window.values()}
    lags = []
    for name in ("t0", "t1"):
        me = cluster.nodes[name].identity.peer_id
        for window, ann in announcements(cluster, name).items():
            if window not in by_window:
                continue
            # its base is a certified head the window allows, and its lease comes from the lease head
            assert window - 1 - m.overlap <= ids[ann.base] <= window - 1
            lags.append(window - 1 - ids[ann.base])
            assert ann.shards == leases_of(by_window[lease_window(window, m)], m, window)[me]
    assert 1 in lags  # trainers did train ahead of the chain
    for head, _ in chain:  # every update the trainers published made it into a certified cohort
        assert not head.skipped
    # the model learned, with every pseudo-gradient applied one window late
    assert chain[-1][0].metrics["test_accuracy"] > 0.5


def test_overlapped_trainer_starts_the_next_window_before_the_head(overlapped_fleet):
    cluster, _ = overlapped_fleet
    # the run up to the validator's head of window 3, within 90 s of virtual time
    reached = [t for t, h, _ in cluster.nodes["validator"].heads if h.window >= 3]
    assert reached and reached[0] <= 90.0
    logs = [(t, n, e, f) for t, n, e, f in cluster.logs if t <= reached[0]]
    heads = {f["window"]: t for t, n, e, f in logs if n == "t0" and e == "head"}
    leases = [(t, f["window"]) for t, n, e, f in logs if n == "t0" and e == "lease"]
    # t0 took a lease of window w before it held the head of window w - 1 (the window's parent)
    assert any(heads.get(w - 1, float("inf")) > t for t, w in leases if w >= 2)


def overlapped(**kw):
    v = Lone(trainers=2, manifest={"overlap": 1, "idle_windows": 0}, shards=(10,) * 4, **kw)
    v.start(0.0)
    for t in v.trainers:
        v.greet(t, ("trainer",))
    return v


def test_an_announcement_for_a_window_ahead_costs_its_sender_nothing():
    v = overlapped()
    t = v.trainers[0]
    genesis = v.engine.head
    m = v.revision.manifest
    for window in range(2, 2 + 3 * v.engine.config.announcement_slack + 10):
        shards = leases_of(genesis, m, window).get(t.peer_id, (0,))
        v.signed(t, UpdateAnnouncement(revision=v.revision.id, window=window, base=genesis.id, shards=shards,
                                       delta=delta_of(t), delta_digest=delta_of(t).digest, train_loss=0.5))
    assert v.engine.rejected_by_reason["ahead"] > 0
    assert "announce-quota" not in v.engine.rejected_by_reason
    assert v.engine.peers[t.peer_id].penalty == 0
    v.announce(t)  # its update for the open window is still taken
    assert t.peer_id in v.role.collector.entries


def test_base_older_than_the_overlap_is_wrong_base():
    v = overlapped()
    c = v.role.collector
    assert c.window == 1 and set(c.bases) == {v.engine.head.id}
    t = v.trainers[0]
    stale = seal(t, UpdateAnnouncement(revision=v.revision.id, window=1, base=content_id(b"an older head"), shards=(0,),
                                       delta=delta_of(t), delta_digest=delta_of(t).digest, train_loss=0.5))
    v.deliver(t, Signed(envelope=stale))
    assert v.engine.rejected_by_reason["wrong-base"] == 1


def test_eager_starts_are_recomputed_by_audits_and_the_loss_check(tmp_path, workload):
    """An update one window ahead names its author's previous update as `prior` and trains from the base moved
    by it (spec/protocol.md §5.2); validators replay that start in the inline audit and the loss check, so
    every honest update passes both, and the chain verifies."""
    cluster = build(tmp_path, workload, trainers=2, window_s=5.0, overlap=1, audit=True, loss_check_samples=16,
                    outer_optimizer="diloco", outer_lr=0.7)
    assert cluster.run_until(lambda c: head_window(c) >= 4, max_time=120.0)
    v = cluster.nodes["validator"]
    chain = [(h, c) for _, h, c in v.heads]
    verify_chain(cluster.revision, chain)
    assert check_rules(cluster.revision, chain)
    cohort = {u for h, _ in chain for u in h.cohort}
    priors = [(w, ann) for name in ("t0", "t1") for w, ann in announcements(cluster, name).items()
              if ann.prior is not None]
    assert priors, "no update started from its prior"
    certified = [ann for w, ann in priors if w <= chain[-1][0].window]
    assert all(ann.prior in cohort for ann in certified)  # a prior is always a certified update
    for reason in ("screen-audit", "screen-loss", "bad-prior"):
        assert v.engine.rejected_by_reason[reason] == 0, reason
    assert not any(h.skipped for h, _ in chain)


def test_start_params_follow_the_eager_rule_and_the_audit_checks_the_start(tmp_path):
    """`ComputeExecutor.start_params` is ``params - scale * outer_state - decode(prior)`` in float64, rounded
    once (spec/protocol.md §5.2); an update trained from the plain base while naming a prior fails the audit,
    one trained from the start passes."""
    import numpy as np

    from peerloom.adapters.compute import ComputeExecutor
    from peerloom.adapters.storage import ArtifactStore
    from peerloom.backends.numpy.tensors import to_safetensors
    from peerloom.core.audit import start_args, train_seed
    from peerloom.core.tasks import Recomputation, ScreenTask, TrainTask

    workload, shards = build_workload("digits-numpy", SEED, N_SHARDS)
    params = workload.initial_params(SEED)
    rev = make_revision(schema=tuple((k, "float32", v.shape) for k, v in params.items()))
    manifest = attrs.evolve(rev.manifest, audit=True, outer_optimizer="diloco", outer_lr=0.7, outer_momentum=0.9,
                            overlap=1)
    ex = ComputeExecutor(ArtifactStore(tmp_path, chunk_size=1 << 16), manifest, workload, shards)
    params_ref = ex.store.put(to_safetensors(params))
    rng = np.random.default_rng(0)
    state = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}
    state_ref = ex.store.put(to_safetensors(state))
    seed = train_seed(b"\x12\x20" + bytes(32), 3, (2,), ident(7).peer_id)
    prior = ex.run(TrainTask(params=params_ref, shards=(1,), seed=seed, inner_steps=0))
    base = attrs.evolve(rev.genesis(), params=params_ref, outer_state=state_ref)
    start = start_args(manifest, base, prior.delta)
    assert start is not None and start.scale == pytest.approx(0.7 * 0.81)
    got = ex.start_params(params_ref, start)
    prior_tensors = ex.load(prior.delta)
    for name, p in params.items():
        want = (p.astype(np.float64) - start.scale * state[name].astype(np.float64)
                - prior_tensors[name].astype(np.float64)).astype(np.float32)
        assert np.array_equal(got[name], want)
    # a fresh executor reads all three inputs block by block from their files: the same bytes
    fresh = ComputeExecutor(ex.store, manifest, workload, shards, compute_threads=2).start_params(params_ref, start)
    assert all(fresh[k].tobytes() == got[k].tobytes() for k in params)
    assert start_args(manifest, base, None) is None  # no prior: the base itself
    audit = Recomputation(params=params_ref, start=start, shards=(2,), seed=seed, inner_steps=0, min_cosine=0.99)
    eager = ex.run(TrainTask(params=params_ref, start=start, shards=(2,), seed=seed, inner_steps=0))
    plain = ex.run(TrainTask(params=params_ref, shards=(2,), seed=seed, inner_steps=0))
    assert ex.run(ScreenTask(delta=eager.delta, delta_digest=eager.delta_digest, audit=audit)).ok
    lazy = ex.run(ScreenTask(delta=plain.delta, delta_digest=plain.delta_digest, audit=audit))
    assert lazy.ok is False and lazy.reason == "audit"


def test_a_prior_on_an_update_trained_from_the_parent_is_bad_prior():
    v = overlapped()
    t = v.trainers[0]
    genesis = v.engine.head
    shards = leases_of(genesis, v.revision.manifest, 1)[t.peer_id]
    v.signed(t, UpdateAnnouncement(revision=v.revision.id, window=1, base=genesis.id, shards=shards,
                                   delta=delta_of(t), delta_digest=delta_of(t).digest, train_loss=0.5,
                                   prior=content_id(b"some update")))
    assert v.engine.rejected_by_reason["bad-prior"] == 1 and v.engine.peers[t.peer_id].penalty == 1
    assert t.peer_id not in v.role.collector.entries
    decoded = UpdateAnnouncement.from_cbor(v.announcement(t).open(UpdateAnnouncement.KIND,
                                                                    PROTOCOL_VERSION))
    assert decoded.prior is None and "prior" not in decoded.to_cbor()  # absent unless set


def test_an_overlapped_trainer_trains_on_while_its_claim_is_written(overlapped_fleet):
    """With overlap the trainer goes on to the next window when it has signed its update, not when the claim
    (and the delta, fsynced first) is durable; the announcement itself is sent only once it is (§5.2)."""
    cluster, _ = overlapped_fleet
    events = [(t, e, f) for t, n, e, f in cluster.logs if n == "t0" and e in ("lease", "announce")]
    announced = {f["window"]: t for t, e, f in events if e == "announce"}
    leased = {f["window"]: t for t, e, f in events if e == "lease"}
    went_on = [w for w in announced if w + 1 in leased and leased[w + 1] < announced[w]]
    assert went_on  # the next lease (its training) began while the claim before it was being written

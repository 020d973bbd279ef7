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
from tests.core.test_engine_pair import N_SHARDS, SEED, build, head_window
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

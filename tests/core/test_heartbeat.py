"""Heartbeats and idle expiry (spec/protocol.md §5): with the manifest's `idle_windows` > 0, a rostered trainer
unheard (heartbeat, update or join) for that many windows is dropped from the roster and recorded in the
head's `expired`; a live trainer without a lease keeps its place by its heartbeats; a validator refuses a
proposal expiring a peer it heard (`expired-heard`); heartbeats over quota are charged; `peerloom verify`
allows a roster to shrink only by `left` and `expired`."""

import attrs
import pytest

from peerloom.backends.registry import build_workload
from peerloom.core import events as ev
from peerloom.core.admission import Admission
from peerloom.core.chain import verify_chain
from peerloom.core.errors import DecodeError, VerificationError
from peerloom.core.leases import leases_of
from peerloom.core.messages import Signed, encode_message
from peerloom.core.objects import Head, Heartbeat, Manifest, Revision, seal
from peerloom.core.trainer import TrainerRole
from peerloom.core.validator import ValidatorRole
from peerloom.verify import check_rules
from tests.engine_cluster import N_SHARDS, SEED, build, build_until, first_head_without, head_window
from tests.helpers import ident

VALIDATORS = ("validator", "v1", "v2", "v3")


@pytest.fixture(scope="module")
def digits():
    return build_workload("digits-numpy", SEED, N_SHARDS)


def validator_role(cluster, name="validator"):
    return next(r for r in cluster.nodes[name].engine.roles if isinstance(r, ValidatorRole))


def roster(cluster, name="validator"):
    return {p for p, _ in cluster.nodes[name].engine.head.roster}


def heads(cluster, name="validator"):
    return [h for _, h, _ in cluster.nodes[name].heads]


def deliver(cluster, name, sender, envelope):
    cluster.feed(name, ev.MessageReceived(now=cluster.now, peer=sender, data=encode_message(Signed(envelope=envelope))))


def test_objects_round_trip_and_decode_strictly(tmp_path, digits):
    cluster = build(tmp_path, digits, trainers=3, idle_windows=2)
    m = cluster.revision.manifest
    assert m.idle_windows == 2 and Manifest.from_cbor(m.to_cbor()) == m
    off = attrs.evolve(m, idle_windows=0)  # off: the key is absent, so the encoding is as before the field
    assert "idle_windows" not in off.to_cbor() and Manifest.from_cbor(off.to_cbor()) == off
    with pytest.raises(DecodeError):
        Manifest.from_cbor({**off.to_cbor(), "idle_windows": 0})  # one encoding per manifest
    with pytest.raises(DecodeError):
        attrs.evolve(m, idle_windows=-1)
    genesis = cluster.revision.genesis()
    peers = sorted(p for p, _ in genesis.roster)
    head = attrs.evolve(genesis, left=(peers[0],), expired=tuple(peers[1:]))
    assert Head.from_cbor(head.to_cbor()) == head and head.id != attrs.evolve(head, expired=()).id
    for bad in (attrs.evolve(head, expired=tuple(reversed(peers[1:]))), attrs.evolve(head, expired=(peers[0],))):
        with pytest.raises(DecodeError):  # unsorted, or also in left
            Head.from_cbor(bad.to_cbor())
    assert "expired" not in genesis.to_cbor()  # absent when empty: heads without expiries hash as before
    with pytest.raises(DecodeError):
        Head.from_cbor({**genesis.to_cbor(), "expired": []})
    beat = Heartbeat(revision=cluster.revision.id, window=5)
    assert Heartbeat.from_cbor(beat.to_cbor()) == beat
    with pytest.raises(DecodeError):
        Heartbeat.from_cbor({**beat.to_cbor(), "extra": 1})


def test_stopped_trainer_expires_after_idle_windows_and_others_stay(tmp_path, digits):
    cluster = build(tmp_path, digits, trainers=3, validators=4, quorum=3, idle_windows=2)
    t0 = cluster.nodes["t0"].identity.peer_id
    assert cluster.run_until(lambda c: head_window(c) >= 1, max_time=60.0)
    crashed_at = max(head_window(cluster, n) for n in VALIDATORS)  # last window t0 may have been heard in + 1
    cluster.crash("t0")
    assert cluster.run_until(lambda c: all(t0 not in roster(c, n) for n in VALIDATORS), max_time=cluster.now + 90)
    chain = heads(cluster)
    gone = chain[-1]
    assert gone.expired == (t0,) and gone.left == ()
    assert all(not h.expired for h in chain[:-1])
    # unheard in windows crashed_at+1 .. gone.window at most: idle_windows (2) windows, plus the window of the crash
    assert gone.window <= crashed_at + 3
    assert t0 not in leases_of(gone, cluster.revision.manifest)
    assert roster(cluster) == {cluster.nodes[n].identity.peer_id for n in ("t1", "t2")}
    assert not any(e == "proposal-invalid" for _, _, e, _ in cluster.logs)  # relayed heartbeats: one view
    w = gone.window
    assert cluster.run_until(lambda c: head_window(c) >= w + 2, max_time=cluster.now + 60)
    assert len(roster(cluster)) == 2 and not any(h.expired for h in heads(cluster)[len(chain):])
    entries = [(h, c) for _, h, c in cluster.nodes["validator"].heads]
    verify_chain(cluster.revision, entries)
    assert check_rules(cluster.revision, entries)
    # the expired peer may join again: restarted, it is no longer rostered and so sends a join
    cluster.restart("t0", [*VALIDATORS, "reducer"])
    assert cluster.run_until(lambda c: all(t0 in roster(c, n) for n in VALIDATORS), max_time=cluster.now + 60)
    entries = [(h, c) for _, h, c in cluster.nodes["validator"].heads]
    assert check_rules(cluster.revision, entries)


def test_live_trainer_without_a_lease_keeps_its_place(tmp_path, digits, monkeypatch):
    trainers = N_SHARDS + 2  # at least two trainers without a lease in every window

    def run(path):
        cluster = build(path, digits, trainers=trainers, idle_windows=2)
        assert cluster.run_until(lambda c: head_window(c) >= 5 or any(h.expired for h in heads(c)),
                                 max_time=200.0)
        return cluster

    cluster = run(tmp_path / "beats")
    assert head_window(cluster) >= 5 and len(roster(cluster)) == trainers
    assert not any(h.expired for h in heads(cluster))
    assert validator_role(cluster).engine.stats["stale_heartbeats"] == 0
    # the same cluster without heartbeats: a trainer left without a lease for two windows expires
    monkeypatch.setattr(TrainerRole, "_send_beat", lambda self, validator: None)
    quiet = run(tmp_path / "quiet")
    expired = [p for h in heads(quiet) for p in h.expired]
    assert expired and len(roster(quiet)) < trainers


def test_proposal_expiring_a_peer_heard_here_is_refused(tmp_path, digits):
    cluster = build_until(3, tmp_path, digits, trainers=2, idle_windows=2)
    role = validator_role(cluster)
    parent = role.collector.head
    t0 = cluster.nodes["t0"].identity.peer_id
    skip = role.screening.skip_head(parent, ())
    assert skip.expired == () and role.screening.structural_fault(skip, ()) == ""
    expiring = attrs.evolve(skip, roster=tuple(x for x in skip.roster if x[0] != t0), expired=(t0,))
    assert role.screening.structural_fault(expiring, ()) == "expired-heard"
    assert role.validity(expiring, ()) is False
    # ... unless a quorum prevoted it (some honest validator had not heard t0): then a locked head stays
    # acceptable to validators whose view differs, and agreement stays live
    role.agreement.prevotes[7] = {role.engine.me: {expiring.id}}
    assert role.screening.structural_fault(expiring, ()) == ""
    del role.agreement.prevotes[7]
    dropped = attrs.evolve(expiring, expired=())
    assert role.screening.structural_fault(dropped, ()) == "roster-shrunk"
    assert role.screening.structural_fault(attrs.evolve(skip, expired=(t0,)), ()) == "expired-unknown"  # still rostered
    # once t0 is unheard here for idle_windows windows, the same expiry is valid and this validator makes it
    role.admission.heard[t0] = parent.window + 1 - 2
    role.admission.first_window = 0
    assert role.screening.structural_fault(expiring, ()) == ""
    assert role.screening.skip_head(parent, ()).expired == (t0,)
    assert t0 not in {p for p, _ in role.screening.skip_head(parent, ()).roster}


def test_a_proposer_with_a_wrong_view_costs_a_round_not_the_peer(tmp_path, digits, monkeypatch):
    cluster = build(tmp_path, digits, trainers=3, validators=4, quorum=3, idle_windows=2)
    t1 = cluster.nodes["t1"].identity.peer_id
    assert cluster.run_until(lambda c: head_window(c) >= 1, max_time=60.0)
    liar = validator_role(cluster, "v1")
    original = Admission.idle
    monkeypatch.setattr(Admission, "idle", lambda self, peer, window: (self is liar.admission and peer == t1)
                        or original(self, peer, window))

    def refused(c) -> list:
        return [f for _, n, e, f in c.logs if e == "proposal-invalid" and f["reason"] == "expired-heard"]

    # Proposers rotate by a hash of the head, so v1's turn comes at some window, not a fixed one.
    assert cluster.run_until(lambda c: refused(c) and head_window(c) >= 7, max_time=cluster.now + 600)
    assert refused(cluster)  # v1 proposed expiring t1 (at least once) and the honest validators refused it
    assert all(t1 in {p for p, _ in h.roster} and not h.expired for h in heads(cluster))
    entries = [(h, c) for _, h, c in cluster.nodes["validator"].heads]
    verify_chain(cluster.revision, entries)


def test_heartbeats_over_quota_are_charged_and_stale_ones_ignored(tmp_path, digits):
    cluster = build_until(1, tmp_path, digits, trainers=2, validators=4, quorum=3, idle_windows=2)
    role = validator_role(cluster)
    window = role.window
    cluster.run_until(lambda c: False, max_time=cluster.now + 0.5)  # heartbeats and relays arrive
    engine = role.engine
    assert role.window == window
    t0 = cluster.nodes["t0"].identity
    v1 = cluster.nodes["v1"].identity.peer_id
    beat = seal(t0, Heartbeat(revision=cluster.revision.id, window=window))
    # t0 already sent this window's heartbeat itself when the window opened: again is over its quota
    assert (t0.peer_id, t0.peer_id, window) in role.admission.heartbeats_taken
    deliver(cluster, "validator", t0.peer_id, beat)
    assert engine.rejected_by_reason["heartbeat-quota"] == 1 and engine.peers[t0.peer_id].penalty > 0
    # each relayer has a quota of its own: v1 relayed it once already, a second copy is charged to v1
    assert (v1, t0.peer_id, window) in role.admission.heartbeats_taken
    deliver(cluster, "validator", v1, beat)
    assert engine.rejected_by_reason["heartbeat-quota"] == 2 and engine.peers[v1].penalty > 0
    # a heartbeat for an old window has no effect and costs nothing; nor one from a peer outside the roster
    stale = engine.stats["stale_heartbeats"]
    t1 = cluster.nodes["t1"].identity.peer_id
    before = engine.peers[t1].penalty
    deliver(cluster, "validator", t1, seal(cluster.nodes["t1"].identity,
                                         Heartbeat(revision=cluster.revision.id, window=window - 1)))
    stranger = seal(ident(40), Heartbeat(revision=cluster.revision.id, window=window))
    deliver(cluster, "validator", t1, stranger)
    assert engine.stats["stale_heartbeats"] == stale + 2 and engine.peers[t1].penalty == before
    assert ident(40).peer_id not in role.admission.heard
    # heard windows advance with heartbeats
    assert role.admission.heard[t0.peer_id] >= window


def test_check_rules_refuses_a_shrink_not_covered_by_left_or_expired(tmp_path, digits):
    cluster = build_until(2, tmp_path, digits, trainers=2, idle_windows=2)
    chain, t0, shrunk = first_head_without(cluster)
    first, cert = chain[0]
    with pytest.raises(VerificationError) as info:
        check_rules(cluster.revision, [(shrunk, cert)])
    assert info.value.reason == "roster-shrunk"
    assert check_rules(cluster.revision, [(attrs.evolve(shrunk, expired=(t0,)), cert)])
    with pytest.raises(VerificationError):  # expired names a peer that is still in the roster
        check_rules(cluster.revision, [(attrs.evolve(first, expired=(t0,)), cert)])
    with pytest.raises(VerificationError):  # both left and expired
        check_rules(cluster.revision, [(attrs.evolve(shrunk, left=(t0,), expired=(t0,)), cert)])
    # a revision with expiry off accepts no expired peer at all
    m = attrs.evolve(cluster.revision.manifest, idle_windows=0)
    off = Revision.verify(m.seal(ident(99)), ident(99).peer_id)
    with pytest.raises(VerificationError) as info:
        check_rules(off, [(attrs.evolve(shrunk, expired=(t0,)), cert)])
    assert info.value.reason == "expired-disabled"

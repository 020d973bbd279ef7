"""Liveness under Sybils (spec/protocol.md §4.1, issue 16 finding 2): unproven trainers hold a bounded share
of the leases, non-delivering unproven leaseholders are dropped, joins are bounded and kept by priority."""

import os

import attrs
import pytest

from peerloom.backends.registry import build_workload
from peerloom.core.encoding import decode, encode
from peerloom.core.errors import DecodeError
from peerloom.core.identity import Identity
from peerloom.core.leases import rank_shards, unproven_cap
from peerloom.core.objects import Head, JoinRequest, Manifest, seal
from peerloom.core.validator import ValidatorRole, join_priority, next_unproven, undelivered

from .helpers import ident, make_revision
from .test_engine_pair import N_SHARDS, SEED, build, head_window

PROVEN = [(ident(10 + i).peer_id, 1) for i in range(2)]
SYBILS = [(ident(100 + i).peer_id, 4) for i in range(40)]


def _owners(ranked):
    return [peers[0] for _, peers in sorted(ranked.items())]


@pytest.mark.parametrize("window", range(6))
def test_unproven_trainers_hold_at_most_their_share(window):
    roster = sorted(PROVEN + SYBILS)
    unproven = frozenset(p for p, _ in SYBILS)
    ranked = rank_shards(b"h" * 34, window, 12, roster, 4, unproven=unproven, unproven_share=0.25)
    owners = _owners(ranked)
    assert len(owners) == 12 and sum(o in unproven for o in owners) <= unproven_cap(12, 0.25) == 3
    # Without the cap the 160 Sybil slots take nearly every shard.
    uncapped = _owners(rank_shards(b"h" * 34, window, 12, roster, 4))
    assert sum(o in unproven for o in uncapped) >= 10
    # Every shard still has a next-ranked trainer other than its owner.
    assert all(len(p) == 2 and p[0] != p[1] for p in ranked.values())


def test_the_cap_needs_a_proven_trainer_and_leaves_everything_else_as_it_was():
    sybils = sorted(SYBILS)
    unproven = frozenset(p for p, _ in SYBILS)
    only = rank_shards(b"h" * 34, 1, 12, sybils, 4, unproven=unproven, unproven_share=0.25)
    assert len(_owners(only)) == 12  # nobody proven yet (a revision that starts empty): no cap
    roster = sorted(PROVEN + SYBILS)
    assert rank_shards(b"h" * 34, 1, 12, roster, 4, unproven=unproven, unproven_share=1.0) == \
        rank_shards(b"h" * 34, 1, 12, roster, 4)
    assert rank_shards(b"h" * 34, 1, 12, roster, 4, unproven=frozenset(), unproven_share=0.25) == \
        rank_shards(b"h" * 34, 1, 12, roster, 4)
    assert unproven_cap(2, 0.25) == 1 and unproven_cap(100, 0.25) == 25 and unproven_cap(7, 1.0) == 7


def test_manifest_keys_are_present_only_when_on():
    m = make_revision().manifest
    body = m.to_cbor()
    assert (body["unproven_share"], body["max_joins"], body["idle_windows"]) == (0.25, 16, 3)  # on by default
    off = attrs.evolve(m, unproven_share=1.0, max_joins=0, idle_windows=0)
    assert not {"unproven_share", "max_joins", "idle_windows"} & set(off.to_cbor())
    for manifest in (m, off):
        assert Manifest.from_cbor(decode(encode(manifest.to_cbor()), max_bytes=1 << 20)) == manifest
    for key, value in (("unproven_share", 1.0), ("max_joins", 0), ("idle_windows", 0)):
        with pytest.raises(DecodeError):
            Manifest.from_cbor({**off.to_cbor(), key: value})  # one encoding per manifest
    with pytest.raises(DecodeError):
        attrs.evolve(m, unproven_share=0.0)


def test_head_unproven_round_trips_and_has_one_encoding():
    genesis = make_revision().genesis()
    peers = tuple(sorted(ident(i).peer_id for i in (20, 21)))
    head = attrs.evolve(genesis, unproven=peers)
    assert Head.from_cbor(decode(head.to_bytes(), max_bytes=1 << 20)) == head
    assert "unproven" not in genesis.to_cbor()
    for bad in ([], [p.to_bytes() for p in reversed(peers)]):
        with pytest.raises(DecodeError):
            Head.from_cbor({**head.to_cbor(), "unproven": bad})


def test_next_unproven_and_undelivered():
    revision = make_revision(trainers=[ident(10)], shards=(10,) * 8)
    genesis = revision.genesis()
    joiners = (ident(20).peer_id, ident(21).peer_id)
    roster = tuple(sorted((*genesis.roster, *((p, 1) for p in joiners))))
    assert next_unproven(genesis, roster, frozenset()) == tuple(sorted(joiners))  # joiners start unproven
    head = attrs.evolve(genesis, window=1, parent=genesis.id, roster=roster, unproven=tuple(sorted(joiners)))
    assert next_unproven(head, roster, frozenset({joiners[0]})) == (joiners[1],)  # a cohort update proves
    dropped = tuple(x for x in roster if x[0] != joiners[1])
    assert next_unproven(head, dropped, frozenset()) == (joiners[0],)  # gone from the roster: gone from here
    leased = undelivered(head, revision.manifest, frozenset())
    assert leased and leased <= set(joiners)  # unproven leaseholders with no update are dropped
    assert undelivered(head, revision.manifest, frozenset(joiners)) == frozenset()
    assert undelivered(genesis, revision.manifest, frozenset()) == frozenset()  # nobody unproven


def _join(revision, identity, window):
    return seal(identity, JoinRequest(revision=revision.id, window=window, capacity=4))


def test_a_join_flood_keeps_the_same_joins_whatever_their_order(tmp_path):
    """The backlog keeps the joins first by `join_priority`, so honest validators that hear the same flood
    in different orders hold (and propose) the same joiners; the flood cannot grow their state."""
    workload = build_workload("digits-mlp", SEED, N_SHARDS)
    cluster = build(tmp_path, workload, trainers=2)
    assert cluster.run_until(lambda c: head_window(c) >= 1, max_time=60.0)
    role = next(r for r in cluster.nodes["validator"].engine.roles if isinstance(r, ValidatorRole))
    flood = [Identity(os.urandom(32)) for _ in range(200)]
    window = role.window

    def held(order):
        role.joins = {p: c for p, c in role.joins.items() if p in role.collector.head.roster_peers}
        for identity in order:
            role.on_signed(identity.peer_id, _join(cluster.revision, identity, window))
        return {p for p in role.joins if p not in role.collector.head.roster_peers}

    first, second = held(flood), held(list(reversed(flood)))
    assert first == second and len(first) == 64
    ranked = sorted(flood, key=lambda i: join_priority(role.collector.head.id, i.peer_id))
    assert first == {i.peer_id for i in ranked[:64]}
    roster = role._next_roster(role.collector.head, (), ())
    added = {p for p, _ in roster} - role.collector.head.roster_peers
    assert added == {i.peer_id for i in ranked[:16]}  # max_joins a head, by priority
    assert role.engine.rejected_by_reason["join-backlog-full"] > 0


def test_a_join_without_admission_evicts_no_admitted_join(tmp_path):
    """Under admission = "certificate" a join is checked before the backlog: a flood of unadmitted joins
    (whatever their priority) is refused as join-not-admitted and leaves the admitted backlog intact."""
    from peerloom.core.errors import VerificationError
    from tests.test_admission import AUTHORITY, certificate

    workload = build_workload("digits-mlp", SEED, N_SHARDS)
    cluster = build(tmp_path, workload, trainers=2, admission="certificate", admission_authority=AUTHORITY.peer_id)
    assert cluster.run_until(lambda c: head_window(c) >= 1, max_time=60.0)
    role = next(r for r in cluster.nodes["validator"].engine.roles if isinstance(r, ValidatorRole))
    revision, window = cluster.revision, role.window
    admitted = [Identity(os.urandom(32)) for _ in range(64)]
    for who in admitted:
        join = JoinRequest(revision=revision.id, window=window, capacity=1,
                           admission=certificate(revision.id, who.peer_id))
        role.on_signed(who.peer_id, seal(who, join))
    pending = {p for p in role.joins if p not in role.collector.head.roster_peers}
    assert pending == {w.peer_id for w in admitted}  # the backlog is full
    refused = 0
    for _ in range(50):
        stranger = Identity(os.urandom(32))
        try:
            role.on_signed(stranger.peer_id, _join(revision, stranger, window))
        except VerificationError as exc:
            refused += exc.reason == "join-not-admitted"
    assert refused == 50
    assert {p for p in role.joins if p not in role.collector.head.roster_peers} == pending

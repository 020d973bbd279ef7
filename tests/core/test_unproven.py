"""Liveness under Sybils (spec/protocol.md §4.1): unproven trainers hold a bounded share
of the leases, silent leaseholders are demoted and then dropped, joins are bounded and kept by priority."""

import os
from pathlib import Path

import attrs
import pytest

from peerloom.backends.registry import build_workload
from peerloom.core.admission import join_priority
from peerloom.core.encoding import decode, encode
from peerloom.core.errors import DecodeError, VerificationError
from peerloom.core.identity import Identity
from peerloom.core.leases import leases_of, next_unproven, rank_shards, undelivered, unproven_cap
from peerloom.core.objects import Head, JoinRequest, Manifest, decode_body, seal
from peerloom.core.validator import ValidatorRole
from peerloom.sim.adversary import make_behaviour
from peerloom.sim.scenario import load_scenario, run_scenario
from peerloom.verify import check_rules
from tests.engine_cluster import N_SHARDS, SEED, build_until
from tests.helpers import ident, make_revision

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
    m = revision.manifest
    assert next_unproven(genesis, leases_of(genesis, m), roster, frozenset(), None) == tuple(sorted(joiners))
    head = attrs.evolve(genesis, window=1, parent=genesis.id, roster=roster, unproven=tuple(sorted(joiners)))
    everyone = frozenset(p for p, _ in roster)
    window = leases_of(head, m)  # the leases of window 2
    assert next_unproven(head, window, roster, frozenset({joiners[0]}), everyone) == (joiners[1],)  # an update proves
    dropped = tuple(x for x in roster if x[0] != joiners[1])
    assert next_unproven(head, window, dropped, frozenset(), everyone) == (joiners[0],)  # gone from the roster
    leased = undelivered(head, window, frozenset())
    assert leased and leased <= set(joiners)  # unproven leaseholders with no update are dropped
    assert undelivered(head, window, frozenset(joiners)) == frozenset()
    assert undelivered(genesis, leases_of(genesis, m), frozenset()) == frozenset()  # nobody unproven


def test_a_silent_leaseholder_turns_unproven_unless_its_window_is_skipped():
    """A proven trainer that held a lease of window w and authored no update of head w's cohort or rejected
    list is unproven in head w (spec/protocol.md §4.1); a skipped head demotes nobody, and `verify` accepts
    exactly the demotions of leaseholders."""
    revision = make_revision(trainers=[ident(10), ident(11)], shards=(10,) * 8)
    m, genesis = revision.manifest, revision.genesis()
    a, b = sorted(leases_of(genesis, m))  # both hold a lease of window 1
    first = leases_of(genesis, m)
    assert next_unproven(genesis, first, genesis.roster, frozenset({a}), frozenset({a})) == (b,)  # b: silent
    assert next_unproven(genesis, first, genesis.roster, frozenset({a}), frozenset({a, b})) == ()  # b: rejected
    assert next_unproven(genesis, first, genesis.roster, frozenset(), None) == ()  # a skipped head
    cohort = tuple(bytes([i]) * 34 for i in range(m.min_updates))
    demoted = attrs.evolve(genesis, window=1, parent=genesis.id, cohort=cohort, unproven=(b,))
    assert check_rules(revision, [(demoted, None)])
    skipped = attrs.evolve(demoted, skipped=True, cohort=())
    with pytest.raises(VerificationError, match="unproven"):
        check_rules(revision, [(skipped, None)])
    one = make_revision(trainers=[ident(10), ident(11)], shards=(10,))  # one shard: one leaseholder
    idle = next(p for p, _ in one.genesis().roster if p not in leases_of(one.genesis(), one.manifest))
    assert next_unproven(one.genesis(), leases_of(one.genesis(), one.manifest), one.genesis().roster, frozenset(),
                         frozenset()) == \
        tuple(sorted(leases_of(one.genesis(), one.manifest)))  # only the leaseholder, not the idle trainer
    stray = attrs.evolve(one.genesis(), window=1, parent=one.genesis().id, cohort=cohort, unproven=(idle,))
    with pytest.raises(VerificationError, match="unproven"):
        check_rules(one, [(stray, None)])


SCENARIOS = Path(__file__).resolve().parents[2] / "sim" / "scenarios"


def _happy(**manifest):
    scenario = load_scenario(SCENARIOS / "happy.toml")
    scenario.update(stop_window=4, duration_s=60.0)
    scenario["manifest"].update(manifest)
    return scenario


@pytest.mark.parametrize("seed", [0, 1])
def test_a_proven_trainer_that_never_delivers_loses_its_leases_then_its_seat(seed):
    """t5 is in the genesis roster (proven) and heartbeats but never sends an update (spec/protocol.md §4.1): the
    head of the first window it held a lease in demotes it; the next window gives it at most the unproven
    cap; the next head in which it held a lease, unproven, drops it. Honest trainers are never demoted, and
    every window certifies without lease expiry (spec/protocol.md §4)."""
    scenario = _happy(shards=24, unproven_share=0.1)  # a proven trainer holds 4 shards, the cap is 2
    result = run_scenario(scenario, seed=seed, behaviours={"t5": make_behaviour("sybil-silent")})
    assert result.ok, result.summary["invariants"]
    sim, final = result.sim, result.checkers.final
    silent, manifest = sim.nodes["t5"].peer_id, sim.manifest
    honest = {sim.nodes[f"t{i}"].peer_id for i in range(5)}
    heads = [sim.revision.genesis(), *(final[w] for w in sorted(final))]
    assert [h.window for h in heads] == list(range(len(heads))) and len(heads) >= 4
    demoted = next(i for i, h in enumerate(heads) if silent in h.unproven)
    assert len(leases_of(heads[demoted - 1], manifest)[silent]) > unproven_cap(24, 0.1)  # proven: a full share
    assert len(leases_of(heads[demoted], manifest).get(silent, ())) <= unproven_cap(24, 0.1)  # then capped
    dropped = next(i for i, h in enumerate(heads) if silent in h.expired)
    assert dropped > demoted and silent not in heads[dropped].roster_peers
    assert not any(honest & set(h.unproven) for h in heads)
    assert not any(h.skipped for h in heads)  # with lease expiry off (the default) no window stalls either


@pytest.mark.parametrize("seed", [0, 1])
def test_an_honest_slow_cohort_is_never_demoted(seed):
    """Trainers that need 3 s of a 4 s window still deliver in time: nobody is ever unproven or expired."""
    scenario = _happy()
    scenario["compute"]["train"] = 3.0
    result = run_scenario(scenario, seed=seed)
    assert result.ok, result.summary["invariants"]
    heads = [result.checkers.final[w] for w in sorted(result.checkers.final)]
    assert len(heads) >= 4 and not any(h.skipped for h in heads)
    assert not any(h.unproven or h.expired for h in heads)


def _join(revision, identity, window):
    return seal(identity, JoinRequest(revision=revision.id, window=window, capacity=4))


def test_a_join_flood_keeps_the_same_joins_whatever_their_order(tmp_path):
    """The backlog keeps the joins first by `join_priority`, so honest validators that hear the same flood
    in different orders hold (and propose) the same joiners; the flood cannot grow their state."""
    workload = build_workload("digits-mlp", SEED, N_SHARDS)
    cluster = build_until(1, tmp_path, workload, trainers=2)
    role = next(r for r in cluster.nodes["validator"].engine.roles if isinstance(r, ValidatorRole))
    flood = [Identity(os.urandom(32)) for _ in range(200)]
    window = role.window

    def held(order):
        role.admission.joins = {p: c for p, c in role.admission.joins.items() if p in role.collector.head.roster_peers}
        for identity in order:
            envelope = _join(cluster.revision, identity, window)
            role.on_signed(identity.peer_id, envelope, decode_body(envelope))
        return {p for p in role.admission.joins if p not in role.collector.head.roster_peers}

    first, second = held(flood), held(list(reversed(flood)))
    assert first == second and len(first) == 64
    ranked = sorted(flood, key=lambda i: join_priority(role.collector.head.id, i.peer_id))
    assert first == {i.peer_id for i in ranked[:64]}
    roster = role.admission.next_roster(role.collector.head, (), ())
    added = {p for p, _ in roster} - role.collector.head.roster_peers
    assert added == {i.peer_id for i in ranked[:16]}  # max_joins a head, by priority
    assert role.engine.rejected_by_reason["join-backlog-full"] > 0


def test_a_join_without_admission_evicts_no_admitted_join(tmp_path):
    """Under admission = "certificate" a join is checked before the backlog: a flood of unadmitted joins
    (whatever their priority) is refused as join-not-admitted and leaves the admitted backlog intact."""
    from peerloom.core.errors import VerificationError
    from tests.core.test_admission import AUTHORITY, certificate

    workload = build_workload("digits-mlp", SEED, N_SHARDS)
    cluster = build_until(1, tmp_path, workload, trainers=2, admission="certificate",
                          admission_authority=AUTHORITY.peer_id)
    role = next(r for r in cluster.nodes["validator"].engine.roles if isinstance(r, ValidatorRole))
    revision, window = cluster.revision, role.window
    admitted = [Identity(os.urandom(32)) for _ in range(64)]
    for who in admitted:
        join = JoinRequest(revision=revision.id, window=window, capacity=1,
                           admission=certificate(revision.id, who.peer_id))
        envelope = seal(who, join)
        role.on_signed(who.peer_id, envelope, decode_body(envelope))
    pending = {p for p in role.admission.joins if p not in role.collector.head.roster_peers}
    assert pending == {w.peer_id for w in admitted}  # the backlog is full
    refused = 0
    for _ in range(50):
        stranger = Identity(os.urandom(32))
        try:
            envelope = _join(revision, stranger, window)
            role.on_signed(stranger.peer_id, envelope, decode_body(envelope))
        except VerificationError as exc:
            refused += exc.reason == "join-not-admitted"
    assert refused == 50
    assert {p for p in role.admission.joins if p not in role.collector.head.roster_peers} == pending

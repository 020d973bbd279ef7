"""Revocation of an admission (spec/auth.md §6, spec/protocol.md §5): the admission authority's signed
`AdmissionRevocation` reaches validators from any peer; they refuse the revoked peers' joins, and the next
head drops revoked rostered peers, carrying the revocation envelope that justifies the removal."""

import random

import attrs
import pytest

from peerloom.core.admission import REVOCATION_PREFIX
from peerloom.core.chain import verify_chain
from peerloom.core.engine import Engine, EngineConfig
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.errors import DecodeError, VerificationError
from peerloom.core.messages import Signed, encode_message
from peerloom.core.objects import (
    MAX_REVOKED_PEERS,
    AdmissionRevocation,
    Head,
    check_revocation,
    decode_body,
    seal,
)
from peerloom.core.validator import ValidatorRole
from peerloom.verify import check_rules
from tests.core.test_admission import AUTHORITY, certificate, digits  # noqa: F401 (fixture)
from tests.engine_cluster import build, build_until, head_window
from tests.helpers import ident, make_revision


def revocation(revision_id, *peers, signer=AUTHORITY):
    return seal(signer, AdmissionRevocation(revision=revision_id, peers=tuple(sorted(peers))))


def _manifest():
    rev = make_revision()
    return rev, attrs.evolve(rev.manifest, admission="certificate", admission_authority=AUTHORITY.peer_id)


def test_revocation_round_trips_and_only_the_authoritys_is_accepted():
    rev, m = _manifest()
    a, b = ident(10).peer_id, ident(11).peer_id
    good = revocation(rev.id, a, b)
    assert check_revocation(good, rev.id, m).peers == tuple(sorted((a, b)))
    assert SignedEnvelope.from_bytes(good.to_bytes()) == good
    for envelope, manifest in [
        (revocation(rev.id, a, signer=ident(96)), m),                  # not the authority
        (revocation(b"\x12\x20" + bytes(32), a), m),                    # another revision
        (good, rev.manifest),                                           # an open manifest has no authority
    ]:
        with pytest.raises(VerificationError) as info:
            check_revocation(envelope, rev.id, manifest)
        assert info.value.reason == "bad-revocation"
    # a forged signature: the authority's signer field on another key's signature
    forged = attrs.evolve(revocation(rev.id, a, signer=ident(96)), signer=AUTHORITY.peer_id)
    with pytest.raises(VerificationError, match="bad-revocation"):
        check_revocation(forged, rev.id, m)


def test_revocation_bodies_are_strict_and_bounded():
    rev, _ = _manifest()
    peers = sorted(ident(100 + i).peer_id.to_bytes() for i in range(MAX_REVOKED_PEERS + 1))
    for body in [
        {"revision": rev.id, "peers": []},                              # revokes nobody
        {"revision": rev.id, "peers": peers},                           # too many
        {"revision": rev.id, "peers": [peers[1], peers[0]]},            # unsorted
        {"revision": rev.id, "peers": [peers[0], peers[0]]},            # duplicate
        {"revision": rev.id, "peers": [peers[0]], "extra": 1},          # unknown field
        {"revision": rev.id},                                           # missing field
        {"revision": rev.id, "peers": [b"not a peer"]},
    ]:
        with pytest.raises(DecodeError):
            AdmissionRevocation.from_cbor(body)
    assert len(AdmissionRevocation.from_cbor({"revision": rev.id, "peers": peers[:-1]}).peers) == MAX_REVOKED_PEERS


def test_revocation_decoding_survives_mutated_bytes():
    rev, m = _manifest()
    data = bytearray(revocation(rev.id, ident(10).peer_id, ident(11).peer_id).to_bytes())
    rng = random.Random(5)
    for _ in range(500):
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        try:
            check_revocation(SignedEnvelope.from_bytes(bytes(mutated)), rev.id, m)
        except (DecodeError, VerificationError):
            continue
        assert bytes(mutated) == bytes(data)  # only the original verifies


def test_a_head_without_revocations_encodes_as_before():
    genesis = make_revision().genesis()
    assert "revoked" not in genesis.header_cbor()
    body = genesis.to_cbor() | {"revoked": []}
    with pytest.raises(DecodeError):
        Head.from_cbor(body)  # absent when empty: one encoding per head


def _validator(cluster, name="validator"):
    return next(r for r in cluster.nodes[name].engine.roles if isinstance(r, ValidatorRole))


def test_a_head_removes_a_rostered_peer_only_with_the_authoritys_revocation(tmp_path, digits):  # noqa: F811
    cluster = build_until(1, tmp_path, digits, trainers=2, admission="certificate",
                          admission_authority=AUTHORITY.peer_id)
    role = _validator(cluster)
    parent = role.collector.head
    victim = parent.roster[0][0]
    skip = role.screening.skip_head(parent, ())
    assert role.screening.structural_fault(skip, ()) == ""
    rid = cluster.revision.id
    dropped = tuple(e for e in skip.roster if e[0] != victim)
    unproven = tuple(p for p in skip.unproven if p != victim)
    # never heard the revocation: the head that carries it is still valid here
    assert not role.admission.revoked
    revoked = attrs.evolve(skip, roster=dropped, unproven=unproven, revoked=(revocation(rid, victim),))
    assert role.screening.structural_fault(revoked, ()) == ""
    assert check_rules(cluster.revision, [(revoked, None)])
    # without it, or with a forged one, the removal is invalid (here and for `peerloom verify`)
    bare = attrs.evolve(revoked, revoked=())
    assert role.screening.structural_fault(bare, ()) == "roster-shrunk"
    with pytest.raises(VerificationError, match="roster-shrunk"):
        check_rules(cluster.revision, [(bare, None)])
    forged = attrs.evolve(revoked, revoked=(revocation(rid, victim, signer=ident(96)),))
    assert role.screening.structural_fault(forged, ()) == "bad-revocation"
    with pytest.raises(VerificationError, match="bad-revocation"):
        check_rules(cluster.revision, [(forged, None)])
    # a revocation that keeps its peer rostered, or names no rostered peer, is refused too
    kept = attrs.evolve(skip, revoked=(revocation(rid, victim),))
    assert role.screening.structural_fault(kept, ()) == "bad-revocation"
    stray = attrs.evolve(skip, revoked=(revocation(rid, ident(77).peer_id),))
    assert role.screening.structural_fault(stray, ()) == "bad-revocation"
    # once the validator holds the revocation, its own next head carries it and drops the peer
    kept_env = revocation(rid, victim)
    role.admission.on_revocation(ident(77).peer_id, kept_env, decode_body(kept_env))
    own = role.screening.skip_head(parent, ())
    assert own.revoked == (revocation(rid, victim),) and victim not in own.roster_peers
    assert role.screening.structural_fault(own, ()) == ""
    # a wrongly signed revocation from a peer is a typed rejection
    wrong = revocation(rid, victim, signer=ident(96))
    with pytest.raises(VerificationError, match="bad-revocation"):
        role.admission.on_revocation(ident(77).peer_id, wrong, decode_body(wrong))


def test_a_revoked_trainer_leaves_the_roster_and_cannot_rejoin(tmp_path, digits):  # noqa: F811
    cluster = build(tmp_path, digits, trainers=2, validators=2, quorum=2, admission="certificate",
                    admission_authority=AUTHORITY.peer_id)
    rid = cluster.revision.id
    member = ident(20)
    node = cluster.add_node("member", member, {"trainer"}, tmp_path / "member", *digits)
    engine = Engine(EngineConfig(roles=node.roles, revision=cluster.revision,
                                 admission=certificate(rid, member.peer_id, 2)),
                    member, random.Random("member"), stored=node.store.refs(), records=node.store.records())
    cluster.restart("member", ["validator", "v1", "reducer"], engine=engine)

    def rostered(c):
        return all(member.peer_id in c.nodes[n].engine.head.roster_peers for n in ("validator", "v1"))

    assert cluster.run_until(rostered, max_time=120.0)
    # a trainer (any peer) forwards the authority's revocation to one validator; it reaches the other
    cluster.sim.send("t1", "validator", encode_message(Signed(envelope=revocation(rid, member.peer_id))))

    def gone(c):
        return all(member.peer_id not in c.nodes[n].engine.head.roster_peers for n in ("validator", "v1"))

    assert cluster.run_until(gone, max_time=cluster.now + 60.0)
    w = head_window(cluster)
    assert cluster.run_until(lambda c: head_window(c) >= w + 3, max_time=cluster.now + 90.0)
    for name in ("validator", "v1"):
        engine = cluster.nodes[name].engine
        assert member.peer_id not in engine.head.roster_peers  # its joins (valid certificate) are refused
        assert _validator(cluster, name).admission.revoked.keys() == {member.peer_id}
        assert engine.rejected_by_reason["join-not-admitted"] >= 1
    entries = [(h, c) for _, h, c in cluster.nodes["validator"].heads]
    verify_chain(cluster.revision, entries)
    assert check_rules(cluster.revision, entries)
    i = next(i for i, (h, _) in enumerate(entries) if h.revoked)
    assert member.peer_id in entries[i - 1][0].roster_peers and member.peer_id not in entries[i][0].roster_peers
    # tampered: the removal without its revocation breaks the rules (and the head id the certificate signs)
    tampered = [*entries[:i], (attrs.evolve(entries[i][0], revoked=()), entries[i][1])]
    with pytest.raises(VerificationError, match="roster-shrunk"):
        check_rules(cluster.revision, tampered)
    with pytest.raises(VerificationError):
        verify_chain(cluster.revision, tampered)
    assert not any(e == "proposal-invalid" for _, _, e, _ in cluster.logs)


def test_revocations_are_records_that_survive_a_restart_and_a_snapshot(tmp_path, digits):  # noqa: F811
    cluster = build_until(1, tmp_path, digits, trainers=2, admission="certificate",
                          admission_authority=AUTHORITY.peer_id)
    node = cluster.nodes["validator"]
    victim = ident(50).peer_id
    envelope = revocation(cluster.revision.id, victim)
    _validator(cluster).admission.on_revocation(victim, envelope, decode_body(envelope))
    assert SignedEnvelope.from_bytes(node.engine.records[REVOCATION_PREFIX + envelope.id.hex()]) == envelope
    restarted = Engine(node.engine.config, ident(1), random.Random(1), records=dict(node.engine.records))
    restored = Engine.restore(node.engine.snapshot(), node.engine.config, ident(1), random.Random(1))
    for engine in (restarted, restored):
        role = next(r for r in engine.roles if isinstance(r, ValidatorRole))
        assert set(role.admission.revoked) == {victim}

"""Admission policy (spec/protocol.md §5): with ``admission = "certificate"`` a join adds its signer to the
roster only with an admission certificate for that peer signed by the manifest's admission authority;
validators refuse other joins (``join-not-admitted``, charged to the sender) and proposals whose roster
adds an unadmitted peer."""

import random

import attrs
import pytest

from peerloom.backends.registry import build_workload
from peerloom.core.engine import Engine, EngineConfig
from peerloom.core.errors import DecodeError, VerificationError
from peerloom.core.objects import (
    AdmissionCertificate,
    JoinRequest,
    Manifest,
    check_admission,
    decode_body,
    seal,
)
from peerloom.core.validator import ValidatorRole
from tests.engine_cluster import N_SHARDS, SEED, build, build_until, head_window
from tests.helpers import ident, make_revision

AUTHORITY = ident(97)


def certificate(revision_id, peer, max_capacity=2, signer=AUTHORITY):
    return seal(signer, AdmissionCertificate(revision=revision_id, peer=peer, max_capacity=max_capacity))


def test_manifest_admission_fields_validate_and_round_trip():
    m = make_revision().manifest
    assert (m.admission, m.admission_authority) == ("open", None)
    for bad in ({"admission": "certificate"}, {"admission_authority": AUTHORITY.peer_id},
                {"admission": "invite", "admission_authority": AUTHORITY.peer_id}):
        with pytest.raises(DecodeError):
            attrs.evolve(m, **bad)
    closed = attrs.evolve(m, admission="certificate", admission_authority=AUTHORITY.peer_id)
    assert Manifest.from_cbor(closed.to_cbor()) == closed


def test_check_admission_accepts_only_the_authoritys_certificate_for_that_peer():
    rev = make_revision()
    m = attrs.evolve(rev.manifest, admission="certificate", admission_authority=AUTHORITY.peer_id)
    me, other = ident(10).peer_id, ident(11).peer_id
    good = certificate(rev.id, me, 3)
    assert check_admission(good, rev.id, m, me).max_capacity == 3
    for envelope, peer, revision_id in [
        (None, me, rev.id),                                               # no certificate
        (certificate(rev.id, me, signer=ident(96)), me, rev.id),          # not the authority
        (good, other, rev.id),                                            # someone else's certificate
        (good, me, b"\x12\x20" + bytes(32)),                              # another revision
        (certificate(rev.id, me, 0), me, rev.id),                         # capacity 0 admits nobody
        (seal(AUTHORITY, JoinRequest(revision=rev.id, window=1, capacity=1)), me, rev.id),  # wrong kind
    ]:
        with pytest.raises(VerificationError) as info:
            check_admission(envelope, revision_id, m, peer)
        assert info.value.reason == "join-not-admitted"
    # a join carries its certificate and round-trips with it
    join = JoinRequest(revision=rev.id, window=1, capacity=2, admission=good)
    assert JoinRequest.from_cbor(join.to_cbor()) == join
    assert "admission" not in JoinRequest(revision=rev.id, window=1, capacity=2).to_cbor()


@pytest.fixture(scope="module")
def digits():
    return build_workload("digits-numpy", SEED, N_SHARDS)


def _add_trainer(cluster, tmp_path, name, identity, digits, admission):
    wl, shards = digits
    node = cluster.add_node(name, identity, {"trainer"}, tmp_path / name, wl, shards)
    # The simulator builds a default config; give this trainer its admission certificate before it starts.
    engine = Engine(EngineConfig(roles=node.roles, revision=cluster.revision, admission=admission),
                    identity, random.Random(name), stored=node.store.refs(), records=node.store.records())
    cluster.restart(name, ["validator", "v1", "v2", "v3", "reducer"], engine=engine)
    return node


def test_only_admitted_joiners_enter_the_roster(tmp_path, digits):
    cluster = build(tmp_path, digits, trainers=2, validators=4, quorum=3, admission="certificate",
                    admission_authority=AUTHORITY.peer_id)
    rid = cluster.revision.id
    admitted, stranger, thief = ident(20), ident(21), ident(22)
    _add_trainer(cluster, tmp_path, "admitted", admitted, digits, certificate(rid, admitted.peer_id, 2))
    _add_trainer(cluster, tmp_path, "stranger", stranger, digits, None)
    _add_trainer(cluster, tmp_path, "thief", thief, digits, certificate(rid, admitted.peer_id, 2))  # not its own

    def roster(c):
        return dict(c.nodes["validator"].engine.head.roster)

    assert cluster.run_until(lambda c: admitted.peer_id in roster(c), max_time=120.0)
    w = head_window(cluster)
    assert cluster.run_until(lambda c: head_window(c) >= w + 2, max_time=cluster.now + 60.0)
    r = roster(cluster)
    assert r[admitted.peer_id] == 1 and stranger.peer_id not in r and thief.peer_id not in r
    for name in ("validator", "v1", "v2", "v3"):
        v = cluster.nodes[name].engine
        assert v.rejected_by_reason["join-not-admitted"] >= 2  # the stranger's and the thief's joins
        assert v.peers[stranger.peer_id].penalty >= 1 and v.peers[thief.peer_id].penalty >= 1
        assert v.peers[admitted.peer_id].penalty == 0
    assert not any(e == "proposal-invalid" for _, _, e, _ in cluster.logs)


def test_proposal_adding_an_unadmitted_peer_is_invalid(tmp_path, digits):
    cluster = build_until(1, tmp_path, digits, trainers=2, admission="certificate",
                          admission_authority=AUTHORITY.peer_id)
    role = next(r for r in cluster.nodes["validator"].engine.roles if isinstance(r, ValidatorRole))
    parent = role.collector.head
    skip = role.screening.skip_head(parent, ())
    assert role.screening.structural_fault(skip, ()) == ""
    newcomer = ident(20).peer_id
    added = attrs.evolve(skip, roster=tuple(sorted((*parent.roster, (newcomer, 1)))), unproven=(newcomer,))
    assert role.screening.structural_fault(added, ()) == "roster-unknown-join"  # no join seen at all
    role.admission.joins[newcomer] = 1  # a join this validator took without a certificate (e.g. before the policy)
    assert role.screening.structural_fault(added, ()) == "roster-not-admitted"
    role.admission.admitted[newcomer] = 1
    assert role.screening.structural_fault(added, ()) == ""
    # a joiner is unproven
    assert role.screening.structural_fault(attrs.evolve(added, unproven=()), ()) == "unproven-mismatch"
    more = attrs.evolve(skip, roster=tuple(sorted((*parent.roster, (newcomer, 2)))))
    assert role.screening.structural_fault(more, ()) == "roster-not-admitted"  # above the certified capacity


@pytest.mark.parametrize("private_data", [False, True])
def test_a_private_join_needs_a_manifest_that_admits_private_data(tmp_path, digits, private_data):
    """spec/protocol.md §10: a join that declares private data is refused (``private-not-admitted``, charged to
    the sender) unless the manifest has ``private_data``; under one that does it is held, flagged private."""
    cluster = build_until(1, tmp_path, digits, trainers=2, private_data=private_data)
    role = next(r for r in cluster.nodes["validator"].engine.roles if isinstance(r, ValidatorRole))
    joiner = ident(30)
    join = seal(joiner, JoinRequest(revision=cluster.revision.id, window=role.admission.window, capacity=1,
                                    private=True))
    if not private_data:
        with pytest.raises(VerificationError, match="private-not-admitted"):
            role.admission.on_join(joiner.peer_id, join, decode_body(join))
        assert joiner.peer_id not in role.admission.joins
    else:
        assert role.admission.on_join(joiner.peer_id, join, decode_body(join))
        assert joiner.peer_id in role.admission.private_joins

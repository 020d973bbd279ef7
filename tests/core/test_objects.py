"""Manifests, heads, quorum certificates, leases and chain verification."""

from collections import Counter

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from peerloom.core.chain import verify_chain
from peerloom.core.encoding import encode
from peerloom.core.errors import DecodeError, VerificationError
from peerloom.core.leases import assign_shards, lease_weight, leases_of, rank_shards
from peerloom.core.objects import (
    PREVOTE,
    ArtifactRef,
    Head,
    Manifest,
    Revision,
    artifact_id,
    make_artifact_ref,
)
from tests.helpers import certify, child, ident, make_revision


def test_manifest_round_trip_and_revision_id_is_envelope_id():
    rev = make_revision(trainers=[ident(10), ident(11)])
    again = Manifest.from_cbor(rev.manifest.to_cbor())
    assert again == rev.manifest
    assert rev.id == rev.envelope.id


def test_norm_mads_is_encoded_only_when_on():
    """spec/protocol.md §6 cohort screening: `norm_mads` defaults to 6; 0, the fixed ratio of revisions before
    the field, is absent from the encoding, so their bytes and ids are unchanged and they decode to it."""
    manifest = make_revision().manifest
    assert manifest.norm_mads == 6 and manifest.to_cbor()["norm_mads"] == 6
    assert Manifest.from_cbor(manifest.to_cbor()) == manifest
    off = attrs.evolve(manifest, norm_mads=0)
    assert "norm_mads" not in off.to_cbor() and Manifest.from_cbor(off.to_cbor()) == off
    with pytest.raises(DecodeError):
        Manifest.from_cbor({**off.to_cbor(), "norm_mads": 0})  # one encoding per manifest
    for bad in (-1, 65):
        with pytest.raises(DecodeError):
            attrs.evolve(manifest, norm_mads=bad)
    with pytest.raises(DecodeError):
        Manifest.from_cbor({**off.to_cbor(), "norm_mads": 65})


def test_a_manifest_has_at_most_max_cohort_shards():
    """One update per shard at most: a window's cohort then always fits a head (MAX_COHORT)."""
    from peerloom.core.objects import MAX_COHORT

    manifest = make_revision().manifest
    assert attrs.evolve(manifest, shards=(1,) * MAX_COHORT).shards == (1,) * MAX_COHORT
    with pytest.raises(DecodeError) as info:
        attrs.evolve(manifest, shards=(1,) * (MAX_COHORT + 1))
    assert "cohort limit" in str(info.value)
    body = manifest.to_cbor() | {"shards": [1] * (MAX_COHORT + 1)}
    with pytest.raises(DecodeError):
        Manifest.from_cbor(body)


def test_manifest_wrong_authority_refused():
    rev = make_revision()
    with pytest.raises(VerificationError):
        Revision.verify(rev.envelope, ident(99).peer_id)


@pytest.mark.parametrize("n,quorum", [(1, 0), (2, 1), (3, 2), (4, 2), (3, 4), (7, 4)])
def test_quorums_that_are_not_byzantine_safe_are_refused(n, quorum):
    with pytest.raises(DecodeError):
        make_revision(validators=[ident(i) for i in range(1, n + 1)], quorum=quorum)


@pytest.mark.parametrize("n,quorum", [(1, 1), (2, 2), (4, 3), (7, 5), (10, 7)])
def test_byzantine_quorums_accepted(n, quorum):
    assert make_revision(validators=[ident(i) for i in range(1, n + 1)], quorum=quorum).manifest.quorum == quorum


def test_prevotes_or_other_rounds_do_not_make_a_certificate():
    vals = [ident(i) for i in range(1, 5)]
    rev = make_revision(validators=vals, quorum=3)
    head = child(rev, rev.genesis())
    with pytest.raises(VerificationError):
        certify(rev, head, vals[:3], step=PREVOTE).verify(rev, head)
    cert = certify(rev, head, vals[:3], round_=2)
    cert.verify(rev, head)
    with pytest.raises(VerificationError):  # the same signatures claimed for another round
        attrs.evolve(cert, round=1).verify(rev, head)


def test_certificate_verifies_and_needs_quorum_of_real_validators():
    vals = [ident(i) for i in range(1, 5)]
    rev = make_revision(validators=vals, quorum=3)
    head = child(rev, rev.genesis())
    certify(rev, head, vals[:3]).verify(rev, head)
    with pytest.raises(VerificationError) as err:
        certify(rev, head, vals[:2]).verify(rev, head)
    assert err.value.reason == "no-quorum"
    with pytest.raises(VerificationError) as err:
        certify(rev, head, [*vals[:2], ident(77)]).verify(rev, head)
    assert err.value.reason == "not-a-validator"
    other = child(rev, rev.genesis(), metrics={"test_accuracy": 0.9})
    with pytest.raises(VerificationError):
        certify(rev, other, vals[:3]).verify(rev, head)


def test_certificate_with_forged_signature_fails():
    rev = make_revision()
    head = child(rev, rev.genesis())
    cert = certify(rev, head, [ident(1)])
    forged = attrs.evolve(cert, votes=((ident(1).peer_id, bytes(64)),))
    with pytest.raises(VerificationError):
        forged.verify(rev, head)


def test_head_round_trip_and_id_changes_with_any_field():
    rev = make_revision(trainers=[ident(10)])
    head = child(rev, rev.genesis())
    assert Head.from_cbor(head.to_cbor()) == head
    assert child(rev, rev.genesis(), metrics={"test_accuracy": 0.51}).id != head.id


def test_artifact_ref_chunks_verify():
    data = bytes(range(256)) * 10
    ref = make_artifact_ref(data, 1000)
    assert ref.num_chunks == 3 and ref.chunk_length(2) == 560
    assert ref.chunk_ok(1, data[1000:2000]) and not ref.chunk_ok(1, data[1001:2001])
    assert ArtifactRef.from_cbor(ref.to_cbor()) == ref
    bad = ref.to_cbor() | {"chunks": ref.to_cbor()["chunks"][:2]}
    with pytest.raises(DecodeError):
        ArtifactRef.from_cbor(bad)


@given(data=st.binary(max_size=3000), chunk_size=st.integers(1, 1200), field=st.sampled_from(
    ["digest", "size", "chunk_size", "chunks"]), flip=st.integers(0, 7))
def test_an_artifact_id_names_its_size_chunking_and_chunks(data, chunk_size, field, flip):
    """spec/wire.md §5: digest = cid(canonical([size, chunk_size, chunks])). A ref that changes any one of
    them without the digest (or the digest alone) is refused when decoded, before any byte is fetched."""
    ref = make_artifact_ref(data, chunk_size)
    assert ref.digest == artifact_id(len(data), chunk_size, ref.chunks)
    assert ArtifactRef.from_cbor(ref.to_cbor()) == ref
    body = ref.to_cbor()
    if field == "digest":
        body["digest"] = body["digest"][:2] + bytes([body["digest"][2] ^ (1 << flip)]) + body["digest"][3:]
    elif field == "chunks":
        if not ref.chunks:
            return
        first = body["chunks"][0]
        body["chunks"] = [bytes([first[0] ^ (1 << flip)]) + first[1:], *body["chunks"][1:]]
    else:
        # another size or chunking that keeps the same number of chunks (else the count check refuses first)
        other = ref.size + 1 if field == "size" else ref.chunk_size + 1
        body[field] = other
        if -(-body["size"] // body["chunk_size"]) != len(ref.chunks):
            return
    with pytest.raises(DecodeError, match="not the id of its size and chunks"):
        ArtifactRef.from_cbor(body)


@given(st.integers(1, 12), st.integers(1, 40), st.binary(min_size=34, max_size=34), st.integers(1, 100))
def test_leases_cover_every_shard_once_and_are_deterministic(n_peers, n_shards, head_id, window):
    roster = [(ident(i).peer_id, 1 + i % 3) for i in range(1, n_peers + 1)]
    a = assign_shards(head_id, window, n_shards, roster, 4)
    assert sorted(a) == list(range(n_shards))
    assert a == assign_shards(head_id, window, n_shards, list(reversed(roster)), 4)


@given(st.integers(1, 12), st.integers(1, 60), st.binary(min_size=34, max_size=34), st.integers(1, 100))
def test_leases_balance_exactly_by_capacity_and_rank_someone_else_second(n_peers, n_shards, head_id, window):
    """Each slot gets floor(S/V) or ceil(S/V) shards (spec/protocol.md §4), so a trainer of capacity c
    holds between c*floor(S/V) and c*ceil(S/V) shards in every window; the next-ranked trainer of a shard
    is never its owner."""
    roster = [(ident(i).peer_id, 1 + i % 3) for i in range(1, n_peers + 1)]
    ranked = rank_shards(head_id, window, n_shards, roster, 4)
    slots = sum(c for _, c in roster)
    held = Counter(r[0] for r in ranked.values())
    for peer, capacity in roster:
        assert capacity * (n_shards // slots) <= held[peer] <= capacity * -(-n_shards // slots)
    for r in ranked.values():
        assert len(r) == (2 if n_peers > 1 else 1) and (len(r) == 1 or r[0] != r[1])


def test_leases_follow_capacity_and_skip_quarantined():
    roster = [(ident(1).peer_id, 1), (ident(2).peer_id, 3)]
    counts = Counter()
    for window in range(200):
        counts.update(assign_shards(b"h" * 34, window, 8, roster, 4).values())
    share = counts[ident(2).peer_id] / sum(counts.values())
    assert 0.70 < share < 0.80  # 3 of 4 draws
    only = assign_shards(b"h" * 34, 1, 8, roster, 4, excluded=frozenset({ident(2).peer_id}))
    assert set(only.values()) == {ident(1).peer_id}


def test_leases_of_head_and_weights_from_manifest():
    rev = make_revision(trainers=[ident(10), ident(11)], shards=(5, 6, 7, 8))
    leases = leases_of(rev.genesis(), rev.manifest)
    assert sorted(s for shards in leases.values() for s in shards) == [0, 1, 2, 3]
    assert sum(lease_weight(rev.manifest, s) for s in leases.values()) == 26


def test_chain_verifies_and_detects_tampering():
    vals = [ident(1), ident(2), ident(3), ident(4)]
    rev = make_revision(validators=vals, quorum=3, trainers=[ident(10)])
    h1 = child(rev, rev.genesis())
    h2 = child(rev, h1)
    chain = [(h1, certify(rev, h1, vals[:3])), (h2, certify(rev, h2, vals[1:]))]
    assert len(verify_chain(rev, chain)) == 3
    with pytest.raises(VerificationError):  # wrong parent link
        verify_chain(rev, [chain[1]])
    evil = child(rev, h1, metrics={"test_accuracy": 0.99})
    with pytest.raises(VerificationError):  # certificate is for the honest head
        verify_chain(rev, [chain[0], (evil, chain[1][1])])
    assert encode(h2.to_cbor()) != encode(evil.to_cbor())


def test_chain_entry_splices_the_cached_head_bytes_into_the_canonical_record():
    """encode_chain_entry reuses the head's cached encoding; the record must be the canonical map."""
    from peerloom.core.chain import decode_chain_entry, encode_chain_entry
    from peerloom.core.encoding import encode

    validators = [ident(i) for i in range(1, 5)]
    rev = make_revision(trainers=[ident(10), ident(11), ident(12)], validators=validators, quorum=3)
    head = child(rev, rev.genesis(), quarantine=((ident(11).peer_id, 9),), left=(ident(12).peer_id,),
                 roster=tuple(e for e in rev.genesis().roster if e[0] != ident(12).peer_id))
    cert = certify(rev, head, validators[:3])
    record = encode_chain_entry(head, cert)
    assert record == encode({"head": head.to_cbor(), "certificate": cert.to_cbor()})
    assert decode_chain_entry(record) == (head, cert)
    assert encode_chain_entry(head, cert) is record  # shared, not rebuilt, by the next engine


def test_head_id_and_roster_set_are_cached_per_instance_and_follow_the_fields():
    rev = make_revision(trainers=[ident(10), ident(11)])
    head = child(rev, rev.genesis())
    assert head.id is head.id and head.to_bytes() is head.to_bytes()
    other = attrs.evolve(head, window=head.window + 1)
    assert other.id != head.id and Head.from_cbor(other.to_cbor()).id == other.id
    assert head.roster_peers == {p for p, _ in head.roster}
    assert rev.genesis() is rev.genesis()


@given(st.lists(st.integers(1, 4), min_size=1, max_size=8), st.integers(1, 40), st.binary(min_size=34, max_size=34))
def test_next_ranked_is_the_next_slot_held_by_someone_else(capacities, n_shards, head_id):
    from peerloom.core.leases import slot_order

    roster = [(ident(i + 1).peer_id, c) for i, c in enumerate(capacities)]
    slots = slot_order(head_id, 3, roster, 4)
    ranked = rank_shards(head_id, 3, n_shards, roster, 4)
    for shard, r in ranked.items():
        i = shard % len(slots)
        later = [slots[(i + k) % len(slots)] for k in range(1, len(slots))]
        second = next((p for p in later if p != slots[i]), None)
        assert r == ((slots[i],) if second is None else (slots[i], second))


def test_one_trainer_with_a_huge_capacity_costs_linear_time():
    """Long runs of one holder in the slot order do not make ranking quadratic."""
    roster = [(ident(1).peer_id, 60000), (ident(2).peer_id, 1)]
    ranked = rank_shards(b"h" * 34, 1, 100, roster, 65536)
    assert all(r[1] != r[0] for r in ranked.values())

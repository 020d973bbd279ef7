"""Unauditable trainers (spec/protocol.md §6.4): a trainer whose training cannot be replayed (a browser peer,
spec/browser.md §3) says `unauditable` in its join and its updates. Under audits, validators take either only
where the manifest has `unauditable_trainers`, else refuse it (``unauditable-not-admitted``, charged); taken,
such an update is screened and loss-checked but never replayed, and audit evidence against it is void."""

import attrs
import pytest

from peerloom.core.audit import check_audit_evidence
from peerloom.core.errors import DecodeError, VerificationError
from peerloom.core.objects import PROTOCOL_VERSION, AuditFailure, JoinRequest, Manifest, UpdateAnnouncement, seal
from tests.helpers import ident, make_revision
from tests.validator_harness import VALIDATOR, Lone, delta_of


def test_the_manifest_option_needs_audits_is_absent_when_off_and_round_trips():
    m = make_revision().manifest
    assert "unauditable_trainers" not in m.to_cbor()  # old revisions keep their ids
    with pytest.raises(DecodeError, match="unauditable_trainers needs audit"):
        attrs.evolve(m, unauditable_trainers=True)
    on = attrs.evolve(m, audit=True, unauditable_trainers=True)
    assert on.to_cbor()["unauditable_trainers"] is True
    assert Manifest.from_cbor(on.to_cbor()) == on
    with pytest.raises(DecodeError, match="absent when off"):
        Manifest.from_cbor({**attrs.evolve(m, audit=True).to_cbor(), "unauditable_trainers": False})


def test_the_flags_are_absent_when_false_and_refused_as_false():
    rev = make_revision()
    join = JoinRequest(revision=rev.id, window=1, capacity=1, unauditable=True)
    assert JoinRequest.from_cbor(join.to_cbor()) == join
    assert "unauditable" not in attrs.evolve(join, unauditable=False).to_cbor()
    with pytest.raises(DecodeError, match="absent when false"):
        JoinRequest.from_cbor({**join.to_cbor(), "unauditable": False})
    delta = delta_of(ident(10))
    ann = UpdateAnnouncement(revision=rev.id, window=1, base=rev.id, shards=(0,), delta=delta,
                             delta_digest=delta.digest, train_loss=0.5, unauditable=True)
    assert UpdateAnnouncement.from_cbor(ann.to_cbor()) == ann
    with pytest.raises(DecodeError):
        UpdateAnnouncement.from_cbor({**ann.to_cbor(), "unauditable": 1})


@pytest.mark.parametrize(("manifest", "admitted"), [
    ({"audit": True}, False),
    ({"audit": True, "unauditable_trainers": True}, True),
    ({}, True),  # without audits every trainer is unauditable anyway
])
def test_an_unauditable_join_under_audits_needs_the_option(manifest, admitted):
    joiner = ident(30)
    v = Lone(trainers=1, manifest={**manifest, "idle_windows": 0})
    v.start(0.0)
    v.greet(joiner, ("trainer",))
    v.signed(joiner, JoinRequest(revision=v.revision.id, window=1, capacity=1, unauditable=True))
    assert v.engine.rejected_by_reason["unauditable-not-admitted"] == (0 if admitted else 1)
    assert (joiner.peer_id in v.role.admission.joins) == admitted


@pytest.mark.parametrize("admits", [False, True])
def test_an_unauditable_update_is_refused_without_the_option_and_never_replayed_with_it(admits):
    v = Lone(trainers=2, manifest={"audit": True, "unauditable_trainers": admits})
    v.start(0.0)
    a, b = v.trainers
    for t in (a, b):
        v.greet(t, ("trainer",))
    v.announce(a, unauditable=True)
    v.announce(b)
    assert v.engine.rejected_by_reason["unauditable-not-admitted"] == (0 if admits else 1)
    screens = {t.task.delta.digest: t.task for t in v.pending("screen")}
    assert screens[delta_of(b).digest].audit is not None  # an ordinary update is replayed inline
    if admits:
        assert screens[delta_of(a).digest].audit is None  # screened, never replayed
    else:
        assert delta_of(a).digest not in screens


def test_audit_evidence_against_an_unauditable_update_is_void():
    rev = make_revision(validators=(VALIDATOR,))
    manifest = attrs.evolve(rev.manifest, audit=True, audit_rate=0.5, unauditable_trainers=True)
    delta = delta_of(ident(10))
    update = seal(ident(10), UpdateAnnouncement(revision=rev.id, window=1, base=rev.id, shards=(0,), delta=delta,
                                                delta_digest=delta.digest, train_loss=0.5, unauditable=True))
    verdict = seal(VALIDATOR, AuditFailure(revision=rev.id, update=update))
    with pytest.raises(VerificationError, match="unauditable"):
        check_audit_evidence((verdict,), rev.id, manifest)
    plain = seal(ident(10), attrs.evolve(UpdateAnnouncement.from_cbor(
        update.open(UpdateAnnouncement.KIND, PROTOCOL_VERSION)), unauditable=False))
    assert check_audit_evidence((seal(VALIDATOR, AuditFailure(revision=rev.id, update=plain)),), rev.id,
                                manifest)[0] == plain

"""End to end (spec/auth.md): a fleet of `peerloom node` processes whose manifest admits by certificate.
One trainer logs in with `peerloom login` at a `peerloom auth serve` process against the fake OIDC provider,
then trains (its update is certified: it leaves the head's `unproven`), until `peerloom auth revoke --out`
revokes it and the revocation POSTed to the validator's edge drops it from the roster; a trainer with an
expired certificate is refused by the validator (join-not-admitted), one with a forged certificate is refused
by its own node at start; `peerloom verify` accepts the chain."""

from __future__ import annotations

import urllib.request

import attrs
import pytest

from peerloom.adapters.keys import generate_identity, save_identity
from peerloom.adapters.storage import atomic_write
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.objects import AdmissionCertificate, Revision, seal
from tests.fake_oidc import FakeProvider, auth_config, log_in, serve_auth, stop_fleet
from tests.node_cluster import chain, free_port, make_fleet, peerloom, wait_until


@pytest.mark.slow
def test_login_admits_a_trainer_that_trains_and_bad_certificates_are_refused(tmp_path):
    nodes = make_fleet(tmp_path, validators=1, trainers=4, quorum=1, window_s=1.0)
    validator, member, volunteer, expired, forged = nodes
    manifest = Revision.verify(SignedEnvelope.from_bytes((tmp_path / "manifest.cbor").read_bytes())).manifest
    authority, gate = generate_identity(), generate_identity()
    save_identity(gate, tmp_path / "gate.key")
    manifest = attrs.evolve(manifest, roster=((member.identity.peer_id, 1),), admission="certificate",
                            admission_authority=gate.peer_id)
    revision = Revision.verify(manifest.seal(authority))
    atomic_write(tmp_path / "manifest.cbor", revision.envelope.to_bytes())
    for node in nodes:
        node.write_config(authority=authority.peer_id.to_text())
    edge_port, auth_port = free_port(), free_port()
    validator.write_config(http={"enabled": True, "listen": f"127.0.0.1:{edge_port}"})

    # expired: a genuine certificate whose last window (0) is before any join's window
    out = peerloom("admit", "--authority-key", str(tmp_path / "gate.key"),
                   "--manifest", str(tmp_path / "manifest.cbor"),
                   "--peer", expired.identity.peer_id.to_text(), "--expires-window", "0",
                   "--out", str(expired.directory / "admission.cbor"))
    assert out.returncode == 0, out.stderr
    expired.write_config(admission="admission.cbor")
    # forged: the right shape, signed by a key that is not the admission authority
    fake = seal(generate_identity(), AdmissionCertificate(revision=revision.id, peer=forged.identity.peer_id,
                                                          max_capacity=1))
    atomic_write(forged.directory / "admission.cbor", fake.to_bytes())
    forged.write_config(admission="admission.cbor")

    auth = None
    with FakeProvider(auto={"claims": {"sub": "volunteer-42"}}) as provider:
        (tmp_path / "auth.toml").write_text(auth_config(provider, auth_port, edge_port=edge_port))
        try:
            for node in (validator, member, expired):
                node.start()
            for node in (validator, member, expired):
                node.wait_port()
            wait_until(lambda: bool(chain(validator)), 30.0, "a first head", nodes)
            auth = serve_auth(tmp_path / "auth.toml", tmp_path / "auth.log")

            assert "enter the code" in log_in(volunteer, auth_port, tmp_path / "auth.log")
            volunteer.start()
            volunteer.wait_port()

            # the forged certificate: its own node refuses to start with it
            refused = peerloom("node", "--config", str(forged.config_path), timeout_s=60)
            assert refused.returncode == 2 and "admission_authority" in refused.stderr, refused.stderr

            me = volunteer.identity.peer_id

            def trained() -> bool:  # rostered, and no longer unproven: an update of its was certified
                return any(me in h.roster_peers and me not in h.unproven for h in chain(validator))

            wait_until(trained, 90.0, "the logged-in trainer's update in a certified head", nodes)

            def expired_refused() -> bool:
                return any(e["event"] == "reject" and e.get("peer") == expired.identity.peer_id.to_text()
                           and e["reason"] == "join-not-admitted" and "expired" in e.get("detail", "")
                           for e in validator.events())

            wait_until(expired_refused, 60.0, "the expired certificate's join refused", nodes)

            # revocation (spec/auth.md §6): the signed revocation, POSTed to the validator's edge, drops the
            # logged-in trainer from the roster, and its later joins (valid certificate) are refused
            out = peerloom("auth", "revoke", "--config", str(tmp_path / "auth.toml"), "--peer", me.to_text(),
                           "--out", str(tmp_path / "revocation.cbor"))
            assert out.returncode == 0, out.stderr
            request = urllib.request.Request(f"http://127.0.0.1:{edge_port}/v1/revocations", method="POST",
                                             data=(tmp_path / "revocation.cbor").read_bytes(),
                                             headers={"Content-Type": "application/cbor"})
            with urllib.request.urlopen(request, timeout=30) as resp:
                assert resp.status == 202

            def removed() -> bool:
                heads = chain(validator)
                return any(h.revoked for h in heads) and me not in heads[-1].roster_peers

            wait_until(removed, 60.0, "the revoked trainer dropped by a head that carries the revocation", nodes)

            def rejoin_refused() -> bool:
                # Each refused join costs the joiner a penalty point, so a trainer that keeps rejoining ends
                # banned; its refusal lines may all fall in the budget that strangers' lines of one kind share
                # (spec/transport.md §14), so the ban for penalties counts as the refusals' evidence too.
                events = validator.events()
                revoked_at = next(e["t"] for e in events if e["event"] == "revocation")
                return any(e["event"] == "reject" and e.get("peer") == me.to_text()
                           and e["reason"] == "join-not-admitted" and "revoked" in e.get("detail", "")
                           for e in events) or \
                    any(e["event"] == "peer-banned" and e.get("peer") == me.to_text() and e["t"] >= revoked_at
                        for e in events)

            wait_until(rejoin_refused, 60.0, "the revoked trainer's join refused", nodes)
            heads = chain(validator)
            i = next(i for i, h in enumerate(heads) if h.revoked)
            assert all(me not in h.roster_peers for h in heads[i:])
            assert all(expired.identity.peer_id not in h.roster_peers for h in heads)
            assert all(forged.identity.peer_id not in h.roster_peers for h in heads)
        finally:
            stop_fleet(auth, nodes)
    check = peerloom("verify", str(validator.directory), "--authority", authority.peer_id.to_text())
    assert check.returncode == 0, check.stdout + check.stderr
    assert auth is not None and auth.returncode == 0

"""End to end, relays and login admission in one fleet (spec/transport.md §12, spec/auth.md): `peerloom node`
processes (tests/node_cluster.py make_fleet: two validators, quorum 2, four trainers) under a manifest with
``admission = "certificate"`` that rosters only trainer-1, and

- trainer-2 ("hidden") listens nowhere and dials nothing but circuits: it holds a reservation at validator-1's
  relay (``[relay] enabled = true``; it has ``[relay] via``, ``only = true``) and the validators dial its
  circuit address (spec/transport.md §12); it joins with a certificate from `peerloom admit`;
- trainer-3 ("volunteer") gets its certificate with `peerloom login` at a `peerloom auth serve` process
  against the fake OIDC provider (tests/fake_oidc.py; spec/auth.md), then joins;
- trainer-4 ("expired") joins with a genuine certificate that expired at window 0, and is refused
  (``join-not-admitted``) and never rostered.

Both admitted newcomers' updates are certified (rostered and no longer ``unproven`` in a head), trainer-2 is
reached only through the relay, and `peerloom verify` accepts both validators' chains."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from peerloom.adapters.keys import generate_identity, save_identity
from peerloom.adapters.storage import atomic_write
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.identity import PeerId
from peerloom.core.objects import Revision
from tests.fake_oidc import FakeProvider, auth_config, log_in, serve_auth, stop_fleet
from tests.node_cluster import Node, chain, free_port, make_fleet, peerloom, wait_until


def certified(validator: Node, peer: PeerId) -> bool:
    """True once a head of `validator` rosters `peer` and no longer lists it unproven: an update of its was
    certified."""
    return any(peer in h.roster_peers and peer not in h.unproven for h in chain(validator))


def refused_as_expired(validator: Node, peer: PeerId) -> bool:
    return any(e.get("event") == "reject" and e.get("peer") == peer.to_text()
               and e.get("reason") == "join-not-admitted" and "expired" in e.get("detail", "")
               for e in validator.events())


@pytest.mark.slow
def test_relayed_logged_in_and_refused_trainers_in_one_certificate_fleet(tmp_path: Path) -> None:
    nodes = make_fleet(tmp_path, validators=2, trainers=4, quorum=2, window_s=1.0)
    validator_1, validator_2, member, hidden, volunteer, expired = nodes
    validators = (validator_1, validator_2)
    manifest_path = tmp_path / "manifest.cbor"

    # the manifest: certificate admission, authority `gate`; only trainer-1 is rostered from the start
    manifest = Revision.verify(SignedEnvelope.from_bytes(manifest_path.read_bytes())).manifest
    authority, gate = generate_identity(), generate_identity()
    save_identity(gate, tmp_path / "gate.key")
    manifest = attrs.evolve(manifest, roster=((member.identity.peer_id, 1),), admission="certificate",
                            admission_authority=gate.peer_id)
    atomic_write(manifest_path, Revision.verify(manifest.seal(authority)).envelope.to_bytes())
    for node in nodes:
        node.write_config(authority=authority.peer_id.to_text())

    # validator-1 serves the HTTP edge (the auth service reads the current window there) and a relay
    edge_port, auth_port, relay_port = free_port(), free_port(), free_port()
    relay = f"/ip4/127.0.0.1/tcp/{relay_port}"
    validator_1.write_config(http={"enabled": True, "listen": f"127.0.0.1:{edge_port}"},
                             relay={"enabled": True, "listen": relay})
    # trainer-2: no direct listener, no bootstrap, circuits only; the validators dial its circuit address
    circuit = f"{relay}/p2p-circuit/{hidden.identity.peer_id.to_text()}"
    config = dict(hidden.config)
    del config["listen"]
    hidden.config = {**config, "bootstrap": [], "relay": {"via": [relay], "only": True}}
    for validator in validators:
        validator.write_config(bootstrap=validator.config["bootstrap"] + [circuit])

    # certificates from `peerloom admit`: trainer-2's without expiry, trainer-4's last window is 0
    for node, expiry in ((hidden, ()), (expired, ("--expires-window", "0"))):
        out = peerloom("admit", "--authority-key", str(tmp_path / "gate.key"), "--manifest", str(manifest_path),
                       "--peer", node.identity.peer_id.to_text(), *expiry,
                       "--out", str(node.directory / "admission.cbor"))
        assert out.returncode == 0, out.stderr
        node.write_config(admission="admission.cbor")

    auth = None
    with FakeProvider(auto={"claims": {"sub": "volunteer-42"}}) as provider:
        (tmp_path / "auth.toml").write_text(auth_config(provider, auth_port, edge_port=edge_port))
        early = (validator_1, validator_2, member, hidden, expired)
        try:
            for node in early:
                node.start()
            auth = serve_auth(tmp_path / "auth.toml", tmp_path / "auth.log", timeout_s=60.0)
            for node in early:
                node.wait_port(timeout_s=60.0)
            wait_until(lambda: bool(chain(validator_1)), 60.0, "a first head", nodes)

            log_in(volunteer, auth_port, tmp_path / "auth.log")
            volunteer.start()
            volunteer.wait_port(timeout_s=60.0)

            for name, node in (("the relayed trainer", hidden), ("the logged-in trainer", volunteer)):
                wait_until(lambda node=node: all(certified(v, node.identity.peer_id) for v in validators), 120.0,
                           f"{name}'s update in a certified head", nodes)
            wait_until(lambda: all(refused_as_expired(v, expired.identity.peer_id) for v in validators), 60.0,
                       "the expired certificate's join refused by both validators", nodes)
        finally:
            stop_fleet(auth, nodes)

    assert auth is not None and auth.returncode == 0, (tmp_path / "auth.log").read_text()[-3000:]
    for validator in validators:
        assert all(expired.identity.peer_id not in h.roster_peers for h in chain(validator))
        check = peerloom("verify", str(validator.directory), "--authority", authority.peer_id.to_text())
        assert check.returncode == 0, check.stdout + check.stderr
    # trainer-2 was reached only through validator-1's relay, in both directions
    hidden_id = hidden.identity.peer_id.to_text()
    for validator in validators:
        to_hidden = [e for e in validator.events() if e.get("event") == "connected" and e.get("peer") == hidden_id]
        assert to_hidden and all(e["transport"] == "relay" and e["address"] == circuit for e in to_hidden)
    connected = [e for e in hidden.events() if e.get("event") == "connected"]
    assert connected and {e["transport"] for e in connected} == {"relay"}
    assert any(e.get("event") == "relay" for e in validator_1.events())

"""`POST /v1/revocations` on the HTTP edge (spec/auth.md §6): the admission authority's signed revocation
reaches the node's engine; a revocation of another signer, a tampered one or another kind changes nothing."""

from __future__ import annotations

import attrs

from peerloom.adapters.http_edge import EdgeLimits, EdgeServer
from peerloom.core.objects import AdmissionRevocation, JoinRequest, Revision, seal
from tests.adapters.test_http_edge import error_code, post
from tests.edge_fixtures import make_view
from tests.helpers import ident, make_revision

AUTHORITY = ident(97)


def test_revocation_endpoint_takes_only_the_authoritys_revocation(tmp_path):
    base = make_revision(validators=(ident(1),), trainers=(ident(10), ident(11)))
    owner = ident(200)  # make_revision's manifest signer
    manifest = attrs.evolve(base.manifest, admission="certificate", admission_authority=AUTHORITY.peer_id)
    revision = Revision.verify(manifest.seal(owner), owner.peer_id)
    view = make_view(tmp_path, revision=revision)
    victim = ident(10).peer_id
    good = seal(AUTHORITY, AdmissionRevocation(revision=revision.id, peers=(victim,))).to_bytes()
    with EdgeServer(view, limits=EdgeLimits(rate=1000, burst=1000)) as server:
        forged = seal(ident(96), AdmissionRevocation(revision=revision.id, peers=(victim,))).to_bytes()
        status, _, body = post(server, "/v1/revocations", forged)
        assert status == 422 and error_code(body) == "bad-revocation"
        assert post(server, "/v1/revocations", good[:-1] + bytes([good[-1] ^ 0x80]))[0] == 403  # bad signature
        join = seal(ident(12), JoinRequest(revision=revision.id, window=1, capacity=1)).to_bytes()
        assert post(server, "/v1/revocations", join)[0] == 400  # another kind
        assert post(server, "/v1/revocations", b"\x00" * 5000)[0] == 413
        assert view.revocations == []
        status, _, _ = post(server, "/v1/revocations", good)
        assert status == 202 and [r.peers for r in view.revocations] == [(victim,)]

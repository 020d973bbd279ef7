"""Builders for the HTTP edge tests: a revision, certified heads signed by a real validator key, and an
`InMemoryEdgeView` holding them."""

from __future__ import annotations

from pathlib import Path

import attrs
from prometheus_client import CollectorRegistry, Counter

from peerloom.adapters.edge_view import PeerInfo
from peerloom.core.encoding import content_id
from peerloom.core.identity import Identity
from peerloom.core.objects import Head, QuorumCertificate, Revision, make_artifact_ref
from peerloom.testing import InMemoryEdgeView

from . import helpers
from .helpers import ident, make_revision

VALIDATOR = ident(1)


def certify(revision: Revision, head: Head, validators: tuple[Identity, ...] = (VALIDATOR,)) -> QuorumCertificate:
    """`tests.helpers.certify` with the edge's one validator as the default signer."""
    return helpers.certify(revision, head, validators)


def next_head(revision: Revision, parent: Head, params: bytes, *, accuracy: float, loss: float,
              chunk_size: int = 64 * 1024) -> Head:
    ref = make_artifact_ref(params, chunk_size)
    return Head(revision=revision.id, parent=parent.id, window=parent.window + 1, skipped=False, params=ref,
                params_digest=ref.digest, cohort=(content_id(b"update %d" % parent.window),), roster=parent.roster,
                quarantine=(), metrics={"test_accuracy": accuracy, "test_loss": loss})


def make_view(tmp_path: Path, *, revision: Revision | None = None, genesis: bytes = b"genesis params",
              trainers: tuple[Identity, ...] = (ident(10), ident(11))) -> InMemoryEdgeView:
    revision = revision or make_revision(validators=(VALIDATOR,), trainers=trainers, genesis=genesis)
    registry = CollectorRegistry()
    Counter("peerloom_windows", "certified windows", registry=registry).inc(0)
    view = InMemoryEdgeView(identity_peer=VALIDATOR.peer_id, revision=revision, registry=registry,
                            artifacts_dir=tmp_path / "artifacts")
    view.put_artifact(genesis)
    for t in trainers:
        view.add_peer(PeerInfo(peer_id=t.peer_id, roles=("trainer",), address="127.0.0.1:1", bytes_sent=1000,
                               bytes_received=2000))
    return view


def populated(head: Head) -> Head:
    """`head` carrying every kind of record a live chain grows: a quarantine, strikes, a rejected update,
    a leave and an idle expiry (the edge must render all of them)."""
    w = head.window
    return attrs.evolve(head, quarantine=((ident(20).peer_id, w + 3),), strikes=((ident(20).peer_id, 3, w),
                                                                                (ident(21).peer_id, 1, w)),
                        rejected=(content_id(b"rejected %d" % w),), left=(ident(22).peer_id,),
                        expired=(ident(23).peer_id,))


def advance(view: InMemoryEdgeView, n: int, *, records: bool = False) -> list[Head]:
    """Certify `n` more heads with made-up params and rising accuracy (`records`: each one `populated`);
    returns them."""
    heads = []
    for _ in range(n):
        parent = view.latest().head
        w = parent.window + 1
        params = b"params of window %d " % w * 100
        view.put_artifact(params)
        head = next_head(view.revision, parent, params, accuracy=0.5 + 0.04 * w, loss=2.0 / w)
        head = populated(head) if records else head
        view.promote(head, certify(view.revision, head), accepted=2, rejected=w % 2,
                     bytes_sent=1000 * w, bytes_received=1500 * w, time=1.0e9 + w)
        heads.append(head)
    return heads


def make_privacy_view(tmp_path: Path) -> tuple[InMemoryEdgeView, Head]:
    """A view of a revision with `privacy` (epsilon budget 8) and `private_data`, certified to window 1 with a
    head whose ledger holds its two trainers (ident 10: 40 steps, epsilon 1.5; ident 11: 16 steps, 0.75,
    private) and ident 12, a peer the view does not know (8 steps, 0.5)."""
    from peerloom.core.objects import PrivacyParams

    from .helpers import make_revision

    trainers = (ident(10), ident(11))
    plain = make_revision(validators=(VALIDATOR,), trainers=trainers)
    manifest = attrs.evolve(plain.manifest, inner_steps=8, private_data=True,
                            privacy=PrivacyParams(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5,
                                                  sample_rate=0.05, epsilon_budget=8.0))
    revision = Revision.verify(manifest.seal(ident(200)), ident(200).peer_id)
    view = make_view(tmp_path, revision=revision, trainers=trainers)
    params = b"params of window 1 " * 100
    view.put_artifact(params)
    ledger = sorted([(ident(10).peer_id, 40, 1.5), (ident(11).peer_id, 16, 0.75), (ident(12).peer_id, 8, 0.5)])
    head = attrs.evolve(next_head(revision, view.latest().head, params, accuracy=0.6, loss=1.0),
                        privacy=tuple(ledger), private=(ident(11).peer_id,))
    view.promote(head, certify(revision, head), accepted=2, rejected=0, bytes_sent=1000, bytes_received=1500,
                 time=1.0e9 + 1)
    return view, head

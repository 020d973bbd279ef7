"""Certificate expiry in the validator (spec/auth.md §4, spec/protocol.md §5): a validator checks a
certificate's `expires_window` against the join's own signed `window`, so the verdict on a join is the same
at every validator: a join naming a window after the certificate's last is refused (join-not-admitted) and
nothing is recorded; one naming the last window itself is taken."""

from __future__ import annotations

import pytest

from peerloom.backends.registry import build_workload
from peerloom.core.errors import VerificationError
from peerloom.core.objects import AdmissionCertificate, JoinRequest, decode_body, seal
from peerloom.core.validator import ValidatorRole
from tests.core.test_admission import AUTHORITY
from tests.engine_cluster import N_SHARDS, SEED, build_until
from tests.helpers import ident


@pytest.fixture(scope="module")
def digits():
    return build_workload("digits-numpy", SEED, N_SHARDS)


def test_join_window_after_expires_window_is_refused_and_the_last_window_is_taken(tmp_path, digits):
    cluster = build_until(1, tmp_path, digits, trainers=2, admission="certificate",
                          admission_authority=AUTHORITY.peer_id)
    role = next(r for r in cluster.nodes["validator"].engine.roles if isinstance(r, ValidatorRole))
    book, rid = role.admission, cluster.revision.id
    w = book.window  # the window this validator collects

    def join(joiner, window, expires_window):
        cert = seal(AUTHORITY, AdmissionCertificate(revision=rid, peer=joiner.peer_id, max_capacity=2,
                                                    expires_window=expires_window, login=bytes(32)))
        return seal(joiner, JoinRequest(revision=rid, window=window, capacity=2, admission=cert))

    late, ahead, last = ident(40), ident(41), ident(42)
    for joiner, window, expires in [(late, w, w - 1), (ahead, w + 2, w + 1)]:
        with pytest.raises(VerificationError) as info:
            envelope = join(joiner, window, expires)
            book.on_join(joiner.peer_id, envelope, decode_body(envelope))
        assert info.value.reason == "join-not-admitted" and "expired" in info.value.detail
        assert joiner.peer_id not in book.joins and joiner.peer_id not in book.admitted
    envelope = join(last, w, w)
    assert book.on_join(last.peer_id, envelope, decode_body(envelope)) is True
    assert book.admitted[last.peer_id] == 2 and last.peer_id in book.joins

"""A privacy manifest without opacus, or with a workload that cannot run DP-SGD, fails in one line that says
what to do (spec/protocol.md §10; README's install table: ``pip install 'peerloom[dp]'``)."""

import sys

import attrs
import pytest

from peerloom.core.objects import PrivacyParams
from peerloom.node import ConfigError, apply_privacy
from peerloom.verify import check_ledger
from tests.helpers import child, ident, make_revision

PARAMS = PrivacyParams(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, sample_rate=0.1, epsilon_budget=8.0)


def dp_manifest():
    return attrs.evolve(make_revision(trainers=[ident(10)]).manifest, privacy=PARAMS, inner_steps=2)


def test_without_opacus_a_privacy_manifest_fails_in_one_line_naming_the_extra(monkeypatch):
    from peerloom.backends.registry import build_workload

    workload, _ = build_workload("mnist1d-mlp", 0, 4)
    monkeypatch.setitem(sys.modules, "opacus", None)
    with pytest.raises(ConfigError) as exc:
        apply_privacy(workload, PARAMS, "mnist1d-mlp")
    message = str(exc.value)
    assert "pip install 'peerloom[dp]'" in message and "\n" not in message
    # `peerloom verify` cannot recompute the ledger either, and says why instead of a traceback
    from peerloom.core.errors import VerificationError
    from peerloom.core.objects import Revision

    authority = ident(200)
    revision = Revision.verify(dp_manifest().seal(authority), authority.peer_id)
    genesis = revision.genesis()
    head = child(revision, genesis, privacy=((ident(10).peer_id, 2, 0.5),))
    with pytest.raises(VerificationError, match=r"peerloom\[dp\]"):
        check_ledger(revision, head, genesis)


def test_a_numpy_workload_cannot_train_with_dp_sgd():
    from peerloom.backends.registry import build_workload

    workload, _ = build_workload("mnist1d-numpy", 0, 4)
    with pytest.raises(ConfigError, match="torch workload"):
        apply_privacy(workload, PARAMS, "mnist1d-numpy")


def test_every_role_of_a_privacy_manifest_trains_with_its_dp_parameters():
    from peerloom.backends.registry import build_workload

    workload, _ = build_workload("mnist1d-mlp", 0, 4)
    apply_privacy(workload, PARAMS, "mnist1d-mlp")
    assert (workload.privacy.noise_multiplier, workload.privacy.max_grad_norm, workload.privacy.sample_rate) == (
        1.0, 1.0, 0.1)

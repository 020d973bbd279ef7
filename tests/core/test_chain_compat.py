"""Chains written before sampled audits and the loss check (main at 559cf7b, `tests/data/chain-559cf7b`: the
`byzantine-trainers` simulation, seed 1) still verify: every new manifest and head field is absent when off,
so an old chain's bytes, ids and signatures mean what they meant (spec/protocol.md §6.1-6.3). A head with a
field this version does not know is refused with the field's name."""

import shutil
from pathlib import Path

import cbor2
import pytest

from peerloom.core.errors import PeerloomError
from peerloom.verify import verified_chain

OLD = Path(__file__).resolve().parents[1] / "data" / "chain-559cf7b"


def test_a_chain_from_before_sampled_audits_verifies():
    checked: list[str] = []
    revision, entries = verified_chain(OLD, checked=checked)
    m = revision.manifest
    assert len(entries) == 6 and (m.audit_rate, m.audit_segments, m.loss_check_samples) == (0.0, 0, 0)
    assert m.norm_mads == 0  # decoded without the key: the fixed norm ratio its heads were screened with
    assert all(not head.audits for head, _ in entries)
    assert checked[-1].startswith("cohort and roster rules hold for 6 heads")


def test_a_head_with_an_unknown_field_is_refused_by_name(tmp_path):
    chain = tmp_path / "chain"
    shutil.copytree(OLD, chain)
    record = cbor2.loads((chain / "000003.cbor").read_bytes())
    record["head"]["future_field"] = 1
    (chain / "000003.cbor").write_bytes(cbor2.dumps(record, canonical=True))
    with pytest.raises(PeerloomError, match=r"000003\.cbor"):
        verified_chain(chain)

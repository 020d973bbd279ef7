"""The engine's durable records (core/records.py): one class per kind, the storage key derived from the fields in
one place and read back by `parse`; the keys are what stores on disk already hold, so they never change."""

import typing

import pytest

from peerloom.core import records as rec
from tests.helpers import ident

HOLDER = ident(3).peer_id
SAMPLES = [
    (rec.HeadRecord(data=b"h"), "head"),
    (rec.ChainRecord(window=7, data=b"c"), "chain/7"),
    (rec.VoteRecord(window=3, round=1, step="precommit", data=b"v"), "vote/3/1/precommit"),
    (rec.LockRecord(window=3, data=b"l"), "lock/3"),
    (rec.ProposalRecord(window=3, round=2, data=b"p"), "proposal/3/2"),
    (rec.ClaimRecord(window=4, data=b"a"), "claim/4"),
    (rec.ClaimRecord(window=4, holder=HOLDER, data=b"a"), f"claim/4/{HOLDER.to_text()}"),
    (rec.RevocationRecord(envelope_id=bytes(range(4)), data=b"r"), "revocation/00010203"),
]


def test_every_record_kind_has_a_sample():
    assert {type(r) for r, _ in SAMPLES} == set(typing.get_args(rec.Record))


@pytest.mark.parametrize(("record", "key"), SAMPLES)
def test_the_key_is_the_stored_format_and_parse_reads_it_back(record, key):
    assert record.key == key
    assert rec.parse(key, record.data) == record


@pytest.mark.parametrize("key", ["", "heads", "chain/x", "chain/1/2", "vote/1/2", "vote/a/0/prevote", "lock/-1",
                                 "claim/1/not-a-peer!", "revocation/zz", "rec/a"])
def test_a_key_no_record_has_parses_to_none(key):
    assert rec.parse(key, b"x") is None

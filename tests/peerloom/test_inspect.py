"""`peerloom inspect DIR`: the chain, votes, claims and peers of a node store as tables."""

import io

from rich.console import Console

from peerloom.adapters.storage import ArtifactStore
from peerloom.core.chain import encode_chain_entry
from peerloom.core.objects import QuorumCertificate, sign_vote
from peerloom.inspect import find_store, render
from tests.helpers import ident, make_revision
from tests.node_zygote import run_cli


def _store(tmp_path):
    revision = make_revision()
    genesis = revision.genesis()
    store = ArtifactStore(tmp_path / "node" / "store")
    store.put_record("head", encode_chain_entry(genesis, QuorumCertificate(head=genesis.id, window=0, round=0,
                                                                           votes=())))
    vote = sign_vote(ident(1), revision.id, 7, 2, "prevote", genesis.id)
    store.put_record("vote/7/2/prevote", vote.to_bytes())
    store.db.note_peer("12D3KooWexample", address="127.0.0.1:7001")
    store.db.charge("12D3KooWexample", "bad-signature", 2)
    store.close()
    return genesis, vote


def test_inspect_renders_chain_votes_and_peers(tmp_path):
    genesis, vote = _store(tmp_path)
    out = io.StringIO()
    render(find_store(tmp_path / "node"), console=Console(file=out, width=200))
    text = out.getvalue()
    assert genesis.id[2:].hex()[:16] in text  # the chain row
    assert vote.id[2:].hex()[:16] in text and "prevote" in text  # the vote row
    assert "127.0.0.1:7001" in text and "bad-signature x2" in text
    assert "integrity ok" in text


def test_inspect_command_and_missing_store(tmp_path):
    _store(tmp_path)
    ok = run_cli(["inspect", tmp_path / "node"])
    assert ok.returncode == 0 and "chain" in ok.stdout and "votes cast (1 in all" in ok.stdout
    missing = run_cli(["inspect", tmp_path / "nowhere"])
    assert missing.returncode == 2 and "no node.db" in missing.stderr

"""`peerloom verify PATH` over both forms of a chain (spec/protocol.md §3): a chain directory (manifest.cbor +
NNNNNN.cbor) and a node store (node.db, or a node directory with store/). A hole fails, naming the
missing window; a store's chain directory must hold the same heads as its database, and a node repairs
one a crash left behind (`fill_chain_dir`)."""

import shutil

import pytest

from peerloom.adapters.storage import ArtifactStore
from peerloom.core.chain import encode_chain_entry
from peerloom.core.chainsync import HEAD_RECORD, chain_key
from peerloom.node import fill_chain_dir
from peerloom.verify import run_verify
from tests.helpers import certify, child, ident, make_revision
from tests.node_zygote import run_cli

VALS = [ident(1), ident(2), ident(3), ident(4)]
REV = make_revision(validators=VALS, quorum=3, trainers=[ident(10)])


def _chain(n):
    chain, head = [], REV.genesis()
    for _ in range(n):
        head = child(REV, head)
        chain.append((head, certify(REV, head, VALS[:3])))
    return chain


def _node(tmp_path, windows, *, n=None, manifest=True):
    """A node directory whose store holds the certified heads of `windows` (archived and promoted, as the
    engine persists them), its manifest and its chain directory."""
    chain = _chain(n or max(windows))
    store_dir = tmp_path / "node" / "store"
    store = ArtifactStore(store_dir)
    for w in windows:
        store.put_record(chain_key(w), encode_chain_entry(*chain[w - 1]))
        store.put_record(HEAD_RECORD, encode_chain_entry(*chain[w - 1]))
    fill_chain_dir(store.db, store_dir / "chain")
    store.close()
    if manifest:
        (store_dir / "manifest.cbor").write_bytes(REV.envelope.to_bytes())
    return tmp_path / "node", store_dir


def _verify(path, **kwargs):
    lines: list[str] = []
    return run_verify(path, echo=lines.append, **kwargs), "\n".join(lines)


def test_a_node_store_verifies_given_as_store_node_directory_or_its_chain_directory(tmp_path):
    node_dir, store_dir = _node(tmp_path, range(1, 5))
    for path in (store_dir, node_dir):
        status, out = _verify(path, authority=REV.authority.to_text())
        assert status == 0, out
        assert "node store" in out and "chain directory" in out and "OK: 4 certified heads" in out
    status, out = _verify(store_dir / "chain")  # a node's store/chain/: the manifest sits one level up
    assert status == 0 and "OK: 4 certified heads" in out, out
    plain = tmp_path / "plain"
    shutil.copytree(store_dir / "chain", plain)
    shutil.copy(store_dir / "manifest.cbor", plain / "manifest.cbor")
    status, out = _verify(plain)
    assert status == 0 and "node store" not in out and "OK: 4 certified heads" in out, out


@pytest.mark.parametrize(("windows", "message"), [
    ((1, 2, 4, 5), "window 3 is missing (window 4 follows window 2)"),
    ((1, 4), "windows 2-3 are missing (window 4 follows window 1)"),
    ((2, 3), "window 1 is missing (window 2 follows window 0)"),
])
def test_a_store_with_a_hole_fails_naming_the_missing_window(tmp_path, windows, message):
    node_dir, store_dir = _node(tmp_path, windows)
    status, out = _verify(node_dir)
    assert status == 1 and f"FAILED: window-gap: {message}" in out, out
    status, out = _verify(store_dir / "chain")  # the same hole in the chain directory
    assert status == 1 and message in out, out
    cli = run_cli(["verify", node_dir], timeout=120)
    assert cli.returncode == 1 and message in cli.stdout, cli.stdout + cli.stderr


def test_a_chain_directory_that_lags_its_store_fails_and_a_restart_repairs_it(tmp_path):
    _, store_dir = _node(tmp_path, range(1, 5))
    (store_dir / "chain" / "000003.cbor").unlink()  # SIGKILL between the database commit and the file
    status, out = _verify(store_dir)
    assert status == 1 and "lacks window(s) 3 of the store's database" in out, out
    store = ArtifactStore(store_dir)
    assert fill_chain_dir(store.db, store_dir / "chain") == [3]
    assert fill_chain_dir(store.db, store_dir / "chain") == []
    store.close()
    assert _verify(store_dir)[0] == 0
    (store_dir / "chain" / "000003.cbor").write_bytes((store_dir / "chain" / "000002.cbor").read_bytes())
    status, out = _verify(store_dir)
    assert status == 1 and "window(s) 3 differ" in out, out


def test_manifest_option_and_user_errors(tmp_path):
    node_dir, _ = _node(tmp_path, range(1, 3), manifest=False)
    manifest = tmp_path / "manifest.cbor"
    manifest.write_bytes(REV.envelope.to_bytes())

    def cli(*args):
        return run_cli(["verify", *args], timeout=120)

    out = cli(node_dir)
    assert out.returncode == 2 and "pass --manifest FILE" in out.stderr and len(out.stderr.splitlines()) == 1
    out = cli(node_dir, "--manifest", manifest)
    assert out.returncode == 0 and "OK: 2 certified heads" in out.stdout, out.stdout + out.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    out = cli(empty)
    assert out.returncode == 2 and "nor a node store" in out.stderr and len(out.stderr.splitlines()) == 1
    other = make_revision(validators=VALS, quorum=3, trainers=[ident(11)])
    manifest.write_bytes(other.envelope.to_bytes())  # another revision: its genesis is not the chain's parent
    assert cli(node_dir, "--manifest", manifest).returncode == 1


def test_peerloom_verify_returns_the_checked_chain(tmp_path):
    """`peerloom.verify(path)`: the same checks, as a value (revision, certified heads, the checks passed)."""
    import peerloom
    from peerloom.core.errors import VerificationError

    node_dir, _ = _node(tmp_path, range(1, 4))
    chain = peerloom.verify(node_dir, authority=REV.authority.to_text())
    revision, entries, checked = chain
    assert revision.id == REV.id and [h.window for h, _ in entries] == [1, 2, 3] and chain.head == entries[-1][0]
    assert checked and chain.checked == checked
    with pytest.raises(VerificationError):
        peerloom.verify(node_dir, authority=ident(99).peer_id.to_text())
    hole, _ = _node(tmp_path / "hole", [1, 3])
    with pytest.raises(VerificationError, match="2"):
        peerloom.verify(hole)

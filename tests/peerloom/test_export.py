"""`peerloom export` and `peerloom.load_head`: a certified head's weights out of a verified
chain, as safetensors with the head's metadata, and back into numpy or a torch module.

The store with weights is a real one: the in-process cluster of tests/engine_cluster.py (real training,
screening, reduction, signatures and SQLite + artifact storage on a virtual clock) certifies three windows.
"""

import shutil
import sqlite3
import subprocess
import sys

import attrs
import numpy as np
import pytest
import safetensors
import safetensors.numpy

import peerloom
from peerloom.adapters.storage import ArtifactStore
from peerloom.backends.numpy.tensors import tensor_digest, to_safetensors
from peerloom.backends.registry import build_workload
from peerloom.core.chain import decode_chain_entry, encode_chain_entry
from peerloom.core.chainsync import HEAD_RECORD, chain_key
from peerloom.core.errors import PeerloomError, VerificationError
from peerloom.core.objects import make_artifact_ref
from peerloom.export import METADATA_KEYS, ExportError, ParamsMismatchError, export_head, load_head
from tests.engine_cluster import N_SHARDS, SEED, build, head_window
from tests.helpers import certify, child, ident, make_revision
from tests.node_zygote import run_cli

torch = pytest.importorskip("torch")
from peerloom.backends.torch.models import mlp  # noqa: E402 - needs torch

WINDOWS = 3


@pytest.fixture(scope="module")
def workload():
    return build_workload("digits-mlp", SEED, N_SHARDS)


@pytest.fixture(scope="module")
def certified(tmp_path_factory, workload):
    """(validator store with its manifest.cbor, revision, [(head, certificate)] of windows 1..WINDOWS)."""
    root = tmp_path_factory.mktemp("cluster")
    cluster = build(root, workload)
    assert cluster.run_until(lambda c: head_window(c) >= WINDOWS, max_time=60.0)
    store = root / "validator"
    (store / "manifest.cbor").write_bytes(cluster.revision.envelope.to_bytes())
    chain = [(h, c) for _, h, c in cluster.nodes["validator"].heads]
    for node in cluster.nodes.values():
        node.store.close()
    assert [h.window for h, _ in chain][:WINDOWS] == [1, 2, 3]
    return store, cluster.revision, chain


def _copy(store, tmp_path):
    """A copy of the shared store that a test may tamper with."""
    return shutil.copytree(store, tmp_path / "store")


def _read(path):
    with safetensors.safe_open(str(path), "np") as fh:
        return {name: fh.get_tensor(name) for name in fh.keys()}, fh.metadata()


def _cli(*args):
    return run_cli(list(args), timeout=120)  # a real `peerloom` process, forked: no import cost


def _one_line(result, *needles):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert all(n in lines[0] for n in needles), lines[0]
    return lines[0]


# --- export -----------------------------------------------------------------------------------------------


def test_export_writes_the_latest_certified_head_with_its_metadata(tmp_path, certified, workload):
    store, revision, chain = certified
    latest = chain[-1][0]
    out = tmp_path / "model.safetensors"
    metadata = export_head(store, out)
    tensors, written = _read(out)
    assert written == metadata == {
        "peerloom.head": latest.id.hex(), "peerloom.window": str(latest.window),
        "peerloom.revision": revision.id.hex(), "peerloom.experiment": "pair", "peerloom.workload": "digits-mlp",
        "peerloom.tensor_digest": latest.params_digest.hex()}
    assert set(written) == set(METADATA_KEYS)
    # the tensors are the head's certified params, under the workload's names, float32
    assert tensor_digest(tensors) == latest.params_digest
    wl, _ = workload
    assert [(n, str(a.dtype), a.shape) for n, a in sorted(tensors.items())] == [
        (n, dt, shape) for n, dt, shape in wl.schema()]
    assert sorted(tensors) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    # they moved: window 3's weights are not genesis'
    assert tensor_digest(tensors) != revision.manifest.genesis_params_digest
    assert not list(tmp_path.glob(".*.tmp"))  # the atomic write left no temporary file


def test_export_by_window_or_head_id(tmp_path, certified, workload):
    store, revision, chain = certified
    first = chain[0][0]
    by_window = export_head(store, tmp_path / "w1.safetensors", head=1)
    assert by_window["peerloom.window"] == "1" and by_window["peerloom.head"] == first.id.hex()
    assert tensor_digest(_read(tmp_path / "w1.safetensors")[0]) == first.params_digest != chain[-1][0].params_digest
    for text in ("1", first.id.hex(), first.id[2:].hex()[:16], first.id.hex()[:20].upper()):
        assert export_head(store, tmp_path / "again.safetensors", head=text) == by_window, text
    # window 0 is genesis: the manifest's initial params
    genesis = export_head(store, tmp_path / "w0.safetensors", head=0)
    assert genesis["peerloom.head"] == revision.genesis().id.hex()
    wl, _ = workload
    initial = wl.initial_params(SEED)
    tensors = _read(tmp_path / "w0.safetensors")[0]
    assert all(np.array_equal(tensors[n], initial[n]) for n in initial) and set(tensors) == set(initial)
    for bad, message in ((9, "no window 9 in the chain: it holds windows 0-3"),
                         ("zz", "give a window number or a head id in hex"),
                         ("ab" * 10, "no head abab")):
        with pytest.raises(ExportError, match=message):
            export_head(store, tmp_path / "bad.safetensors", head=bad)
    assert not (tmp_path / "bad.safetensors").exists()


def test_export_reads_a_node_directory_and_a_stores_chain_directory(tmp_path, certified):
    store, _, chain = certified
    node = tmp_path / "node"
    copy = shutil.copytree(store, node / "store")
    _write_chain_dir(copy, chain)
    for path in (node, copy / "chain", copy / "node.db"):
        assert export_head(path, tmp_path / "m.safetensors")["peerloom.head"] == chain[-1][0].id.hex(), path


def _flip_artifact(store, head):
    path = store / "artifacts" / head.params.digest[2:].hex()
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def _alter_head_in_db(store, window):
    db = sqlite3.connect(store / "node.db")
    (entry,) = db.execute("SELECT entry FROM heads WHERE window=?", (window,)).fetchone()
    head, cert = decode_chain_entry(bytes(entry))
    forged = attrs.evolve(head, metrics={**head.metrics, "test_accuracy": 1.0})
    db.execute("UPDATE heads SET entry=? WHERE window=?", (encode_chain_entry(forged, cert), window))
    db.commit()
    db.close()


def _write_chain_dir(store, chain):
    (store / "chain").mkdir()
    for window, (head, cert) in enumerate(chain, 1):
        (store / "chain" / f"{window:06d}.cbor").write_bytes(encode_chain_entry(head, cert))


def _flip_chain_file(store, chain, window):
    _write_chain_dir(store, chain)
    path = store / "chain" / f"{window:06d}.cbor"
    path.write_bytes(path.read_bytes().replace(b"test_accuracy", b"test_accuracz"))


@pytest.mark.parametrize(("tamper", "reason"), [
    (lambda store, chain: _flip_artifact(store, chain[-1][0]), "corrupt-artifact"),
    (lambda store, chain: _alter_head_in_db(store, 2), "window 2"),
    (lambda store, chain: _flip_chain_file(store, chain, 1), "chain-dir"),
    (lambda store, chain: (store / "manifest.cbor").write_bytes(make_revision().envelope.to_bytes()), "window 1"),
], ids=["artifact-bytes", "head-in-database", "chain-file", "other-manifest"])
def test_a_tampered_store_is_refused_before_anything_is_written(tmp_path, certified, tamper, reason):
    store, _, chain = certified
    copy = _copy(store, tmp_path)
    out = tmp_path / "model.safetensors"
    assert export_head(copy, out)  # untampered, it exports
    out.unlink()
    tamper(copy, chain)
    with pytest.raises(PeerloomError, match=reason) as info:
        export_head(copy, out)
    assert not isinstance(info.value, ExportError)  # a verification failure, not a user error
    assert not out.exists() and not list(tmp_path.glob(".*.tmp"))
    with pytest.raises(PeerloomError, match=reason):
        load_head(copy)
    result = _cli("export", copy, "--out", out)
    assert result.returncode == 1 and "FAILED" in result.stderr and reason in result.stderr, result.stderr
    assert "nothing written" in result.stderr and not out.exists()
    if (copy / "chain").is_dir():  # the store's chain directory read on its own fails too
        with pytest.raises(PeerloomError, match="window 1"):
            export_head(copy / "chain", out)
        assert not out.exists()


def test_params_that_do_not_match_the_certified_digest_are_refused(tmp_path):
    """A chain whose certified head names a params artifact whose tensors are not its params_digest (only a
    quorum of dishonest validators could certify it): the store's bytes match their content id, so only the
    tensor digest check catches it."""
    genesis = {"w": np.zeros(2, np.float32)}
    trained = {"w": np.ones(2, np.float32)}
    validators = [ident(1)]
    revision = make_revision(validators=validators, trainers=[ident(10)], genesis=to_safetensors(genesis),
                             params_digest=tensor_digest(genesis))
    blob = to_safetensors(trained)
    head = child(revision, revision.genesis(), params=make_artifact_ref(blob, revision.manifest.chunk_size),
                 params_digest=tensor_digest({"w": np.full(2, 2, np.float32)}))
    store_dir = tmp_path / "store"
    store = ArtifactStore(store_dir, chunk_size=revision.manifest.chunk_size)
    store.put(blob)
    store.put_record(chain_key(1), encode_chain_entry(head, certify(revision, head, validators)))
    store.put_record(HEAD_RECORD, encode_chain_entry(head, certify(revision, head, validators)))
    store.close()
    (store_dir / "manifest.cbor").write_bytes(revision.envelope.to_bytes())
    out = tmp_path / "model.safetensors"
    with pytest.raises(VerificationError, match="params-digest: window 1"):
        export_head(store_dir, out)
    assert not out.exists()
    with pytest.raises(ExportError, match="does not hold the params of window 0"):  # genesis was never stored
        export_head(store_dir, out, head=0)


def test_a_bare_chain_directory_has_no_weights_and_says_where_they_are(tmp_path, certified):
    sim = _cli("sim", "happy", "--seed", "1", "--out", tmp_path / "sim", "--no-plots", "--quiet")
    assert sim.returncode == 0, sim.stderr
    chain_dir, out = tmp_path / "sim" / "chain", tmp_path / "model.safetensors"
    assert _cli("verify", chain_dir).returncode == 0  # a valid chain: only the weights are missing
    _one_line(_cli("export", chain_dir, "--out", out), "peerloom export:", f"{chain_dir} is a chain directory",
              "no weights", "a node directory (with store/node.db and store/artifacts/)")
    assert not out.exists()
    # laid out as the demo leaves it (DIR/chain beside DIR/nodes/<name>/store), it names a validator's directory
    store, _, _ = certified
    shutil.copytree(store, tmp_path / "sim" / "nodes" / "validator-0" / "store")
    shutil.copytree(store, tmp_path / "sim" / "nodes" / "a-trainer" / "store")
    with pytest.raises(ExportError, match=r"export from a node directory such as .*nodes/validator-0$"):
        export_head(chain_dir, out)
    with pytest.raises(ExportError, match="no weights"):
        load_head(chain_dir)
    assert not out.exists()


def test_cli_export_exit_statuses(tmp_path, certified):
    store, _, chain = certified
    out = tmp_path / "model.safetensors"
    ok = _cli("export", store, "--head", "2", "--out", out)
    assert ok.returncode == 0, ok.stderr
    assert f"verified {WINDOWS} certified heads" in ok.stdout and f"head {chain[1][0].id.hex()}" in ok.stdout
    assert _read(out)[1]["peerloom.window"] == "2"
    _one_line(_cli("export", store, "--head", "7", "--out", tmp_path / "x.safetensors"), "no window 7")
    _one_line(_cli("export", store, "--out", tmp_path / "no" / "x.safetensors"), str(tmp_path / "no"))
    _one_line(_cli("export", tmp_path / "nowhere", "--out", tmp_path / "x.safetensors"), "nowhere: no such file")
    _one_line(_cli("export", tmp_path, "--out", tmp_path / "x.safetensors"), "not a chain directory")
    wrong = _cli("export", store, "--authority", ident(5).peer_id.to_text(), "--out", tmp_path / "x.safetensors")
    assert wrong.returncode == 1 and "FAILED: wrong-authority" in wrong.stderr, wrong.stderr  # as `verify` fails it
    assert not (tmp_path / "x.safetensors").exists()


# --- load_head ----------------------------------------------------------------------------------------------


def test_load_head_returns_verified_numpy_params_from_a_store_or_an_export(tmp_path, certified):
    store, _, chain = certified
    out = tmp_path / "model.safetensors"
    export_head(store, out, head=2)
    from_store = peerloom.load_head(store, head=2)
    from_file = peerloom.load_head(out)
    assert tensor_digest(from_store) == tensor_digest(from_file) == chain[1][0].params_digest
    assert all(a.dtype == np.float32 and a.flags.writeable for a in from_file.values())
    assert tensor_digest(load_head(store)) == chain[-1][0].params_digest  # default: the latest head
    assert tensor_digest(load_head(out, head=2, manifest=store / "manifest.cbor")) == chain[1][0].params_digest
    with pytest.raises(ExportError, match="holds window 2"):
        load_head(out, head=3)


def test_load_head_refuses_a_file_that_does_not_verify(tmp_path, certified):
    store, _, _ = certified
    out = tmp_path / "model.safetensors"
    export_head(store, out)
    tensors, metadata = _read(out)
    changed = dict(tensors, **{"0.bias": tensors["0.bias"] + 1})
    safetensors.numpy.save_file(changed, str(tmp_path / "changed.safetensors"), metadata=metadata)
    with pytest.raises(VerificationError, match="tensor-digest"):
        load_head(tmp_path / "changed.safetensors")
    safetensors.numpy.save_file(tensors, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ExportError, match="not a peerloom export"):
        load_head(tmp_path / "plain.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 3)
    with pytest.raises(ExportError, match="not a safetensors file"):
        load_head(tmp_path / "junk.safetensors")
    other = tmp_path / "other-manifest.cbor"
    other.write_bytes(make_revision().envelope.to_bytes())
    with pytest.raises(VerificationError, match="revision-mismatch"):
        load_head(out, manifest=other)


def test_an_exported_head_loads_into_the_mlp_the_torch_workload_builds(tmp_path, certified, workload):
    store, _, chain = certified
    latest = chain[-1][0]
    out = tmp_path / "model.safetensors"
    export_head(store, out)
    model = mlp((64, 128, 10))
    assert load_head(out, model) is model
    params = load_head(out)
    assert all(np.array_equal(t.detach().numpy(), params[n]) for n, t in model.state_dict().items())
    # the loaded model is the certified head: it scores exactly the accuracy the validators recorded
    wl, _ = workload
    with torch.no_grad():
        accuracy = float((model(wl.x_eval).argmax(dim=-1) == wl.y_eval).float().mean())
    assert accuracy == pytest.approx(latest.metrics["test_accuracy"], abs=1e-6)
    assert accuracy > 0.5
    again = load_head(store, mlp((64, 128, 10)))  # straight from the store
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values(),
                                                  strict=True))


@pytest.mark.parametrize(("module", "needles"), [
    (lambda: mlp((64, 32, 10)), ["0.weight: params hold torch.float32 [128, 64], the module has torch.float32 "
                                 "[32, 64]", "0.bias", "2.weight"]),
    (lambda: mlp((64, 128, 128, 10)), ["missing keys (in the module, not in the params): 4.bias, 4.weight",
                                       "2.weight"]),
    (lambda: torch.nn.Sequential(torch.nn.Linear(64, 128)), [
        "unexpected keys (in the params, not in the module): 2.bias, 2.weight"]),
    (lambda: mlp((64, 128, 10)).double(), [
        "0.weight: params hold torch.float32 [128, 64], the module has torch.float64 [128, 64]", "2.bias"]),
])
def test_load_head_names_the_keys_that_do_not_fit(tmp_path, certified, module, needles):
    store, _, _ = certified
    out = tmp_path / "model.safetensors"
    export_head(store, out)
    model = module()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(ParamsMismatchError) as info:
        load_head(out, model)
    message = str(info.value)
    assert isinstance(info.value, ValueError) and message.startswith("params do not fit the module")
    assert all(needle in message for needle in needles), message
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())  # left untouched


def test_import_peerloom_loads_neither_numpy_nor_torch():
    code = ("import sys, peerloom; assert 'torch' not in sys.modules and 'numpy' not in sys.modules; "
            "f = peerloom.load_head; assert 'torch' not in sys.modules; print(f.__module__)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "peerloom.export", result.stderr

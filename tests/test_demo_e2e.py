"""End to end: the smoke demo as a user runs it — real OS processes, TCP+Noise on 127.0.0.1."""

import json
import shutil
import subprocess
import sys

import pytest

REPORT_KEYS = {"peerloom_version", "profile", "seed", "workload", "transport", "nodes", "windows", "final_head",
               "baseline", "updates", "bytes_on_wire", "wall_s"}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e") / "demo"
    proc = subprocess.run([sys.executable, "-m", "peerloom", "demo", "--profile", "smoke", "--out", str(out),
                           "--seed", "1", "--kill-trainer-at", "1"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


@pytest.mark.slow
def test_smoke_demo_with_a_killed_trainer(smoke_run):
    out, proc = smoke_run
    report = json.loads((out / "report.json").read_text())
    assert REPORT_KEYS <= set(report)
    assert report["profile"] == "smoke" and report["seed"] == 1 and report["transport"] == "tcp+noise"
    assert report["windows"] == {"certified": 3, "skipped": 0}  # stop_after_window holds the fleet at 3
    roles = sorted(n["role"] for n in report["nodes"])
    assert roles.count("trainer") >= 4 and "validator" in roles and "reducer" in roles
    assert len({n["pid"] for n in report["nodes"]}) == len(report["nodes"])  # separate OS processes
    assert [n["behaviour"] for n in report["nodes"]].count("killed") == 1
    assert report["final_head"]["window"] == 3
    assert 0.5 < report["final_head"]["test_accuracy"] <= 1.0
    assert 0.9 < report["baseline"]["test_accuracy"] <= 1.0
    assert report["updates"]["accepted"] >= 3 * 2
    assert report["bytes_on_wire"] > 0 and report["verified"] is True
    assert "deadline reached" in proc.stdout  # the killed trainer's window closed on its deadline
    chain = sorted(p.name for p in (out / "chain").iterdir())
    assert chain == ["000001.cbor", "000002.cbor", "000003.cbor", "manifest.cbor"]
    assert (out / "plots" / "accuracy.png").stat().st_size > 1000


@pytest.mark.slow
def test_verify_fails_on_tampered_chain(smoke_run):
    """The chain written by a node verifies; flipping one byte of a head makes verification fail."""
    from peerloom.core.chain import decode_chain_entry, verify_chain
    from peerloom.core.envelope import SignedEnvelope
    from peerloom.core.errors import PeerloomError
    from peerloom.core.objects import Revision

    out, _ = smoke_run
    revision = Revision.verify(SignedEnvelope.from_bytes((out / "chain" / "manifest.cbor").read_bytes()))
    paths = sorted((out / "chain").glob("0*.cbor"))
    entries = [decode_chain_entry(p.read_bytes()) for p in paths]
    verify_chain(revision, entries)
    data = bytearray(paths[1].read_bytes())
    failures = 0
    for i in range(0, len(data), max(1, len(data) // 40)):
        tampered = bytearray(data)
        tampered[i] ^= 0x01
        try:
            verify_chain(revision, [entries[0], decode_chain_entry(bytes(tampered)), entries[2]])
        except PeerloomError:
            failures += 1
    assert failures == len(range(0, len(data), max(1, len(data) // 40)))


@pytest.mark.slow
def test_peerloom_verify_command_passes_and_fails_on_any_tampered_byte(smoke_run, tmp_path):
    out, _ = smoke_run
    ok = subprocess.run([sys.executable, "-m", "peerloom", "verify", str(out / "chain")],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and "OK: 3 certified heads" in ok.stdout, ok.stdout
    for name in ("000002.cbor", "manifest.cbor"):
        original = (out / "chain" / name).read_bytes()
        for index in (0, len(original) // 2, len(original) - 1):
            bad = tmp_path / f"chain-{name}-{index}"
            shutil.copytree(out / "chain", bad)
            data = bytearray(original)
            data[index] ^= 0x01
            (bad / name).write_bytes(bytes(data))
            result = subprocess.run([sys.executable, "-m", "peerloom", "verify", str(bad)],
                                    capture_output=True, text=True)
            assert result.returncode == 1 and "FAILED" in result.stdout, (name, index, result.stdout)

"""End to end: the smoke demo as a user runs it — real OS processes, TCP+Noise on 127.0.0.1.

`peerloom demo` runs as a process of its own each time. Where a test looks at what the fleet does (the smoke
run, the undefended mean), the nodes it starts are forked from a fork server that has imported peerloom and
torch (`DEMO_FORKED_NODES`, tests/node_zygote.py): real processes running the real `peerloom node` command
line over real sockets, without eight interpreter start-ups and torch imports competing for two cores (a
smoke demo took 51-66 s that way here, 25 s forked). The SIGTERM test starts every node as
`python -m peerloom node`, as a user's demo does, and checks that none is left running.
"""

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.node_zygote import run_cli

REPORT_KEYS = {"peerloom_version", "profile", "seed", "workload", "transport", "nodes", "windows", "final_head",
               "baseline", "updates", "bytes_on_wire", "wall_s", "quarantined", "verified", "quarantine_over_time",
               "head_lag_s", "bytes_by_role", "chain", "per_window", "defence", "double_votes", "verification"}


ROOT = Path(__file__).resolve().parents[2]
# `python -m peerloom demo ARGS`, its nodes forked from a fork server with torch imported (module docstring).
DEMO_FORKED_NODES = [sys.executable, "-c", "import sys; from tests.node_zygote import cli_with_forked_nodes; "
                     "cli_with_forked_nodes(sys.argv[1:], preload='torch')", "demo"]


CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"), "/usr/bin/chromium")
                 if p and shutil.which(p)), None)
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def watch_dashboard(url: str, demo: subprocess.Popen) -> list[int]:
    """Open the demo's dashboard in headless Chromium while the demo runs; return the latest window the page
    showed each time it changed (the head chain advancing), or [] without chromium/playwright."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return []
    if CHROMIUM is None:
        return []
    seen: list[int] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(url, wait_until="load")
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and (not seen or seen[-1] < 5) and demo.poll() is None:
                text = (page.text_content("#latest-window") or "").strip()
                if text.isdigit() and (not seen or int(text) != seen[-1]):
                    seen.append(int(text))
                page.wait_for_timeout(250)
        finally:
            browser.close()
    return seen


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """Run the smoke demo as a user would, and watch its dashboard in a browser while it runs."""
    out = tmp_path_factory.mktemp("e2e") / "demo"
    proc = subprocess.Popen([*DEMO_FORKED_NODES, "--profile", "smoke", "--out", str(out), "--seed", "1",
                             "--kill-trainer-at", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    lines: list[str] = []
    url = None
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        match = re.search(r"dashboard: (http://127\.0\.0\.1:\d+/)", line)
        if match:
            url = match.group(1)
            break
    # Keep draining the demo's output while the browser watches, so the demo never blocks on a full pipe.
    drain = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    drain.start()
    seen = watch_dashboard(url, proc) if url else []
    proc.wait(timeout=240)
    drain.join(timeout=10)
    stdout = "".join(lines)
    assert proc.returncode == 0, stdout[-4000:]
    return out, subprocess.CompletedProcess(proc.args, proc.returncode, stdout, ""), seen


def _revision(out):
    from peerloom.core.envelope import SignedEnvelope
    from peerloom.core.objects import Revision

    return Revision.verify(SignedEnvelope.from_bytes((out / "chain" / "manifest.cbor").read_bytes()))


def _genesis_roster(out):
    return [(p.to_text(), cap) for p, cap in _revision(out).manifest.roster]


def _audited_authors(out):
    """{window: authors} of every head in the demo's chain that carries failed audits, each checked from the
    head alone (spec/protocol.md §6.2)."""
    from peerloom.core.audit import check_audit_evidence
    from peerloom.core.auditing import audit_authors
    from peerloom.core.chain import decode_chain_entry

    revision = _revision(out)
    audited = {}
    for path in sorted((out / "chain").glob("0*.cbor")):
        head, _ = decode_chain_entry(path.read_bytes())
        if head.audits:
            checked = [check_audit_evidence(v, revision.id, revision.manifest)[0].signer for v in head.audits]
            assert checked == list(audit_authors(head.audits))
            audited[head.window] = {p.to_text() for p in checked}
    return audited


@pytest.mark.slow
def test_smoke_demo_mixed_fleet(smoke_run):
    """The smoke fleet: a leaseholder killed for good, a trainer killed and restarted from its disk, a late
    joiner and two Byzantine trainers (sign-flip-scale, ALIE), all separate processes over TCP+Noise."""
    out, proc, _ = smoke_run
    report = json.loads((out / "report.json").read_text())
    assert REPORT_KEYS <= set(report)
    assert report["profile"] == "smoke" and report["seed"] == 1 and report["transport"] == "tcp+noise"
    assert report["windows"] == {"certified": 7, "skipped": 0}  # stop_after_window holds the fleet at 7
    nodes = {n["behaviour"]: n for n in report["nodes"]}
    roles = sorted(n["role"] for n in report["nodes"])
    assert roles.count("trainer") == 7 and "validator" in roles and "reducer" in roles
    assert len({n["pid"] for n in report["nodes"]}) == len(report["nodes"])  # separate OS processes
    assert [n["behaviour"] for n in report["nodes"]].count("killed") == 1
    # Both Byzantine trainers end up quarantined by the chain; nobody else does. Sign-flip-scale never gets an
    # update in: screening (the per-update norm bound, cohort outliers) or the loss check rejects each, and
    # three strikes quarantine it. ALIE looks typical and passes them all, so some of its updates are
    # certified; audited after the fact (this profile audits every certified update), its replay fails and a
    # later head carries the validators' verdicts, which quarantine it at once.
    flipper, alie = nodes["sign-flip-scale"], nodes["alie"]
    assert flipper["accepted"] == 0 and flipper["rejected"] >= 3
    assert flipper["rejected_by_reason"] and set(flipper["rejected_by_reason"]) <= {
        "screen-norm-bound", "screen-loss", "screen-norm-outlier", "screen-cosine"}
    assert flipper["caught_by"] and set(flipper["caught_by"]) <= {"loss-check", "screening"}
    assert alie["failed_audits"] >= 1 and "audit" in alie["caught_by"]
    assert sorted(report["quarantined"]) == sorted([flipper["peer_id"], alie["peer_id"]])
    audited = _audited_authors(out)  # from the signed heads themselves
    assert audited and set().union(*audited.values()) == {alie["peer_id"]}
    assert sorted(audited) == alie["failed_audit_windows"]
    assert all(n["failed_audits"] == 0 for n in report["nodes"] if n["behaviour"] != "alie")
    # Audits are sampled after the fact, never inline at screening.
    assert not any("screen-audit" in n["rejected_by_reason"] for n in report["nodes"])
    verification = report["verification"]
    assert verification["loss_check_samples"] == 64 and verification["audit_rate"] == 1.0
    assert verification["max_update_norm"] > 0
    assert verification["audit_mode"] == "sampled" and verification["audit_segments"] == 0
    assert verification["audits_in_heads"] == len(verification["audits"]) == sum(len(a) for a in audited.values())
    assert {a["peer_id"] for a in verification["audits"]} == {alie["peer_id"]}
    assert verification["audit_counters"].get("audits_failed", 0) >= 1
    assert "carries a failed audit of" in proc.stdout
    # Killed as window 2 opens and restarted from its disk at once: it contributes again afterwards.
    assert any(w >= 3 for w in nodes["killed-restarted"]["accepted_windows"])
    # The late joiner was not in the genesis roster, asked to join and then held leases.
    assert nodes["late-joiner"]["accepted"] >= 1 and min(nodes["late-joiner"]["accepted_windows"]) >= 2
    assert nodes["late-joiner"]["peer_id"] not in {p for p, _ in _genesis_roster(out)}
    assert report["double_votes"] == []
    assert report["final_head"]["window"] == 7
    assert 0.8 < report["final_head"]["test_accuracy"] <= 1.0
    assert 0.9 < report["baseline"]["test_accuracy"] <= 1.0
    assert report["defence"]["degraded"] is False
    assert report["bytes_on_wire"] > 0 and report["verified"] is True
    assert "deadline reached" in proc.stdout  # the killed trainer's window closed on its deadline
    assert "dashboard: http://127.0.0.1:" in proc.stdout
    chain = sorted(p.name for p in (out / "chain").iterdir())
    assert chain == [f"{w:06d}.cbor" for w in range(1, 8)] + ["manifest.cbor"]
    for plot in ("accuracy.png", "updates.png", "bytes.png"):
        assert (out / "plots" / plot).stat().st_size > 1000


@pytest.mark.slow
def test_verify_fails_on_tampered_chain(smoke_run):
    """The chain written by a node verifies; flipping one byte of a head makes verification fail."""
    from peerloom.core.chain import decode_chain_entry, verify_chain
    from peerloom.core.envelope import SignedEnvelope
    from peerloom.core.errors import PeerloomError
    from peerloom.core.objects import Revision

    out, _, _ = smoke_run
    revision = Revision.verify(SignedEnvelope.from_bytes((out / "chain" / "manifest.cbor").read_bytes()))
    paths = sorted((out / "chain").glob("0*.cbor"))
    entries = [decode_chain_entry(p.read_bytes()) for p in paths]
    verify_chain(revision, entries)
    data = bytearray(paths[1].read_bytes())
    failures = 0
    for i in range(len(data)):  # every byte of the head and its certificate
        tampered = bytearray(data)
        tampered[i] ^= 0x01
        try:
            verify_chain(revision, [entries[0], decode_chain_entry(bytes(tampered)), *entries[2:]])
        except PeerloomError:
            failures += 1
    assert failures == len(data)


@pytest.mark.slow
def test_peerloom_verify_command_passes_and_fails_on_any_tampered_byte(smoke_run, tmp_path):
    out, _, _ = smoke_run
    ok = run_cli(["verify", out / "chain"])
    assert ok.returncode == 0 and "OK: 7 certified heads" in ok.stdout, ok.stdout
    for name in ("000002.cbor", "manifest.cbor"):
        original = (out / "chain" / name).read_bytes()
        for index in (0, len(original) // 2, len(original) - 1):
            bad = tmp_path / f"chain-{name}-{index}"
            shutil.copytree(out / "chain", bad)
            data = bytearray(original)
            data[index] ^= 0x01
            (bad / name).write_bytes(bytes(data))
            result = run_cli(["verify", bad])
            assert result.returncode == 1 and "FAILED" in result.stdout, (name, index, result.stdout)


@pytest.mark.slow
def test_undefended_mean_visibly_degrades_and_the_report_says_so(tmp_path):
    """--rule mean turns the defences off (plain mean, no outlier screening): the sign-flip-scale trainer
    is never quarantined and wrecks the model, and the report's defence verdict says so."""
    out = tmp_path / "mean"
    proc = subprocess.run([*DEMO_FORKED_NODES, "--profile", "smoke", "--out", str(out), "--seed", "1", "--rule",
                           "mean"], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["rule"] == "mean" and report["verified"] is True
    assert report["quarantined"] == []
    # No loss check and no audits either: only the schema, finiteness and signature checks stay on.
    verification = report["verification"]
    assert verification["audit_mode"] == "off" and verification["loss_check_samples"] == 0
    assert verification["max_update_norm"] == 0
    assert verification["audits_in_heads"] == 0
    assert report["defence"]["defended"] is False and report["defence"]["degraded"] is True
    assert report["defence"]["gap"] > 10  # points behind the centralized baseline
    assert "DEGRADED" in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium)")
def test_dashboard_of_the_running_demo_shows_the_chain_advancing(smoke_run):
    """Headless Chromium on the seed's dashboard while the demo runs: the head chain advances on the page."""
    _, _, seen = smoke_run
    assert len(seen) >= 2 and seen == sorted(seen) and seen[-1] > seen[0], seen


@pytest.mark.slow
def test_sigterm_stops_the_demo_and_every_node_it_started(tmp_path):
    """SIGTERM (as a supervisor or `kill` sends it) ends `peerloom demo` with every node it started stopped,
    even where it inherited SIGINT ignored (a background job): none of its node processes is left running."""
    import os
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "peerloom", "demo", "--profile", "smoke", "--out",
                             str(tmp_path / "demo")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert proc.stdout is not None
    seen = ""
    try:
        for line in proc.stdout:
            seen += line
            if "dashboard:" in line:
                break
        pids = [int(p) for p in re.findall(r"\d+", re.search(r"pids ([\d,\s]+)", seen).group(1))]
        assert len(pids) >= 4 and all(os.kill(pid, 0) is None for pid in pids), seen
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=90)  # nodes: SIGTERM, then SIGKILL after 15 s
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, seen + rest  # the CLI's status after an interrupt
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # nor any node it started after printing those pids (a late joiner started as the signal came)
    left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "peerloom node" in text and str(tmp_path / "demo") in text:
            left.append(text)
    assert not left, left

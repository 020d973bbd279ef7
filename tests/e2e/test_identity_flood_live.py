"""Resource exhaustion against live `peerloom node` processes on 127.0.0.1: a flood of fresh identities and a
full disk (spec/transport.md §14 and §15).

One fleet (a validator with the HTTP edge, a trainer; quorum 1) serves both cases, to keep the suite short:

- 1,500 fresh identities each complete the Noise handshake, send three non-canonical messages (rejected
  ``decode-non-canonical``) and leave. The validator stays alive, an honest newcomer is served, windows
  go on certifying, ``/metrics`` and the ``peers`` and ``reputation`` tables do not grow with the flood,
  and RSS and the disk growth come back within 20% of the baseline (disk: against the undisturbed
  growth per certified window measured just before).
- The validator's "disk" fills up (the test-only seam `adapters.disk.TEST_FAULT_ENV`: every store and log
  write fails with ENOSPC while a flag file exists). One log line says so, ``/healthz`` says
  ``disk-full``, uploads are refused and reads served; once the flag is gone it resumes by itself and
  certifies again. A restart while the disk is full starts in that state (one line, no traceback). The
  chain on disk verifies (`peerloom verify`).

The long form, in `make fuzz-live`, is `python -m tests.e2e.test_identity_flood_live N` (N identities; prints
the measurements).
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import trio

from peerloom.adapters import tcp
from peerloom.adapters.disk import TEST_FAULT_ENV
from peerloom.adapters.transport import TransportError
from peerloom.core.identity import Identity
from tests.live_attacks import certified, honest_hello, longest_skip_run, wait_certified
from tests.node_cluster import free_port, make_fleet
from tests.node_zygote import run_cli

pytestmark = pytest.mark.slow

FLOOD_IDENTITIES = 1500
NON_CANONICAL = (b"\x82\x65hello\x18\x00", b"\x82\x66signed\x18\x05", b"\x82\x18\x01\x18\x02")


async def identity_flood(port: int, identities: int, concurrency: int = 8) -> int:
    """`identities` fresh keys, `concurrency` at a time: handshake, three non-canonical messages, close.
    Returns how many completed the handshake."""
    done = 0
    remaining = iter(range(identities))

    async def worker() -> None:
        nonlocal done
        for _ in remaining:
            try:
                conn = await tcp.connect("127.0.0.1", port, Identity(os.urandom(32)), handshake_timeout=10.0)
            except (TransportError, OSError):
                continue
            done += 1
            try:
                for message in NON_CANONICAL:
                    await conn.send_message(message)
                await trio.sleep(0.01)
            except (TransportError, OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            await conn.aclose()

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return done


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def disk_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def http_get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def http_post(port: int, path: str, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method="POST",
                                     headers={"Content-Type": "application/cbor"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def health(port: int) -> str | None:
    try:
        return json.loads(http_get(port, "/healthz")[1])["status"]
    except (OSError, ValueError, KeyError):
        return None


def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return bool(predicate())


def table_rows(node, table: str) -> int:
    db = sqlite3.connect(f"file:{node.directory / 'store' / 'node.db'}?mode=ro", uri=True)
    try:
        return int(db.execute(f"SELECT count(*) FROM {table}").fetchone()[0])
    finally:
        db.close()


def log_lines(node, text: str) -> list[str]:
    return [line for line in (node.directory / "node.log").read_text().splitlines() if text in line]


def start_fleet(root: Path, flag: Path):
    """A validator (HTTP edge; the disk-full seam armed with `flag`) and a trainer, with retention on so that
    artifacts do not dominate the disk measurements; returns (nodes, http port) once window 1 certified."""
    nodes = make_fleet(root, validators=1, trainers=1, quorum=1, window_s=1.0)
    http_port = free_port()
    validator = nodes[0]
    # Every flooding identity comes from 127.0.0.1, like the honest trainer: the per-address handshake bucket
    # (spec/transport.md §13) would refuse most of them before any state exists, and this test is about the
    # state that identities which do complete a handshake leave behind.
    validator.write_config(http={"enabled": True, "listen": f"127.0.0.1:{http_port}"},
                           limits={"handshake_rate": 10_000.0, "handshake_burst": 10_000})
    for node in nodes:
        node.write_config(keep_windows=2)
    os.environ[TEST_FAULT_ENV] = str(flag)  # the validator only: the env is read when it starts
    try:
        validator.start()
    finally:
        del os.environ[TEST_FAULT_ENV]
    for node in nodes[1:]:
        node.start()
    for node in nodes:
        node.wait_port()
    assert wait_certified(validator, 1, 120), "the fleet never certified a window"
    return nodes, http_port


def flood_and_measure(validator, http_port: int, identities: int) -> dict:
    """Baseline, a quiet stretch (disk growth per certified window), the flood, one log interval for the
    node to summarise and trim, then the same measurements."""
    from peerloom.adapters.runtime import LOG_INTERVAL_S

    pid = validator.process.pid
    time.sleep(2.0)
    base = {"rss": rss_bytes(pid), "disk": disk_bytes(validator.directory), "certified": certified(validator),
            "metrics": len(http_get(http_port, "/metrics")[1])}
    time.sleep(4.0)
    quiet_windows = max(1, certified(validator) - base["certified"])
    per_window = (disk_bytes(validator.directory) - base["disk"]) / quiet_windows
    start_disk, start_certified = disk_bytes(validator.directory), certified(validator)
    started = time.monotonic()
    handshakes = trio.run(identity_flood, validator.port, identities)
    flood_s = time.monotonic() - started
    trio.run(honest_hello, validator.port)  # an honest newcomer is served right after the flood
    time.sleep(LOG_INTERVAL_S + 1.0)
    windows = certified(validator) - start_certified
    after = {"rss": rss_bytes(pid), "disk": disk_bytes(validator.directory),
             "metrics": len(http_get(http_port, "/metrics")[1])}
    return {"identities": identities, "handshakes": handshakes, "flood_s": round(flood_s, 1),
            "rss_mb": [round(base["rss"] / 2**20, 1), round(after["rss"] / 2**20, 1)],
            "disk_kb": [round(start_disk / 1024), round(after["disk"] / 1024)],
            "disk_growth_kb": round((after["disk"] - start_disk) / 1024),
            "undisturbed_growth_kb": round(per_window * windows / 1024), "windows_during": windows,
            "metrics_bytes": [base["metrics"], after["metrics"]],
            "peers_rows": table_rows(validator, "peers"), "reputation_rows": table_rows(validator, "reputation"),
            "_base": base, "_after": after, "_expected_disk": start_disk + per_window * windows}


def test_identity_flood_then_full_disk_against_a_live_validator(tmp_path):
    flag = tmp_path / "validator-disk-full.flag"
    nodes, http_port = start_fleet(tmp_path / "fleet", flag)
    validator = nodes[0]
    try:
        # --- a flood of fresh identities --------------------------------------------------------------
        m = flood_and_measure(validator, http_port, FLOOD_IDENTITIES)
        print(json.dumps({k: v for k, v in m.items() if not k.startswith("_")}))
        assert all(n.process.poll() is None for n in nodes)
        assert m["handshakes"] >= FLOOD_IDENTITIES // 2, m
        assert m["windows_during"] >= 1 and longest_skip_run(validator) <= 2, m
        assert m["_after"]["metrics"] <= m["_base"]["metrics"] + 2048, m  # no series per stranger
        assert m["peers_rows"] <= len(nodes) and m["reputation_rows"] <= 8, m  # strangers share one row
        assert m["_after"]["rss"] <= 1.2 * m["_base"]["rss"], m
        assert m["_after"]["disk"] <= m["_expected_disk"] + 0.2 * m["_base"]["disk"], m
        events = validator.events()
        assert sum(e["event"] == "reject" for e in events) < FLOOD_IDENTITIES  # summarised, not one a message
        assert any(e["event"] == "suppressed" and e["kind"] == "reject/decode-non-canonical" for e in events)

        # --- the disk fills up, then is freed ---------------------------------------------------------
        flag.touch()
        assert wait_for(lambda: health(http_port) == "disk-full", 20), health(http_port)
        assert validator.process.poll() is None
        assert http_get(http_port, "/v1/heads/latest")[0] == 200  # reads are served
        status, body = http_post(http_port, "/v1/updates", b"\xa0")
        assert status == 503 and b"disk-full" in body, (status, body)
        time.sleep(2.0)
        assert len(log_lines(validator, "disk full")) == 1, log_lines(validator, "disk full")
        before = certified(validator)
        flag.unlink()
        assert wait_for(lambda: health(http_port) == "ok", 20), "the node did not resume by itself"
        assert log_lines(validator, "writing resumed")
        assert wait_certified(validator, before + 2, 60), "no window certified after the disk was freed"
        assert all(n.process.poll() is None for n in nodes)

        # --- a restart while the disk is full ---------------------------------------------------------
        validator.stop()
        flag.touch()
        os.environ[TEST_FAULT_ENV] = str(flag)
        try:
            validator.start()
        finally:
            del os.environ[TEST_FAULT_ENV]
        assert wait_for(lambda: health(http_port) == "disk-full", 60), \
            (validator.directory / "node.log").read_text()[-2000:]
        assert validator.process.poll() is None
        assert len(log_lines(validator, "disk full")) == 2  # the first run's line and this start's one
        assert "Traceback" not in (validator.directory / "node.log").read_text()
        flag.unlink()
        assert wait_for(lambda: health(http_port) == "ok", 20)
    finally:
        flag.unlink(missing_ok=True)
        for node in nodes:
            node.stop()
    authority = (tmp_path / "fleet" / "authority").read_text().strip()
    verified = run_cli(["verify", validator.directory / "store" / "chain", "--authority", authority, "--manifest",
                        tmp_path / "fleet" / "manifest.cbor"], timeout=120)
    assert verified.returncode == 0, verified.stdout + verified.stderr


if __name__ == "__main__":  # the long form: python -m tests.e2e.test_identity_flood_live 12000
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        fleet, port = start_fleet(Path(root) / "fleet", Path(root) / "unused.flag")
        try:
            result = flood_and_measure(fleet[0], port, int(sys.argv[1]) if len(sys.argv) > 1 else 10_000)
            result["alive"] = all(n.process.poll() is None for n in fleet)
            result["longest_skip_run"] = longest_skip_run(fleet[0])
            print(json.dumps({k: v for k, v in result.items() if not k.startswith("_")}))
        finally:
            for node in fleet:
                node.stop()

"""Benchmarks run with --quick and print their JSON object on the last line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_bench(name: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / name), "--quick", *args], capture_output=True,
                         text=True, check=True, cwd=ROOT, timeout=120).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_aggregate_bench_quick() -> None:
    report = run_bench("aggregate.py")
    assert isinstance(report["baseline_s"], float)
    rules = {(r["backend"], r["rule"]) for r in report["results"]}
    names = ("mean", "median", "trimmed_mean", "krum", "multi_krum", "centered_clip")
    assert rules == {(b, r) for b in ("numpy", "torch") for r in names}
    for r in report["results"]:
        assert set(r) == {"backend", "rule", "seconds", "ratio"}


def test_aggregate_reduce_bench_quick() -> None:
    """bench/aggregate.py --reduce: the executor's streamed reduce on 1 and 2 kernel threads."""
    report = run_bench("aggregate.py", "--reduce")
    assert report["same_bytes"] is True and [r["threads"] for r in report["results"]] == [1, 2]
    assert all(r["seconds"] > 0 for r in report["results"]) and report["results"][0]["speedup"] == 1.0


def test_hashing_bench_quick() -> None:
    """bench/hashing.py: SHA-256 and BLAKE3 over chunks and whole artifacts, SHA-256 the baseline."""
    report = run_bench("hashing.py")
    cases = {(r["mode"], r["hasher"], r["threads"]) for r in report["results"]}
    assert {("chunks", "sha256", 1), ("chunks", "blake3", 1), ("whole", "sha256", 1), ("whole", "blake3", 1),
            ("whole", "blake3", "auto")} <= cases
    assert all(r["speedup"] == 1.0 for r in report["results"] if r["hasher"] == "sha256" and r["threads"] == 1)


def test_pool_bench_quick() -> None:
    """bench/pool.py (spec/pools.md): one process and a 2-rank gloo pool on the same lease, same result."""
    report = run_bench("pool.py")
    assert report["single"]["seconds"] > 0
    (pool,) = report["pools"]
    assert pool["ranks"] == 2 and pool["efficiency"] == pytest.approx(pool["speedup"] / 2, abs=1e-3)
    assert set(pool) >= {"windows_per_min", "samples_per_s_per_rank", "speedup", "max_abs_diff"}
    assert pool["max_abs_diff"] < 1e-5  # spec/pools.md §3: the pool computes the single process's delta


def test_engine_bench_quick() -> None:
    """bench/engine.py: a validator engine driven through certified windows at two cohort sizes."""
    report = run_bench("engine.py")
    assert report["validators"] == 4
    assert [r["trainers"] for r in report["results"]] == [10, 100]
    for r in report["results"]:
        assert r["windows"] == 1 and r["head_window"] == 2  # every driven window was certified, none skipped
        assert r["events"] > r["trainers"] and r["events_per_s"] > 0 and r["engine_s"] > 0
        assert set(r) == {"trainers", "windows", "events", "engine_s", "events_per_s", "us_per_event",
                          "events_per_window", "ms_per_window", "head_window", "rejections"}
        assert r["rejections"] == 0  # the benchmark's peers send only what the engine accepts
    small, large = report["results"]
    assert large["events_per_window"] > small["events_per_window"]  # a bigger cohort is more messages


def test_loss_check_bench_quick() -> None:
    """bench/loss_check.py (spec/protocol.md §6.1): both loss checks measured on honest and noise updates."""
    report = run_bench("loss_check.py")
    (digits,) = report["results"].values()
    assert digits["updates"] == 4 * report["trainers"]  # windows 2..5 of 6, every trainer
    for test in ("before_after", "symmetric"):
        assert 0.0 <= digits[test]["honest_rejected"] <= 1.0 and 0.0 <= digits[test]["noise_caught"] <= 1.0
    assert [t["loss_min_drop"] for t in digits["thresholds"]] == [0.0, 0.01, 0.02, 0.05, 0.1]
    assert digits["symmetric"]["honest_rejected"] == 0.0  # an honest update points downhill on its own data


def test_handshake_bench_quick() -> None:
    """bench/handshake.py (spec/transport.md §13): a handshake costs the responder far more than a refusal."""
    report = run_bench("handshake.py")
    assert report["handshakes"] == 20
    assert report["responder_cpu_ms_median"] > 0 and report["server_cpu_ms_per_tcp_connection"] > 0
    assert report["refusal_cpu_us"] > 0 and report["ratio_handshake_to_refusal"] >= 1

"""Benchmarks run with --quick and print their JSON object on the last line (issue 5)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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

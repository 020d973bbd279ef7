"""bench/upload_memory.py --quick: its JSON report, every upload stored, and the edge's peak RSS increase within
the memory bound the edge documents (spec/transport.md §5; before the fix, 6 x 8 MiB uploads raised it by 107 MiB)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_upload_memory_bench_quick_stays_within_the_bound() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "upload_memory.py"), "--quick"], capture_output=True,
                         text=True, check=True, cwd=ROOT, timeout=120).stdout
    report = json.loads(out.strip().splitlines()[-1])
    assert set(report) == {"uploads", "upload_bytes", "accepted", "refused_503", "stored", "bound_bytes",
                           "budget_bytes", "baseline_rss_bytes", "peak_rss_increase_bytes", "ratio", "seconds"}
    assert report["uploads"] == report["accepted"] == report["stored"] == 6
    assert report["refused_503"] >= 1  # 6 uploads, 4 slots: some waited for their Retry-After
    assert report["budget_bytes"] == 4 * report["upload_bytes"] < report["bound_bytes"]
    # The bodies of the admitted uploads really were in memory together (so this measures the bound) ...
    assert report["peak_rss_increase_bytes"] > report["upload_bytes"]
    # ... and never more than the bound.
    assert report["peak_rss_increase_bytes"] <= report["bound_bytes"], report
    assert report["ratio"] == round(report["peak_rss_increase_bytes"] / report["bound_bytes"], 4)

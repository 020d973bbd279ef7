"""The window benchmark's short form (issue 20): a real fleet at 1M parameters completes and prints its JSON.

Only the shape of the report is checked; the targets are the benchmark's to measure, never a timed test's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PHASES = {"fetch_head", "train", "publish", "fetch", "screen", "reduce", "agree"}
ROLES = {"validator", "reducer", "trainer"}


@pytest.mark.slow
def test_window_bench_quick() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "window.py"), "--quick"], capture_output=True,
                         text=True, check=True, cwd=ROOT, timeout=240).stdout
    report = json.loads(out.strip().splitlines()[-1])
    assert report["processes"] == 4
    (result,) = report["results"]
    assert result["params"] == 1_000_000 and result["model_bytes"] == 4_000_000
    assert result["windows"] >= 1 and result["skipped"] == 0
    assert set(result["phases"]) == PHASES
    assert all(isinstance(v, float) and v >= 0.0 for v in result["phases"].values())
    assert set(result["wire_bytes"]) == ROLES and set(result["peak_rss_bytes"]) == ROLES
    # every role moved at least the model once per window (a trainer sends its delta, receives the head)
    assert all(v >= result["model_bytes"] for v in result["wire_bytes"].values())
    assert all(v > result["model_bytes"] for v in result["peak_rss_bytes"].values())
    assert result["baseline_s"] > 0.0 and result["ratio"] > 0.0
    assert result["tasks"]["trainer"]["train"] >= 0.0

"""The window benchmark's short form: a real fleet at 1M parameters completes and prints its JSON.

Only the shape of the report is checked; the targets are the benchmark's to measure, never a timed test's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from peerloom.core.messages import ROLES

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
TRAIN_S = 0.3
PHASES = {"fetch_head", "train", "publish", "fetch", "screen", "reduce", "agree"}


@pytest.mark.slow
def test_window_bench_quick() -> None:
    """Also the one run of overlapped windows between real node processes (spec/protocol.md §5.2): the
    second fleet, ``overlap = 1``, where a trainer goes on before its claim and delta are durable."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "window.py"), "--quick", "--train-s", str(TRAIN_S),
                          "--overlap", "0,1"],
                         capture_output=True, text=True, check=True, cwd=ROOT, timeout=360).stdout
    report = json.loads(out.strip().splitlines()[-1])
    assert report["processes"] == 4
    result, overlapped = report["results"]
    assert overlapped["overlap"] == 1 and overlapped["windows"] >= 1 and overlapped["skipped"] == 0
    assert overlapped["tasks"]["trainer"]["train"] >= TRAIN_S
    # the train task's parts: the training holds the idle wait, and no part is longer than the whole task
    parts = overlapped["train_parts"]
    assert set(parts) == {"start", "training", "store"} and parts["training"] >= TRAIN_S
    assert all(0.0 <= v <= overlapped["tasks"]["trainer"]["train"] for v in parts.values())
    assert all(0.0 < v <= 1.0 for v in overlapped["utilization"].values())
    assert result["params"] == 1_000_000 and result["model_bytes"] == 4_000_000
    assert result["windows"] >= 1 and result["skipped"] == 0
    assert set(result["phases"]) == PHASES
    assert all(isinstance(v, float) and v >= 0.0 for v in result["phases"].values())
    assert set(result["wire_bytes"]) == set(ROLES) and set(result["peak_rss_bytes"]) == set(ROLES)
    # every role moved at least the model once per window (a trainer sends its delta, receives the head)
    assert all(v >= result["model_bytes"] for v in result["wire_bytes"].values())
    assert all(v > result["model_bytes"] for v in result["peak_rss_bytes"].values())
    assert result["baseline_s"] > 0.0 and result["ratio"] > 0.0
    # the idle wait reached the nodes' workload: every train task waited it
    assert result["train_s"] == TRAIN_S and result["tasks"]["trainer"]["train"] >= TRAIN_S
    assert result["overlap"] == 0
    # utilization: per trainer and across them, a share of wall time
    assert set(result["utilization"]) == {"trainer-1", "trainer-2"}
    assert all(0.0 < v <= 1.0 for v in result["utilization"].values())
    assert 0.0 < result["utilization_median"] <= 1.0


def _train(started: float, seconds: float) -> dict:
    return {"event": "task-done", "kind": "train", "t": started + seconds, "seconds": seconds, "started": started}


def test_utilization_is_training_over_the_time_between_train_starts() -> None:
    from bench.window import utilization

    # window 1 warms up; then trains of 2 s starting every 4 s, then every 8 s: shares 0.5, 0.5, 0.25
    lines = [_train(0.0, 9.0), _train(10.0, 2.0), _train(14.0, 2.0), {"event": "head", "window": 3, "t": 17.0},
             _train(18.0, 2.0), _train(26.0, 2.0)]
    assert utilization(lines, train_s=0.0) == 0.5
    assert utilization(lines, train_s=1.0) == 0.25  # the idle wait, not the whole task, is the training
    # without two train tasks after the warm-up there is no period to measure
    assert utilization(lines[:2], train_s=0.0) is None
    # a line without `started` (an older log) gives its start as t - seconds
    older = [{k: v for k, v in line.items() if k != "started"} for line in lines]
    assert utilization(older, train_s=0.0) == 0.5

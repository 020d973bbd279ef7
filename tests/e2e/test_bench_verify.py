"""bench/verify.py --quick: verification cost per update as a fraction of training (spec/protocol.md §6.1-6.3).

Only the shape of the report is checked; the fractions are the benchmark's to measure, never a timed test's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECONDS = {"workload_train_s", "train_s", "train_segments_s", "audit_full_s", "screen_s", "screen_loss_check_s",
           "loss_check_s", "segment_audit_s", "segment_replay_s"}
FRACTIONS = {"commit_overhead", "full_replay", "inline_per_update", "loss_check", "segment_audit",
             "segment_audit_expected", "new_scheme", "segment_replay", "new_scheme_replay_only",
             "sampled_full_replay", "fleet_new"}


def test_verify_bench_quick() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "verify.py"), "--quick"], capture_output=True,
                         text=True, check=True, cwd=ROOT, timeout=120).stdout
    report = json.loads(out.strip().splitlines()[-1])
    assert set(report) == {"clock", "settings", "target", "results", "torch_skipped", "met", "load_avg", "wall_s"}
    assert report["clock"] == "process_time" and report["target"] == 0.1
    assert set(report["settings"]) >= {"inner_steps", "batch", "segments", "audit_rate", "loss_check_samples"}
    assert len(report["results"]) == 2  # two model sizes
    small, large = report["results"]
    assert large["params"] > small["params"] > 0
    for r in report["results"]:
        assert set(r) == {"name", "backend", "params", "auditors", "met", "wall", "spread_cpu_s"} | SECONDS | FRACTIONS
        assert all(isinstance(r[k], float) for k in SECONDS | FRACTIONS)
        assert all(r[k] > 0.0 for k in SECONDS - {"loss_check_s"})  # a difference of two timings may dip below 0
        assert r["auditors"] == report["settings"]["validators"] + report["settings"]["reducers"]
        assert r["met"] == (r["new_scheme"] <= report["target"])
        assert set(r["wall"]) == {"met"} | FRACTIONS | (SECONDS - {"loss_check_s"})
    assert report["met"] == all(r["met"] for r in report["results"])

"""The cheater-detection benchmark's short form (bench/detection.py --quick): every adversary and the
all-honest control run and the last stdout line is one well-formed JSON report.

Only the shape of the report is checked; detection rates are the benchmark's to measure, never a test's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "detection.py"
ADVERSARIES = {"lazy", "replayer", "free-rider-noise", "lazy-1-in-5", "honest"}
SUMMARY_KEYS = {"seeds", "detected", "detection_rate", "detection_rate_ci95", "median_first_window",
                "first_window_histogram", "mechanism", "reject_reasons", "cheater_strikes", "cheating_updates",
                "honest", "skipped_windows", "final_accuracy", "invariant_failures", "wall_s"}


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_detection", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_extra_manifest_keys_reach_the_scenario() -> None:
    """`--manifest KEY=VALUE` sets any manifest key (TOML-typed), so keys the engine learns later work too."""
    bench = _bench_module()
    assert bench._manifest_item("audit_segments=8") == ("audit_segments", 8)
    assert bench._manifest_item("audit_min_cosine = 0.95") == ("audit_min_cosine", 0.95)
    assert bench._manifest_item("codec=int8") == ("codec", "int8")
    with pytest.raises(argparse.ArgumentTypeError):
        bench._manifest_item("no-equals-sign")
    from peerloom.sim.scenario import load_scenario

    args = argparse.Namespace(windows=6, workload="synthetic", inner_steps=8, loss_check_samples=0,
                              loss_min_drop=0.0, audit_rate=0.25, manifest={"audit_segments": 8})
    scenario = bench.build_scenario(load_scenario(bench.SCENARIO), "lazy", args)
    m = scenario["manifest"]
    assert m["audit_segments"] == 8 and m["audit"] is True and m["audit_rate"] == 0.25
    assert "loss_check_samples" not in m and m["inner_steps"] == 8
    assert scenario["stop_window"] == 6 and scenario["workload"]["name"] == "synthetic"
    assert scenario["adversaries"] == [{"behaviour": "lazy", "count": 1}]
    assert bench.build_scenario(load_scenario(bench.SCENARIO), "honest", args)["adversaries"] == []


@pytest.mark.slow
def test_detection_bench_quick() -> None:
    proc = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, check=True,
                          cwd=ROOT, timeout=600)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(report) == {"settings", "wall_s", "runs", "adversaries", "honest_false", "targets", "met"}
    assert set(report["adversaries"]) == ADVERSARIES
    seeds = report["settings"]["seeds"]
    assert seeds >= 1 and report["runs"] == seeds * len(ADVERSARIES)
    assert report["settings"]["manifest"]["loss_check_samples"] > 0 and report["settings"]["manifest"]["audit"]
    for name, summary in report["adversaries"].items():
        assert set(summary) == SUMMARY_KEYS, name
        assert summary["seeds"] == seeds and 0 <= summary["detected"] <= seeds
        assert 0.0 <= summary["detection_rate"] <= 1.0
        assert sum(summary["mechanism"].values()) == seeds
        assert set(summary["honest"]) == {"seeds_struck", "seeds_quarantined", "seeds_audited", "strikes",
                                          "seeds_rejected", "reject_reasons"}
        assert summary["invariant_failures"] == 0, name
    control = report["adversaries"]["honest"]
    assert control["detected"] == 0 and control["median_first_window"] is None
    assert control["cheating_updates"] == {"sent": 0, "certified": 0, "seeds_any_certified": 0, "audit_failed": 0,
                                           "audit_passed": 0}
    assert report["adversaries"]["lazy"]["cheating_updates"]["sent"] >= 1
    assert set(report["honest_false"]) == {"runs", "seeds_struck", "seeds_quarantined", "seeds_audited", "strikes",
                                           "seeds_rejected"}
    assert isinstance(report["met"]["detection"], bool) and isinstance(report["met"]["no_honest_strikes"], bool)

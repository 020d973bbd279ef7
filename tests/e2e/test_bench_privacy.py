"""bench/privacy.py on a tiny setting (2 windows of 4 inner steps, one seed, epsilon 8 at one lr): the JSON
report's shape, the rows' privacy accounting and the plot written."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("opacus")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]


def test_privacy_bench_tiny(tmp_path: Path) -> None:
    png = tmp_path / "privacy.png"
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "privacy.py"), "--windows", "2", "--inner-steps", "4",
                          "--seeds", "0", "--epsilons", "8", "--dp-lrs", "0.005", "--plot", str(png)],
                         capture_output=True, text=True, check=True, cwd=ROOT, timeout=120).stdout
    report = json.loads(out.strip().splitlines()[-1])
    assert (report["workload"], report["trainers"], report["shards"]) == ("mnist1d-mlp", 4, 8)
    assert (report["windows"], report["inner_steps"], report["delta"], report["max_grad_norm"]) == (2, 4, 1e-5, 1.0)
    assert report["lease_samples"] == 1000 and report["sample_rate"] == 0.032  # a batch of 32 over the lease
    assert [r["name"] for r in report["rows"]] == ["no DP", "clip only", "epsilon 8"]
    plain, clip, private = report["rows"]
    assert plain["sigma"] is None and plain["median"]["gap_points"] == 0 and plain["median"]["throughput_ratio"] == 1
    assert clip["sigma"] == 0 and clip["epsilon_spent"] == "inf" and clip["epsilon_target"] == "inf"
    assert private["sigma"] > 0 and private["steps"] == 8
    assert 7.5 < private["epsilon_spent"] <= 8.0  # noise_multiplier_for's sigma spends the budget, to 0.01
    for row in report["rows"]:
        (run,) = row["runs"]
        assert len(run["curve"]) == 3 and run["final"] == run["curve"][-1]
        assert run["samples"] > 0 and run["samples_per_s"] > 0
        assert row["median"]["gap_points"] == round(100 * (run["final"] - plain["runs"][0]["final"]), 2)
        if row["sigma"] is not None:
            assert run["privacy_steps_per_trainer"] == 8  # windows x H steps per trainer, as accounted
    assert plain["runs"][0]["samples"] == 2 * 4 * 4 * 32  # windows x trainers x H x batch
    target = report["target"]
    assert target["epsilon"] == 8 and target["max_gap_points"] == 5
    assert target["met"] == (target["gap_points"] >= -5) and math.isclose(
        target["miss_points"], max(0.0, -target["gap_points"] - 5), abs_tol=0.01)
    assert png.stat().st_size > 0

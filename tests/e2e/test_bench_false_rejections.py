"""bench/false_rejections.py --quick: its JSON report, measured with the engine's own screening at the
manifest's defaults, and honest cohorts under the false-rejection target of spec/protocol.md §6."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import attrs

from peerloom.core.objects import Manifest

ROOT = Path(__file__).resolve().parents[2]


def test_false_rejections_bench_quick() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "false_rejections.py"), "--quick"],
                         capture_output=True, text=True, check=True, cwd=ROOT, timeout=120).stdout
    report = json.loads(out.strip().splitlines()[-1])
    defaults = {f.name: f.default for f in attrs.fields(Manifest)}
    assert report["rule"] == {k: defaults[k] for k in report["rule"]}  # the engine's defaults, not the bench's
    assert [(r["workload"], r["trainers"]) for r in report["results"]] == [("digits", 4), ("breast-cancer", 4)]
    for row in report["results"]:
        assert row["updates"] == report["windows"] * row["trainers"]
        assert row["screen_rate"] == row["screened"] / row["updates"] <= 0.01  # every update is honest
        assert 0 <= row["loss_rejected"] <= row["updates"]
        assert 1.0 <= row["norm_spread"]["median"] <= row["norm_spread"]["max"]
        # the loop trains: above chance (digits: 0.1; breast-cancer: 0.63, its majority class)
        assert row["accuracy"] > {"digits": 0.5, "breast-cancer": 0.7}[row["workload"]]

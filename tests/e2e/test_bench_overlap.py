"""bench/overlap.py on a tiny setting (3 windows, mnist1d-numpy): the JSON report's shape, both modes training
the same first window from genesis, and the plot written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_overlap_bench_tiny(tmp_path: Path) -> None:
    png = tmp_path / "overlap.png"
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "overlap.py"), "--windows", "3", "--seeds", "0,1",
                          "--plot", str(png)], capture_output=True, text=True, check=True, cwd=ROOT, timeout=60).stdout
    report = json.loads(out.strip().splitlines()[-1])
    assert report["trainers"] == 4 and report["shards"] == 8 and report["rule"] == "centered_clip"
    assert report["outer"] == {"name": "diloco", "lr": 0.7, "momentum": 0.9}  # `peerloom init`'s defaults
    assert report["outer_overlap1"] == report["outer"]  # no --overlap1-outer
    assert report["seeds"] == [0, 1]
    (res,) = report["results"]
    assert (res["workload"], res["metric"], res["windows"], res["inner_steps"]) == ("mnist1d-numpy", "accuracy", 3, 0)
    assert res["target"]["max_loss"] == 1.0 and res["target"]["unit"] == "points"
    assert [r["seed"] for r in res["runs"]] == [0, 1]
    for row in res["runs"]:
        zero, one = row["overlap0"], row["overlap1"]
        assert len(zero["curve"]) == len(one["curve"]) == 4  # genesis, then every window
        assert zero["curve"][:2] == one["curve"][:2]  # window 1 trains from genesis in both modes
        assert zero["final"] == zero["curve"][-1] and zero["best"] == max(zero["curve"][1:])
        assert zero["curve"][-1] > 0.2  # the loop learns (10 classes: chance 0.1)
        assert row["difference"]["final"] == round(100 * (one["final"] - zero["final"]), 3)
    assert set(res["median"]) == {"overlap0_final", "overlap0_best", "overlap1_final", "overlap1_best",
                                  "difference_final", "difference_best"}
    assert res["met"] == (res["median"]["difference_final"] >= -1.0)
    assert png.stat().st_size > 0

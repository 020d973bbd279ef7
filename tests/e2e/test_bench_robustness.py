"""bench/robustness.py --quick: the report's schema, and that the default rule beats the mean under attack."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_robustness", ROOT / "bench" / "robustness.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_schema_default_rule_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "heatmap.png"
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "robustness.py"), "--quick", "--plot", str(png)],
                         capture_output=True, text=True, check=True, cwd=ROOT, timeout=120).stdout
    report = json.loads(out.strip().splitlines()[-1])
    assert isinstance(report["clean_accuracy"], float) and 0.5 < report["clean_accuracy"] <= 1.0
    assert isinstance(report["default_rule"], str)
    cells = report["cells"]
    assert all(set(c) == {"attack", "rule", "accuracy"} and 0.0 <= c["accuracy"] <= 1.0 for c in cells)
    by = {(c["attack"], c["rule"]): c["accuracy"] for c in cells}
    attacks = {c["attack"] for c in cells}
    rules = {c["rule"] for c in cells}
    assert {"scaling", "sign-flip", "alie", "ipm-100"} <= attacks
    assert rules == {"mean", "median", "trimmed_mean", "multi_krum", "centered_clip"}
    assert len(by) == len(attacks) * len(rules) == len(cells)
    default = report["default_rule"]
    # the defence matters: under scaling x10 the mean collapses and the default rule does not
    assert by[("scaling", default)] > by[("scaling", "mean")] + 0.2
    assert by[("ipm-100", default)] > by[("ipm-100", "mean")] + 0.2
    assert all(by[(a, default)] >= 0.9 * report["clean_accuracy"] for a in attacks)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_choose_default_prefers_the_first_rule_that_holds_every_column() -> None:
    bench = load_bench()
    cells = [
        {"attack": "none", "rule": "mean", "accuracy": 0.95},
        {"attack": "scaling", "rule": "mean", "accuracy": 0.1},
        {"attack": "none", "rule": "centered_clip", "accuracy": 0.95},
        {"attack": "scaling", "rule": "centered_clip", "accuracy": 0.8},  # below 0.9 x 0.95
        {"attack": "none", "rule": "trimmed_mean", "accuracy": 0.94},
        {"attack": "scaling", "rule": "trimmed_mean", "accuracy": 0.9},
    ]
    assert bench.choose_default(cells, 0.95) == "trimmed_mean"
    cells[5]["accuracy"] = 0.5
    assert bench.choose_default(cells, 0.95) is None

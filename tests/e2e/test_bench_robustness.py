"""bench/robustness.py: the --quick report's schema, that the default rule beats the mean under attack, and the
--defenses model (loss check, cohort screening, strikes and quarantine, sampled audits and their timing)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

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


class _Bowl:
    """A stub workload: loss = |w|^2 on any samples, an honest update shrinks w by 10%."""

    num_train = 200
    y_train = np.zeros(200, dtype=np.int64)

    def initial_params(self, seed: int) -> dict[str, np.ndarray]:
        return {"w": np.ones(8, dtype=np.float32)}

    def train(self, params: dict[str, np.ndarray], indices: list[int], seed: int) -> tuple[dict[str, np.ndarray]]:
        return ({"w": (params["w"] * np.float32(0.1)).astype(np.float32)},)

    def loss(self, params: dict[str, np.ndarray], indices: list[int]) -> float:
        assert 0 < len(indices) <= 64 and all(0 <= i < self.num_train for i in indices)
        return float(np.sum(params["w"].astype(np.float64) ** 2))

    def evaluate(self, params: dict[str, np.ndarray]) -> dict[str, float]:
        return {"accuracy": float(np.exp(-np.sum(params["w"].astype(np.float64) ** 2)))}


def test_defences_strike_quarantine_and_audit_timing() -> None:
    bench = load_bench()
    stub = _Bowl()
    shards = [list(range(20 * i, 20 * i + 20)) for i in range(10)]
    # sign-flip points uphill on the author's batch: rejected every time, never aggregated, and no strike
    # (spec/protocol.md §6.1); but a rejected update is audited like an aggregated one (§6.2): at rate 1 the
    # audits of window 0 quarantine both attackers with head 1, so they send updates in windows 0 and 1 only
    _, caught = bench.run_defended_cell(stub, stub, shards, ("sign-flip", {}), "centered_clip", 6, 0,
                                        audit_rate=1.0)
    assert caught["attacker_updates"] == caught["attacker_loss"] == 4  # 2 windows, 2 attackers
    assert caught["attacker_audit_failed"] == 4 and caught["attacker_quarantined_audit"] == 2
    assert "attacker_quarantined_strikes" not in caught and caught["attacker_quarantined_windows"] == 8
    assert "attacker_aggregated" not in caught and "honest_loss" not in caught
    # ALIE lowers the loss and is no outlier: only the audit catches it. At rate 1 the update of window 0
    # is aggregated, the author still trains in window 1 (its lease comes from head 0), head 1 quarantines
    _, caught = bench.run_defended_cell(stub, stub, shards, ("alie", {"z": 1.0}), "mean", 5, 0, audit_rate=1.0)
    assert caught["attacker_aggregated"] == caught["attacker_audit_failed"] == 4
    assert caught["attacker_quarantined_audit"] == 2 and caught["attacker_quarantined_windows"] == 6
    # label-flip is an honest computation: audits pass it
    _, caught = bench.run_defended_cell(stub, stub, shards, ("label-flip", {}), "mean", 3, 0, audit_rate=1.0)
    assert caught["attacker_audited"] == 6 and "attacker_audit_failed" not in caught
    # the ablation switches each defence off
    _, caught = bench.run_defended_cell(stub, stub, shards, ("sign-flip", {}), "mean", 3, 0, defenses=("audit",))
    assert "attacker_loss" not in caught and caught["attacker_aggregated"] == caught["attacker_updates"] >= 2


def test_cohort_outliers_is_the_engines_norm_ratio() -> None:
    bench = load_bench()
    deltas = [{"w": np.full(4, 1.0 + 0.01 * i, dtype=np.float32)} for i in range(5)]
    deltas.append({"w": np.full(4, 10.5, dtype=np.float32)})  # 10.2x the median norm (2.06)
    deltas.append({"w": np.full(4, 9.5, dtype=np.float32)})
    assert bench.cohort_outliers(deltas) == {5: "norm-outlier"}


def test_quick_run_with_defences() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "robustness.py"), "--quick", "--defenses",
                          "--rules", "mean,centered_clip", "--attacks", "none,sign-flip,alie"],
                         capture_output=True, text=True, check=True, cwd=ROOT, timeout=120).stdout
    report = json.loads(out.strip().splitlines()[-1])
    assert {(c["attack"], c["rule"]) for c in report["defended_cells"]} == \
        {(c["attack"], c["rule"]) for c in report["cells"]}
    assert report["defenses"]["enabled"] == ["screen", "loss", "audit"]
    by = {(c["attack"], c["rule"]): c for c in report["defended_cells"]}
    assert by[("sign-flip", "mean")]["caught"]["attacker_loss"] > 0
    assert "honest_loss" not in by[("none", "mean")]["caught"]
    assert by[("alie", "mean")]["caught"].get("attacker_audit_failed", 0) > 0
    assert all(c["accuracy"] >= 0.9 * report["clean_accuracy"] for c in report["defended_cells"])

"""bench/codecs.py --quick prints its JSON report on the last line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_codecs_bench_quick_schema() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "codecs.py"), "--quick"], capture_output=True,
                         text=True, check=True, cwd=ROOT, timeout=120).stdout
    report = json.loads(out.strip().splitlines()[-1])
    assert [r["codec"] for r in report["codecs"]] == ["none", "fp16", "bf16", "int8", "topk", "sign"]
    for row in report["codecs"]:
        assert set(row) == {"codec", "ratio", "encode_gbps", "decode_gbps", "error_feedback", "accuracy", "curve"}
        assert row["curve"][-1] == [report["windows"], row["accuracy"]]
        assert set(row["encode_gbps"]) == set(row["decode_gbps"]) == {"numpy", "torch"}
        assert all(v > 0 for v in (*row["encode_gbps"].values(), *row["decode_gbps"].values()))
        assert 0.0 <= row["accuracy"] <= 1.0
    ratios = {r["codec"]: r["ratio"] for r in report["codecs"]}
    assert ratios["none"] == 1.0 and ratios["fp16"] == ratios["bf16"] == 2.0
    assert 3.8 < ratios["int8"] < 4.0 and ratios["sign"] > 30 and ratios["topk"] > 40
    assert report["baseline_accuracy"] == report["codecs"][0]["accuracy"]
    assert isinstance(report["topk_within_2_points"], bool)
    scale = report["scale"]  # update bytes and encode/decode time at scale (--quick: 200k parameters)
    assert [r["codec"] for r in scale["codecs"]] == ["none", "int8", "topk"]
    sizes = {r["codec"]: r["update_bytes"] for r in scale["codecs"]}
    assert sizes["none"] > 4 * scale["params"] > sizes["int8"] > sizes["topk"]
    assert all(r["encode_s"] > 0 and r["decode_s"] > 0 for r in scale["codecs"])

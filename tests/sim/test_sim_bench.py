"""bench/sim_scale.py --quick runs the real engines at small scale and prints its JSON line."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sim_scale_quick_prints_the_json_line():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "sim_scale.py"), "--quick"], capture_output=True,
                          text=True, check=True, cwd=ROOT, timeout=120)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(report) == {"trainers", "windows", "wall_s", "events", "events_per_s", "peak_rss_bytes", "shards"}
    assert report["trainers"] == 30 and report["windows"] == 2 and report["shards"] == 30
    assert report["events"] > 1000 and report["events_per_s"] > 0 and report["peak_rss_bytes"] > 10 << 20
    assert "window 2 certified" in proc.stderr

"""DESIGN §1: core/ is pure. import-linter checks imports in CI; this also scans for clocks, OS
randomness and threads, which import rules cannot see."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = [
    r"^\s*(import|from)\s+(trio|aiohttp|asyncio|socket|threading|numpy|torch|zeroconf|secrets|safetensors)\b",
    r"\btime\.(time|monotonic|perf_counter|sleep)\(",
    r"\bos\.urandom\(",
    r"\bdatetime\.now\(",
    r"\brandom\.(random|randint|choice|shuffle|getrandbits|seed)\(",
]


def test_core_has_no_io_clock_or_os_randomness():
    hits = []
    for path in sorted((ROOT / "core").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if any(re.search(p, line) for p in FORBIDDEN):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_importing_core_loads_no_io_or_numeric_library():
    code = ("import sys, peerloom.core.engine, peerloom.core.chain; "
            "bad = [m for m in ('trio', 'numpy', 'torch', 'socket', 'asyncio', 'safetensors') if m in sys.modules]; "
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"core pulled in: {out}"

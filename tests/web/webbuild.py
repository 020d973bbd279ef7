"""The browser peer's build for the tests (spec/browser.md): `web/dist` built from the lock file by `make web`
(`npm ci && npm run build`), which `make test` runs first. A test that needs the build calls `built()`: it
builds when npm is present and the build is missing or older than the sources, and skips with the reason
when node or npm is absent."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

WEB = Path(__file__).resolve().parents[2] / "web"
DIST = WEB / "dist"
NODE = shutil.which("node")
NPM = shutil.which("npm")


def _stale() -> bool:
    marker = DIST / "node" / "interop.mjs"
    if not marker.exists():
        return True
    built = marker.stat().st_mtime
    sources = [*WEB.joinpath("src").rglob("*"), WEB / "build.mjs", WEB / "package-lock.json"]
    return any(p.is_file() and p.stat().st_mtime > built for p in sources)


def built() -> Path:
    """`web/dist`, built if stale; skips the test without node and npm."""
    if NODE is None or NPM is None:
        pytest.skip("node and npm are needed for the browser peer (install node 20)")
    if _stale():
        if not (WEB / "node_modules").exists():
            subprocess.run([NPM, "ci", "--no-audit", "--no-fund"], cwd=WEB, check=True, capture_output=True)
        subprocess.run([NPM, "run", "build"], cwd=WEB, check=True, capture_output=True)
    return DIST


def node_driver(command: dict, timeout: float = 60.0) -> dict:
    """Run dist/node/interop.mjs with one JSON command; its one JSON line back."""
    dist = built()
    proc = subprocess.run([NODE, str(dist / "node" / "interop.mjs")], input=json.dumps(command), text=True,
                          capture_output=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no result from the node driver (rc {proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(lines[-1])

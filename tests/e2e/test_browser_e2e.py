"""Browser peers end to end (issue 31, spec/browser.md): a real fleet (a validator with the HTTP transport and
edge, a native numpy trainer) and headless Chromium, through Playwright, opening `/train` in two browser
contexts, each a separate browser peer with its key in its own IndexedDB. Both peers' updates are accepted into
certified heads, `peerloom verify` accepts the chain, and the head's accuracy rises at least 20 points above
genesis. Skips, saying why, without Chromium, Playwright or npm (tests/web/webbuild.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from peerloom.adapters.http_client import EdgeClient
from peerloom.core.identity import PeerId
from tests.node_cluster import free_port, make_fleet, numpy_digits
from tests.web.webbuild import built

CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"), "/usr/bin/chromium")
                 if p and os.path.exists(p)), None)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium)")]


def _fleet(tmp_path):
    validator, trainer = make_fleet(tmp_path, validators=1, trainers=1, quorum=1, window_s=2.0, min_updates=1,
                                    shards=8)
    edge_port = free_port()
    validator.config.pop("listen")
    validator.write_config(transport={"kind": "http", "listen": f"http://127.0.0.1:{validator.port}"},
                           http={"enabled": True, "listen": f"127.0.0.1:{edge_port}"})
    trainer.write_config(bootstrap=[f"http://127.0.0.1:{validator.port}"])
    return validator, trainer, f"http://127.0.0.1:{edge_port}"


def _genesis_accuracy() -> float:
    workload, _ = numpy_digits(0, 8)
    return workload.evaluate(workload.initial_params(0))["accuracy"]


def test_two_browser_tabs_train_into_certified_heads(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    built()
    validator, trainer, url = _fleet(tmp_path)
    authority = (tmp_path / "authority").read_text().strip()
    validator.start()
    trainer.start()
    try:
        validator.wait_port()
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            pages, errors = [], []
            for _ in range(2):
                page = browser.new_context().new_page()  # its own IndexedDB: its own key, its own peer
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                page.goto(f"{url}/train")
                pages.append(page)
            deadline = time.monotonic() + 150
            accepted: list[list[dict]] = [[], []]
            while time.monotonic() < deadline:
                for i, page in enumerate(pages):
                    events = page.evaluate("window.peerloomEvents || []")
                    accepted[i] = [e for e in events if e["type"] == "verdict" and e["accepted"]]
                if all(accepted):
                    break
                time.sleep(1.0)
            texts = [page.inner_text("body") for page in pages]
            peers = [page.inner_text("#peer") for page in pages]
            browser.close()
        assert not errors, errors
        assert all(accepted), texts
        assert peers[0] != peers[1]
        assert all("accepted" in t for t in texts)
        client = EdgeClient(url)
        revision = client.revision(PeerId.from_text(authority))
        chain = client.chain(revision, 1, 256)
        cohorts = {c.hex() for head, _ in chain for c in head.cohort}
        assert {e["update"] for tab in accepted for e in tab} <= cohorts
        # training goes on (native and browser peers) until the head is 20 points above genesis
        genesis = _genesis_accuracy()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            latest = client.chain(revision, 1, 256)[-1][0]
            if latest.metrics.get("test_accuracy", 0.0) >= genesis + 0.20:
                break
            time.sleep(1.0)
        assert latest.metrics["test_accuracy"] >= genesis + 0.20, (genesis, dict(latest.metrics))
    finally:
        trainer.stop()
        validator.stop()
    check = subprocess.run([sys.executable, "-m", "peerloom", "verify", str(validator.directory), "--authority",
                            authority], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr

"""Browser peers end to end (spec/browser.md): a real fleet of `peerloom node` processes (a validator with the
HTTP transport and edge, a reducer on the HTTP transport, a native numpy trainer; audits on, unauditable
trainers admitted) and headless Chromium, through Playwright, opening `/train` in two browser contexts, each a
separate browser peer with its key in its own IndexedDB. Both peers' updates are accepted into certified
heads, `peerloom verify` accepts the chain, and the head's accuracy rises at least 20 points above genesis.
Skips, saying why, without Chromium, Playwright or npm (tests/web/webbuild.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time

import pytest

from peerloom.adapters.http_client import EdgeClient
from peerloom.adapters.keys import generate_identity, save_identity
from peerloom.core.identity import PeerId
from tests.node_cluster import Node, free_port, make_fleet, numpy_digits
from tests.web.webbuild import built

CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"), "/usr/bin/chromium")
                 if p and os.path.exists(p)), None)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium)")]


# Audits on: the native trainer's updates are replayed inline; the browser peers', which say `unauditable`,
# are admitted because the manifest allows unauditable trainers (spec/protocol.md §6.4).
MANIFEST = {"audit": True, "unauditable_trainers": True}


def _fleet(tmp_path, manifest=MANIFEST):
    """A validator (HTTP transport and edge), a reducer (HTTP transport, which the browser peers dial once the
    validator's `peers` message lists it) and a native trainer."""
    validator, trainer = make_fleet(tmp_path, validators=1, trainers=1, quorum=1, window_s=2.0, min_updates=1,
                                    shards=8, manifest_options=manifest)
    edge_port = free_port()
    validator.config.pop("listen")
    validator.write_config(transport={"kind": "http", "listen": f"http://127.0.0.1:{validator.port}"},
                           http={"enabled": True, "listen": f"127.0.0.1:{edge_port}"})
    trainer.write_config(bootstrap=[f"http://127.0.0.1:{validator.port}"])
    reducer = Node("reducer-1", "reducer", generate_identity(), tmp_path / "reducer-1", port=free_port())
    reducer.directory.mkdir()
    save_identity(reducer.identity, reducer.directory / "key")
    reducer.config = {**{k: v for k, v in trainer.config.items() if k != "listen"}, "name": "reducer-1",
                      "roles": ["reducer"], "transport": {"kind": "http",
                                                          "listen": f"http://127.0.0.1:{reducer.port}"}}
    reducer.write_config()
    return validator, reducer, trainer, f"http://127.0.0.1:{edge_port}"


def _wait_connected(url: str, peer: str, timeout_s: float = 30.0) -> None:
    """Until the edge's node lists `peer` among its connected peers (so its `peers` message to a browser that
    connects later names it)."""
    client = EdgeClient(url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        doc = client.get_json("/v1/peers")
        listed = doc.get("peers", doc) if isinstance(doc, dict) else doc
        if any(p.get("peer") == peer for p in listed):
            return
        time.sleep(0.3)
    raise AssertionError(f"{peer} never connected to the validator")


def _genesis_accuracy() -> float:
    workload, _ = numpy_digits(0, 8)
    return workload.evaluate(workload.initial_params(0))["accuracy"]


@contextlib.contextmanager
def _running(tmp_path, manifest=MANIFEST):
    """The fleet of `_fleet`, started, the reducer connected to the validator; yields (validator, reducer,
    trainer, edge url, authority) and a Playwright Chromium; stops everything after."""
    sync_api = pytest.importorskip("playwright.sync_api")
    built()
    validator, reducer, trainer, url = _fleet(tmp_path, manifest)
    authority = (tmp_path / "authority").read_text().strip()
    validator.start()
    reducer.start()
    trainer.start()
    try:
        validator.wait_port()
        reducer.wait_port()
        _wait_connected(url, reducer.identity.peer_id.to_text())
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                yield (validator, reducer, trainer, url, authority), browser
            finally:
                browser.close()
    finally:
        trainer.stop()
        reducer.stop()
        validator.stop()


def _tab(browser, url: str, errors: list[str], query: str = ""):
    page = browser.new_context().new_page()  # its own IndexedDB: its own key, its own peer
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{url}/train{query}")
    return page


def _events(page) -> list[dict]:
    return page.evaluate("window.peerloomEvents || []")


def _verify(validator, authority: str) -> None:
    check = subprocess.run([sys.executable, "-m", "peerloom", "verify", str(validator.directory), "--authority",
                            authority], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr


def test_two_browser_tabs_train_into_certified_heads(tmp_path):
    with _running(tmp_path) as ((validator, reducer, _trainer, url, authority), browser):
        errors: list[str] = []
        pages = [_tab(browser, url, errors) for _ in range(2)]
        deadline = time.monotonic() + 150
        accepted: list[list[dict]] = [[], []]
        while time.monotonic() < deadline:
            for i, page in enumerate(pages):
                accepted[i] = [e for e in _events(page) if e["type"] == "verdict" and e["accepted"]]
            if all(accepted):
                break
            time.sleep(1.0)
        texts = [page.inner_text("body") for page in pages]
        peers = [page.inner_text("#peer") for page in pages]
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
        # The browser peers dialed the reducer (the validator's `peers` message named it), and the reducer
        # fetched their deltas over those connections: a reducer fetches a delta from its author or whoever
        # relayed the announcement, and the browsers sent theirs to it directly.
        dialed = {e["peer"] for e in reducer.events() if e.get("event") == "connected"}
        assert set(peers) <= dialed, (peers, dialed)
        deltas = {e["delta"][:16] for page in pages for e in _events(page) if e["type"] == "announced"}
        fetched = {e["digest"] for e in reducer.events() if e.get("event") == "artifact-fetched"}
        assert deltas & fetched, (sorted(deltas), sorted(fetched))
    _verify(validator, authority)


def test_closing_a_tab_mid_window_loses_no_window(tmp_path):
    """spec/browser.md §4: a tab that holds a lease and closes before delivering is a silent leaseholder. With
    `lease_s` the native trainer claims its lease in the window itself; with `idle_windows` the chain expires
    the tab. No window after the close is skipped."""
    manifest = {**MANIFEST, "lease_s": 1.0, "idle_windows": 2}
    with _running(tmp_path, manifest) as ((validator, _reducer, trainer, url, authority), browser):
        errors: list[str] = []
        # `?delay`: the tab waits a minute before training each leased window (a slow device), so it holds
        # a lease it has not delivered when the test closes it
        page = _tab(browser, url, errors, "?ephemeral=1&delay=60000")
        client = EdgeClient(url)
        revision = client.revision(PeerId.from_text(authority))
        peer, leased = page.inner_text("#peer"), None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and leased is None:
            latest = client.chain(revision, 1, 256)[-1][0].window
            leased = next((e["window"] for e in _events(page) if e["type"] == "lease" and e["window"] > latest),
                          None)  # a lease of the open window
            time.sleep(0.2)
        assert leased is not None, page.inner_text("body")
        page.context.close()  # the tab goes mid-window, its lease undelivered
        assert not errors, errors
        deadline = time.monotonic() + 60
        heads: list = []
        while time.monotonic() < deadline:
            heads = [h for h, _ in client.chain(revision, 1, 256)]
            if heads[-1].window >= leased + 4 and any(PeerId.from_text(peer) in h.expired for h in heads):
                break
            time.sleep(0.5)
        after = [h for h in heads if h.window >= leased]
        assert after and after[-1].window >= leased + 4, [h.window for h in heads]
        assert not any(h.skipped for h in after), [(h.window, h.skipped) for h in after]
        assert any(PeerId.from_text(peer) in h.expired for h in after), "the closed tab never expired"
        assert PeerId.from_text(peer) not in heads[-1].roster_peers
        # the native trainer, next-ranked, claimed the closed tab's lease of that window
        claims = [e for e in trainer.events() if e.get("event") == "lease-claim" and e.get("holder") == peer]
        assert claims, [e for e in trainer.events() if "claim" in str(e.get("event"))][-10:]
    _verify(validator, authority)


def test_a_tampered_browser_update_is_rejected_and_the_page_shows_why(tmp_path):
    """spec/browser.md §3: a tab whose delta does not match the digest it signed (the test injects it with
    the page's `?tamper` test flag) is rejected by the validator with a typed reason, and the page shows it."""
    with _running(tmp_path) as ((validator, _reducer, _trainer, url, authority), browser):
        errors: list[str] = []
        page = _tab(browser, url, errors, "?ephemeral=1&tamper=1")
        peer = page.inner_text("#peer")
        deadline = time.monotonic() + 60
        verdicts: list[dict] = []
        while time.monotonic() < deadline and not verdicts:
            verdicts = [e for e in _events(page) if e["type"] == "verdict"]
            time.sleep(0.5)
        assert verdicts and not verdicts[0]["accepted"], _events(page)
        assert verdicts[0]["reason"].startswith("screen-digest-mismatch"), verdicts
        reasons = {e.get("reason") for e in validator.events() if e.get("peer") == peer and e.get("reason")}
        assert "screen-digest-mismatch" in reasons, reasons
        page.wait_for_function("document.querySelector('#updates').innerText.includes('screen-digest-mismatch')",
                               timeout=5000)
        # the rejected update's row, wherever it is: the tab goes on training, and a later window's row (still
        # "announced", awaiting its verdict) may be on top by now
        rows = page.inner_text("#updates").splitlines()
        assert any("rejected: screen-digest-mismatch" in row for row in rows), rows
        assert not errors, errors
    _verify(validator, authority)

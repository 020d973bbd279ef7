"""The edge's dashboard in a real headless Chromium (system package; playwright drives it, no downloads).

Loads the page served by the edge, checks that the head chain and the validation curve render from the
JSON endpoints, then certifies more heads and checks that the page follows (server-sent events).
"""

from __future__ import annotations

import shutil

import pytest

from peerloom.adapters.http_edge import EdgeServer

from .edge_fixtures import advance, make_view

CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"), "/usr/bin/chromium")
                 if p and shutil.which(p)), None)
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium)")


def test_dashboard_renders_chain_and_curve_and_follows_new_heads(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    view = make_view(tmp_path)
    heads = advance(view, 4)
    with EdgeServer(view) as server, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(server.url + "/", wait_until="load")
            # (expect() polls without eval, which the page's Content-Security-Policy forbids.)
            sync_api.expect(page.locator("#chain-rows tr")).to_have_count(5, timeout=15_000)
            assert page.text_content("#latest-window") == "4"
            # Newest first; each row shows its head id prefix and the accuracy of that window.
            first = page.locator("#chain-rows tr").first
            assert first.get_attribute("data-window") == "4"
            assert heads[-1].id.hex()[4:16] in first.inner_text()
            assert page.locator("#curve circle.acc").count() == 4
            assert page.locator("#curve circle.loss").count() == 4
            assert page.locator("#curve polyline").count() == 2
            assert page.locator("#peer-rows tr").count() == 2
            assert "sent" in page.text_content("#bytes")
            # The chain advances: the page follows via server-sent events (or its 5 s poll).
            advance(view, 2)
            sync_api.expect(page.locator("#chain-rows tr")).to_have_count(7, timeout=15_000)
            assert page.text_content("#latest-window") == "6"
            assert page.locator("#curve circle.acc").count() == 6
            assert errors == []
        finally:
            browser.close()

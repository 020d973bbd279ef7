"""The edge's dashboard in a real headless Chromium (system package; playwright drives it, no downloads).

Loads the page served by the edge, checks that the head chain and the validation curve render from the
JSON endpoints, then certifies more heads and checks that the page follows (server-sent events).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from peerloom.adapters.edge_view import PeerInfo
from peerloom.adapters.http_edge import EdgeServer
from tests.edge_fixtures import advance, make_view
from tests.helpers import ident

CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"), "/usr/bin/chromium")
                 if p and shutil.which(p)), None)
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium)")


@contextlib.contextmanager
def dashboard_page(pw: Any) -> Iterator[tuple[Any, list[str]]]:
    """A page of a headless system Chromium and the list its script errors are appended to; closed after."""
    browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
    try:
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        yield page, errors
    finally:
        browser.close()


def test_dashboard_renders_chain_and_curve_and_follows_new_heads(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    view = make_view(tmp_path)
    heads = advance(view, 4)
    with EdgeServer(view) as server, sync_api.sync_playwright() as pw:
        with dashboard_page(pw) as (page, errors):
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
            assert page.text_content("#last-error") == "none"
            # A trainer's update rejected, a task failed: the page shows both at its next refresh. The detail
            # is a peer's text: it must render as text, never as markup.
            view.add_peer(PeerInfo(peer_id=ident(12).peer_id, roles=("trainer",), rejected=2,
                                   last_rejection="screen-loss (<b id='x'>loss 2</b>)"))
            view.set_last_error("train task failed: ValueError: sample 17")
            # The chain advances: the page follows via server-sent events (or its 5 s poll).
            advance(view, 2)
            sync_api.expect(page.locator("#chain-rows tr")).to_have_count(7, timeout=15_000)
            # the two heads may arrive as two events: the page converges on the second
            sync_api.expect(page.locator("#latest-window")).to_have_text("6", timeout=15_000)
            sync_api.expect(page.locator("#curve circle.acc")).to_have_count(6, timeout=15_000)
            sync_api.expect(page.locator("#peer-rows tr")).to_have_count(3, timeout=15_000)
            assert page.text_content("#last-error") == "train task failed: ValueError: sample 17"
            row = page.locator("#peer-rows tr").last.inner_text()
            assert "\t2\t" in row and "screen-loss (<b id='x'>loss 2</b>)" in row
            assert page.locator("#x").count() == 0
            assert errors == []


@pytest.mark.slow
def test_dashboard_of_a_running_node_sees_the_chain_advance(tmp_path):
    """`peerloom node` processes (a validator with the edge on, two trainers): the page shows the certified
    chain growing and the accuracy curve gaining points, from the node's own JSON endpoints."""
    sync_api = pytest.importorskip("playwright.sync_api")
    from tests.node_cluster import free_port, make_fleet

    nodes = make_fleet(tmp_path, validators=1, trainers=2, quorum=1, window_s=1.0, min_updates=1)
    http_port = free_port()
    nodes[0].write_config(http={"enabled": True, "listen": f"127.0.0.1:{http_port}"})
    for node in nodes:
        node.start()
    try:
        for node in nodes:
            node.wait_port()
        with sync_api.sync_playwright() as pw:
            with dashboard_page(pw) as (page, errors):
                page.goto(f"http://127.0.0.1:{http_port}/", wait_until="load")
                rows = page.locator("#chain-rows tr")
                sync_api.expect(rows).not_to_have_count(0, timeout=15_000)
                # Window 2 certified (rows for windows 0..2), then two more windows later.
                sync_api.expect(page.locator("#chain-rows tr[data-window='2']")).to_have_count(1, timeout=40_000)
                seen = int(page.text_content("#latest-window") or "0")
                sync_api.expect(page.locator(f"#chain-rows tr[data-window='{seen + 2}']")).to_have_count(
                    1, timeout=40_000)
                assert int(page.text_content("#latest-window") or "0") >= seen + 2
                assert page.locator("#curve circle.acc").count() >= seen + 1
                assert page.locator("#peer-rows tr").count() >= 2  # the two trainers, with their roles
                assert errors == []
    finally:
        for node in nodes:
            node.stop()


def test_dashboard_shows_each_trainers_epsilon_and_the_budget(tmp_path):
    """Under a manifest with `privacy` the peers table gives each trainer's epsilon and DP-SGD steps from the
    latest head's ledger (and a row for a ledger entry of a peer the node does not know), which trainers are
    private, and `#privacy` the budget and DP-SGD's parameters; without it, `#privacy` says off."""
    sync_api = pytest.importorskip("playwright.sync_api")
    from tests.edge_fixtures import make_privacy_view

    view, _ = make_privacy_view(tmp_path)
    plain = make_view(tmp_path / "plain")
    advance(plain, 1)
    with EdgeServer(view) as server, EdgeServer(plain) as plain_server, sync_api.sync_playwright() as pw:
        with dashboard_page(pw) as (page, errors):
            page.goto(server.url + "/", wait_until="load")
            sync_api.expect(page.locator("#peer-rows tr")).to_have_count(3, timeout=15_000)
            sync_api.expect(page.locator("#privacy")).to_contain_text("budget 8 per trainer", timeout=15_000)
            text = page.text_content("#privacy")
            assert "\u03c3 1.1, clip 1, q 0.05, \u03b4 1e-5" in text and "as of window 1" in text, text
            assert "private data admitted, private trainers: 1" in text

            def cells(i):
                row = page.locator(f"#peer-rows tr[data-peer='{i.peer_id.to_text()}']")
                return row.locator("td.epsilon").inner_text(), row.locator("td.private").inner_text()

            assert cells(ident(10)) == ("1.500 of 8 (40)", "")
            assert cells(ident(11)) == ("0.750 of 8 (16)", "yes")
            assert cells(ident(12)) == ("0.500 of 8 (8)", "")  # in the ledger, not a peer of this node
            page.goto(plain_server.url + "/", wait_until="load")
            sync_api.expect(page.locator("#peer-rows tr")).to_have_count(2, timeout=15_000)
            assert page.text_content("#privacy") == "off"
            assert page.locator("#peer-rows td.epsilon").first.inner_text() == ""
            assert errors == []

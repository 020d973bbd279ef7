"""The browser peer's trainer (web/src/peer.ts), run under node, against a real `peerloom node` validator with
the HTTP transport and edge (spec/browser.md): it joins over the transport, trains on the samples it fetched
by range requests, and its updates are certified; a tampered update is rejected with a typed reason."""

from __future__ import annotations

import json
import os

import pytest

from peerloom.adapters.http_client import EdgeClient
from peerloom.core.identity import Identity, PeerId
from tests.node_cluster import free_port, make_fleet
from tests.web.webbuild import node_driver

pytestmark = pytest.mark.slow


def _validator(tmp_path):
    (validator,) = make_fleet(tmp_path, validators=1, trainers=0, quorum=1, window_s=2.0, min_updates=1)
    edge_port = free_port()
    validator.config.pop("listen")
    validator.write_config(transport={"kind": "http", "listen": f"http://127.0.0.1:{validator.port}"},
                           http={"enabled": True, "listen": f"127.0.0.1:{edge_port}"})
    return validator, f"http://127.0.0.1:{edge_port}"


def test_browser_peer_updates_are_certified(tmp_path):
    validator, url = _validator(tmp_path)
    seed = os.urandom(32)
    validator.start()
    try:
        validator.wait_port()
        result = node_driver({"op": "train", "edge": url, "seed": seed.hex(), "updates": 2, "timeout_s": 60},
                             timeout=90)
        accepted = [v for v in result.get("verdicts", []) if v["accepted"]]
        assert len(accepted) >= 2, json.dumps(result)[-4000:]
        authority = (tmp_path / "authority").read_text().strip()
        client = EdgeClient(url)
        revision = client.revision(PeerId.from_text(authority))
        cohorts = {c.hex() for head, cert in client.chain(revision, 1, 256) for c in head.cohort}
        assert {v["update"] for v in accepted} <= cohorts
        assert result["peer"] == Identity(seed).peer_id.to_text()
    finally:
        validator.stop()


def test_a_tampered_browser_update_is_rejected_with_a_typed_reason(tmp_path):
    validator, url = _validator(tmp_path)
    validator.start()
    try:
        validator.wait_port()
        result = node_driver({"op": "train", "edge": url, "seed": os.urandom(32).hex(), "updates": 1,
                              "timeout_s": 60, "tamper": True}, timeout=90)
        verdicts = result.get("verdicts", [])
        assert verdicts and not any(v["accepted"] for v in verdicts), json.dumps(result)[-4000:]
        # the validator rejected it with the typed reason, and the browser peer reports that reason
        reasons = [e for e in validator.events() if e.get("reason") == "screen-digest-mismatch"
                   and e.get("peer") == result["peer"]]
        assert reasons, [e for e in validator.events() if "reason" in e][-10:]
        assert verdicts[0]["reason"].startswith("screen-digest-mismatch"), verdicts
    finally:
        validator.stop()

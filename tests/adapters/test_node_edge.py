"""`peerloom node` with the HTTP edge on: a light trainer using only the HTTP client gets updates accepted
into certified heads; /metrics serves the node's registry; SIGTERM and SIGINT shut nodes down cleanly."""

from __future__ import annotations

import json
import re
import signal
import time
import urllib.request

import pytest

from peerloom.adapters.database import Database
from peerloom.adapters.http_client import EdgeClient, LightTrainer
from peerloom.adapters.keys import generate_identity
from peerloom.core.identity import PeerId
from tests.node_cluster import free_port, make_fleet, numpy_digits


@pytest.mark.slow
def test_light_trainer_over_http_contributes_to_certified_heads(tmp_path):
    light = generate_identity()
    nodes = make_fleet(tmp_path, validators=1, trainers=1, quorum=1, window_s=2.0, min_updates=1,
                       extra_roster=(light,))
    validator, trainer = nodes
    http_port = free_port()
    validator.write_config(http={"enabled": True, "listen": f"127.0.0.1:{http_port}"})
    authority = PeerId.from_text((tmp_path / "authority").read_text())
    for node in nodes:
        node.start()
    try:
        for node in nodes:
            node.wait_port()
        client = EdgeClient(f"http://127.0.0.1:{http_port}")
        workload, shards = numpy_digits(0, 4)
        trainer_http = LightTrainer(client, light, authority=authority, workload=workload, shards=shards,
                                    workdir=tmp_path / "light")
        submitted: set[str] = set()
        in_cohort: set[str] = set()
        deadline = time.monotonic() + 45.0
        while time.monotonic() < deadline and not in_cohort:
            step = trainer_http.step()
            if step.update_id:
                submitted.add(step.update_id)
            head, cert = client.latest(trainer_http.revision)
            in_cohort |= {c.hex() for c in head.cohort} & submitted
            time.sleep(0.2)
        trainer_http.close()
        assert in_cohort, f"no HTTP update reached a certified head (submitted {len(submitted)})"
        assert cert is not None and cert.window == head.window  # verified against the manifest by the client
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10).read().decode()
        assert "peerloom_windows_total" in metrics and "peerloom_head_window" in metrics
        assert "peerloom_updates_accepted_total" in metrics and "peerloom_head_lag_windows 0.0" in metrics
        assert re.search(r'peerloom_peer_bytes_total\{direction="sent",peer="12D3KooW\w+"\} [1-9]', metrics)
    finally:
        validator.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]  # started
        trainer.process.send_signal(signal.SIGINT)  # type: ignore[union-attr]  # started
        codes = [node.process.wait(timeout=20) for node in nodes]  # type: ignore[union-attr]  # started
    assert codes == [0, 0]
    for node in nodes:  # graceful: stats written at shutdown, the shutdown logged, the database closed cleanly
        stats = json.loads((node.directory / "stats.json").read_text())
        assert stats["head_window"] >= head.window - 1
        assert "shutting down" in (node.directory / "node.log").read_text()
        assert Database(node.directory / "store" / "node.db").integrity_check() == "ok"
    db = Database(validator.directory / "store" / "node.db")
    assert db.heads(limit=1)[0][0] >= head.window  # the chain view in the node database
    assert trainer.identity.peer_id.to_text() in {p for p, *_ in db.peers()}

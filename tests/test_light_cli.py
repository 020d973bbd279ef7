"""`peerloom light`: a light trainer over HTTP only, against a real validator node with the edge on; its
update is accepted and lands in a certified head's cohort. Bad arguments exit 2 without touching the net."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from peerloom.adapters.http_client import EdgeClient
from peerloom.adapters.keys import generate_identity, save_identity
from peerloom.core.identity import PeerId
from peerloom.light import run
from tests.node_cluster import free_port, make_fleet


@pytest.mark.slow
def test_light_command_gets_an_update_into_a_certified_head(tmp_path):
    light = generate_identity()
    save_identity(light, tmp_path / "light.key")
    # No full trainer: every lease is the light peer's, so a head's cohort can only hold its updates.
    (validator,) = make_fleet(tmp_path, validators=1, trainers=0, quorum=1, window_s=2.0, min_updates=1,
                              extra_roster=(light,))
    http_port = free_port()
    validator.write_config(http={"enabled": True, "listen": f"127.0.0.1:{http_port}"})
    authority = (tmp_path / "authority").read_text().strip()
    url = f"http://127.0.0.1:{http_port}"
    validator.start()
    try:
        validator.wait_port()
        cmd = [sys.executable, "-m", "peerloom", "light", "--edge", url, "--authority", authority,
               "--key", str(tmp_path / "light.key"), "--updates", "2", "--threads", "1", "--poll", "0.2",
               "--timeout", "40", "--workload", "tests.node_cluster:numpy_digits", "--workdir", str(tmp_path / "w")]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=55,
                              env={**os.environ, "PYTHONHASHSEED": "0"})
        assert done.returncode == 0, done.stderr[-3000:]
        steps = [json.loads(line) for line in done.stdout.splitlines()]
        ids = {s["update_id"] for s in steps if s["update_id"]}
        assert len(ids) == 2 and len({s["window"] for s in steps if s["update_id"]}) == 2  # one per window
        client = EdgeClient(url)
        revision = client.revision(PeerId.from_text(authority))
        deadline = time.monotonic() + 10.0
        in_cohort: set[str] = set()
        while time.monotonic() < deadline and not in_cohort:
            head, cert = client.latest(revision)  # certificate verified against the manifest
            in_cohort = {c.hex() for c in head.cohort} & ids
            time.sleep(0.2)
        assert in_cohort, f"no update of the light command reached a certified head (uploaded {ids})"
        assert cert is not None and cert.window == head.window
    finally:
        assert validator.stop() == 0


@pytest.mark.parametrize("argv, message", [
    (["--updates", "0"], "at least 1"),
    (["--authority", "not-a-peer-id"], ""),
])
def test_bad_arguments_exit_2(tmp_path, capsys, argv, message):
    import argparse

    from peerloom import light

    save_identity(generate_identity(), tmp_path / "k")
    parser = argparse.ArgumentParser()
    light.add_parser(parser.add_subparsers(dest="command"))
    base = ["light", "--edge", "http://127.0.0.1:9", "--authority", generate_identity().peer_id.to_text(),
            "--key", str(tmp_path / "k")]
    assert run(parser.parse_args(base + argv)) == 2
    assert message in capsys.readouterr().err


def test_unreachable_edge_exits_2(tmp_path, capsys):
    import argparse

    from peerloom import light

    save_identity(generate_identity(), tmp_path / "k")
    parser = argparse.ArgumentParser()
    light.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["light", "--edge", f"http://127.0.0.1:{free_port()}", "--authority",
                              generate_identity().peer_id.to_text(), "--key", str(tmp_path / "k")])
    assert run(args) == 2
    assert "cannot start" in capsys.readouterr().err

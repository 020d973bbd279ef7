"""`peerloom light`: an ordinary trainer node that listens nowhere and dials a validator's HTTP transport
(spec/transport.md §10). Its updates reach certified heads over that transport, not through the edge's REST
upload; the edge only serves the manifest and lists the transport addresses. Bad arguments, a manifest not
signed by the authority and an unreachable edge exit 2 before any node starts."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tomllib
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from peerloom import light
from peerloom.adapters.http_client import EdgeClient
from peerloom.adapters.http_edge import EdgeServer
from peerloom.adapters.keys import generate_identity, save_identity
from peerloom.core.identity import PeerId
from peerloom.node import ConfigError, transport_listens
from peerloom.testing import InMemoryEdgeView
from tests.edge_fixtures import VALIDATOR
from tests.helpers import make_revision
from tests.node_cluster import free_port, make_fleet


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    light.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["light", *argv])


@pytest.mark.slow
def test_light_command_gets_updates_into_certified_heads_over_the_http_transport(tmp_path):
    me = generate_identity()
    save_identity(me, tmp_path / "light.key")
    # No full trainer, and the light peer is not in the genesis roster: it joins (over the transport), then
    # every lease is its own, so a head's cohort can only hold its updates.
    (validator,) = make_fleet(tmp_path, validators=1, trainers=0, quorum=1, window_s=2.0, min_updates=1)
    edge_port = free_port()
    validator.config.pop("listen")  # the validator listens on the HTTP transport only
    validator.write_config(transport={"kind": "http", "listen": f"http://127.0.0.1:{validator.port}"},
                           http={"enabled": True, "listen": f"127.0.0.1:{edge_port}"})
    authority = (tmp_path / "authority").read_text().strip()
    url = f"http://127.0.0.1:{edge_port}"
    validator.start()
    try:
        validator.wait_port()
        # No --peer: the light command dials the transport address the edge lists in /healthz.
        cmd = [sys.executable, "-m", "peerloom", "light", "--edge", url, "--authority", authority,
               "--key", str(tmp_path / "light.key"), "--updates", "2", "--timeout", "60",
               "--workload", "tests.node_cluster:numpy_digits", "--workdir", str(tmp_path / "w")]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=90,
                              env={**os.environ, "PYTHONHASHSEED": "0"})
        assert done.returncode == 0, done.stderr[-3000:]
        lines = [json.loads(line) for line in done.stdout.splitlines()]
        assert lines[0]["joined"] and not lines[0]["update_id"], lines  # a head rostered it first
        updates = [line for line in lines if line["update_id"]]
        ids = {line["update_id"] for line in updates}
        assert len(ids) == 2 and len({line["window"] for line in updates}) == 2, lines
        assert all(line["shards"] for line in updates)
        # The updates are in certified heads, each certificate verified against the manifest.
        client = EdgeClient(url)
        revision = client.revision(PeerId.from_text(authority))
        cohorts = {c.hex() for head, cert in client.chain(revision, 1, 256) for c in head.cohort}
        assert ids <= cohorts
        # They came over the HTTP transport: the validator's connection from the light peer is http, and
        # the edge's REST upload and join endpoints were never called.
        connected = [e for e in validator.events() if e.get("event") == "connected"
                     and e.get("peer") == me.peer_id.to_text()]
        assert connected and {e["transport"] for e in connected} == {"http"}
        metrics = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
        assert 'route="/healthz"' in metrics and 'route="/v1/manifest"' in metrics
        assert 'route="/v1/updates"' not in metrics and 'route="/v1/join"' not in metrics
        written = tomllib.loads((tmp_path / "w" / "light.toml").read_text())
        assert written["transport"] == {"kind": "http", "dial_only": True}
        assert written["bootstrap"] == [f"http://127.0.0.1:{validator.port}"]
    finally:
        assert validator.stop() == 0


def test_edge_lists_transport_addresses_and_light_picks_the_http_ones(tmp_path):
    addresses = ("/ip4/127.0.0.1/tcp/7001", "http://127.0.0.1:7002", "http://0.0.0.0:7003", "memory://x",
                 "http://not-an-ip:7004")
    view = InMemoryEdgeView(identity_peer=VALIDATOR.peer_id, revision=make_revision(validators=(VALIDATOR,)),
                            registry=CollectorRegistry(), artifacts_dir=tmp_path / "a", addresses=addresses)
    with EdgeServer(view) as server:
        assert EdgeClient(server.url).get_json("/healthz")["addresses"] == list(addresses)
        # A wildcard host becomes the edge's host; tcp, memory and undialable addresses are skipped.
        assert light._advertised(server.url) == ["http://127.0.0.1:7002", "http://127.0.0.1:7003"]


def test_dial_only_transport_listens_nowhere():
    assert transport_listens({"transport": {"kind": "http", "dial_only": True}}) == ()
    assert transport_listens({"transport": [{"kind": "http", "dial_only": True},
                                            {"kind": "tcp", "listen": "127.0.0.1:0"}]}) == ("127.0.0.1:0",)
    with pytest.raises(ConfigError, match="dial_only"):
        transport_listens({"transport": {"kind": "http", "dial_only": True, "listen": "http://127.0.0.1:0"}})


@pytest.mark.parametrize("argv, message", [
    (["--updates", "0"], "at least 1"),
    (["--authority", "not-a-peer-id"], ""),
])
def test_bad_arguments_exit_2(tmp_path, capsys, argv, message):
    save_identity(generate_identity(), tmp_path / "k")
    base = ["--edge", "http://127.0.0.1:9", "--authority", generate_identity().peer_id.to_text(),
            "--key", str(tmp_path / "k")]
    assert light.run(parse(base + argv)) == 2
    assert message in capsys.readouterr().err


def test_no_edge_needs_manifest_and_peer(tmp_path, capsys):
    save_identity(generate_identity(), tmp_path / "k")
    args = parse(["--authority", generate_identity().peer_id.to_text(), "--key", str(tmp_path / "k"),
                  "--peer", "http://127.0.0.1:9"])
    assert light.run(args) == 2
    assert "--manifest" in capsys.readouterr().err


def test_manifest_not_signed_by_the_authority_exits_2(tmp_path, capsys):
    (node,) = make_fleet(tmp_path, validators=1, trainers=0, quorum=1)
    save_identity(generate_identity(), tmp_path / "k")
    impostor = generate_identity().peer_id.to_text()
    args = parse(["--authority", impostor, "--key", str(tmp_path / "k"), "--manifest",
                  str(tmp_path / "manifest.cbor"), "--peer", f"http://127.0.0.1:{node.port}"])
    assert light.run(args) == 2
    assert "failed verification" in capsys.readouterr().err


def test_unreachable_edge_exits_2(tmp_path, capsys):
    save_identity(generate_identity(), tmp_path / "k")
    args = parse(["--edge", f"http://127.0.0.1:{free_port()}", "--authority", generate_identity().peer_id.to_text(),
                  "--key", str(tmp_path / "k")])
    assert light.run(args) == 2
    assert "cannot start" in capsys.readouterr().err

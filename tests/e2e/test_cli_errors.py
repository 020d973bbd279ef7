"""Every error a user can cause ends in one line naming the file, key or port, with exit status 2 and no
traceback; `--debug` shows the traceback."""

import socket
import subprocess

import pytest

from tests.node_cluster import make_fleet
from tests.node_zygote import run_cli


def _run(*args: str, cwd=None) -> subprocess.CompletedProcess[str]:
    """`python -m peerloom <args>` as a real process, forked from the session's fork server (no import cost)."""
    return run_cli(list(args), timeout=120, cwd=cwd)


def _one_line(out: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def test_port_in_use_names_the_address(tmp_path):
    node = make_fleet(tmp_path, validators=1, trainers=0, quorum=1)[0]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", node.port))
        holder.listen()
        out = _run("node", "--config", str(node.config_path))
    _one_line(out, "peerloom node:", f"cannot listen on 127.0.0.1:{node.port}: Address already in use")


@pytest.mark.parametrize("command", [
    ["node", "--config", "{missing}"],
    ["sim", "{missing}"],
    ["verify", "{missing}"],
    ["admit", "--authority-key", "{missing}", "--manifest", "{missing}", "--peer",
     "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN", "--out", "{tmp}/cert.cbor"],
])
def test_a_missing_file_is_named(tmp_path, command):
    missing = str(tmp_path / "no-such-file.toml")
    out = _run(*(part.format(missing=missing, tmp=tmp_path) for part in command))
    _one_line(out, f"peerloom {command[0]}:", "no-such-file.toml")


def test_invalid_toml_is_named(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    _one_line(_run("node", "--config", str(bad)), str(bad), "invalid TOML")
    _one_line(_run("sim", str(bad)), str(bad), "invalid TOML")


def test_a_wrong_type_says_what_type(tmp_path):
    scenario = tmp_path / "s.toml"
    scenario.write_text('[roles]\nvalidators = "four"\n')
    _one_line(_run("sim", str(scenario), "--out", str(tmp_path / "o")), "roles.validators must be an integer",
              "'four'")
    node = make_fleet(tmp_path / "fleet", validators=1, trainers=0, quorum=1)[0]
    node.config_path.write_text(node.config_path.read_text() + "capacity = 1.5\n")
    _one_line(_run("node", "--config", str(node.config_path)), "capacity must be an integer, got 1.5")


def test_an_unknown_key_lists_the_valid_ones_and_suggests_the_closest(tmp_path):
    scenario = tmp_path / "s.toml"
    scenario.write_text("[manifest]\nwindw_s = 2.0\n")
    line = _one_line(_run("sim", str(scenario), "--out", str(tmp_path / "o")), "manifest.windw_s: unknown key",
                     "did you mean 'window_s'?")
    assert "valid keys:" in line and "min_updates" in line
    node = make_fleet(tmp_path / "fleet", validators=1, trainers=0, quorum=1)[0]
    node.config_path.write_text(node.config_path.read_text() + 'lisen = "127.0.0.1:1"\n')
    _one_line(_run("node", "--config", str(node.config_path)), "lisen: unknown key", "did you mean 'listen'?",
              "valid keys:")


def test_a_manifest_that_does_not_match_the_authority(tmp_path):
    nodes = make_fleet(tmp_path, validators=1, trainers=0, quorum=1)
    chain = tmp_path / "chain"
    chain.mkdir()
    (chain / "manifest.cbor").write_bytes((tmp_path / "manifest.cbor").read_bytes())
    other = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
    node = nodes[0]
    node.config_path.write_text(node.config_path.read_text().replace(node.config["authority"], other))
    _one_line(_run("node", "--config", str(node.config_path)), "manifest", "not a revision signed by", other)


def test_a_key_file_that_is_not_a_key(tmp_path):
    node = make_fleet(tmp_path, validators=1, trainers=0, quorum=1)[0]
    (node.directory / "key").write_text("not a key\n")
    _one_line(_run("node", "--config", str(node.config_path)), "key")


def test_debug_shows_the_traceback(tmp_path):
    scenario = tmp_path / "s.toml"
    scenario.write_text('[roles]\nvalidators = "four"\n')
    out = _run("--debug", "sim", str(scenario), "--out", str(tmp_path / "o"))
    assert out.returncode != 0 and "Traceback" in out.stderr and "ScenarioError" in out.stderr


def test_a_shipped_scenario_runs_by_name(tmp_path):
    out = _run("sim", "happy", "--seed", "1", "--out", str(tmp_path / "o"), "--no-plots", "--quiet")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("happy seed 1:")
    _one_line(_run("sim", "no-such-scenario"), "no-such-scenario", "shipped scenario", "happy")

"""`peerloom node` config validation gives clear errors; `peerloom keygen` never overwrites a key."""

import subprocess
import sys

import pytest

from peerloom.node import ConfigError, load_config


def test_missing_keys_are_named(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text('name = "x"\nroles = ["trainer"]\n')
    with pytest.raises(ConfigError, match="missing key, manifest, authority, store"):
        load_config(path)


def test_bad_toml_is_reported(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text("name = \n")
    with pytest.raises(ConfigError, match=r"node\.toml"):
        load_config(path)


def test_relative_paths_resolve_next_to_config(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text('name="n"\nroles=["trainer"]\nkey="k"\nmanifest="m"\nauthority="a"\nstore="s"\n')
    assert load_config(path)["store"] == tmp_path / "s"


def test_keygen_prints_peer_id_and_refuses_overwrite(tmp_path):
    key = tmp_path / "id.key"
    out = subprocess.run([sys.executable, "-m", "peerloom", "keygen", str(key)], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("12D3KooW")
    again = subprocess.run([sys.executable, "-m", "peerloom", "keygen", str(key)], capture_output=True, text=True)
    assert again.returncode != 0 and "refusing to overwrite" in again.stderr

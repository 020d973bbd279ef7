"""The node side of private data (spec/protocol.md §10): the config key ``data``, the private shard map and
the secret train seed of a private-data trainer's executor."""

from __future__ import annotations

import hashlib
import hmac
import subprocess
import sys

import attrs
import numpy as np
import pytest

from peerloom.adapters.compute import ComputeExecutor, private_seed
from peerloom.adapters.keys import save_identity
from peerloom.adapters.storage import ArtifactStore
from peerloom.backends.sharding import private_shards_for
from peerloom.core.objects import Revision
from peerloom.core.tasks import TrainTask
from peerloom.node import ConfigError, build_runtime, load_config
from tests.helpers import ident, make_revision

AUTHORITY = ident(200)


def test_the_private_seed_is_the_keyed_hmac_of_the_public_seed() -> None:
    a, b = ident(1), ident(2)
    expected = hmac.new(a.seed, b"peerloom/private-seed/v1" + (1234).to_bytes(8, "big"), hashlib.sha256).digest()
    assert private_seed(a.seed, 1234) == int.from_bytes(expected[:8], "big")
    assert private_seed(a.seed, 1234) == private_seed(ident(1).seed, 1234)  # one identity: the same seed
    assert private_seed(a.seed, 1234) != private_seed(b.seed, 1234)  # another identity: another seed
    assert private_seed(a.seed, 1234) != private_seed(a.seed, 1235)
    assert 0 <= private_seed(a.seed, 0) < 1 << 64 and private_seed(a.seed, 1234) != 1234


class _Recorder:
    """A workload that records what `train` was given and returns a zero delta."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], int]] = []

    def schema(self):
        return (("w", "float32", (2,)),)

    def train(self, params, indices, seed, **options):
        self.calls.append((list(indices), seed))
        return {"w": np.zeros(2, np.float32)}, {"train_loss": 0.5}

    def with_train_data(self, x, y):
        other = _Recorder()
        other.x, other.y = x, y
        return other


def _train(executor: ComputeExecutor, seed: int) -> tuple[list[int], int]:
    params, _ = executor.save({"w": np.ones(2, np.float32)})
    executor.run(TrainTask(params=params, shards=(0, 2), seed=seed))
    return executor.workload.calls[-1]


def test_a_private_executor_trains_its_shard_map_with_the_secret_seed(tmp_path) -> None:
    manifest = make_revision().manifest
    shards = private_shards_for(manifest.shards, 25, manifest.workload_seed)
    store = ArtifactStore(tmp_path, chunk_size=1 << 16)
    public = ComputeExecutor(store, manifest, _Recorder(), shards)
    private = ComputeExecutor(store, manifest, _Recorder(), shards, seed_key=ident(5).seed)
    assert _train(public, 77) == (shards[0] + shards[2], 77)
    assert _train(private, 77) == (shards[0] + shards[2], private_seed(ident(5).seed, 77))


def make_recorder(seed, num_shards):
    return _Recorder(), [[i] for i in range(num_shards)]


def _node(tmp_path, *, private_data=True, roles='["trainer"]', roster=(), extra="", npz=None,
          schema=(("w", "float32", (2,)),)):
    """A node config (trainer key ``k``) with ``data = "d.npz"`` under a manifest with `private_data`."""
    manifest = attrs.evolve(make_revision(schema=schema).manifest, private_data=private_data,
                            roster=tuple(sorted((t.peer_id, 1) for t in roster)))
    revision = Revision.verify(manifest.seal(AUTHORITY), AUTHORITY.peer_id)
    (tmp_path / "m").write_bytes(revision.envelope.to_bytes())
    save_identity(ident(7), tmp_path / "k")
    if npz is None:
        npz = {"x": np.zeros((30, 3), np.float32), "y": np.arange(30) % 10}
    if npz:
        np.savez(tmp_path / "d.npz", **npz)
    path = tmp_path / "node.toml"
    path.write_text(f'name="n"\nroles={roles}\nkey="k"\nmanifest="m"\nauthority="{AUTHORITY.peer_id.to_text()}"\n'
                    'store="s"\nworkload="tests.peerloom.test_private_node:make_recorder"\ndata="d.npz"\n' + extra)
    return path


def test_a_private_trainer_node_declares_private_data_and_trains_on_its_own(tmp_path) -> None:
    runtime = build_runtime(load_config(_node(tmp_path)))
    try:
        manifest = runtime.engine.manifest
        assert runtime.engine.config.private_data
        executor = runtime.executor
        assert executor.seed_key == ident(7).seed
        assert executor.shards == private_shards_for(manifest.shards, 30, manifest.workload_seed)
        assert executor.workload.x.shape == (30, 3) and executor.workload.y.dtype == np.int64
    finally:
        runtime.close()


@pytest.mark.parametrize(("setup", "message"), [
    ({"private_data": False}, "admits no private-data trainers (its private_data is off)"),
    ({"roles": '["validator"]'}, "data (private training data, spec/protocol.md §10) applies to nodes whose only "
                                 "role is trainer"),
    ({"roles": '["trainer", "reducer"]'}, "applies to nodes whose only role is trainer"),
    ({"roster": (ident(7),)}, "is in the manifest's genesis roster but not in its private list"),
    ({"extra": "[pool]\nranks = 2\n"}, "drop data or the pool"),
    ({"npz": {"x": np.zeros((3, 2), np.float32)}}, "must hold exactly the arrays x and y, holds x"),
    ({"npz": {"x": np.zeros((3, 2), np.float32), "y": np.zeros(3), }}, "y must be an integer array [n]"),
    ({"npz": {"x": np.zeros(3, np.int64), "y": np.zeros(3, np.int64)}}, "x must be a floating-point array"),
    ({"npz": {"x": np.zeros((3, 2), np.float32), "y": np.zeros(4, np.int64)}}, "the same number n >= 1"),
    ({"npz": False}, "d.npz: cannot read"),
])
def test_data_errors_name_the_file_and_the_key(tmp_path, setup, message) -> None:
    path = _node(tmp_path, **setup)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert message in str(caught.value) and str(caught.value).startswith(str(path))
    assert "\n" not in str(caught.value)


def test_data_that_does_not_fit_the_workload_is_named(tmp_path) -> None:
    from peerloom.backends.registry import build_workload

    digits = build_workload("digits-numpy", 0, 4)[0]
    path = _node(tmp_path, npz={"x": np.zeros((5, 40), np.float32), "y": np.zeros(5, np.int64)},
                 schema=digits.schema())
    path.write_text(path.read_text().replace('workload="tests.peerloom.test_private_node:make_recorder"',
                                             'workload="tests.peerloom.test_private_node:make_digits"'))
    with pytest.raises(ConfigError, match=r"data .*d\.npz: does not fit the workload NumpyWorkload: x must be "
                                          r"\[n, 64\]"):
        build_runtime(load_config(path))


def make_digits(seed, num_shards):
    from peerloom.backends.registry import build_workload

    workload, shards = build_workload("digits-numpy", seed, num_shards)
    return workload, shards


def test_the_cli_reports_a_data_error_in_one_line(tmp_path) -> None:
    path = _node(tmp_path, npz=False)
    out = subprocess.run([sys.executable, "-m", "peerloom", "node", "--config", str(path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "data " in lines[0] and "d.npz: cannot read" in lines[0], out.stderr

"""A cluster of real engines on a virtual clock (`peerloom.testing.Cluster`): a validator (or several), a
reducer and trainers on the digits MLP, connected; the builder of tests/core/test_engine_pair.py and of the
other tests that run whole windows."""

from pathlib import Path

import attrs
import pytest

from peerloom.backends.numpy.tensors import tensor_digest, to_safetensors
from peerloom.backends.registry import build_workload
from peerloom.core.objects import Manifest, Revision, make_artifact_ref
from peerloom.testing import Cluster
from tests.helpers import ident

SEED = 3
N_SHARDS = 4


@pytest.fixture(scope="module")
def workload():
    """The digits MLP on N_SHARDS shards under SEED: (workload, shards)."""
    return build_workload("digits-mlp", SEED, N_SHARDS)


def build(tmp_path: Path, workload, *, trainers=2, min_updates=1, window_s=5.0, validators=1, quorum=1,
          rule="mean", compute="numpy", engine_options=None, **manifest_fields):
    """A validator (or `validators` of them), a reducer and `trainers` trainers, connected, on `workload`'s
    (workload, shards); validators and the reducer screen and reduce with the `compute` backend, either one
    name for all or a list (validators, then the reducer)."""
    wl, shards = workload
    params = wl.initial_params(SEED)
    genesis = to_safetensors(params)
    vals = [ident(1)] + [ident(30 + i) for i in range(validators - 1)]
    reducer = ident(2)
    tr = [ident(10 + i) for i in range(trainers)]
    authority = ident(99)
    manifest = Manifest(
        experiment="pair", workload="digits-mlp", workload_seed=SEED, schema=_schema(params),
        shards=tuple(len(s) for s in shards), validators=tuple(v.peer_id for v in vals), quorum=quorum,
        window_s=window_s,
        min_updates=min_updates, max_capacity=4, aggregation=rule,
        **dict({"outer_optimizer": "fedavg", "outer_lr": 1.0}, **manifest_fields),
        chunk_size=16 * 1024, genesis_params=make_artifact_ref(genesis, 16 * 1024),
        genesis_params_digest=tensor_digest(params), roster=tuple(sorted((t.peer_id, 1) for t in tr)))
    revision = Revision.verify(manifest.seal(authority), authority.peer_id)
    cluster = Cluster(revision, seed=SEED, engine_options=engine_options)
    names = ["validator"] + [f"v{i}" for i in range(1, validators)]
    computes = [compute] * (validators + 1) if isinstance(compute, str) else list(compute)
    for name, identity, backend in zip(names, vals, computes[:-1], strict=True):
        cluster.add_node(name, identity, {"validator"}, tmp_path / name, wl, shards, compute=backend).store.put(genesis)
    reducer_node = cluster.add_node("reducer", reducer, {"reducer"}, tmp_path / "r", wl, shards, compute=computes[-1])
    reducer_node.store.put(genesis)
    for i, t in enumerate(tr):
        cluster.add_node(f"t{i}", t, {"trainer"}, tmp_path / f"t{i}", wl, shards)
    cluster.start()
    for i in range(trainers):
        for name in names:
            cluster.connect(f"t{i}", name)
        cluster.connect(f"t{i}", "reducer")
    for j, name in enumerate(names):
        cluster.connect("reducer", name)
        for other in names[j + 1:]:
            cluster.connect(name, other)
    return cluster


def build_until(window: int, tmp_path: Path, workload, *, max_time: float = 60.0, **options):
    """`build(tmp_path, workload, **options)`, run until the validator certified `window` (asserted, within
    `max_time` virtual seconds)."""
    cluster = build(tmp_path, workload, **options)
    assert cluster.run_until(lambda c: head_window(c) >= window, max_time=max_time)
    return cluster


def first_head_without(cluster, trainer: str = "t0"):
    """The validator's first two certified (head, certificate) pairs, `trainer`'s peer id, and the first head
    with that peer taken out of its roster (nothing records why: a chain check must ask)."""
    chain = [(h, c) for _, h, c in cluster.nodes["validator"].heads][:2]
    peer = cluster.nodes[trainer].identity.peer_id
    first = chain[0][0]
    return chain, peer, attrs.evolve(first, roster=tuple(x for x in first.roster if x[0] != peer))


def _schema(params):
    from peerloom.backends.numpy.tensors import schema_of
    return schema_of(params)


def head_window(cluster, name="validator"):
    """The window of `name`'s latest certified head."""
    return cluster.nodes[name].engine.head.window

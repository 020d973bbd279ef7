"""Artifact retention (spec/protocol.md §8.1, `EngineConfig.keep_windows`): at each head the engine drops the
artifacts it first held more than `keep_windows` heads ago, never the current head's params and optimizer
state, and the host deletes them, so a long run's disk stays at a few windows' worth."""

from __future__ import annotations

import attrs

from peerloom.core import effects as fx
from tests.engine_cluster import build, head_window
from tests.engine_cluster import workload as workload  # the fixture


def _stored_files(cluster, name):
    return {p.name for p in (cluster.nodes[name].store.root / "artifacts").iterdir() if not p.name.startswith(".")
            and not p.suffix}


def test_old_artifacts_are_dropped_and_deleted_and_the_head_is_kept(tmp_path, workload):
    cluster = build(tmp_path, workload, engine_options={"keep_windows": 1}, outer_optimizer="diloco",
                    outer_lr=0.7)
    assert cluster.run_until(lambda c: all(head_window(c, n) >= 6 for n in c.nodes), max_time=120.0)
    for name, node in cluster.nodes.items():
        engine = node.engine
        head = engine.head
        if name in ("validator", "reducer"):  # a trainer fetches a head's params when it next trains
            assert engine.is_stored(head.params.digest), name
            assert head.outer_state is not None and engine.is_stored(head.outer_state.digest), name
        files = _stored_files(cluster, name)
        # what the engine still holds is on disk, and nothing else is: deleted as dropped
        assert files == {d[2:].hex() for d in engine.fetching.stored}, name
        dropped = [f for t, n, e, f in cluster.logs if n == name and e == "artifacts-dropped"]
        assert dropped and sum(f["count"] for f in dropped) > 0, name
    # A validator that kept everything would hold, by window 6, genesis plus every window's params, state
    # and updates; with keep_windows = 1 it holds at most two windows' worth.
    v = cluster.nodes["validator"].engine
    per_window = 2 + len(v.head.cohort)  # params, optimizer state, updates
    assert len(v.fetching.stored) <= 2 * per_window + 2
    old = [h for _, h, _ in cluster.nodes["validator"].heads if h.window <= v.head.window - 3]
    assert old and not any(v.is_stored(h.params.digest) for h in old)


def test_keep_windows_zero_keeps_every_artifact(tmp_path, workload):
    cluster = build(tmp_path, workload)
    assert cluster.run_until(lambda c: all(head_window(c, n) >= 4 for n in c.nodes), max_time=120.0)
    v = cluster.nodes["validator"]
    assert all(v.engine.is_stored(h.params.digest) for _, h, _ in v.heads)
    assert not [1 for _, _, e, _ in cluster.logs if e == "artifacts-dropped"]


def test_the_current_heads_artifacts_survive_any_retention(tmp_path, workload):
    """Even when a head's params were first held long ago (a head that kept its parent's params after a
    skipped window), the current head's artifacts are never dropped."""
    cluster = build(tmp_path, workload, engine_options={"keep_windows": 1})
    engine = cluster.nodes["validator"].engine
    genesis = engine.head.params
    assert engine.is_stored(genesis.digest)
    engine.fetching.stored_at[genesis.digest] = -100  # first held "long ago"
    engine.head = attrs.evolve(engine.head, window=50)  # stands for a run of skipped windows
    engine._retire_artifacts()
    assert engine.is_stored(genesis.digest)
    drops = []
    while (effect := engine.next_effect()) is not None:
        if isinstance(effect, fx.DropArtifacts):
            drops.extend(effect.digests)
    assert genesis.digest not in drops

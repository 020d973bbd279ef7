"""Which fetched artifacts are committed durably (core.effects.CommitArtifact.durable, spec/design.md §6
Storage): an update's delta, which the node can fetch again and neither signs nor persists, need not be;
heads' params and everything else must be."""

from peerloom.sim import kernel
from tests.engine_cluster import build, head_window, workload  # noqa: F401  (the fixture)


def test_only_fetched_update_deltas_are_committed_without_fsync(tmp_path, workload, monkeypatch):  # noqa: F811
    commits: list[tuple[str, bytes, bool]] = []
    original = kernel._NodeHost.commit_artifact

    def recording(host, ref, durable, done):
        commits.append((host.node.name, ref.digest, durable))
        original(host, ref, durable, done)

    monkeypatch.setattr(kernel._NodeHost, "commit_artifact", recording)
    cluster = build(tmp_path, workload)
    assert cluster.run_until(lambda c: all(head_window(c, n) >= 2 for n in c.nodes), max_time=60.0)
    trainers = [n for n in cluster.nodes if n.startswith("t")]
    fetched_by_trainers = {d for name, d, _ in commits if name in trainers}
    # a trainer's own deltas: what it stored without fetching it
    deltas = {r.digest for t in trainers for r in cluster.nodes[t].store.refs()} - fetched_by_trainers
    assert deltas
    by_validators = [(d, durable) for name, d, durable in commits if name in ("validator", "reducer")]
    assert {d for d, _ in by_validators} >= deltas  # every delta was fetched by the validator and reducer
    assert all(not durable for d, durable in by_validators if d in deltas)
    # the heads' params the trainers fetch, and anything else, durably
    assert fetched_by_trainers and all(durable for name, _, durable in commits if name in trainers)
    assert all(durable for d, durable in by_validators if d not in deltas)

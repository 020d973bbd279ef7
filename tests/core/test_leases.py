"""Lease expiry and next-ranked claims on whole engines (spec/protocol.md §4): a leaseholder that never
reports costs its shards nothing beyond `lease_s` - the trainer ranked second for each of them claims it;
sample weights come from lease sizes only; one update per lease."""

import pytest

from peerloom.backends.registry import build_workload
from peerloom.core.leases import claims_of, lease_weight, leases_of
from tests.engine_cluster import N_SHARDS, SEED, build, build_until, head_window


@pytest.fixture(scope="module")
def workload():
    return build_workload("digits-mlp", SEED, N_SHARDS)


def announced(cluster, event):
    return {bytes.fromhex(f["update"]): (n, f) for _, n, e, f in cluster.logs if e == event}


def test_silent_leaseholder_is_replaced_by_next_ranked_claims(tmp_path, workload):
    cluster = build(tmp_path, workload, trainers=3, window_s=6.0, lease_s=1.5)
    m = cluster.revision.manifest
    genesis = cluster.revision.genesis()
    leases = leases_of(genesis, m)
    name = next(n for n in ("t0", "t1", "t2") if cluster.nodes[n].identity.peer_id in leases)
    silent = cluster.nodes[name].identity.peer_id
    cluster.crash(name)  # holds a lease for window 1 and never reports
    assert any(holder == silent for by in claims_of(genesis, m).values() for holder in by)
    assert cluster.run_until(lambda c: head_window(c) >= 1, max_time=30.0)
    head = cluster.nodes["validator"].heads[0][1]
    claims = announced(cluster, "announce-claim")
    in_cohort = [claims[u] for u in head.cohort if u in claims]
    assert in_cohort and all(f["holder"] == str(silent) for _, f in in_cohort)
    # Every shard of the silent lease was claimed by the trainer ranked second for it, so the window
    # closed as soon as everything was in, before its deadline.
    claimed = {s for peer, by in claims_of(genesis, m).items() for holder, shards in by.items()
               if holder == silent for s in shards}
    assert claimed == set(leases_of(genesis, m)[silent])
    assert not [e for t, n, e, f in cluster.logs if n == "validator" and e == "window-deadline" and t < 6.0]
    assert not head.skipped and len(head.cohort) == len(leases_of(genesis, m)) - 1 + len(in_cohort)
    assert sum(lease_weight(m, s) for s in leases_of(genesis, m).values()) == sum(m.shards)


def test_claims_lose_to_a_leaseholder_that_reports(tmp_path, workload):
    cluster = build_until(2, tmp_path, workload, trainers=3, window_s=6.0, lease_s=1.5, max_time=40.0)
    genesis = cluster.revision.genesis()
    head = cluster.nodes["validator"].heads[0][1]
    own = announced(cluster, "announce")
    assert len(head.cohort) == len(leases_of(genesis, cluster.revision.manifest))
    assert all(u in own for u in head.cohort)  # one update per lease: the holder's own

"""Prometheus metrics fed from engine effects: windows, updates by reason, votes, bytes per peer, head lag."""

import attrs
from prometheus_client import generate_latest

from peerloom.adapters.metrics import NodeMetrics
from tests.helpers import make_revision


def _value(metrics, name, labels=None):
    return metrics.registry.get_sample_value(name, labels or {})


def test_heads_and_rejections_drive_the_counters():
    stats = {"votes_prevote": 2, "votes_precommit": 1, "votes_cast": 3}  # the engine's counters (core/voting.py)
    metrics = NodeMetrics(peer_bytes=lambda: [("12D3KooWpeer", 100, 250)], engine_stats=lambda: stats)
    genesis = make_revision().genesis()

    certified = attrs.evolve(genesis, window=4, skipped=False, cohort=(b"u1", b"u2", b"u3"))
    metrics.on_head(certified)
    metrics.on_head(attrs.evolve(genesis, window=5, skipped=True))
    metrics.on_rejected("screen-norm-bound")
    metrics.on_rejected("bad-signature")
    assert _value(metrics, "peerloom_windows_total", {"outcome": "certified"}) == 1
    assert _value(metrics, "peerloom_windows_total", {"outcome": "skipped"}) == 1
    assert _value(metrics, "peerloom_updates_accepted_total") == 3
    assert _value(metrics, "peerloom_updates_rejected_total", {"reason": "screen-norm-bound"}) == 1
    assert _value(metrics, "peerloom_updates_rejected_total", {"reason": "bad-signature"}) is None
    assert _value(metrics, "peerloom_rejections_total", {"reason": "bad-signature"}) == 1
    assert _value(metrics, "peerloom_votes_total", {"step": "prevote"}) == 2
    assert _value(metrics, "peerloom_votes_total", {"step": "precommit"}) == 1
    assert _value(metrics, "peerloom_head_window") == 5
    assert _value(metrics, "peerloom_peer_bytes_total", {"peer": "12D3KooWpeer", "direction": "received"}) == 250
    assert _value(metrics, "peerloom_peers") == 1
    assert 0 <= _value(metrics, "peerloom_head_age_seconds") < 60
    metrics.note_peer_head(9, own_window=5)
    assert _value(metrics, "peerloom_head_lag_windows") == 4
    text = generate_latest(metrics.registry).decode()
    assert "peerloom_votes_total" in text and "peerloom_peer_bytes_total" in text


def test_two_nodes_in_one_process_have_separate_registries():
    a, b = NodeMetrics(engine_stats=lambda: {"votes_prevote": 1}), NodeMetrics()
    assert _value(a, "peerloom_votes_total", {"step": "prevote"}) == 1
    assert _value(b, "peerloom_votes_total", {"step": "prevote"}) is None

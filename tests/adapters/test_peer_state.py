"""Bounded per-identity state and rate-limited log lines (spec/transport.md §14)."""

import random

from peerloom.adapters.addressbook import AddressBook
from peerloom.adapters.database import Database
from peerloom.adapters.logs import LineLimiter
from peerloom.adapters.metrics import NodeMetrics
from peerloom.adapters.peerstate import BoundedLru, release_freed_memory
from peerloom.core.identity import Identity


def ident(n: int) -> Identity:
    return Identity(bytes([n % 256, n // 256]) + bytes(30))


def test_bounded_lru_evicts_the_least_recently_used_first():
    evicted = []
    lru = BoundedLru(3, on_evict=lambda k, v: evicted.append((k, v)))
    for key in "abc":
        lru[key] = key.upper()
    lru.touch("a")  # b is now the least recent
    lru["d"] = "D"
    assert evicted == [("b", "B")]
    assert list(lru) == ["c", "a", "d"] and len(lru) == 3
    lru["c"] = "C2"  # setting an existing key refreshes it, evicts nothing
    assert evicted == [("b", "B")] and list(lru) == ["a", "d", "c"]


def test_line_limiter_allows_a_burst_per_kind_then_summarises_once():
    limiter = LineLimiter(burst=2, interval_s=10.0)
    assert [limiter.allow("reject/x", 0.0) for _ in range(5)] == [True, True, False, False, False]
    assert limiter.allow("reject/y", 1.0)  # another kind has its own budget
    assert limiter.summaries(5.0) == []  # the interval has not ended
    assert limiter.summaries(10.0) == [("reject/x", 3)]
    assert limiter.summaries(20.0) == []  # each count once; quiet kinds are forgotten
    assert limiter.allow("reject/x", 21.0)


def test_line_limiter_keeps_counts_across_a_new_interval_and_bounds_its_kinds():
    limiter = LineLimiter(burst=1, interval_s=1.0, max_kinds=2)
    assert limiter.allow("a", 0.0) and not limiter.allow("a", 0.5)
    assert limiter.allow("a", 1.5)  # a new interval: the old count is kept for the summary
    assert limiter.allow("b", 1.5)
    assert limiter.allow("c", 1.5) and not limiter.allow("d", 1.5)  # "c" and "d" count as "other"
    assert dict(limiter.summaries(3.0)) == {"a": 1, "other": 1}


def test_a_flood_of_fresh_identities_leaves_bounded_address_book_state():
    book = AddressBook(random.Random(0), max_peer_entries=100, ban_after_failures=2)
    for n in range(1000):
        book.connection_failed(ident(n).peer_id, now=float(n))
    assert len(book._peer_failures) == 100
    assert book.connection_failed(ident(999).peer_id, now=1000.0)  # the most recent are the ones kept: banned
    for n in range(1000, 1500):
        book.ban_peer(ident(n).peer_id, now=float(n), seconds=50.0)
    assert len(book._banned_peers) <= 100
    assert book.is_banned(ident(1499).peer_id, now=1499.0)  # the latest bans are kept


def test_peer_bytes_series_are_what_the_runtime_gives_and_the_peers_gauge_counts_connections():
    metrics = NodeMetrics(peer_bytes=lambda: [("12D3KooWa", 1, 2), ("other", 10, 20)], connected=lambda: 7)
    from prometheus_client import generate_latest

    text = generate_latest(metrics.registry).decode()
    assert 'peerloom_peer_bytes_total{direction="sent",peer="other"} 10.0' in text
    assert "peerloom_peers 7.0" in text


def test_batched_database_writes(tmp_path):
    db = Database(tmp_path / "node.db")
    db.note_peers([("p1", "127.0.0.1:1", None, 5.0), ("p2", None, "trainer", 6.0)])
    db.note_peers([("p1", None, None, 4.0)])  # an older contact does not move last_seen back
    assert sorted(db.peers()) == [("p1", "127.0.0.1:1", None, 5.0), ("p2", None, "trainer", 6.0)]
    db.charge_many([("p1", "bad", 2), ("other", "bad", 3)])
    db.charge_many([("other", "bad", 4)])
    assert db.reputation() == {"p1": {"bad": 2}, "other": {"bad": 7}}
    db.close()


def test_release_freed_memory_is_safe_to_call():
    assert release_freed_memory() in (True, False)

"""Connection limits as one concept (adapters/limits.py; spec/transport.md §13). Times are chosen by hand."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from peerloom.adapters.limits import REFUSALS, ConnectionLimiter, Limits, LimitsCollector, Slot, raise_nofile

A, B = "192.0.2.1", "192.0.2.2"


def limiter(**kwargs) -> ConnectionLimiter:
    return ConnectionLimiter(Limits(**kwargs), nofile=1 << 16)


def test_pending_cap_per_address_evicts_the_oldest_idle_socket_first() -> None:
    lim = limiter(max_pending_per_ip=2)
    evicted: list[int] = []
    first, second = (lim.open(A, now=0.0, evict=lambda i=i: evicted.append(i)) for i in range(2))
    assert isinstance(first, Slot) and isinstance(second, Slot)
    third = lim.open(A, now=0.0, evict=lambda: evicted.append(2))
    assert isinstance(third, Slot) and evicted == [0] and lim.refusals["idle-evicted"] == 1
    assert lim.counts()["pending"] == 2
    lim.close(first)  # the evicted socket's own close later is a no-op
    assert lim.counts()["pending"] == 2 and lim.sockets == 2
    assert isinstance(lim.open(B, now=0.0), Slot)  # another address has its own share


def test_started_sockets_are_never_evicted_so_the_newcomer_is_refused() -> None:
    lim = limiter(max_pending_per_ip=2)
    slots = [lim.open(A, now=0.0, evict=lambda: None) for _ in range(2)]
    for slot in slots:
        assert lim.started(slot, now=0.0) is None
    assert lim.open(A, now=0.0, evict=lambda: None) == "pending-cap-ip"
    assert lim.refusals == {"pending-cap-ip": 1}


def test_total_caps_and_the_descriptor_budget() -> None:
    lim = limiter(max_pending=2, max_pending_per_ip=2, max_inbound=3, max_inbound_per_ip=3)
    a, b = lim.open(A, now=0.0), lim.open(B, now=0.0)
    assert lim.open("192.0.2.3", now=0.0) == "pending-cap"  # no evict callback: nothing to make room
    for slot in (a, b):
        lim.started(slot, now=0.0)
        assert lim.established(slot, known=True) is None
    assert isinstance(lim.open(A, now=0.0), Slot)
    assert lim.open(B, now=0.0) == "inbound-cap"
    small = ConnectionLimiter(Limits(fd_reserve=8, max_peers=4, max_peers_per_ip=4, max_strangers=4), nofile=14)
    assert small.fd_budget == 2
    assert [isinstance(small.open(ip, now=0.0), Slot) for ip in (A, B)] == [True, True]
    assert small.open("192.0.2.3", now=0.0) == "fd-budget"


def test_handshake_bucket_per_address() -> None:
    lim = limiter(handshake_rate=1.0, handshake_burst=2)

    def handshake(ip: str, now: float) -> str | None:
        slot = lim.open(ip, now=now)
        assert isinstance(slot, Slot)
        reason = lim.started(slot, now=now)
        lim.close(slot)
        return reason

    assert [handshake(A, 0.0) for _ in range(3)] == [None, None, "handshake-rate"]
    assert handshake(B, 0.0) is None  # one address's flood does not spend another's tokens
    assert handshake(A, 1.0) is None  # refilled at `handshake_rate` per second
    assert lim.sockets == 0


def test_strangers_cannot_take_the_known_peers_slots() -> None:
    lim = limiter(max_strangers=2)
    strangers = [lim.open(A, now=0.0) for _ in range(3)]
    assert [lim.established(s, known=False) for s in strangers] == [None, None, "stranger-cap"]
    known = lim.open(A, now=0.0)
    assert lim.established(known, known=True) is None  # a known peer still gets in
    lim.close(strangers[0])
    again = lim.open(A, now=0.0)
    assert lim.established(again, known=False) is None  # a stranger slot was freed
    assert lim.counts()["strangers"] == 2


def test_edge_sockets_have_their_own_caps_and_share_the_budget() -> None:
    lim = limiter(max_edge_connections=2, max_edge_connections_per_ip=1)
    assert isinstance(lim.open(A, now=0.0, scope="edge"), Slot)
    assert lim.open(A, now=0.0, scope="edge") == "edge-cap-ip"
    assert isinstance(lim.open(B, now=0.0, scope="edge"), Slot)
    assert lim.open("192.0.2.3", now=0.0, scope="edge") == "edge-cap"
    assert lim.counts()["edge"] == 2 and lim.counts()["pending"] == 0


def test_limits_validate_and_the_config_table_names_the_key() -> None:
    with pytest.raises(ValueError, match="max_strangers"):
        Limits(max_strangers=65, max_peers=64)
    with pytest.raises(ValueError, match="positive"):
        Limits(handshake_rate=0.0)
    from peerloom.node import ConfigError, limits_settings

    with pytest.raises(ConfigError, match="did you mean 'max_pending'"):
        limits_settings({"limits": {"max_pendng": 3}})
    with pytest.raises(ConfigError, match="must be an integer"):
        limits_settings({"limits": {"max_pending": 2.5}})
    with pytest.raises(ConfigError, match="not a peer id"):
        limits_settings({"limits": {"protected_peers": ["nope"]}})
    assert limits_settings({"limits": {"handshake_rate": 5, "max_pending": 16}}) == \
        Limits(handshake_rate=5.0, max_pending=16)
    assert limits_settings({}) == Limits()


def test_metrics_report_every_limit_and_the_refusals() -> None:
    lim = limiter(max_pending_per_ip=1)
    lim.open(A, now=0.0)
    lim.open(A, now=0.0)
    registry = CollectorRegistry()
    registry.register(LimitsCollector(lim))
    text = generate_latest(registry).decode()
    assert 'peerloom_limit{name="max_pending_per_ip"} 1.0' in text
    assert 'peerloom_limit{name="fd_budget"}' in text
    assert 'peerloom_limit_refusals_total{reason="pending-cap-ip"} 1.0' in text
    assert 'peerloom_limited_sockets{state="pending"} 1.0' in text
    assert "peerloom_open_fds " in text
    assert set(REFUSALS) >= {"pending-cap-ip", "handshake-rate", "stranger-cap"}


def test_raise_nofile_never_lowers_nor_passes_the_hard_limit() -> None:
    import resource

    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft, hard = raise_nofile(16)  # lower than now: unchanged
    assert (soft, hard) == before
    soft, hard = raise_nofile(1 << 40)
    assert hard == before[1] and (hard == resource.RLIM_INFINITY or soft <= hard) and soft >= before[0]
    resource.setrlimit(resource.RLIMIT_NOFILE, before)

"""AddressBook: dial backoff with jitter, connection limits, bans (sans-IO: explicit `now`, seeded rng)."""

from __future__ import annotations

import random

import pytest

from peerloom.adapters.addressbook import AddressBook
from peerloom.core.identity import Identity

A = "/ip4/127.0.0.1/tcp/4001"
B = "/ip4/127.0.0.1/tcp/4002"
C = "/ip4/127.0.0.2/tcp/4001"
PEER_A = Identity(bytes([1]) * 32).peer_id
PEER_B = Identity(bytes([2]) * 32).peer_id


def book(**kwargs) -> AddressBook:
    return AddressBook(random.Random(7), **kwargs)


def test_backoff_doubles_up_to_the_cap_within_the_jitter_band() -> None:
    b = book(base_backoff_s=1.0, max_backoff_s=16.0, jitter=0.5)
    b.add(A, now=0.0)
    now = 0.0
    for n in range(1, 9):
        assert b.due(now) == [A]
        b.dial_started(A, now=now)
        retry = b.dial_failed(A, now=now)
        cap = min(16.0, 2.0 ** (n - 1))
        assert now + cap * 0.5 <= retry <= now + cap
        assert b.due(retry - 1e-9) == [] and b.next_due(now) == retry
        now = retry


def test_success_resets_the_backoff() -> None:
    b = book(base_backoff_s=1.0, max_backoff_s=100.0, jitter=0.0)
    b.add(A, now=0.0)
    for now in (0.0, 1.0, 3.0):
        b.dial_started(A, now=now)
        b.dial_failed(A, now=now)
    assert b.next_due(3.0) == 7.0  # fourth failure pending: 4 s
    b.dial_started(A, now=7.0)
    assert b.connected(A, PEER_A, now=7.0)
    assert b.due(100.0) == []  # connected: nothing to dial
    b.disconnected(A, now=10.0)
    assert b.next_due(10.0) == 11.0  # back to the base delay
    b.dial_started(A, now=11.0)
    assert b.dial_failed(A, now=11.0) == 12.0


def test_jitter_is_seeded_and_desynchronizes_nodes() -> None:
    def retries(seed: int) -> list[float]:
        b = AddressBook(random.Random(seed), base_backoff_s=1.0, max_backoff_s=60.0, jitter=1.0)
        b.add(A, now=0.0)
        out = []
        for _ in range(5):
            b.dial_started(A, now=0.0)
            out.append(b.dial_failed(A, now=0.0))
        return out

    assert retries(1) == retries(1)  # same seed, same schedule
    assert retries(1) != retries(2)


def test_handshake_failures_ban_the_address_and_connect_failures_do_not() -> None:
    b = book(ban_after_failures=3, ban_s=100.0, base_backoff_s=0.1, max_backoff_s=0.1, jitter=0.0)
    b.add(A, now=0.0)
    b.add(B, now=0.0)
    now = 0.0
    for _ in range(10):  # a closed port: keeps retrying, never banned
        b.dial_started(B, now=now)
        b.dial_failed(B, now=now, handshake=False)
        now += 1.0
    assert B in b.due(now)
    for i in range(3):  # someone else answers at A, three times
        b.dial_started(A, now=now)
        retry = b.dial_failed(A, now=now, handshake=True)
        if i < 2:
            assert retry == pytest.approx(now + 0.1)
        now += 1.0
    assert retry == pytest.approx(now - 1.0 + 100.0)  # banned for ban_s
    assert A not in b.due(now + 50.0)
    assert A in b.due(now + 100.0)


def test_banned_peer_is_refused_wherever_it_is() -> None:
    b = book()
    b.add(A, PEER_A, now=0.0)
    b.add(C, now=0.0)
    b.ban_peer(PEER_A, now=0.0, seconds=30.0)
    assert b.is_banned(PEER_A, now=29.0) and not b.is_banned(PEER_A, now=30.0)
    assert b.due(1.0) == [C]  # A is known to be PEER_A
    b.dial_started(C, now=1.0)
    assert not b.connected(C, PEER_A, now=1.0)  # PEER_A turned up at C: hang up
    assert b.connections == 0
    assert b.next_due(2.0) >= 2.0


def test_connection_limits_total_and_per_ip() -> None:
    b = book(max_connections=3, max_connections_per_ip=2)
    addresses = [f"/ip4/127.0.0.1/tcp/{5000 + i}" for i in range(3)] + ["/ip4/127.0.0.2/tcp/5000"]
    for a in addresses:
        b.add(a, now=0.0)
    due = b.due(0.0)
    assert due == [addresses[0], addresses[1], addresses[3]]  # per-IP cap counts dials in progress too
    for i, a in enumerate(due):
        b.dial_started(a, now=0.0)
        assert b.connected(a, Identity(bytes([10 + i]) * 32).peer_id, now=0.0)
    assert b.connections == 3
    assert b.due(0.0) == []  # total cap
    assert not b.admit_inbound("127.0.0.3", now=0.0) and not b.inbound_opened("127.0.0.3")
    b.disconnected(due[0], now=1.0)
    assert b.admit_inbound("127.0.0.3", now=1.0) and b.inbound_opened("127.0.0.3")
    assert b.connections == 3
    b.inbound_closed("127.0.0.3")
    assert b.connections == 2


def test_dials_in_progress_count_toward_the_limits_across_calls() -> None:
    b = book(max_connections=10, max_connections_per_ip=2)
    addresses = [f"/ip4/127.0.0.1/tcp/{5000 + i}" for i in range(4)]
    for a in addresses:
        b.add(a, now=0.0)
    first = b.due(0.0)[0]
    b.dial_started(first, now=0.0)
    assert b.due(0.0) == [addresses[1]]  # one dial in flight + one more = the per-IP cap
    b.dial_failed(first, now=0.0)
    assert b.due(0.0) == addresses[1:3]


def test_inbound_ip_bans_are_opt_in() -> None:
    off, on = book(ban_after_failures=2, ban_s=10.0), book(ban_after_failures=2, ban_s=10.0, ban_inbound_ips=True)
    for b in (off, on):
        b.inbound_handshake_failed("10.0.0.9", now=0.0)
        b.inbound_handshake_failed("10.0.0.9", now=1.0)
    assert off.admit_inbound("10.0.0.9", now=2.0)
    assert not on.admit_inbound("10.0.0.9", now=2.0) and on.admit_inbound("10.0.0.9", now=11.0)
    on.inbound_handshake_failed("10.0.0.8", now=0.0)
    on.inbound_handshake_ok("10.0.0.8")
    on.inbound_handshake_failed("10.0.0.8", now=1.0)
    assert on.admit_inbound("10.0.0.8", now=2.0)  # not two in a row


def test_misuse_is_a_value_error() -> None:
    b = book()
    with pytest.raises(ValueError):
        b.dial_started(A, now=0.0)  # unknown address
    b.add(A, now=0.0)
    b.dial_started(A, now=0.0)
    with pytest.raises(ValueError):
        b.dial_started(A, now=0.0)
    with pytest.raises(ValueError):
        AddressBook(random.Random(0), base_backoff_s=0)


def test_addresses_of_a_peer() -> None:
    b = book()
    b.add(B, PEER_A, now=0.0)
    b.add(A, now=0.0)
    b.add(A, PEER_A, now=0.0)
    b.add(C, PEER_B, now=0.0)
    assert b.addresses(PEER_A) == [A, B]
    assert b.peer_of(C) == PEER_B


def test_real_dial_failures_classify_as_the_book_expects() -> None:
    """peer-mismatch (someone else answers) counts toward a ban; a closed port does not."""
    import functools

    import trio

    from peerloom.adapters.addressbook import HANDSHAKE_FAILURES
    from peerloom.adapters.tcp import connect, serve
    from peerloom.adapters.transport import TransportError

    reasons = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(functools.partial(serve, "127.0.0.1", 0, Identity(bytes([7]) * 32),
                                                         lambda conn: trio.sleep(0)))
            for target, expected in ((port, PEER_A), (1, None)):  # port 1: nothing listens there
                try:
                    await connect("127.0.0.1", target, Identity(bytes([8]) * 32), expected_peer=expected)
                except TransportError as exc:
                    reasons.append(exc.reason)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert reasons == ["peer-mismatch", "connect-failed"]
    assert reasons[0] in HANDSHAKE_FAILURES and reasons[1] not in HANDSHAKE_FAILURES


def test_learned_addresses_are_forgotten_after_repeated_failures_but_bootstrap_ones_never():
    book = AddressBook(random.Random(0), forget_after_failures=3)
    tip, seed = "/ip4/127.0.0.1/tcp/7001", "/ip4/127.0.0.1/tcp/7000"
    book.add(seed, now=0.0)
    assert book.add(tip, now=0.0, learned=True)
    now = 0.0
    for _ in range(3):
        for address in (tip, seed):
            if address in book:
                book.dial_started(address, now=now)
                book.dial_failed(address, now=now)
        now += 1000.0
    assert tip not in book and seed in book  # the stale tip is gone; the configured seed stays
    assert book.add(tip, now=now, learned=True) and tip in book  # a peer may tell us again
    # configuring a learned address makes it permanent
    book.add(tip, now=now)
    for _ in range(5):
        book.dial_started(tip, now=now)
        book.dial_failed(tip, now=now)
        now += 1000.0
    assert tip in book


def test_learned_addresses_are_capped():
    book = AddressBook(random.Random(0), max_learned=2)
    assert book.add("/ip4/127.0.0.1/tcp/1", now=0.0, learned=True)
    assert book.add("/ip4/127.0.0.1/tcp/2", now=0.0, learned=True)
    assert not book.add("/ip4/127.0.0.1/tcp/3", now=0.0, learned=True)  # a flood of tips cannot grow the book
    assert "/ip4/127.0.0.1/tcp/3" not in book
    assert book.add("/ip4/127.0.0.1/tcp/4", now=0.0)  # configured addresses are not capped

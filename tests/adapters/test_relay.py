"""Relays (adapters/relay.py, spec/transport.md §12): circuit addresses, a relayed connection behaving like
a direct one, the Noise handshake running end to end (a relay that tampers, drops or reroutes causes a clean,
typed failure and the dialer reaches the peer through another relay), the limits' typed refusals, and
hostile control input never ending the relay. Everything runs in one trio run over a `MemoryNetwork`."""

from __future__ import annotations

import functools
import random
from collections.abc import Awaitable, Callable

import pytest
import trio

from peerloom.adapters.memory import MemoryNetwork, MemoryNetworkTransport
from peerloom.adapters.relay import (
    MAX_REQUEST_BYTES,
    RelayLimits,
    RelayRefused,
    RelayServer,
    RelayTransport,
    decode_message,
    encode_message,
)
from peerloom.adapters.tcp import SecureConnection
from peerloom.adapters.transport import (
    LANE_BULK,
    LANE_CONTROL,
    PEER_FAULTS,
    Connection,
    ConnectionClosed,
    Transport,
    TransportError,
    address_host,
    canonical_address,
)
from peerloom.core.encoding import encode
from peerloom.core.errors import DecodeError
from peerloom.core.identity import Identity
from peerloom.core.messages import parse_peer_address
from peerloom.node import ConfigError, relay_settings
from tests.helpers import CLIENT, OTHER, SERVER, StalledBulk, echo

# SERVER (tests/helpers.py) is the peer behind a NAT: reachable only through a relay.
RELAY = Identity(bytes([4]) * 32)
RELAY_2 = Identity(bytes([5]) * 32)
SERVER_ID = SERVER.peer_id.to_text()


class Net:
    """A memory network with relays on ``memory://NAME`` and peers reserving at them."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.network = MemoryNetwork()
        self.relays: dict[str, RelayServer] = {}

    def client(self) -> RelayTransport:
        return RelayTransport([MemoryNetworkTransport(self.network)])

    async def relay(self, name: str, server: RelayServer | None = None, identity: Identity = RELAY) -> RelayServer:
        server = server or RelayServer()
        await self.nursery.start(server.serve, MemoryNetworkTransport(self.network), f"memory://{name}", identity)
        self.relays[name] = server
        return server

    async def reserve(self, name: str, identity: Identity, handler: Callable[[SecureConnection], Awaitable[object]],
                      *, max_message_bytes: int = 16 * 2**20) -> str:
        """Listen at relay `name` as `identity`; returns the circuit address once the reservation is held."""
        before = self.relays[name].reservations
        bound = await self.nursery.start(functools.partial(
            self.client().listen, f"memory://{name}/p2p-circuit", identity, handler,
            max_message_bytes=max_message_bytes))
        with trio.fail_after(10):
            while self.relays[name].reservations <= before:
                await trio.sleep(0.01)
        return bound


def run(body: Callable[[Net], Awaitable[None]]) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            with trio.fail_after(30):
                await body(Net(nursery))
            nursery.cancel_scope.cancel()

    trio.run(main)


# --- addresses ---------------------------------------------------------------------------------------------


def test_circuit_addresses_parse_strictly() -> None:
    circuit = f"/ip4/127.0.0.1/tcp/7000/p2p-circuit/{SERVER_ID}"
    assert parse_peer_address(circuit) == ("relay", circuit, 0)
    assert canonical_address(f"127.0.0.1:7000/p2p-circuit/{SERVER_ID}") == circuit  # the relay part canonical
    assert canonical_address(f"http://[::1]:80/p2p-circuit/{SERVER_ID}") == f"http://[::1]:80/p2p-circuit/{SERVER_ID}"
    assert address_host(circuit) == "127.0.0.1"  # per-IP limits count the relay
    assert len(f"http://[ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff]:65535/p2p-circuit/{SERVER_ID}") <= 128
    for bad in (f"/ip4/127.0.0.1/tcp/7000/p2p-circuit/{SERVER_ID}x",  # not a peer id
                f"/ip4/127.0.0.1/tcp/7000/p2p-circuit/{SERVER_ID[:-1]}",
                "/ip4/127.0.0.1/tcp/7000/p2p-circuit/",
                f"/ip4/0.0.0.0/tcp/7000/p2p-circuit/{SERVER_ID}",  # a relay must be dialable
                f"memory://r/p2p-circuit/{SERVER_ID}/p2p-circuit/{SERVER_ID}",  # no nested circuits
                f"/ip4/127.0.0.1/tcp/7000/p2p-circuit/{SERVER_ID}" + "1" * 80):  # over 128 bytes
        with pytest.raises(DecodeError):
            parse_peer_address(bad)
    transport = RelayTransport([MemoryNetworkTransport(MemoryNetwork())])
    assert isinstance(transport, Transport)
    assert transport.handles(f"memory://r/p2p-circuit/{SERVER_ID}")
    assert not transport.handles(circuit)  # no direct transport of this one reaches a tcp relay
    assert not transport.handles("memory://r")


def test_relay_config() -> None:
    listen, limits, circuits = relay_settings({"relay": {"enabled": True, "listen": "/ip4/127.0.0.1/tcp/0",
                                                         "max_circuits": 3, "circuit_s": 60}})
    assert listen == "/ip4/127.0.0.1/tcp/0" and limits == RelayLimits(max_circuits=3, circuit_s=60) and not circuits
    assert relay_settings({"relay": {"via": ["127.0.0.1:7100", "http://127.0.0.1:80"], "only": True}}) == (
        None, None, ("/ip4/127.0.0.1/tcp/7100/p2p-circuit", "http://127.0.0.1:80/p2p-circuit"))
    assert relay_settings({}) == (None, None, ())
    for bad in ({"via": [f"memory://r/p2p-circuit/{SERVER_ID}"]}, {"via": ["x"]}, {"via": [1]},
                {"via": ["127.0.0.1:1", "127.0.0.1:1"]}, {"listen": "127.0.0.1:1"}, {"max_circuits": 2},
                {"enabled": True, "max_circuits": 0}, {"enabled": True, "circuit_s": -1.0}, {"enabled": 1},
                {"enabled": True, "listen": "nowhere"}, {"relays": []}):
        with pytest.raises(ConfigError):
            relay_settings({"relay": bad})


# --- a relayed connection is a connection --------------------------------------------------------------------


def test_a_relayed_connection_proves_both_ends_and_keeps_messages_whole_and_ordered() -> None:
    seen = []

    async def handler(conn: SecureConnection) -> None:
        seen.append((conn.remote_peer, conn.transport_kind))
        await echo(conn)

    async def body(net: Net) -> None:
        relay = await net.relay("relay")
        address = await net.reserve("relay", SERVER, handler)
        assert address == f"memory://relay/p2p-circuit/{SERVER_ID}"
        client = net.client()
        with pytest.raises(TransportError) as info:  # the address names SERVER: nobody else will do
            await client.dial(address, CLIENT, expected_peer=OTHER.peer_id)
        assert info.value.reason == "peer-mismatch"
        conn = await client.dial(address, CLIENT, expected_peer=SERVER.peer_id)
        assert isinstance(conn, Connection)
        assert conn.remote_peer == SERVER.peer_id and conn.transport_kind == "relay"
        with trio.fail_after(10):  # the responder finishes the handshake after the dialer
            while not seen:
                await trio.sleep(0.01)
        assert seen == [(CLIENT.peer_id, "relay")]  # the far end proved who dialed, end to end
        assert relay.circuits == 1
        sizes = [0, 1, 65535, 70_000, 3 * 2**20 + 7, 5]
        messages = [bytes([i + 1]) * size for i, size in enumerate(sizes)]
        async with trio.open_nursery() as nursery:
            for i, message in enumerate(messages):
                nursery.start_soon(functools.partial(conn.send_message, message, lane=i % 2))
                await trio.sleep(0)
            got = [await conn.receive_message(LANE_CONTROL) for _ in messages[0::2]]
            got_bulk = [await conn.receive_message(LANE_BULK) for _ in messages[1::2]]
        assert got == messages[0::2] and got_bulk == messages[1::2]
        assert conn.bytes_sent > sum(sizes) and conn.bytes_received > sum(sizes)
        await conn.aclose()
        with trio.fail_after(10):  # the relay ends the circuit when one side closes
            while relay.circuits:
                await trio.sleep(0.01)

    run(body)


def test_a_stalled_bulk_lane_stalls_only_its_sender_through_a_relay() -> None:
    stalled = StalledBulk(2**20, 12)  # three lane windows of bulk

    async def body(net: Net) -> None:
        await net.relay("relay")
        address = await net.reserve("relay", SERVER, stalled.handler)
        conn = await net.client().dial(address, CLIENT)
        await stalled.stall(conn, lambda: conn.inner.send_credit(LANE_BULK), rounds=10)
        await conn.aclose()

    run(body)


def test_dialing_without_a_relay_or_reservation_is_a_typed_failure() -> None:
    async def body(net: Net) -> None:
        client = net.client()
        with pytest.raises(TransportError) as info:
            await client.dial(f"memory://nobody/p2p-circuit/{SERVER_ID}", CLIENT)
        assert info.value.reason == "connect-failed"
        relay = await net.relay("relay")
        with pytest.raises(RelayRefused) as refused:
            await client.dial(f"memory://relay/p2p-circuit/{SERVER_ID}", CLIENT)
        assert refused.value.reason == "no-reservation"
        assert relay.refusals["no-reservation"] == 1
        with pytest.raises(TransportError) as info:
            await client.dial("memory://relay", CLIENT)
        assert info.value.reason == "bad-address"

    run(body)


# --- malicious relays ----------------------------------------------------------------------------------------


class TamperingRelay(RelayServer):
    """Flips one bit of every circuit message from the `after`-th on."""

    def __init__(self, after: int = 0) -> None:
        super().__init__()
        self.after = after
        self.seen = 0

    async def forward(self, sink, data: bytes) -> None:
        self.seen += 1
        if self.seen > self.after and data:
            data = bytes([data[0] ^ 1]) + data[1:] if len(data) < 8 else data[:-5] + bytes([data[-5] ^ 1]) + data[-4:]
        await super().forward(sink, data)


class DroppingRelay(RelayServer):
    """Silently drops the `index`-th circuit message."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.seen = 0

    async def forward(self, sink, data: bytes) -> None:
        self.seen += 1
        if self.seen != self.index:
            await super().forward(sink, data)


class ReroutingRelay(RelayServer):
    """Hands every circuit to whichever peer holds a reservation here, whatever peer was asked for."""

    async def _connect(self, conn, target) -> None:
        await super()._connect(conn, next(iter(self._reservations)))


def test_a_tampering_relay_fails_the_handshake_and_the_dialer_reaches_the_peer_through_another() -> None:
    async def body(net: Net) -> None:
        await net.relay("bad", TamperingRelay())
        await net.relay("good", identity=RELAY_2)
        bad = await net.reserve("bad", SERVER, echo)
        good = await net.reserve("good", SERVER, echo)
        client = net.client()
        with pytest.raises(TransportError) as info:
            await client.dial(bad, CLIENT, expected_peer=SERVER.peer_id)
        assert not isinstance(info.value, RelayRefused)
        assert info.value.reason in ("decrypt-failed", "bad-payload", "bad-message-length", "bad-dh-key",
                                     "truncated", "reset")
        conn = await client.dial(good, CLIENT, expected_peer=SERVER.peer_id)  # the next relay works
        await conn.send_message(b"through the good relay")
        assert await conn.receive_message() == b"through the good relay"
        await conn.aclose()

    run(body)


@pytest.mark.parametrize("relay", [TamperingRelay(after=5), DroppingRelay(index=6)], ids=["tamper", "drop"])
def test_a_relay_corrupting_an_open_circuit_ends_it_cleanly_without_blaming_the_peer(relay: RelayServer) -> None:
    far_end: list[TransportError] = []

    async def handler(conn: SecureConnection) -> None:
        try:
            while True:
                await conn.send_message(await conn.receive_message(LANE_CONTROL), lane=LANE_CONTROL)
        except TransportError as exc:
            far_end.append(exc)

    async def body(net: Net) -> None:
        await net.relay("relay", relay)
        address = await net.reserve("relay", SERVER, handler)
        conn = await net.client().dial(address, CLIENT, expected_peer=SERVER.peer_id)
        with pytest.raises(TransportError) as info:  # messages follow the damaged one: it is found at once
            for i in range(50):
                await conn.send_message(bytes([i]) * 100, lane=LANE_CONTROL)
            for i in range(50):
                assert await conn.receive_message(LANE_CONTROL) == bytes([i]) * 100
        await conn.aclose()
        with trio.fail_after(10):
            while not far_end:
                await trio.sleep(0.01)
        # whichever end decrypts the damaged message reports it; the other sees the circuit close
        reasons = {info.value.reason, far_end[0].reason}
        assert "relay-corrupted" in reasons and not reasons & PEER_FAULTS, reasons

    run(body)


def test_a_relay_cannot_impersonate_the_peer_it_was_asked_for() -> None:
    async def body(net: Net) -> None:
        await net.relay("relay", ReroutingRelay())
        await net.reserve("relay", OTHER, echo)  # OTHER reserved; the relay passes it off as SERVER
        with pytest.raises(TransportError) as info:
            await net.client().dial(f"memory://relay/p2p-circuit/{SERVER_ID}", CLIENT)
        assert info.value.reason == "peer-mismatch"

    run(body)


# --- limits --------------------------------------------------------------------------------------------------


def test_reservation_and_circuit_caps_give_typed_refusals() -> None:
    async def body(net: Net) -> None:
        relay = await net.relay("relay", RelayServer(RelayLimits(max_reservations=1, max_circuits=2,
                                                                 max_circuits_per_reservation=1)))
        first = await net.reserve("relay", SERVER, echo)
        await net.nursery.start(functools.partial(net.client().listen, "memory://relay/p2p-circuit", OTHER, echo))
        with trio.fail_after(10):
            while not relay.refusals["reservation-refused"]:
                await trio.sleep(0.01)
        assert relay.reservations == 1  # OTHER was refused, SERVER keeps its reservation
        client = net.client()
        held = await client.dial(first, CLIENT)
        with pytest.raises(RelayRefused) as refused:  # one circuit per reservation
            await client.dial(first, CLIENT)
        assert refused.value.reason == "limit-exceeded"
        await held.aclose()
        with trio.fail_after(10):
            while relay.circuits:
                await trio.sleep(0.01)
        again = await client.dial(first, CLIENT)  # the slot is free again
        await again.send_message(b"x")
        assert await again.receive_message() == b"x"
        await again.aclose()

    run(body)


def test_reservations_per_address_are_bounded() -> None:
    """A flood of fresh identities from one address takes at most `max_reservations_per_ip` reservations
    (spec/transport.md §12, §13); in-memory peers all count under the address ``memory``."""
    async def body(net: Net) -> None:
        relay = await net.relay("relay", RelayServer(RelayLimits(max_reservations_per_ip=1)))
        await net.reserve("relay", SERVER, echo)
        await net.nursery.start(functools.partial(net.client().listen, "memory://relay/p2p-circuit", OTHER, echo))
        with trio.fail_after(10):
            while not relay.refusals["reservation-refused"]:
                await trio.sleep(0.01)
        assert relay.reservations == 1

    run(body)


async def lose_reservation(relay: RelayServer, peer: Identity) -> None:
    """Close `peer`'s reservation connection at the relay and wait until the relay has let it go."""
    await relay._reservations[peer.peer_id].conn.aclose()
    with trio.fail_after(10):
        while peer.peer_id in relay._reservations:
            await trio.sleep(0.01)


async def refused_while_server_returns(net: Net, relay: RelayServer, newcomer: Identity) -> None:
    """`newcomer` asks for a reservation (and keeps asking): it is refused, while SERVER, reconnecting after
    a lost reservation, gets its own back."""
    await net.nursery.start(functools.partial(net.client().listen, "memory://relay/p2p-circuit", newcomer, echo))
    with trio.fail_after(10):
        while not relay.refusals["reservation-refused"] or SERVER.peer_id not in relay._reservations:
            await trio.sleep(0.01)
    assert newcomer.peer_id not in relay._reservations


async def echoes_back(net: Net, address: str) -> None:
    """A dial of the circuit `address` reaches its peer's echo handler."""
    conn = await net.client().dial(address, CLIENT)
    await conn.send_message(b"back")
    assert await conn.receive_message() == b"back"
    await conn.aclose()


def test_a_lost_reservation_keeps_its_slot_while_its_peer_reconnects() -> None:
    """The relay is full; SERVER's reservation connection drops. A stranger cannot take the slot during
    the grace, and SERVER gets its reservation back when it reconnects."""
    async def body(net: Net) -> None:
        relay = await net.relay("relay", RelayServer(RelayLimits(max_reservations=1)))
        address = await net.reserve("relay", SERVER, echo)
        await lose_reservation(relay, SERVER)
        await refused_while_server_returns(net, relay, OTHER)
        await echoes_back(net, address)

    run(body)


def test_a_lost_reservation_keeps_its_share_of_its_address() -> None:
    """Two reservations per address (in memory every peer counts under ``memory``): SERVER's and OTHER's.
    SERVER's connection drops; a third identity from the same address cannot take SERVER's share of the
    address during the grace (the relay's total has room), and SERVER gets it back when it reconnects. Live,
    a flood of fresh identities from one address took the share at once (tests/e2e/test_relay_flood_live.py)."""
    third = Identity(bytes([6]) * 32)

    async def body(net: Net) -> None:
        relay = await net.relay("relay", RelayServer(RelayLimits(max_reservations=8, max_reservations_per_ip=2)))
        address = await net.reserve("relay", SERVER, echo)
        await net.reserve("relay", OTHER, echo)
        await lose_reservation(relay, SERVER)
        await refused_while_server_returns(net, relay, third)
        await echoes_back(net, address)

    run(body)


def test_total_circuits_cap_and_circuit_byte_and_time_limits() -> None:
    async def body(net: Net) -> None:
        relay = await net.relay("relay", RelayServer(RelayLimits(max_circuits=1, circuit_bytes=200_000)))
        server = await net.reserve("relay", SERVER, echo)
        other = await net.reserve("relay", OTHER, echo)
        client = net.client()
        conn = await client.dial(server, CLIENT)
        with pytest.raises(RelayRefused) as refused:  # one circuit in all
            await client.dial(other, CLIENT)
        assert refused.value.reason == "limit-exceeded"
        assert relay.refusals == {"limit-exceeded": 1}
        with pytest.raises(TransportError) as info:  # 200 kB both ways, then the relay closes the circuit
            for _ in range(10):
                await conn.send_message(bytes(50_000), lane=LANE_BULK)
                await conn.receive_message(LANE_BULK)
        assert isinstance(info.value, ConnectionClosed) or info.value.reason in ("truncated", "reset", "broken")
        await conn.aclose()

        timed = await net.relay("timed", RelayServer(RelayLimits(circuit_s=0.3)), identity=RELAY_2)
        address = await net.reserve("timed", SERVER, echo)
        conn = await client.dial(address, CLIENT)
        with pytest.raises(TransportError):  # the circuit's time is up: closed, whatever flows
            for _ in range(1000):
                await conn.send_message(b"tick")
                await conn.receive_message()
                await trio.sleep(0.01)
        assert timed.circuits_total == 1
        await conn.aclose()

    run(body)


def test_an_expired_reservation_is_renewed() -> None:
    async def body(net: Net) -> None:
        relay = await net.relay("relay", RelayServer(RelayLimits(reservation_s=2.0)))
        address = await net.reserve("relay", SERVER, echo)
        first = relay._reservations[SERVER.peer_id]
        await trio.sleep(3.0)  # past the first lifetime: the client renewed at half of it
        assert relay._reservations[SERVER.peer_id] is first  # renewed, not lost and remade
        assert first.expires > trio.current_time()
        conn = await net.client().dial(address, CLIENT)
        await conn.send_message(b"still reserved")
        assert await conn.receive_message() == b"still reserved"
        await conn.aclose()

    run(body)


# --- hostile control input -----------------------------------------------------------------------------------


def test_relay_messages_decode_strictly() -> None:
    assert decode_message(encode_message("reserve", {})) == ("reserve", {})
    rng = random.Random(7)
    samples = [bytes(rng.randrange(256) for _ in range(rng.randrange(40))) for _ in range(2000)]
    samples += [encode(["reserve"]), encode({"a": 1}), encode([1, {}]), encode(["x", []]), encode(["", {}]),
                encode(["k" * 33, {}]), b"\xa0" * 2000]
    for data in samples:
        try:
            kind, body = decode_message(data)
        except RelayRefused as exc:
            assert exc.reason == "bad-request"
        else:
            assert isinstance(kind, str) and kind and isinstance(body, dict)
    with pytest.raises(RelayRefused):
        decode_message(encode_message("reserve", {"pad": b"x" * MAX_REQUEST_BYTES}))


def test_hostile_control_input_never_ends_the_relay() -> None:
    async def body(net: Net) -> None:
        relay = await net.relay("relay", RelayServer(RelayLimits(request_timeout_s=0.5)))
        address = await net.reserve("relay", SERVER, echo)
        raw = MemoryNetworkTransport(net.network)
        hostile = [b"", b"\xff\xfe", encode(["connect", {"peer": b"not a peer id"}]), encode(["connect", {}]),
                   encode(["accept", {"token": b"\0" * 16}]), encode(["accept", {"token": 5}]),
                   encode(["reserve", {"x": 1}]), encode(["incoming", {}]), encode(["hello", {}]),
                   encode_message("connect", {"peer": OTHER.peer_id.to_bytes()}), b"\x00" * 70_000]
        for message in hostile:
            conn = await raw.dial("memory://relay", OTHER, max_message_bytes=2**20)
            try:
                await conn.send_message(message, lane=LANE_CONTROL)
                answer = await conn.receive_message(LANE_CONTROL)
                kind, refusal = decode_message(answer)
                assert kind == "refused" and refusal["reason"] in ("bad-request", "bad-token", "no-reservation")
            except TransportError:
                pass  # message-too-large (the relay's cap) or the relay closed after refusing
            await conn.aclose()
        silent = await raw.dial("memory://relay", OTHER, max_message_bytes=2**20)  # sends nothing at all
        with pytest.raises(TransportError):
            await silent.receive_message()  # dropped after request_timeout_s
        await silent.aclose()
        # a token announced for SERVER cannot be taken by another peer
        thief = await raw.dial("memory://relay", OTHER, max_message_bytes=2**20)
        await thief.send_message(encode_message("reserve", {}), lane=LANE_CONTROL)
        assert decode_message(await thief.receive_message(LANE_CONTROL))[0] == "reserved"
        await thief.send_message(b"garbage renewal", lane=LANE_CONTROL)
        assert decode_message(await thief.receive_message(LANE_CONTROL)) == ("refused", {"reason": "bad-request"})
        await thief.aclose()
        assert relay.refusals["bad-request"] >= 8 and relay.refusals["bad-token"] >= 1
        conn = await net.client().dial(address, CLIENT)  # and the relay still relays
        await conn.send_message(b"alive")
        assert await conn.receive_message() == b"alive"
        await conn.aclose()

    run(body)


def test_a_target_that_never_accepts_gives_accept_timeout() -> None:
    async def body(net: Net) -> None:
        await net.relay("relay", RelayServer(RelayLimits(accept_timeout_s=0.3)))
        raw = MemoryNetworkTransport(net.network)
        mute = await raw.dial("memory://relay", SERVER, max_message_bytes=2**20)  # reserves, never accepts
        await mute.send_message(encode_message("reserve", {}), lane=LANE_CONTROL)
        assert decode_message(await mute.receive_message(LANE_CONTROL))[0] == "reserved"
        with pytest.raises(RelayRefused) as refused:
            await net.client().dial(f"memory://relay/p2p-circuit/{SERVER_ID}", CLIENT)
        assert refused.value.reason == "accept-timeout"
        kind, announced = decode_message(await mute.receive_message(LANE_CONTROL))
        assert kind == "incoming" and announced["from"] == CLIENT.peer_id.to_bytes()
        thief = await raw.dial("memory://relay", OTHER, max_message_bytes=2**20)  # the token is SERVER's
        await thief.send_message(encode_message("accept", {"token": announced["token"]}), lane=LANE_CONTROL)
        assert decode_message(await thief.receive_message(LANE_CONTROL)) == ("refused", {"reason": "bad-token"})
        await thief.aclose()
        await mute.aclose()

    run(body)


@pytest.mark.parametrize("limits", [
    {"circuit_window_bytes": 200_000},  # one circuit's own period budget
    {"reservation_window_bytes": 200_000},  # shared by every circuit to one reserved peer
], ids=["per-circuit", "per-reservation"])
def test_bytes_per_period_pace_circuits_and_lose_nothing(limits) -> None:
    """spec/transport.md §12: per period of `window_s` (0.5 s here), a circuit, and a reservation's circuits
    together, relay at most their budget (200 kB, both directions). Two circuits to one peer echo 10 × 50 kB
    each: all of it arrives, nothing is closed, and it takes at least the periods the budget allows, since
    without the bound the same bytes take a few milliseconds."""
    async def body(net: Net) -> None:
        await net.relay("relay", RelayServer(RelayLimits(window_s=0.5, **limits)))
        server = await net.reserve("relay", SERVER, echo)
        client = net.client()
        conns = [await client.dial(server, CLIENT), await client.dial(server, OTHER)]
        started = trio.current_time()

        async def echoes(conn) -> None:
            for i in range(10):
                await conn.send_message(bytes([i]) * 50_000, lane=LANE_BULK)
                assert await conn.receive_message(LANE_BULK) == bytes([i]) * 50_000

        async with trio.open_nursery() as nursery:
            for conn in conns:
                nursery.start_soon(echoes, conn)
        took = trio.current_time() - started
        # 2 MB both ways over the budget of the period: per circuit, 1 MB each at 200 kB a period (at least 4
        # waits); per reservation, 2 MB at 200 kB a period (at least 9 waits)
        waits = 4 if "circuit_window_bytes" in limits else 9
        assert took >= waits * 0.5 - 0.05, took
        for conn in conns:
            await conn.aclose()

    run(body)


def test_period_budgets_must_hold_one_message() -> None:
    with pytest.raises(ValueError, match="circuit_window_bytes"):
        RelayLimits(circuit_window_bytes=1000)
    with pytest.raises(ValueError, match="window_s"):
        RelayLimits(window_s=0)

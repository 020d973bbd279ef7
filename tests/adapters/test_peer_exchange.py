"""Peer exchange (spec/wire.md §4, spec/transport.md §5): a node tells a newly greeted peer where its
other peers listen, and a receiver reports, strictly checked and rate limited, the addresses of peers it
is not connected to. Engine-level tests by hand, then three `peerloom node` processes on 127.0.0.1."""

from __future__ import annotations

import random
import time

import pytest

from peerloom.core import effects as fx
from peerloom.core import events as ev
from peerloom.core.encoding import encode
from peerloom.core.engine import Engine, EngineConfig
from peerloom.core.messages import Hello, PeerExchange, decode_message, encode_message
from tests.helpers import ident, make_revision

ME, A, B, C, D = ident(1), ident(2), ident(3), ident(4), ident(5)


def drain(engine):
    out = []
    while (effect := engine.next_effect()) is not None:
        out.append(effect)
    return out


def node(listen: str | None = "127.0.0.1:4001") -> Engine:
    engine = Engine(EngineConfig(roles={"validator"}, revision=make_revision(validators=[ME]), listen_address=listen),
                    ME, random.Random(0))
    engine.handle(ev.Start(now=0.0))
    drain(engine)
    return engine


def greet(engine, peer, listen=None, now=0.0):
    engine.handle(ev.PeerConnected(now=now, peer=peer.peer_id))
    hello = Hello(revision=engine.revision.id, roles=("trainer",), head_window=0, listen=listen)
    engine.handle(ev.MessageReceived(now=now, peer=peer.peer_id, data=encode_message(hello)))


def deliver(engine, peer, data, now=0.0):
    data = data if isinstance(data, bytes) else encode_message(data)
    engine.handle(ev.MessageReceived(now=now, peer=peer.peer_id, data=data))


def sent_to(effects, peer, kind):
    out = []
    for e in effects:
        if isinstance(e, fx.Send) and e.peer == peer.peer_id:
            message = decode_message(e.data, max_bytes=1 << 20)
            if isinstance(message, kind):
                out.append(message)
    return out


def discovered(effects):
    return [p for e in effects if isinstance(e, fx.PeersDiscovered) for p in e.peers]


def test_hello_carries_the_listen_address():
    engine = node("127.0.0.1:4001")
    engine.handle(ev.PeerConnected(now=1.0, peer=A.peer_id))
    (hello,) = sent_to(drain(engine), A, Hello)
    assert hello.listen == "127.0.0.1:4001"
    quiet = node(None)
    quiet.handle(ev.PeerConnected(now=1.0, peer=A.peer_id))
    (hello,) = sent_to(drain(quiet), A, Hello)
    assert hello.listen is None


def test_a_new_peer_is_told_the_other_peers_listen_addresses_but_never_its_own():
    engine = node()
    greet(engine, A, "127.0.0.1:5002")
    greet(engine, B, None)  # accepts no connections: nothing to pass on
    effects = drain(engine)
    assert not sent_to(effects, A, PeerExchange)  # nobody else with an address yet
    assert sent_to(effects, B, PeerExchange) == [PeerExchange(peers=((A.peer_id, "127.0.0.1:5002"),))]
    greet(engine, C, "127.0.0.1:5004")
    (told,) = sent_to(drain(engine), C, PeerExchange)
    assert told.peers == ((A.peer_id, "127.0.0.1:5002"),)
    assert all(p != C.peer_id for p, _ in told.peers)
    engine.handle(ev.PeerDisconnected(now=0.0, peer=A.peer_id))
    greet(engine, D, "127.0.0.1:5005")
    (told,) = sent_to(drain(engine), D, PeerExchange)
    assert told.peers == ((C.peer_id, "127.0.0.1:5004"),)  # only peers still connected


def test_peers_are_told_again_periodically_so_later_arrivals_are_found():
    engine = node()
    greet(engine, A, "127.0.0.1:5002", now=1.0)
    greet(engine, B, "127.0.0.1:5003", now=2.0)  # B is told about A at once
    drain(engine)
    greet(engine, C, "127.0.0.1:5004", now=45.0)  # arrives later: A and B only hear of it in the next round
    drain(engine)
    engine.handle(ev.TimerDue(now=60.0))  # the first round (peer_exchange_every_s = 60)
    effects = drain(engine)
    assert sent_to(effects, A, PeerExchange) == [PeerExchange(peers=(
        *sorted([(B.peer_id, "127.0.0.1:5003"), (C.peer_id, "127.0.0.1:5004")]),))]
    assert (C.peer_id, "127.0.0.1:5004") in sent_to(effects, B, PeerExchange)[0].peers
    assert not sent_to(effects, C, PeerExchange)  # told at its greeting 15 s ago: inside 2 x the quota interval
    engine.handle(ev.TimerDue(now=120.0))
    assert sent_to(drain(engine), C, PeerExchange)  # the next round tells it


def test_a_valid_exchange_reports_unknown_peers_only():
    engine = node()
    greet(engine, A, "127.0.0.1:5002")
    greet(engine, B, "127.0.0.1:5003")
    drain(engine)
    deliver(engine, A, PeerExchange(peers=(
        (ME.peer_id, "127.0.0.1:4001"),   # ourselves: never learnt
        (A.peer_id, "127.0.0.1:5002"),    # the sender: already connected
        (B.peer_id, "127.0.0.1:5003"),    # already connected
        (C.peer_id, "127.0.0.1:5004"),
        (D.peer_id, "[::1]:5005"),
    )), now=1.0)
    effects = drain(engine)
    assert discovered(effects) == [(C.peer_id, "127.0.0.1:5004"), (D.peer_id, "[::1]:5005")]
    assert not engine.rejected_by_reason
    assert engine.peers[A.peer_id].penalty == 0
    deliver(engine, B, PeerExchange(peers=((ME.peer_id, "127.0.0.1:4001"),)), now=1.0)
    assert not discovered(drain(engine))  # nothing new: no effect at all


def test_a_second_exchange_within_ten_seconds_is_refused_and_charged():
    engine = node()
    greet(engine, A, "127.0.0.1:5002")
    greet(engine, B, None)
    drain(engine)
    one = PeerExchange(peers=((C.peer_id, "127.0.0.1:5004"),))
    deliver(engine, A, one, now=1.0)
    assert discovered(drain(engine))
    deliver(engine, A, one, now=10.9)
    assert not discovered(drain(engine))
    assert engine.rejected_by_reason["peers-quota"] == 1 and engine.peers[A.peer_id].penalty == 1
    deliver(engine, B, one, now=10.9)  # the quota is per peer: B is not limited by A's flood
    assert discovered(drain(engine)) == [(C.peer_id, "127.0.0.1:5004")]
    deliver(engine, A, one, now=11.0)  # ten seconds after the last accepted one
    assert discovered(drain(engine)) == [(C.peer_id, "127.0.0.1:5004")]
    assert engine.peers[A.peer_id].penalty == 1


def test_a_flood_of_exchanges_ends_in_a_hang_up():
    engine = node()
    greet(engine, A, "127.0.0.1:5002")
    drain(engine)
    effects = []
    for i in range(engine.config.penalty_limit + 1):
        deliver(engine, A, PeerExchange(peers=((C.peer_id, "127.0.0.1:5004"),)), now=1.0 + i * 0.01)
        effects += drain(engine)
    assert len(discovered(effects)) == 1
    assert any(isinstance(e, fx.HangUp) and e.peer == A.peer_id and e.reason == "penalty-limit" for e in effects)


C_ID = C.peer_id.to_bytes()


@pytest.mark.parametrize("entries,reason", [
    ([[C_ID, "127.0.0.1:5004"]] * 33, "decode-bad-field"),                               # over 32 entries
    ([[C_ID, "127.0.0.1:5004"], [C_ID, "127.0.0.1:5005"]], "decode-bad-field"),           # duplicate peer
    ([[C_ID, "127.0.0.1:5004"], [D.peer_id.to_bytes(), "127.0.0.1:5004"]], "decode-bad-field"),  # same address
    ([[C_ID, "127.0.0.1:0"]], "decode-bad-field"),                                         # port 0
    ([[C_ID, "127.0.0.1:70000"]], "decode-bad-field"),                                     # port too large
    ([[C_ID, "example.org:80"]], "decode-bad-field"),                                      # not an IP literal
    ([[C_ID, "0.0.0.0:80"]], "decode-bad-field"),                                          # unspecified
    ([[C_ID, "127.0.0.1:" + "1" * 60]], "decode-bad-field"),                               # over 64 bytes
    ([[C_ID]], "decode-bad-field"),                                                        # short entry
    ([[b"\x00" * 38, "127.0.0.1:5004"]], "decode-bad-peer-id"),                           # not a peer id
])
def test_malformed_exchanges_are_refused_and_charged(entries, reason):
    engine = node()
    greet(engine, A, "127.0.0.1:5002")
    drain(engine)
    deliver(engine, A, encode(["peers", {"peers": entries}]), now=1.0)
    assert not discovered(drain(engine))
    assert engine.rejected_by_reason[reason] == 1 and engine.peers[A.peer_id].penalty == 1
    # A malformed one does not use up the sender's quota: a valid one right after is still heard.
    deliver(engine, A, PeerExchange(peers=((C.peer_id, "127.0.0.1:5004"),)), now=1.0)
    assert discovered(drain(engine)) == [(C.peer_id, "127.0.0.1:5004")]


def test_an_oversized_exchange_is_refused_before_its_entries_are_read():
    engine = node()
    greet(engine, A, "127.0.0.1:5002")
    drain(engine)
    huge = encode(["peers", {"peers": [[C_ID, "127.0.0.1:5004"]] * 40000}])  # ~2 MiB: over the control cap
    assert len(huge) > 1 << 20
    deliver(engine, A, huge, now=1.0)
    assert not discovered(drain(engine))
    assert engine.rejected_by_reason["decode-too-large"] == 1


def test_an_exchange_before_hello_is_refused():
    engine = node()
    engine.handle(ev.PeerConnected(now=0.0, peer=A.peer_id))
    drain(engine)
    deliver(engine, A, PeerExchange(peers=((C.peer_id, "127.0.0.1:5004"),)))
    assert not discovered(drain(engine))
    assert engine.rejected_by_reason["no-hello"] == 1


# --- three `peerloom node` processes ----------------------------------------------------------------------


def _connected(node_, peer) -> bool:
    return any(e["event"] == "connected" and e.get("peer") == peer.identity.peer_id.to_text()
               for e in node_.events())


def _wait(cond, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not cond():
        time.sleep(0.05)
    return cond()


@pytest.mark.slow
def test_a_node_bootstrapped_to_one_peer_finds_the_rest_of_the_fleet(tmp_path):
    """B is the only address A and C are given; A and C still end up connected to each other."""
    from tests.node_cluster import make_fleet

    nodes = make_fleet(tmp_path, validators=1, trainers=2, quorum=1, window_s=1.0)
    b, a, c = nodes
    for n in (a, c):
        n.write_config(bootstrap=[f"127.0.0.1:{b.port}"])
    b.write_config(bootstrap=[])
    try:
        b.start()
        b.wait_port()
        a.start()
        a.wait_port()
        assert _wait(lambda: _connected(a, b), 20.0), "A never reached its bootstrap node"
        c.start()
        c.wait_port()
        assert _wait(lambda: _connected(a, c) and _connected(c, a), 20.0), "A and C never met"
        # Both ends log the transport cipher they negotiated (spec/transport.md §1.1): the same one.
        ciphers = {e["cipher"] for n, other in ((a, c), (c, a)) for e in n.events()
                   if e["event"] == "connected" and e.get("peer") == other.identity.peer_id.to_text()}
        assert len(ciphers) == 1 and ciphers <= {"AESGCM", "ChaChaPoly"}, ciphers
    finally:
        codes = [n.stop() for n in nodes]
    assert codes == [0, 0, 0]
    learnt = [e for e in c.events() if e["event"] == "peers-discovered"]
    assert learnt and learnt[0]["peer"] == str(b.identity.peer_id)
    assert not [e for n in nodes for e in n.events()
                if e["event"] == "reject" and (e["reason"].startswith("decode") or e["reason"] == "peers-quota")]


# --- transport-qualified addresses (spec/wire.md §4, spec/transport.md §9) --------------------------------


@pytest.mark.parametrize(("text", "parsed", "canonical"), [
    ("/ip4/127.0.0.1/tcp/7000", ("tcp", "127.0.0.1", 7000), "/ip4/127.0.0.1/tcp/7000"),
    ("/ip6/::1/tcp/7000", ("tcp", "::1", 7000), "/ip6/::1/tcp/7000"),
    ("127.0.0.1:7000", ("tcp", "127.0.0.1", 7000), "/ip4/127.0.0.1/tcp/7000"),  # legacy = tcp
    ("http://10.0.0.7:8000", ("http", "10.0.0.7", 8000), "http://10.0.0.7:8000"),
    ("http://[::1]:8000", ("http", "::1", 8000), "http://[::1]:8000"),
    ("memory://validator-1", ("memory", "validator-1", 0), "memory://validator-1"),
])
def test_transport_addresses_parse_strictly_and_canonically(text, parsed, canonical):
    from peerloom.core.messages import format_peer_address, parse_peer_address

    assert parse_peer_address(text) == parsed
    assert format_peer_address(*parsed) == canonical


@pytest.mark.parametrize("text", [
    "/ip4/127.0.0.1/udp/7000", "/ip4/::1/tcp/7000", "/ip6/127.0.0.1/tcp/7000", "/ip4/127.0.0.1/tcp/0",
    "/ip4/localhost/tcp/80", "/ip4/127.0.0.1/tcp/80/", "http://localhost:80", "http://127.0.0.1:80/",
    "https://127.0.0.1:443", "http://0.0.0.0:80", "memory://", "memory://a/b", "memory://" + "x" * 33,
    "memory://é", "/ip4/" + "1" * 60, "ws://127.0.0.1:80",
])
def test_malformed_transport_addresses_are_refused(text):
    from peerloom.core.errors import DecodeError
    from peerloom.core.messages import parse_peer_address

    with pytest.raises(DecodeError) as err:
        parse_peer_address(text)
    assert err.value.reason == "bad-field"


def test_hello_and_peers_carry_transport_qualified_addresses():
    from peerloom.core.errors import DecodeError

    revision = make_revision(validators=[ME]).id
    for listen in ("/ip4/127.0.0.1/tcp/7000", "http://127.0.0.1:8000", "memory://v1"):
        hello = Hello(revision=revision, roles=("trainer",), head_window=0, listen=listen)
        assert decode_message(encode_message(hello), max_bytes=4096) == hello
    exchange = PeerExchange(peers=((A.peer_id, "/ip4/127.0.0.1/tcp/7000"), (B.peer_id, "http://127.0.0.1:8000")))
    assert decode_message(encode_message(exchange), max_bytes=4096) == exchange
    with pytest.raises(DecodeError):
        decode_message(encode_message(Hello(revision=revision, roles=("trainer",), head_window=0,
                                            listen="ftp://127.0.0.1:21")), max_bytes=4096)


def test_an_http_address_from_a_hello_is_passed_on_to_the_next_peer():
    engine = node("http://127.0.0.1:4001")
    greet(engine, A, listen="http://127.0.0.1:5001")
    drain(engine)
    greet(engine, B, listen="/ip4/127.0.0.1/tcp/5002")
    told = sent_to(drain(engine), B, PeerExchange)
    assert told and (A.peer_id, "http://127.0.0.1:5001") in told[0].peers

"""NodeRuntime over several transports at once (spec/transport.md §9): one node listens on tcp, http and memory, is
reachable and proven over each, advertises a transport-qualified address, and its address book dials the
kinds it has a transport for; config `[transport]` tables choose the listeners."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from peerloom.adapters.addressbook import AddressBook
from peerloom.adapters.http_transport import HttpTransport
from peerloom.adapters.memory import MemoryNetwork, MemoryNetworkTransport
from peerloom.adapters.tcp import TcpTransport
from peerloom.core.messages import Hello
from peerloom.node import ConfigError, transport_listens
from tests.adapters.test_runtime_admission import TRAINER, first_message, running_node, trio_test
from tests.helpers import ident


@trio_test
async def test_one_node_listens_on_three_transports_and_each_proves_it(tmp_path: Path) -> None:
    network = MemoryNetwork()
    listen = ("/ip4/127.0.0.1/tcp/0", "http://127.0.0.1:0", "memory://node")
    async with running_node(tmp_path, listen=listen, memory_network=network) as runtime:
        kinds = [a.split(":")[0] if "://" in a else "tcp" for a in runtime.listen_addresses]
        assert kinds == ["tcp", "http", "memory"]
        assert runtime.engine.config.listen_address == runtime.listen_addresses[0]  # hello.listen
        # One dialer per transport: the runtime drops a second connection from a peer whose first one it
        # has not yet seen close, which a fast redial of the same identity could race into.
        transports = (TcpTransport(), HttpTransport(), MemoryNetworkTransport(network))
        for n, transport, address in zip((20, 21, 22), transports, runtime.listen_addresses, strict=True):
            conn = await transport.dial(address, ident(n), expected_peer=TRAINER.peer_id,
                                        max_message_bytes=1 << 20)
            hello = await first_message(conn)
            assert isinstance(hello, Hello) and hello.listen == runtime.listen_addresses[0]
            await conn.aclose()


@trio_test
async def test_bootstrap_addresses_of_every_kind_are_dialed_through_their_transport(tmp_path: Path) -> None:
    network = MemoryNetwork()
    peer = ident(21)
    seen: list[str] = []

    async def accept(conn) -> None:
        seen.append(conn.transport_kind)
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        tcp_at = await nursery.start(TcpTransport().listen, "/ip4/127.0.0.1/tcp/0", peer, accept)
        http_at = await nursery.start(HttpTransport().listen, "http://127.0.0.1:0", peer, accept)
        memory_at = await nursery.start(MemoryNetworkTransport(network).listen, "memory://peer", peer, accept)
        legacy = tcp_at.replace("/ip4/", "").replace("/tcp/", ":")  # "127.0.0.1:P" still means tcp
        async with running_node(tmp_path, bootstrap=(http_at, memory_at, legacy), memory_network=network):
            with trio.fail_after(10):
                while len(seen) < 3:
                    await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert sorted(seen) == ["http", "memory", "tcp"]


def test_address_book_keys_on_transport_addresses_and_counts_per_ip() -> None:
    import random

    book = AddressBook(random.Random(0), max_connections_per_ip=1)
    tcp_address, http_address = "/ip4/127.0.0.1/tcp/7000", "http://127.0.0.1:8000"
    book.add(tcp_address, now=0.0)
    book.add(http_address, now=0.0)
    book.add("memory://a", now=0.0)
    due = book.due(0.0)
    assert "memory://a" in due and len(due) == 2  # tcp and http share 127.0.0.1's one slot
    for address in due:
        book.dial_started(address, now=0.0)
        assert book.connected(address, ident(30 + len(address)).peer_id, now=0.0)
    assert book.due(0.0) == []


@pytest.mark.parametrize(("config", "listens"), [
    ({}, ()),
    ({"transport": {"kind": "http"}}, ("http://127.0.0.1:0",)),
    ({"transport": {"kind": "tcp", "listen": "/ip4/127.0.0.1/tcp/7000"}}, ("/ip4/127.0.0.1/tcp/7000",)),
    ({"transport": [{"kind": "tcp"}, {"kind": "http", "listen": "http://127.0.0.1:8000"},
                    {"kind": "memory", "listen": "memory://n"}]},
     ("127.0.0.1:0", "http://127.0.0.1:8000", "memory://n")),
])
def test_transport_tables_choose_the_listeners(config, listens) -> None:
    assert transport_listens(config) == listens


@pytest.mark.parametrize(("config", "error"), [
    ({"transport": {"kind": "udp"}}, "transport.kind must be tcp, http or memory"),
    ({"transport": {"kind": "http", "port": 1}}, "unknown key"),
    ({"transport": {"kind": "http", "listen": "127.0.0.1:80"}}, "must start with http://"),
    ({"transport": {"kind": "memory"}}, "memory://NAME"),
    ({"transport": {"kind": "tcp"}, "listen": "127.0.0.1:0"}, "not both"),
    ({"transport": ["tcp"]}, "must be tables"),
])
def test_bad_transport_tables_are_named(config, error) -> None:
    with pytest.raises(ConfigError, match=error):
        transport_listens(config)

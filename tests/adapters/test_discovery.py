"""Zeroconf discovery on 127.0.0.1: nodes of one revision find each other, ignore themselves and other
revisions; `peerloom node` pairs with no bootstrap address connect through it."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from peerloom.adapters.discovery import SERVICE_TYPE, MdnsDiscovery
from tests.helpers import ident

pytest.importorskip("zeroconf")


def _wait(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not cond():
        time.sleep(0.05)
    return cond()


def test_two_advertisers_find_each_other_on_loopback_only():
    from zeroconf import ServiceInfo

    found: dict[str, list] = {"a": [], "b": [], "c": []}
    lock = threading.Lock()

    def recorder(key):
        def on_found(peer, address):
            with lock:
                found[key].append((peer, address))
        return on_found

    a = MdnsDiscovery(ident(1).peer_id, 7001, b"rev-1", recorder("a")).start()
    b = MdnsDiscovery(ident(2).peer_id, 7002, b"rev-1", recorder("b")).start()
    c = MdnsDiscovery(ident(3).peer_id, 7003, b"rev-2", recorder("c")).start()  # another experiment
    try:
        assert _wait(lambda: found["a"] and found["b"])
        time.sleep(0.5)  # give c's records time to arrive, so ignoring them is what is tested
        assert found["a"] == [(ident(2).peer_id, ("127.0.0.1", 7002))]
        assert found["b"] == [(ident(1).peer_id, ("127.0.0.1", 7001))]
        assert found["c"] == []
        name = ident(4).peer_id.to_text()
        stranger = ServiceInfo(SERVICE_TYPE, f"{name}.{SERVICE_TYPE}", addresses=[socket.inet_aton("10.1.2.3")],
                               port=7004, properties={"peer": name, "rev": b"rev-1".hex()})
        assert a.parse(stranger) is None  # an address off our interface is never dialed
        assert a.parse(ServiceInfo(SERVICE_TYPE, f"x.{SERVICE_TYPE}", addresses=[socket.inet_aton("127.0.0.1")],
                                   port=7005, properties={"peer": "not-a-peer", "rev": b"rev-1".hex()})) is None
    finally:
        for d in (a, b, c):
            d.close()


def test_only_ipv4_interfaces():
    with pytest.raises(ValueError):
        MdnsDiscovery(ident(1).peer_id, 1, b"r", lambda p, a: None, interface="::1")


@pytest.mark.slow
def test_peerloom_nodes_find_each_other_with_no_bootstrap(tmp_path):
    from tests.node_cluster import make_fleet

    nodes = make_fleet(tmp_path, validators=1, trainers=1, quorum=1, window_s=1.0)
    for node in nodes:
        node.config.pop("bootstrap")
        node.write_config(discovery={"mdns": True})
    try:
        for node in nodes:
            node.start()
        for node in nodes:
            node.wait_port()
        assert _wait(lambda: any(e["event"] == "head" for e in nodes[0].events()), 40.0), \
            "no head certified: the nodes never connected"
    finally:
        codes = [node.stop() for node in nodes]
    assert codes == [0, 0]
    log = (nodes[1].directory / "node.log").read_text()
    assert "mdns found" in log

"""Zeroconf (mDNS / DNS-SD) discovery of peerloom nodes, service type ``_peerloom._tcp.local.`` (spec/design.md §6).

Each node advertises one service instance named by its peer id, whose SRV/A records point at its TCP+Noise
listener, with TXT properties ``peer`` (peer id text) and ``rev`` (the revision id, hex) so nodes of other
experiments on the same LAN ignore each other. It browses the same type and reports every other node of
its revision through `on_found(peer, (host, port))` (called from zeroconf's thread).

Scope on purpose: the responder binds `interface` only (default 127.0.0.1) and advertises that address
only; a found address that is not `interface` is ignored. A discovered address is a hint, never trust:
the Noise handshake proves the peer id before the engine hears of the peer (spec/transport.md).
RFC 6762 (mDNS), RFC 6763 (DNS-SD); python-zeroconf.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections.abc import Callable

from zeroconf import IPVersion, ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf

from peerloom.core.identity import PeerId

SERVICE_TYPE = "_peerloom._tcp.local."
log = logging.getLogger("peerloom.discovery")

FoundCallback = Callable[[PeerId, tuple[str, int]], None]


class MdnsDiscovery:
    """Advertise this node and browse for others of the same revision, on one IPv4 interface.

    `start()` blocks while the name is probed (about a second); `close()` withdraws the advertisement.
    """

    def __init__(self, peer_id: PeerId, port: int, revision: bytes, on_found: FoundCallback, *,
                 interface: str = "127.0.0.1") -> None:
        if ipaddress.ip_address(interface).version != 4:
            raise ValueError(f"mDNS discovery binds an IPv4 interface, got {interface}")
        self.peer_id = peer_id
        self.port = port
        self.revision = revision.hex()
        self.interface = interface
        self.on_found = on_found
        self._zc: Zeroconf | None = None
        self._browser: ServiceBrowser | None = None
        self._info: ServiceInfo | None = None
        self._lock = threading.Lock()
        self.found: dict[PeerId, tuple[str, int]] = {}

    def start(self) -> MdnsDiscovery:
        self._zc = Zeroconf(interfaces=[self.interface], ip_version=IPVersion.V4Only)
        name = self.peer_id.to_text()
        self._info = ServiceInfo(SERVICE_TYPE, f"{name}.{SERVICE_TYPE}",
                                 addresses=[socket.inet_aton(self.interface)], port=self.port,
                                 properties={"peer": name, "rev": self.revision}, server=f"{name.lower()}.local.")
        self._zc.register_service(self._info, allow_name_change=True)
        self._browser = ServiceBrowser(self._zc, SERVICE_TYPE, handlers=[self._on_change])
        return self

    def _on_change(self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is not ServiceStateChange.Added and state_change is not ServiceStateChange.Updated:
            return
        info = zeroconf.get_service_info(service_type, name, timeout=3000)
        if info is None:
            return
        found = self.parse(info)
        if found is None:
            return
        peer, address = found
        with self._lock:
            if self.found.get(peer) == address:
                return
            self.found[peer] = address
        log.info("mdns found", extra={"fields": {"peer": peer.to_text(), "address": f"{address[0]}:{address[1]}"}})
        self.on_found(peer, address)

    def parse(self, info: ServiceInfo) -> tuple[PeerId, tuple[str, int]] | None:
        """(peer, address) from a service record, or None if it is ours, another revision's, malformed, or
        points anywhere but our interface."""
        props = info.properties or {}
        try:
            peer = PeerId.from_text(bytes(props.get(b"peer") or b"").decode())
        except Exception:
            return None
        if peer == self.peer_id or (props.get(b"rev") or b"").decode() != self.revision or not info.port:
            return None
        if self.interface not in info.parsed_addresses(IPVersion.V4Only):
            return None
        return peer, (self.interface, int(info.port))

    def close(self) -> None:
        if self._browser is not None:
            self._browser.cancel()
        if self._zc is not None:
            if self._info is not None:
                self._zc.unregister_service(self._info)
            self._zc.close()
        self._zc = self._browser = self._info = None

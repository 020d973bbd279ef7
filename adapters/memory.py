"""The in-memory transport: `MemoryNetworkTransport` (with its registry `MemoryNetwork`), a real
`adapters.transport.Transport` for tests and single-process fleets of `NodeRuntime`s: ``memory://NAME``
addresses, trio memory streams carrying the same Noise handshake, frames and flow control as TCP
(spec/transport.md §11). (The simulator's message queue is `sim/links.py`: it needs no trio.)
"""

from __future__ import annotations

import errno
from collections.abc import Awaitable, Callable
from typing import Any

import trio
import trio.testing

from peerloom.core.errors import PeerloomError
from peerloom.core.identity import Identity, PeerId
from peerloom.core.messages import parse_peer_address

from .tcp import DEFAULT_MAX_MESSAGE_BYTES, Acceptor, SecureConnection, SecureOptions, secure_stream
from .transport import TransportError

# --- the in-memory node transport (adapters.transport.Transport) -----------------------------------------


class MemoryNetwork:
    """A registry of in-process listeners by name: the "network" that `MemoryNetworkTransport`s sharing it
    can reach. One per test or per single-process fleet (nothing module-global), so tests stay isolated.
    Trio-only; use from one trio run."""

    def __init__(self) -> None:
        self._listeners: dict[str, Callable[[trio.abc.Stream, tuple[str, int]], None]] = {}
        self._next_port = 1

    def bind(self, name: str, accept: Callable[[trio.abc.Stream, tuple[str, int]], None]) -> None:
        """Register `accept(stream, remote)` under `name`; OSError (EADDRINUSE) if the name is taken."""
        if name in self._listeners:
            raise OSError(errno.EADDRINUSE, f"cannot listen on memory://{name}: name in use")
        self._listeners[name] = accept

    def unbind(self, name: str) -> None:
        self._listeners.pop(name, None)

    def connect(self, name: str) -> trio.abc.Stream:
        """A new byte stream to the listener `name` (its end is handed to the listener at once); raises
        TransportError("connect-failed") when nothing listens there."""
        accept = self._listeners.get(name)
        if accept is None:
            raise TransportError("connect-failed", f"memory://{name}: nothing listens there")
        ours, theirs = trio.testing.memory_stream_pair()
        self._next_port += 1
        accept(theirs, ("memory", self._next_port))
        return ours


class MemoryNetworkTransport:
    """`Transport` between nodes of one process (spec/transport.md §11): addresses ``memory://NAME``.

    The byte stream is a `trio.testing.memory_stream_pair` (no sockets, no copies beyond trio's buffer);
    on it run the same Noise XX handshake, frames, lanes and credit-based flow control as TCP
    (`adapters.tcp.secure_stream`), so the remote `PeerId` is proven and backpressure behaves exactly as
    over TCP. Every `MemoryNetworkTransport` built on the same `network` reaches the same listeners."""

    kind = "memory"

    def __init__(self, network: MemoryNetwork, options: SecureOptions | None = None) -> None:
        self.network = network
        self.options = options or SecureOptions()

    def handles(self, address: str) -> bool:
        return address.startswith("memory://") and self._name(address, strict=False) is not None

    @staticmethod
    def _name(address: str, *, strict: bool = True) -> str | None:
        try:
            kind, name, _ = parse_peer_address(address)
        except PeerloomError:
            kind = ""
        if kind != "memory":
            if strict:
                raise TransportError("bad-address", f"{address!r} is not a memory://NAME address")
            return None
        return name

    async def dial(self, address: str, identity: Identity, *, expected_peer: PeerId | None = None,
                   max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> SecureConnection:
        """Connect to the listener named in `address` and run the handshake as initiator. Raises
        TransportError: ``bad-address``, ``connect-failed`` (no such listener), handshake errors."""
        stream = self.network.connect(self._name(address) or "")
        o = self.options
        conn = await secure_stream(stream, identity, initiator=True, expected_peer=expected_peer,
                                   max_message_bytes=max_message_bytes, handshake_timeout=o.handshake_timeout,
                                   keepalive_interval=o.keepalive_interval, idle_timeout=o.idle_timeout,
                                   transport_ciphers=o.transport_ciphers, remote_address=("memory", 0))
        conn.transport_kind = self.kind
        return conn

    async def listen(self, address: str, identity: Identity, handler: Callable[[Any], Awaitable[object]], *,
                     max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                     task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Register `address` in the network and serve each dialed stream (caps, admission, handshake,
        containment as `tcp.serve`, via `tcp.Acceptor`) until cancelled; then the name is free again."""
        name = self._name(address) or ""

        async def handle(conn: SecureConnection) -> object:
            conn.transport_kind = self.kind
            return await handler(conn)

        acceptor = Acceptor(identity, handle, max_message_bytes=max_message_bytes, options=self.options)
        async with trio.open_nursery() as nursery:
            self.network.bind(name, lambda stream, remote: nursery.start_soon(acceptor.accept, stream, remote))
            try:
                task_status.started(f"memory://{name}")
                await trio.sleep_forever()
            finally:
                self.network.unbind(name)

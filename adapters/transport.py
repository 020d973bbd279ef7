"""The transport interface: how a node reaches its peers, whatever carries the bytes (spec/transport.md).

A transport turns an address into a `Connection`: secure (the remote end's `PeerId` is proven by a
handshake bound to its identity key), framed (whole application messages, never partial ones) and
flow-controlled per lane (a receiver that stops reading one lane stalls only that lane's sender). The node
runtime, the tests and an embedding program see only this interface; `tcp` (TCP + Noise), `http`
(HTTP/1.1 with signed envelopes) and `memory` (trio memory streams, one process) implement it and pass one
conformance suite (tests/adapters/test_transport_conformance.py). All three run the same Noise XX handshake and
frame layer (`adapters.tcp.SecureConnection`) over their own byte stream: a TCP socket, an HTTP/1.1
WebSocket, a trio in-memory stream pair.

Addresses carry their transport (spec/transport.md §9):
- ``/ip4/127.0.0.1/tcp/7000`` (also ``/ip6/::1/tcp/7000``) for TCP + Noise;
- ``http://127.0.0.1:8000`` for the HTTP transport;
- ``memory://NAME`` for an in-process listener registered under NAME;
- ``<one of those>/p2p-circuit/<peer-id>`` for a peer reached through a relay (`adapters.relay`, §12).

Errors: every failure of a connection is a `TransportError` with a stable `reason` code;
`ConnectionClosed` is the orderly end (``eof``, ``closed``, ``reset``). Reasons in `PEER_FAULTS` can only
be caused by a misbehaving peer and are charged to it (spec/transport.md §6).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol, runtime_checkable

import trio

from peerloom.core.errors import DecodeError, PeerloomError
from peerloom.core.identity import Identity, PeerId
from peerloom.core.messages import format_peer_address, parse_peer_address

LANE_CONTROL = 0
"""Small messages (votes, requests, announcements): never wait behind artifact bytes."""
LANE_BULK = 1
"""Artifact chunks and other large messages."""

PEER_FAULTS = frozenset({"bad-frame", "flow-control", "message-too-large", "decrypt-failed"})
"""TransportError reasons that only a misbehaving peer causes (not a network failure or a clean close)."""


class TransportError(PeerloomError):
    """The connection failed. `reason` is a stable code; `detail` is for people."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class ConnectionClosed(TransportError):
    """The connection is closed: ``eof`` (peer closed cleanly between messages), ``closed`` (by us),
    ``reset`` (the underlying stream broke)."""


def fault_reason(exc: TransportError) -> str:
    """The reason that ended a connection: an earlier receive error's for ``broken``, else `exc.reason`."""
    return exc.detail if exc.reason == "broken" and exc.detail else exc.reason


def first_transport_error(group: BaseExceptionGroup) -> TransportError | None:
    """The first TransportError inside `group` (nested groups included), or None."""
    matched: BaseException | None = group.subgroup(TransportError)
    while isinstance(matched, BaseExceptionGroup):
        matched = matched.exceptions[0]
    return matched if isinstance(matched, TransportError) else None


def canonical_address(text: str) -> str:
    """The canonical spelling of a listen or dial address (`parse_peer_address` forms; ``host:port`` means
    tcp). Raises ValueError naming the accepted forms."""
    try:
        return format_peer_address(*parse_peer_address(text))
    except DecodeError:
        raise ValueError(f"address {text!r} must be host:port (tcp), /ip4/HOST/tcp/PORT, /ip6/HOST/tcp/PORT, "
                         "http://HOST:PORT or memory://NAME, the host an IP literal") from None


def address_kind(address: str) -> str:
    """The transport kind (``tcp``, ``http``, ``memory``) of a canonical or legacy address; ValueError if
    it is not one."""
    try:
        return parse_peer_address(address)[0]
    except DecodeError:
        raise ValueError(f"not a transport address: {address!r}") from None


def address_host(address: str) -> str:
    """What per-IP limits count an address under: its IP literal, ``"memory"`` for in-process ones, and for
    a circuit (``<relay>/p2p-circuit/<peer-id>``, adapters/relay.py) the relay's."""
    kind, host, _ = parse_peer_address(address)
    if kind == "relay":
        return address_host(host.partition("/p2p-circuit/")[0])
    return "memory" if kind == "memory" else host


@runtime_checkable
class Connection(Protocol):
    """One secure, framed, flow-controlled connection to a proven peer.

    `send_message` waits while the lane's flow-control window is spent (backpressure) and raises
    TransportError when the connection fails; several tasks may send at once, and messages of one lane
    arrive whole and in call order. `receive_message(lane)` returns the next whole message of that lane (or
    of either lane, in completion order, when `lane` is None); it raises `ConnectionClosed` after an orderly
    end and `TransportError` after a fault, once the messages already received are drained.
    """

    remote_peer: PeerId

    @property
    def bytes_sent(self) -> int:
        """Bytes written to the wire so far (framing and encryption included)."""
        ...

    @property
    def bytes_received(self) -> int:
        """Bytes read from the wire so far."""
        ...

    @property
    def remote_address(self) -> tuple[str, int] | None:
        """(host, port) of the other end where the transport has one (address-book accounting), else None."""
        ...

    def queued_bytes(self, lane: int) -> int:
        """Bytes received on `lane` and not yet taken by `receive_message`."""
        ...

    async def send_message(self, data: bytes | bytearray | memoryview, *, lane: int | None = None) -> None: ...

    async def receive_message(self, lane: int | None = None) -> bytes: ...

    async def aclose(self) -> None: ...


Handler = Callable[[Connection], Awaitable[object]]


@runtime_checkable
class Transport(Protocol):
    """A way to reach peers. `kind` is the config name (``"tcp"``, ``"http"``, ``"memory"``, ``"relay"``).

    Implementations: `adapters.tcp.TcpTransport`, `adapters.http_transport.HttpTransport`,
    `adapters.memory.MemoryNetworkTransport`, and `adapters.relay.RelayTransport` over them; each takes a
    `tcp.SecureOptions` (timeouts, inbound caps, the `admit` / `on_handshake_failed` hooks an address book
    plugs into)."""

    kind: str

    def handles(self, address: str) -> bool:
        """True if `address` (see the module docstring) is one of this transport's."""
        ...

    async def dial(self, address: str, identity: Identity, *, expected_peer: PeerId | None = None,
                   max_message_bytes: int) -> Connection:
        """Connect to `address` and prove both ends; raises TransportError (``connect-failed``,
        ``handshake-timeout``, ``peer-mismatch``, ...)."""
        ...

    async def listen(self, address: str, identity: Identity, handler: Handler, *, max_message_bytes: int,
                     task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Accept connections on `address` forever; report the bound address (its real port) through
        `task_status.started(bound_address)`. Each accepted connection runs ``await handler(conn)`` in its
        own task and is closed when that returns; nothing the handler raises ends the listener."""
        ...

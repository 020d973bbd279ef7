"""Relays for peers that cannot be dialed (spec/transport.md §12), after libp2p's circuit relay v2.

A peer behind a NAT listens on ``<relay-address>/p2p-circuit``: it keeps one connection to the relay and a
*reservation* there, and advertises ``<relay-address>/p2p-circuit/<its peer id>``. A dialer of that
address connects to the relay and asks for a *circuit* to the peer; the relay tells the peer over its
reservation connection, the peer opens a second connection to the relay and accepts, and the relay then
copies bytes between the two connections. The Noise handshake of spec/transport.md §1 runs **end to end**
over that byte stream (`tcp.secure_stream` over `CircuitStream`), the dialer naming the peer id it expects,
so the relay carries only ciphertext: it can drop, delay or refuse, and learns who talks to whom and how
much, but it cannot read, forge or impersonate.

Every connection to a relay is itself an ordinary secure connection (any direct transport: tcp, http,
memory), so the relay knows the proven peer id of each end: a reservation belongs to the peer id that made
it, and only that peer can accept its circuits. Its first message is a request, canonical CBOR of at most
`MAX_REQUEST_BYTES` on the control lane:

- ``["reserve", {}]`` → ``["reserved", {"expires_s": float, "circuit_s": float, "circuit_bytes": int}]``
  or ``["refused", {"reason": tstr}]``; the connection stays open as the reservation's control connection,
  on which the peer renews (``reserve`` again) and the relay announces circuits:
  ``["incoming", {"token": bstr .size 16, "from": peer-id}]``;
- ``["connect", {"peer": peer-id}]`` (the dialer) and ``["accept", {"token": bstr .size 16}]`` (the
  reserved peer, on a new connection) → ``["connected", {}]`` on both, then the bulk lane of each carries
  the circuit's bytes (each message at most `DATA_CHUNK` bytes), or ``["refused", {"reason": tstr}]``.

Refusal reasons (also the `TransportError` reason a client raises): ``bad-request``,
``reservation-refused`` (the relay holds `RelayLimits.max_reservations`), ``no-reservation``,
``limit-exceeded`` (`max_circuits` in all or `max_circuits_per_reservation`), ``bad-token``,
``accept-timeout``. A circuit ends when either side closes, after `circuit_s` seconds or `circuit_bytes`
bytes (both directions together): the relay closes both connections. Within that, each circuit relays at
most `circuit_window_bytes` and each reservation (all its circuits together) at most
`reservation_window_bytes` per `window_s` seconds: beyond, the relay stops reading the circuit until the
next period, so the senders wait (backpressure) and nothing is lost.

`RelayServer` is the relay (a node with ``[relay] enabled = true``); `RelayTransport` is the client, an
`adapters.transport.Transport` of kind ``relay`` that dials circuit addresses and listens on relays.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
import trio

from peerloom.core.encoding import decode, encode
from peerloom.core.errors import PeerloomError
from peerloom.core.identity import Identity, PeerId
from peerloom.core.messages import CIRCUIT, format_peer_address, parse_peer_address

from .tcp import DEFAULT_MAX_MESSAGE_BYTES, SecureConnection, SecureOptions, secure_stream
from .transport import (
    LANE_BULK,
    LANE_CONTROL,
    Connection,
    ConnectionClosed,
    Transport,
    TransportError,
    fault_reason,
    first_transport_error,
)

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 1024
"""Largest relay control message (reserve, connect, accept, and the relay's answers), in bytes."""
DATA_CHUNK = 64 * 1024
"""Largest message of circuit bytes on a connection to a relay (bytes)."""
RELAY_MAX_MESSAGE_BYTES = 2 * DATA_CHUNK
"""`max_message_bytes` of connections to and from a relay: anything larger is `message-too-large`."""
TOKEN_BYTES = 16
REFUSALS = frozenset({"bad-request", "reservation-refused", "no-reservation", "limit-exceeded", "bad-token",
                      "accept-timeout"})
MIN_RENEW_S = 1.0  # a reservation is renewed at half its lifetime, but never more often than this (seconds)
MAX_BACKOFF_S = 10.0  # between attempts to (re)make a reservation after a failure (seconds)
LOST_GRACE_S = 3 * MAX_BACKOFF_S  # a lost reservation's slot waits this long for its peer (seconds)


@attrs.frozen(kw_only=True)
class RelayLimits:
    """What a relay grants (seconds and bytes); over a limit it answers a typed refusal.

    A reservation lasts `reservation_s` unless renewed; a circuit at most `circuit_s` seconds and
    `circuit_bytes` bytes (both directions); the relay holds at most `max_reservations` reservations (at
    most `max_reservations_per_ip` made from one remote address) and
    `max_circuits` circuits, at most `max_circuits_per_reservation` of them to one reserved peer; a reserved
    peer has `accept_timeout_s` to accept an announced circuit, and a new connection `request_timeout_s` to
    send its request. Per period of `window_s` seconds (a training window's order), one circuit relays at most
    `circuit_window_bytes` and one reservation's circuits together at most `reservation_window_bytes`, both
    directions counted; beyond, the circuit waits for the next period (spec/transport.md §12)."""

    reservation_s: float = 3600.0
    circuit_s: float = 3600.0
    circuit_bytes: int = 1 << 30
    max_reservations: int = 128
    max_circuits: int = 256
    max_circuits_per_reservation: int = 16
    max_reservations_per_ip: int = 8
    accept_timeout_s: float = 10.0
    request_timeout_s: float = 10.0
    window_s: float = 60.0
    circuit_window_bytes: int = 256 << 20
    reservation_window_bytes: int = 512 << 20

    def __attrs_post_init__(self) -> None:
        for name in ("reservation_s", "circuit_s", "accept_timeout_s", "request_timeout_s", "window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"relay {name} must be > 0")
        for name in ("circuit_window_bytes", "reservation_window_bytes"):
            if getattr(self, name) < RELAY_MAX_MESSAGE_BYTES:
                raise ValueError(f"relay {name} must be >= {RELAY_MAX_MESSAGE_BYTES} (one message)")
        for name in ("circuit_bytes", "max_reservations", "max_circuits", "max_circuits_per_reservation",
                     "max_reservations_per_ip"):
            if getattr(self, name) < 1:
                raise ValueError(f"relay {name} must be >= 1")


class RelayRefused(TransportError):
    """The relay refused a request; `reason` is one of `REFUSALS` (or ``bad-request`` for an answer that
    is not a relay message)."""


def split_circuit(address: str) -> tuple[str, PeerId]:
    """(relay's direct address, relayed peer) of a circuit address; TransportError("bad-address")."""
    try:
        kind, text, _ = parse_peer_address(address)
    except PeerloomError as exc:
        raise TransportError("bad-address", f"{address!r}: {exc}") from None
    if kind != "relay":
        raise TransportError("bad-address", f"{address!r} is not <relay>/p2p-circuit/<peer-id>")
    relay, _, peer = text.partition(CIRCUIT)
    return relay, PeerId.from_text(peer)


def relay_of_listen(address: str) -> str:
    """The relay's canonical direct address in a listen address ``<relay>/p2p-circuit`` (a trailing peer id,
    the listener's own, is allowed); TransportError("bad-address")."""
    base = address.split("/p2p-circuit", 1)[0]
    try:
        kind, host, port = parse_peer_address(base)
    except PeerloomError as exc:
        raise TransportError("bad-address", f"{address!r}: {exc}") from None
    if kind == "relay" or not address.startswith(base + "/p2p-circuit"):
        raise TransportError("bad-address", f"{address!r} is not <relay>/p2p-circuit")
    return format_peer_address(kind, host, port)


# --- messages ---------------------------------------------------------------------------------------------


def encode_message(kind: str, body: dict[str, Any]) -> bytes:
    return encode([kind, body])


def decode_message(data: bytes) -> tuple[str, dict[str, Any]]:
    """(kind, body) of a relay control message; RelayRefused("bad-request") for anything that is not a
    canonical CBOR ``[tstr, {…}]`` of at most `MAX_REQUEST_BYTES` (checked before parsing)."""
    try:
        message = decode(data, max_bytes=MAX_REQUEST_BYTES)
    except PeerloomError as exc:
        raise RelayRefused("bad-request", str(exc)) from None
    if not (isinstance(message, list) and len(message) == 2 and isinstance(message[0], str)
            and 1 <= len(message[0]) <= 32 and isinstance(message[1], dict)):
        raise RelayRefused("bad-request", "a relay message is [kind (1..32 characters), {body}]")
    return message[0], message[1]


def _body_bytes(body: dict[str, Any], key: str, size: int | None = None) -> bytes:
    value = body.get(key)
    if not isinstance(value, bytes) or (size is not None and len(value) != size) or len(value) > 64:
        raise RelayRefused("bad-request", f"{key} must be a byte string")
    return value


def _body_peer(body: dict[str, Any], key: str) -> PeerId:
    try:
        return PeerId.from_bytes(_body_bytes(body, key))
    except PeerloomError as exc:
        raise RelayRefused("bad-request", f"{key}: {exc}") from None


def _expect(body: dict[str, Any], keys: set[str]) -> None:
    if set(body) != keys:
        raise RelayRefused("bad-request", f"body keys must be {sorted(keys)}")


async def _receive_control(conn: Connection, timeout_s: float) -> tuple[str, dict[str, Any]]:
    """The next relay control message on `conn`; RelayRefused("bad-request") for a malformed one,
    TransportError for the connection, ("", {}) after `timeout_s` seconds (a real kind is never empty)."""
    with trio.move_on_after(timeout_s):
        data = await conn.receive_message(LANE_CONTROL)
        if len(data) > MAX_REQUEST_BYTES:
            raise RelayRefused("bad-request", f"{len(data)} bytes")
        return decode_message(data)
    return "", {}


async def _refuse(conn: Connection, reason: str, detail: str = "") -> None:
    """Tell `conn` why its request is refused (best effort: it may already be gone)."""
    log.info("relay refused %s: %s %s", conn.remote_peer.short(), reason, detail)
    try:
        with trio.move_on_after(2.0):
            await conn.send_message(encode_message("refused", {"reason": reason}), lane=LANE_CONTROL)
    except TransportError:
        pass


# --- the relay --------------------------------------------------------------------------------------------


@attrs.define(eq=False)
class _WindowBytes:
    """Bytes a circuit or a reservation may still relay in the current period of `window_s` seconds."""

    limit: int
    window_s: float
    left: int = 0
    resets_at: float = float("-inf")

    async def take(self, n: int) -> None:
        """Count `n` bytes (at most `limit`), first waiting for the next period when this one has too few left."""
        while True:  # both directions of a circuit, and a reservation's circuits, take from one count
            now = trio.current_time()
            if now >= self.resets_at:
                self.left, self.resets_at = self.limit, now + self.window_s
            if n <= self.left:
                self.left -= n
                return
            await trio.sleep_until(self.resets_at)


@attrs.define(eq=False)
class _Reservation:
    peer: PeerId
    conn: Connection
    expires: float
    circuits: int = 0
    ip: str = ""
    expired: bool = False
    relayed: _WindowBytes | None = None  # this period's bytes of all its circuits (`reservation_window_bytes`)


@attrs.define(eq=False)
class _Pending:
    """A circuit announced to its target and waiting for the target's `accept` connection."""

    target: PeerId
    accepted: trio.Event = attrs.Factory(trio.Event)
    done: trio.Event = attrs.Factory(trio.Event)  # the circuit ended: the accept handler may return
    other: Connection | None = None


class RelayServer:
    """The relay role (spec/transport.md §12): serve its requests on any direct transport's listener with
    ``await nursery.start(server.serve, transport, address)``. `handle` is the per-connection handler; it
    never raises for anything a peer sends (the transport's listener contains the rest). `refusals`
    counts refusals by reason; `reservations` and `circuits` are the live counts."""

    def __init__(self, limits: RelayLimits | None = None) -> None:
        self.limits = limits or RelayLimits()
        self._reservations: dict[PeerId, _Reservation] = {}
        self._pending: dict[bytes, _Pending] = {}
        # Peers whose reservation connection was lost -> (end of its grace, the address it reserved from)
        self._lost: dict[PeerId, tuple[float, str]] = {}
        self.circuits = 0
        self.circuits_total = 0
        self.refusals: Counter[str] = Counter()

    @property
    def reservations(self) -> int:
        return len(self._reservations)

    async def serve(self, transport: Transport, address: str, identity: Identity, *,
                    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Accept relay connections on `address` (a direct address of `transport`) until cancelled; reports
        the bound address."""
        await transport.listen(address, identity, self.handle, max_message_bytes=RELAY_MAX_MESSAGE_BYTES,
                               task_status=task_status)

    async def handle(self, conn: Connection) -> None:
        """One connection to the relay: its first message says what it is for."""
        try:
            kind, body = await _receive_control(conn, self.limits.request_timeout_s)
            if kind == "reserve":
                _expect(body, set())
                await self._reserve(conn)
            elif kind == "connect":
                _expect(body, {"peer"})
                await self._connect(conn, _body_peer(body, "peer"))
            elif kind == "accept":
                _expect(body, {"token"})
                await self._accept(conn, _body_bytes(body, "token", TOKEN_BYTES))
            elif kind:  # "": no request within request_timeout_s; the listener closes the connection
                raise RelayRefused("bad-request", f"unknown request {kind!r}")
        except RelayRefused as exc:
            self.refusals[exc.reason] += 1
            await _refuse(conn, exc.reason, exc.detail)

    async def _reserve(self, conn: Connection) -> None:
        peer, limits = conn.remote_peer, self.limits
        old = self._reservations.get(peer)
        ip = conn.remote_address[0] if conn.remote_address is not None else ""
        if old is None:
            now = trio.current_time()
            for held, (until, _) in list(self._lost.items()):
                if until <= now:
                    del self._lost[held]
            # A peer whose reservation connection was lost keeps its slot for `LOST_GRACE_S` (spec/transport.md
            # §12), in the relay's total and in its address's share: a flood of fresh identities, from its
            # address too, cannot take it while the peer reconnects.
            kept = [lost_ip for p, (_, lost_ip) in self._lost.items() if p != peer]
            if len(self._reservations) + len(kept) >= limits.max_reservations:
                raise RelayRefused("reservation-refused", f"{limits.max_reservations} reservations held")
            from_ip = sum(1 for r in self._reservations.values() if r.ip == ip) + kept.count(ip)
            if from_ip >= limits.max_reservations_per_ip:
                raise RelayRefused("reservation-refused", f"{limits.max_reservations_per_ip} reservations from {ip}")
            self._lost.pop(peer, None)
        if old is not None:  # a peer's new reservation replaces its old one (e.g. after a lost connection)
            await old.conn.aclose()
        reservation = _Reservation(peer=peer, conn=conn, expires=trio.current_time() + limits.reservation_s, ip=ip,
                                   relayed=_WindowBytes(limits.reservation_window_bytes, limits.window_s))
        if old is not None and old.relayed is not None:
            reservation.relayed = old.relayed  # a renewed or remade reservation keeps its period's count
        self._reservations[peer] = reservation
        try:
            while True:
                await conn.send_message(encode_message("reserved", {
                    "expires_s": float(limits.reservation_s), "circuit_s": float(limits.circuit_s),
                    "circuit_bytes": limits.circuit_bytes}), lane=LANE_CONTROL)
                kind, body = await _receive_control(conn, reservation.expires - trio.current_time())
                if not kind:
                    log.info("reservation of %s expired", peer.short())
                    reservation.expired = True
                    return
                if kind != "reserve":
                    raise RelayRefused("bad-request", "only reserve renews a reservation")
                _expect(body, set())
                reservation.expires = trio.current_time() + limits.reservation_s
        except TransportError as exc:
            if isinstance(exc, RelayRefused):
                raise
            log.info("reservation of %s ended: %s", peer.short(), exc)
        finally:
            if self._reservations.get(peer) is reservation:
                del self._reservations[peer]
                if not reservation.expired and len(self._lost) < limits.max_reservations:
                    self._lost[peer] = (trio.current_time() + LOST_GRACE_S, reservation.ip)

    async def _connect(self, conn: Connection, target: PeerId) -> None:
        limits = self.limits
        reservation = self._reservations.get(target)
        if reservation is None or reservation.expires <= trio.current_time():
            raise RelayRefused("no-reservation", target.short())
        if self.circuits >= limits.max_circuits:
            raise RelayRefused("limit-exceeded", f"{limits.max_circuits} circuits")
        if reservation.circuits >= limits.max_circuits_per_reservation:
            raise RelayRefused("limit-exceeded", f"{limits.max_circuits_per_reservation} circuits to {target.short()}")
        token = secrets.token_bytes(TOKEN_BYTES)
        pending = _Pending(target=target)
        self._pending[token] = pending
        self.circuits += 1
        reservation.circuits += 1
        try:
            try:
                await reservation.conn.send_message(encode_message("incoming", {
                    "token": token, "from": conn.remote_peer.to_bytes()}), lane=LANE_CONTROL)
            except TransportError:
                raise RelayRefused("no-reservation", f"{target.short()}'s reservation is gone") from None
            with trio.move_on_after(limits.accept_timeout_s):
                await pending.accepted.wait()
            other = pending.other
            if other is None:
                raise RelayRefused("accept-timeout", f"{target.short()} did not accept")
            self.circuits_total += 1
            connected = encode_message("connected", {})
            try:
                await other.send_message(connected, lane=LANE_CONTROL)
                await conn.send_message(connected, lane=LANE_CONTROL)
            except TransportError:
                return
            await self._splice(conn, other, reservation)
        finally:
            self._pending.pop(token, None)
            pending.done.set()
            self.circuits -= 1
            reservation.circuits -= 1

    async def _accept(self, conn: Connection, token: bytes) -> None:
        pending = self._pending.get(token)
        if pending is None or pending.other is not None or pending.target != conn.remote_peer:
            raise RelayRefused("bad-token", "no circuit waits for this token from this peer")
        pending.other = conn
        pending.accepted.set()
        await pending.done.wait()  # the connect side splices; this connection stays open until it ends

    async def _splice(self, a: Connection, b: Connection, reservation: _Reservation) -> None:
        """Copy the bulk lanes of `a` and `b` into each other until either side ends or a limit is reached
        (`circuit_s`, `circuit_bytes`); the caller's listeners then close both. Per period of `window_s`, the
        circuit's `circuit_window_bytes` and the reservation's `reservation_window_bytes` pace the copying:
        a message over either waits for the next period, and meanwhile nothing more is read."""
        limits = self.limits
        left = [limits.circuit_bytes]
        circuit = _WindowBytes(limits.circuit_window_bytes, limits.window_s)
        shared = reservation.relayed or _WindowBytes(limits.reservation_window_bytes, limits.window_s)

        async def pump(source: Connection, sink: Connection, cancel: trio.CancelScope) -> None:
            try:
                while True:
                    data = await source.receive_message(LANE_BULK)
                    left[0] -= len(data)
                    if left[0] < 0:
                        log.info("circuit %s-%s: byte limit reached", a.remote_peer.short(), b.remote_peer.short())
                        return
                    await circuit.take(len(data))
                    await shared.take(len(data))
                    await self.forward(sink, data)
            except TransportError as exc:
                log.debug("circuit ended: %s", exc)
            finally:
                cancel.cancel()

        with trio.move_on_after(self.limits.circuit_s):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump, a, b, nursery.cancel_scope)
                nursery.start_soon(pump, b, a, nursery.cancel_scope)
        with trio.CancelScope(shield=True):
            await a.aclose()
            await b.aclose()

    async def forward(self, sink: Connection, data: bytes) -> None:
        """Send one message of circuit bytes on `sink` (a seam for tests that play a malicious relay)."""
        await sink.send_message(data, lane=LANE_BULK)


# --- the client -------------------------------------------------------------------------------------------


class CircuitStream(trio.abc.Stream):
    """A trio byte stream over the bulk lane of a connection to a relay (the circuit's bytes, in messages
    of at most `DATA_CHUNK` bytes). EOF when the relay closes; a failed connection is BrokenResourceError."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._buffer = memoryview(b"")

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        try:
            for start in range(0, len(view), DATA_CHUNK):
                await self.conn.send_message(view[start:start + DATA_CHUNK], lane=LANE_BULK)
        except TransportError as exc:
            raise trio.BrokenResourceError(str(exc)) from exc

    async def wait_send_all_might_not_block(self) -> None:
        return None

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if not self._buffer:
            try:
                self._buffer = memoryview(await self.conn.receive_message(LANE_BULK))
            except ConnectionClosed as exc:
                if exc.reason == "eof":
                    return b""
                raise trio.BrokenResourceError(str(exc)) from exc
            except TransportError as exc:
                raise trio.BrokenResourceError(str(exc)) from exc
        n = len(self._buffer) if max_bytes is None else min(max_bytes, len(self._buffer))
        out = bytes(self._buffer[:n])
        self._buffer = self._buffer[n:]
        return out

    async def aclose(self) -> None:
        await self.conn.aclose()


class RelayedConnection:
    """A `Connection` to a peer through a relay: the end-to-end `SecureConnection` over a `CircuitStream`.
    `transport_kind` is ``relay``. ``decrypt-failed`` (a Noise message that does not authenticate) becomes
    ``relay-corrupted``: over a circuit the relay can cause it (tamper, drop, reorder), so it is not
    charged to the remote peer (spec/transport.md §12); every other reason is unchanged."""

    transport_kind = "relay"

    def __init__(self, inner: SecureConnection, relay: str) -> None:
        self.inner = inner
        self.relay = relay
        self.remote_peer = inner.remote_peer
        self.transport_cipher = inner.transport_cipher

    @property
    def bytes_sent(self) -> int:
        return self.inner.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.inner.bytes_received

    @property
    def remote_address(self) -> tuple[str, int] | None:
        return self.inner.remote_address

    def queued_bytes(self, lane: int) -> int:
        return self.inner.queued_bytes(lane)

    async def send_message(self, data: bytes | bytearray | memoryview, *, lane: int | None = None) -> None:
        try:
            await self.inner.send_message(data, lane=lane)
        except TransportError as exc:
            raise _relayed_error(exc) from exc

    async def receive_message(self, lane: int | None = None) -> bytes:
        try:
            return await self.inner.receive_message(lane)
        except TransportError as exc:
            raise _relayed_error(exc) from exc

    async def aclose(self) -> None:
        await self.inner.aclose()


def _relayed_error(exc: TransportError) -> TransportError:
    if fault_reason(exc) == "decrypt-failed":
        return TransportError("relay-corrupted", f"decrypt-failed over a relayed connection: {exc.detail}")
    return exc


class RelayTransport:
    """`Transport` of kind ``relay`` (spec/transport.md §12): dials ``<relay>/p2p-circuit/<peer-id>`` and
    listens on ``<relay>/p2p-circuit`` (a reservation, reported as ``<relay>/p2p-circuit/<own peer id>``),
    reaching the relay through one of `transports` (the direct ones). `options`: the handshake timeout and
    keep-alives of the end-to-end connection, and `max_connections`, the most relayed inbound connections
    served at once per listener."""

    kind = "relay"

    def __init__(self, transports: Sequence[Transport], options: SecureOptions | None = None) -> None:
        self.transports = list(transports)
        self.options = options or SecureOptions()

    def handles(self, address: str) -> bool:
        try:
            return parse_peer_address(address)[0] == "relay" and self._direct(split_circuit(address)[0]) is not None
        except PeerloomError:
            return False

    def _direct(self, address: str) -> Transport | None:
        return next((t for t in self.transports if t.handles(address)), None)

    async def _open(self, relay: str, identity: Identity, request: bytes) -> Connection:
        """A connection to `relay` that has sent `request` and been answered ``connected``; raises
        TransportError (the relay's refusal reason, or the connection's)."""
        transport = self._direct(relay)
        if transport is None:
            raise TransportError("bad-address", f"no transport reaches the relay {relay}")
        conn = await transport.dial(relay, identity, max_message_bytes=RELAY_MAX_MESSAGE_BYTES)
        try:
            await conn.send_message(request, lane=LANE_CONTROL)
            kind, body = await _receive_control(conn, 2 * self.options.handshake_timeout)
            if kind == "refused":
                reason = body.get("reason")
                raise RelayRefused(reason if reason in REFUSALS else "bad-request", f"by the relay {relay}")
            if kind != "connected":
                raise RelayRefused("bad-request", f"the relay {relay} answered {kind[:32]!r}" if kind else
                                   f"the relay {relay} did not answer")
        except BaseException:
            with trio.CancelScope(shield=True):
                await conn.aclose()
            raise
        return conn

    async def _secure(self, conn: Connection, relay: str, identity: Identity, *, initiator: bool,
                      expected_peer: PeerId | None, max_message_bytes: int) -> RelayedConnection:
        o = self.options
        inner = await secure_stream(CircuitStream(conn), identity, initiator=initiator, expected_peer=expected_peer,
                                    max_message_bytes=max_message_bytes, handshake_timeout=o.handshake_timeout,
                                    keepalive_interval=o.keepalive_interval, idle_timeout=o.idle_timeout,
                                    transport_ciphers=o.transport_ciphers,
                                    remote_address=conn.remote_address or ("relay", 0))
        return RelayedConnection(inner, relay)

    async def dial(self, address: str, identity: Identity, *, expected_peer: PeerId | None = None,
                   max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Connection:
        """Open a circuit to the peer named in `address` and run the Noise handshake with it end to end,
        expecting that peer. Raises TransportError: ``bad-address``, ``peer-mismatch`` (`expected_peer` is
        not the address's peer, or the far end is not), a relay refusal (`REFUSALS`), or any failure of
        the connection to the relay or of the handshake (``decrypt-failed`` when the relay tampers)."""
        relay, target = split_circuit(address)
        if expected_peer is not None and expected_peer != target:
            raise TransportError("peer-mismatch", f"{address} names {target.short()}, not {expected_peer.short()}")
        conn = await self._open(relay, identity, encode_message("connect", {"peer": target.to_bytes()}))
        return await self._secure(conn, relay, identity, initiator=True, expected_peer=target,
                                  max_message_bytes=max_message_bytes)

    async def listen(self, address: str, identity: Identity, handler: Callable[[Any], Awaitable[object]], *,
                     max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                     task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold a reservation at the relay of `address` (``<relay>/p2p-circuit``) forever, remaking it with
        backoff (0.5 s doubling to `MAX_BACKOFF_S`) whenever it is refused or lost, and serve each announced
        circuit: ``await handler(conn)`` in its own task, contained like `tcp.Acceptor`. Reports
        ``<relay>/p2p-circuit/<own peer id>`` at once (the relay need not be up yet)."""
        relay = relay_of_listen(address)
        if self._direct(relay) is None:
            raise TransportError("bad-address", f"no transport reaches the relay {relay}")
        limiter = trio.CapacityLimiter(max(1, self.options.max_connections))
        backoff = 0.5
        async with trio.open_nursery() as nursery:
            task_status.started(f"{relay}{CIRCUIT}{identity.peer_id.to_text()}")
            while True:
                try:
                    await self._hold_reservation(relay, identity, handler, max_message_bytes, nursery, limiter)
                    backoff = 0.5
                except TransportError as exc:
                    log.info("reservation at %s: %s", relay, exc)
                    await trio.sleep(backoff)
                    backoff = min(MAX_BACKOFF_S, 2 * backoff)
                    continue
                await trio.sleep(0.5)

    async def _hold_reservation(self, relay: str, identity: Identity, handler: Callable[[Any], Awaitable[object]],
                                max_message_bytes: int, nursery: trio.Nursery, limiter: trio.CapacityLimiter) -> None:
        """Reserve at `relay` and serve its announcements until the connection ends (returns) or the relay
        refuses (raises RelayRefused)."""
        transport = self._direct(relay)
        assert transport is not None
        conn = await transport.dial(relay, identity, max_message_bytes=RELAY_MAX_MESSAGE_BYTES)
        try:
            await conn.send_message(encode_message("reserve", {}), lane=LANE_CONTROL)
            renew_s = math.inf
            while True:
                kind, body = await _receive_control(conn, renew_s)
                if not kind:  # time to renew
                    await conn.send_message(encode_message("reserve", {}), lane=LANE_CONTROL)
                    renew_s = math.inf
                elif kind == "reserved":
                    expires = body.get("expires_s")
                    if not isinstance(expires, float) or not math.isfinite(expires) or expires <= 0:
                        raise RelayRefused("bad-request", "reserved without expires_s")
                    renew_s = max(MIN_RENEW_S, expires / 2)
                    log.info("reserved at %s for %.0f s", relay, expires)
                elif kind == "incoming":
                    _expect(body, {"token", "from"})
                    token = _body_bytes(body, "token", TOKEN_BYTES)
                    nursery.start_soon(self._accept, relay, identity, token, handler, max_message_bytes, limiter)
                elif kind == "refused":
                    reason = body.get("reason")
                    raise RelayRefused(reason if reason in REFUSALS else "bad-request", f"by the relay {relay}")
                else:
                    raise RelayRefused("bad-request", f"the relay sent {kind[:32]!r}")
        except ConnectionClosed as exc:
            log.info("reservation connection to %s closed: %s", relay, exc)
        finally:
            with trio.CancelScope(shield=True):
                await conn.aclose()

    async def _accept(self, relay: str, identity: Identity, token: bytes,
                      handler: Callable[[Any], Awaitable[object]], max_message_bytes: int,
                      limiter: trio.CapacityLimiter) -> None:
        """Open our side of an announced circuit and serve it (never raises: containment, §6)."""
        if limiter.available_tokens < 1:
            log.info("relayed connection via %s refused: %d served at once", relay, limiter.total_tokens)
            return
        async with limiter:
            try:
                conn = await self._open(relay, identity, encode_message("accept", {"token": token}))
                relayed = await self._secure(conn, relay, identity, initiator=False, expected_peer=None,
                                             max_message_bytes=max_message_bytes)
            except TransportError as exc:
                log.info("relayed connection via %s failed: %s", relay, exc)
                return
            try:
                await handler(relayed)
            except TransportError as exc:
                log.info("relayed connection from %s ended: %s", relayed.remote_peer.short(), exc)
            except Exception as exc:  # containment (spec/transport.md §6): it ends this connection only
                error = first_transport_error(exc) if isinstance(exc, BaseExceptionGroup) else None
                if error is None:
                    log.exception("relayed connection from %s ended by an error in its handler",
                                  relayed.remote_peer.short())
            finally:
                with trio.CancelScope(shield=True):
                    await relayed.aclose()

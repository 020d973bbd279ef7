"""The HTTP transport: a full node connection over one HTTP/1.1 WebSocket (spec/transport.md §10).

Addresses ``http://H:P``. The dialer opens ``GET /peerloom/v1/connect`` with ``Upgrade: websocket`` (RFC 6455),
so the connection passes proxies and firewalls that let only HTTP through (`HttpTransport(proxy=...)` dials
through an HTTP proxy). Every WebSocket message is binary and carries bytes of exactly the stream TCP
carries: the libp2p Noise XX handshake that proves both ends' PeerIds, then Noise transport messages
holding the frames of spec/transport.md §3 (`adapters.tcp.secure_stream` runs over `WebSocketStream`).
So identities, encryption, lanes, whole messages, credit-based flow control, the message-size limit
(refused before allocation), keep-alives and idle timeout are those of TCP, byte for byte; only the
carrier differs. A text WebSocket message is ``bad-frame``; a WebSocket message over `MAX_WS_MESSAGE` bytes
(more than one send turn of the frame layer) is ``message-too-large``; both are peer faults.

aiohttp runs on asyncio while the node runtime is trio: one daemon thread per process runs an asyncio loop
for every HTTP connection and listener (`_loop()`), and `WebSocketStream` crosses between the two with
`asyncio.run_coroutine_threadsafe` and the trio token. Reads are pulled (one WebSocket message at a time,
when the trio side asks), so TCP backpressure reaches the sender as with a raw socket.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import aiohttp
import trio
from aiohttp import web

from peerloom.core.errors import PeerloomError
from peerloom.core.identity import Identity, PeerId
from peerloom.core.messages import format_peer_address, parse_peer_address

from .tcp import DEFAULT_MAX_MESSAGE_BYTES, Acceptor, SecureConnection, SecureOptions, secure_stream
from .transport import TransportError

log = logging.getLogger(__name__)

HTTP_PATH = "/peerloom/v1/connect"
MAX_WS_MESSAGE = 2 * 2**20
"""Largest WebSocket message accepted (bytes): the frame layer writes at most ~1 MiB per send turn."""
_CLOSE_TIMEOUT_S = 2.0  # seconds to wait for the WebSocket closing handshake

_loop_lock = threading.Lock()
_loop_instance: asyncio.AbstractEventLoop | None = None


def _loop() -> asyncio.AbstractEventLoop:
    """The process's asyncio loop for HTTP connections, on a daemon thread started on first use."""
    global _loop_instance
    with _loop_lock:
        if _loop_instance is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="peerloom-http-transport", daemon=True).start()
            _loop_instance = loop
        return _loop_instance


async def _wait_future(future: concurrent.futures.Future[Any]) -> Any:
    """Await a concurrent future from trio (cancelling the wait leaves the future running)."""
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()

    def wake(_: object) -> None:
        try:
            token.run_sync_soon(done.set)
        except trio.RunFinishedError:
            pass

    future.add_done_callback(wake)
    await done.wait()
    return future.result()


def _submit(coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
    return asyncio.run_coroutine_threadsafe(coro, _loop())


class WebSocketStream(trio.abc.Stream):
    """A trio byte stream over an aiohttp WebSocket living on the HTTP loop thread (binary messages).

    `receive_some` returns the bytes of one WebSocket message (in pieces of at most `max_bytes`), b"" once
    the WebSocket is closed; it is cancel-safe (a message that arrives after a cancelled call is kept for
    the next). `send_all` sends one binary message. `aclose` starts closing the WebSocket (and then the client
    session, or wakes the server handler) without waiting for the peer, and is idempotent."""

    def __init__(self, ws: Any, *, on_close: Callable[[], Awaitable[None]] | None = None) -> None:
        self._ws = ws
        self._on_close = on_close
        self._pending: concurrent.futures.Future[Any] | None = None
        self._buffer = memoryview(b"")  # the unread rest of the last WebSocket message
        self._closed = False
        self._eof = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise trio.ClosedResourceError("stream closed")
        future = _submit(self._ws.send_bytes(bytes(data)))
        try:
            await _wait_future(future)
        except trio.Cancelled:
            future.cancel()
            raise
        except (ConnectionError, RuntimeError, aiohttp.ClientError) as exc:
            raise trio.BrokenResourceError(str(exc)) from exc

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await self._fill()
        size = len(self._buffer) if max_bytes is None else max_bytes
        data, self._buffer = bytes(self._buffer[:size]), self._buffer[size:]
        return data

    async def receive_into(self, buffer: memoryview) -> int:
        """Like `receive_some(len(buffer))` but copies straight into `buffer` (`tcp._receive_into`)."""
        await self._fill()
        n = min(len(buffer), len(self._buffer))
        buffer[:n] = self._buffer[:n]
        self._buffer = self._buffer[n:]
        return n

    async def _fill(self) -> None:
        """Wait until unread bytes or EOF; raises on a closed stream or a faulty WebSocket message."""
        if self._closed:
            raise trio.ClosedResourceError("stream closed")
        while not self._buffer and not self._eof:
            if self._pending is None:
                self._pending = _submit(self._ws.receive())
            message = await _wait_future(self._pending)  # cancelled: the pending receive is kept
            self._pending = None
            if message.type == aiohttp.WSMsgType.BINARY:
                self._buffer = memoryview(message.data)
            elif message.type == aiohttp.WSMsgType.TEXT:
                raise TransportError("bad-frame", "text WebSocket message")
            elif message.type == aiohttp.WSMsgType.ERROR:
                if getattr(message.data, "code", None) == aiohttp.WSCloseCode.MESSAGE_TOO_BIG:
                    raise TransportError("message-too-large", f"WebSocket message over {MAX_WS_MESSAGE} bytes")
                raise trio.BrokenResourceError(str(message.data))
            else:  # CLOSE, CLOSING, CLOSED
                self._eof = True

    async def aclose(self) -> None:
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        if self._pending is not None:
            self._pending.cancel()
        # Like closing a socket, do not wait for the peer: the closing handshake (at most _CLOSE_TIMEOUT_S)
        # finishes on the loop thread, so a peer that never answers it delays nobody.
        _submit(self._close())
        await trio.lowlevel.checkpoint()

    async def _close(self) -> None:
        try:
            await asyncio.wait_for(self._ws.close(), _CLOSE_TIMEOUT_S)
        except (TimeoutError, ConnectionError, RuntimeError, aiohttp.ClientError):
            pass
        finally:
            if self._on_close is not None:
                await self._on_close()


class HttpTransport:
    """`Transport` over HTTP/1.1 WebSockets (see the module docstring; spec/transport.md §10).

    `options`: timeouts, caps and admission hooks as for TCP. `proxy`: an ``http://`` proxy URL to dial
    through (None: connect directly; the environment's proxy variables are not read)."""

    kind = "http"

    def __init__(self, options: SecureOptions | None = None, *, proxy: str | None = None) -> None:
        self.options = options or SecureOptions()
        self.proxy = proxy

    def handles(self, address: str) -> bool:
        try:
            return parse_peer_address(address)[0] == "http"
        except PeerloomError:
            return False

    async def dial(self, address: str, identity: Identity, *, expected_peer: PeerId | None = None,
                   max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> SecureConnection:
        """Open the WebSocket to `address` and run the handshake as initiator. Raises TransportError:
        ``bad-address``, ``connect-failed`` (no HTTP server, or it refused the upgrade), handshake errors."""
        host, port = _http_endpoint(address)
        o = self.options
        url = f"{format_peer_address('http', host, port)}{HTTP_PATH}"
        future = _submit(_open_client(url, self.proxy, o.handshake_timeout))
        try:
            with trio.fail_after(o.handshake_timeout):
                session, ws = await _wait_future(future)
        except (trio.Cancelled, trio.TooSlowError) as exc:
            future.add_done_callback(_discard_client)
            if isinstance(exc, trio.TooSlowError):
                raise TransportError("handshake-timeout", f"WebSocket upgrade from {address}") from None
            raise
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise TransportError("connect-failed", f"{address}: {exc!r}") from exc

        async def close_session() -> None:
            await session.close()

        stream = WebSocketStream(ws, on_close=close_session)
        conn = await secure_stream(stream, identity, initiator=True, expected_peer=expected_peer,
                                   max_message_bytes=max_message_bytes, handshake_timeout=o.handshake_timeout,
                                   keepalive_interval=o.keepalive_interval, idle_timeout=o.idle_timeout,
                                   transport_ciphers=o.transport_ciphers, remote_address=(host, port))
        conn.transport_kind = self.kind
        return conn

    async def listen(self, address: str, identity: Identity, handler: Callable[[Any], Awaitable[object]], *,
                     max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                     task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve WebSocket upgrades on `address` (``http://H:P``; port 0 picks one) until cancelled: each one
        goes through `tcp.Acceptor` (caps, admission, responder handshake, containment). Reports the bound
        address. Raises OSError if it cannot bind. Other paths answer 404."""
        host, port = _http_endpoint(address, listening=True)

        async def handle(conn: SecureConnection) -> object:
            conn.transport_kind = self.kind
            return await handler(conn)

        acceptor = Acceptor(identity, handle, max_message_bytes=max_message_bytes, options=self.options)
        token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            def deliver(stream: WebSocketStream, remote: tuple[str, int], slot: Any) -> None:  # on the trio thread
                try:
                    nursery.start_soon(acceptor.accept, stream, remote, slot)
                except RuntimeError:  # the listener is closing
                    _submit(stream._close())

            server = _Server(token, deliver, acceptor.limiter)
            try:
                bound = await _wait_future(_submit(server.start(host, port)))
            except OSError as exc:
                raise OSError(exc.errno, f"cannot listen on {address}: {exc.strerror or exc}") from exc
            try:
                task_status.started(format_peer_address("http", host, bound))
                await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True):
                    await _wait_future(_submit(server.stop()))


def _refusal(reason: str) -> bytes:
    """The whole HTTP response that refuses a connection over a limit (spec/transport.md §13)."""
    body = f'{{"error": "limit", "reason": "{reason}"}}\n'.encode()
    return (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Retry-After: 1\r\nConnection: close\r\n\r\n").encode() + body


class _Guard(asyncio.Protocol):
    """aiohttp's protocol for one connection of the HTTP transport, wrapped (spec/transport.md §10, §13): the
    socket is counted by the limiter from accept to close, refused at once with a 503 naming the reason when
    over a limit; the request line and headers must be complete within `header_timeout` seconds of the
    accept (a client trickling a request line is closed, ``header-timeout``); `upgraded()` stops that clock.
    While the socket waits it is *idle* for the limiter, which may evict it to make room for a newcomer."""

    def __init__(self, inner: asyncio.Protocol, limiter: Any, guards: dict[asyncio.BaseTransport, _Guard]) -> None:
        self._inner, self._limiter, self._guards = inner, limiter, guards
        self._transport: asyncio.BaseTransport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.slot: Any = None
        self._upgrading = False  # the upgrade request arrived
        self._talking = False  # bytes arrived after it (the Noise handshake's first message): not idle

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        loop = asyncio.get_running_loop()
        peer = transport.get_extra_info("peername")
        ip = str(peer[0]) if peer else "unknown"
        slot = self._limiter.open(ip, now=time.monotonic(), evict=lambda: loop.call_soon_threadsafe(transport.close),
                                  probe=lambda: self._talking)
        if isinstance(slot, str):
            log.debug("refused an HTTP connection from %s: %s", ip, slot)
            if isinstance(transport, asyncio.WriteTransport):
                transport.write(_refusal(slot))
            transport.close()
            return
        self.slot = slot
        self._guards[transport] = self
        self._timer = loop.call_later(self._limiter.limits.http_header_timeout_s, self._expire)
        self._inner.connection_made(transport)

    def upgraded(self) -> None:
        self._upgrading = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        self._limiter.refuse("header-timeout")
        if self._transport is not None:
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        if self.slot is not None:
            self._talking = self._talking or self._upgrading
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self.slot is not None else None

    def pause_writing(self) -> None:
        if self.slot is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self.slot is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.slot is None:
            return
        self.upgraded()
        if self._transport is not None:
            self._guards.pop(self._transport, None)
        self._limiter.close(self.slot)
        self._inner.connection_lost(exc)


class _Server:
    """The aiohttp side of one HTTP listener (runs on the HTTP loop thread)."""

    def __init__(self, token: trio.lowlevel.TrioToken,
                 deliver: Callable[[WebSocketStream, tuple[str, int], Any], None], limiter: Any) -> None:
        self._token = token
        self._deliver = deliver
        self._limiter = limiter
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None
        self._open: set[asyncio.Future[None]] = set()
        self._guards: dict[asyncio.BaseTransport, _Guard] = {}

    async def start(self, host: str, port: int) -> int:
        app = web.Application()
        app.router.add_get(HTTP_PATH, self._handle)
        # keepalive_timeout: a kept-alive connection (after a 404) must send its next request as soon.
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=1.0,
                                     keepalive_timeout=self._limiter.limits.http_header_timeout_s)
        await self._runner.setup()
        server = self._runner.server
        assert server is not None
        # The default listen backlog (100) matters: asyncio accepts up to that many sockets per loop turn before
        # any of them reaches `_Guard`, so a larger one lets a flood take that many descriptors at once.
        self._listener = await asyncio.get_running_loop().create_server(
            lambda: _Guard(server(), self._limiter, self._guards), host, port, reuse_address=True)
        return int(self._listener.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        for done in list(self._open):
            if not done.done():
                done.set_result(None)
        if self._listener is not None:
            self._listener.close()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        guard = self._guards.get(request.transport) if request.transport is not None else None
        if guard is None:  # the socket is already gone (or was never counted)
            raise web.HTTPServiceUnavailable(text="connection closed\n")
        ws = web.WebSocketResponse(max_msg_size=MAX_WS_MESSAGE, autoclose=True, autoping=True)
        if not ws.can_prepare(request).ok:
            raise web.HTTPBadRequest(text="this endpoint takes a WebSocket upgrade\n")
        guard.upgraded()  # the Noise handshake's own start deadline applies from here (tcp.secure_stream)
        await ws.prepare(request)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._open.add(done)

        async def on_close() -> None:
            if not done.done():
                done.set_result(None)

        peer = request.transport.get_extra_info("peername") if request.transport else None
        remote = (str(peer[0]), int(peer[1])) if peer else (request.remote or "unknown", 0)
        stream = WebSocketStream(ws, on_close=on_close)
        try:
            self._token.run_sync_soon(self._deliver, stream, remote, guard.slot)
        except trio.RunFinishedError:
            await ws.close()
            return ws
        try:
            await done  # the trio side closes the stream (or the listener stops)
        finally:
            self._open.discard(done)
            if not ws.closed:
                await ws.close()
        return ws


async def _open_client(url: str, proxy: str | None, timeout: float) -> tuple[aiohttp.ClientSession, Any]:
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=timeout))
    try:
        ws = await session.ws_connect(url, proxy=proxy, max_msg_size=MAX_WS_MESSAGE, autoping=True,
                                      timeout=aiohttp.ClientWSTimeout(ws_close=_CLOSE_TIMEOUT_S))
    except BaseException:
        await session.close()
        raise
    return session, ws


def _discard_client(future: concurrent.futures.Future[Any]) -> None:
    """A dial was cancelled after the WebSocket opened: close it (on the loop thread)."""
    if future.cancelled() or future.exception() is not None:
        return
    session, ws = future.result()

    async def close() -> None:
        await ws.close()
        await session.close()

    _submit(close())


def _http_endpoint(address: str, *, listening: bool = False) -> tuple[str, int]:
    """(host, port) of an http address; listening also accepts port 0 and wildcard hosts. Raises
    TransportError("bad-address")."""
    if listening and address.startswith("http://"):
        host, sep, port_text = address[len("http://"):].rpartition(":")
        if sep and port_text.isdigit() and host:
            return host.strip("[]"), int(port_text)
    try:
        kind, host, port = parse_peer_address(address)
    except PeerloomError as exc:
        raise TransportError("bad-address", f"{address!r}: {exc}") from None
    if kind != "http":
        raise TransportError("bad-address", f"{address!r} is not an http address")
    return host, port


__all__ = ["HTTP_PATH", "MAX_WS_MESSAGE", "HttpTransport", "WebSocketStream"]

"""TCP transport on trio, secured by the libp2p ``/noise`` handshake (DESIGN §6).

Wire format, bottom up:

1. Noise messages, each prefixed by its 2-byte big-endian length (libp2p noise README, "Wire Format").
   The first three are the XX handshake (`peerloom.adapters.noise.Libp2pNoiseHandshake`); every later one is
   a transport message: ChaChaPoly ciphertext of at most 65519 plaintext bytes + 16-byte tag.
2. The decrypted transport plaintexts form one byte stream per direction. Application messages are
   framed in it as a 4-byte big-endian length followed by that many bytes; one application message spans
   as many Noise messages as it needs, and a Noise message boundary carries no meaning.

There is no multistream-select negotiation in front of the handshake: both ends are peerloom.

Errors are `TransportError` with a stable ``reason``: ``connect-failed``, ``handshake-timeout``,
``message-too-large``, ``truncated`` (EOF inside a frame), ``broken`` (after an earlier receive error),
any `NoiseError` reason of the handshake (``bad-identity-signature``, ``peer-mismatch``, ``decrypt-failed``,
...) or of the transport (``decrypt-failed``, ``nonce-exhausted``). `ConnectionClosed` (a
`TransportError`) has reason ``eof`` (clean close by the peer), ``closed`` (closed locally) or ``reset``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable

import trio

from peerloom.core.errors import PeerloomError
from peerloom.core.identity import Identity, PeerId

from .noise import (
    LENGTH_PREFIX_BYTES,
    MAX_TRANSPORT_PLAINTEXT,
    Libp2pNoiseHandshake,
    NoiseError,
    NoiseTransport,
    frame,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 16 * 2**20
DEFAULT_HANDSHAKE_TIMEOUT = 10.0  # seconds
APP_LENGTH_PREFIX_BYTES = 4
_RECEIVE_CHUNK = 256 * 1024  # bytes asked of the socket per receive_some
_SEND_BATCH = 16  # Noise messages (about 1 MiB) handed to the socket per send_all


class TransportError(PeerloomError):
    """The secure connection failed. `reason` is a stable code (see the module docstring)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class ConnectionClosed(TransportError):
    """The connection is closed: ``eof`` (peer closed cleanly between messages), ``closed`` (by us),
    ``reset`` (the socket broke)."""


class SecureConnection:
    """One Noise-secured TCP connection carrying length-framed application messages.

    `remote_peer` is the verified PeerId of the other end. `bytes_sent` / `bytes_received` count bytes on
    the socket (handshake included: length prefixes, Noise framing, ciphertext and tags). Senders are
    serialized by a lock, as are receivers, so messages never interleave. After a receive error the
    connection is closed and every later `receive_message` raises.
    """

    def __init__(self, stream: trio.SocketStream, transport: NoiseTransport, remote_peer: PeerId, *,
                 max_message_bytes: int, bytes_sent: int, bytes_received: int,
                 buffered: bytes = b"") -> None:
        self.remote_peer = remote_peer
        self.max_message_bytes = max_message_bytes
        self.bytes_sent = bytes_sent
        self.bytes_received = bytes_received
        self._stream = stream
        self._transport = transport
        self._wire = _WireReader(stream, self, buffered)
        self._plain = bytearray()  # decrypted bytes not yet returned as (part of) a message
        self._body_length: int | None = None  # length of the message being assembled, if any
        self._body_parts: list[bytes | bytearray] = []
        self._body_have = 0
        self._send_lock = trio.Lock()
        self._receive_lock = trio.Lock()
        self._closed = False
        self._broken: TransportError | None = None

    def __repr__(self) -> str:
        return f"SecureConnection({self.remote_peer.short()})"

    async def send_message(self, data: bytes) -> None:
        """Send one application message of at most `max_message_bytes` bytes.

        Raises TransportError("message-too-large") before sending anything, ConnectionClosed ("closed",
        "reset") if the connection is gone, TransportError("nonce-exhausted") after 2^64-1 messages.
        Cancelled part-way, a message may be half on the wire: the connection is then closed.
        """
        if len(data) > self.max_message_bytes:
            raise TransportError("message-too-large", f"{len(data)} > {self.max_message_bytes} bytes")
        body = memoryview(len(data).to_bytes(APP_LENGTH_PREFIX_BYTES, "big") + bytes(data))
        async with self._send_lock:
            if self._closed:
                raise ConnectionClosed("closed")
            n_chunks = max(1, math.ceil(len(body) / MAX_TRANSPORT_PLAINTEXT))
            try:
                for first in range(0, n_chunks, _SEND_BATCH):
                    batch = bytearray()
                    for i in range(first, min(first + _SEND_BATCH, n_chunks)):
                        chunk = body[i * MAX_TRANSPORT_PLAINTEXT:(i + 1) * MAX_TRANSPORT_PLAINTEXT]
                        batch += frame(self._transport.encrypt(chunk))
                    await self._send_raw(bytes(batch))
            except NoiseError as exc:
                await self._abort()
                raise TransportError(exc.reason, exc.detail) from exc
            except BaseException:
                await self._abort()
                raise

    async def _send_raw(self, data: bytes) -> None:
        try:
            await self._stream.send_all(data)
        except trio.ClosedResourceError as exc:
            raise ConnectionClosed("closed") from exc
        except trio.BrokenResourceError as exc:
            raise ConnectionClosed("reset", str(exc)) from exc
        self.bytes_sent += len(data)

    async def receive_message(self) -> bytes:
        """The next application message (bytes).

        Raises ConnectionClosed("eof") when the peer closed cleanly between messages, ConnectionClosed
        ("closed"/"reset"), TransportError("message-too-large") when the 4-byte length exceeds
        `max_message_bytes` (checked before the body is read or a buffer allocated), ("truncated") on EOF
        inside a frame, ("decrypt-failed") on a tampered Noise message, ("broken") after an earlier error.
        A clean EOF stays ConnectionClosed("eof") on every later call.
        """
        async with self._receive_lock:
            if self._broken is not None:
                if isinstance(self._broken, ConnectionClosed):
                    raise ConnectionClosed(self._broken.reason, "earlier")
                raise TransportError("broken", self._broken.reason) from self._broken
            try:
                return await self._receive_message()
            except TransportError as exc:
                if not (isinstance(exc, ConnectionClosed) and exc.reason == "closed"):
                    self._broken = exc
                    await self._abort()
                raise

    async def _receive_message(self) -> bytes:
        # Cancel-safe: a message being assembled lives in self._body_* until it is complete, so a
        # cancelled receive_message loses nothing and the next call resumes.
        if self._body_length is None:
            while len(self._plain) < APP_LENGTH_PREFIX_BYTES:
                plaintext = await self._receive_plaintext(at_boundary=not self._plain)
                if plaintext is None:
                    raise ConnectionClosed("eof")
                self._plain += plaintext
            length = int.from_bytes(self._plain[:APP_LENGTH_PREFIX_BYTES], "big")
            if length > self.max_message_bytes:
                raise TransportError("message-too-large", f"{length} > {self.max_message_bytes} bytes")
            del self._plain[:APP_LENGTH_PREFIX_BYTES]
            self._body_length, self._body_parts, self._body_have = length, [], 0
        length = self._body_length
        while True:
            take = min(length - self._body_have, len(self._plain))
            if take:
                self._body_parts.append(self._plain[:take])
                del self._plain[:take]
                self._body_have += take
            if self._body_have == length:
                message = b"".join(self._body_parts)
                self._body_length, self._body_parts, self._body_have = None, [], 0
                return message
            plaintext = await self._receive_plaintext(at_boundary=False)
            assert plaintext is not None
            if len(plaintext) <= length - self._body_have:  # inside a long message: no extra copy
                self._body_parts.append(plaintext)
                self._body_have += len(plaintext)
            else:
                self._plain += plaintext

    async def _receive_plaintext(self, *, at_boundary: bool) -> bytes | None:
        """Plaintext of the next Noise transport message; None on a clean EOF at a message boundary."""
        ciphertext = await self._wire.read_frame(at_boundary=at_boundary)
        if ciphertext is None:
            return None
        try:
            return self._transport.decrypt(ciphertext)
        except NoiseError as exc:
            raise TransportError(exc.reason, exc.detail) from exc

    async def _abort(self) -> None:
        self._closed = True
        with trio.CancelScope(shield=True):
            await self._stream.aclose()

    async def aclose(self) -> None:
        """Close the socket. Idempotent; pending and later sends/receives raise ConnectionClosed."""
        self._closed = True
        await self._stream.aclose()


class _WireReader:
    """Reads 2-byte-length-prefixed Noise messages off a stream, counting bytes into `counter`."""

    def __init__(self, stream: trio.SocketStream, counter: object, buffered: bytes = b"") -> None:
        self._stream = stream
        self._counter = counter
        self._buffer = bytearray(buffered)

    def take_buffer(self) -> bytes:
        """Bytes read past the last frame (handed from the handshake to the connection)."""
        out = bytes(self._buffer)
        self._buffer.clear()
        return out

    async def _fill(self, n: int) -> bool:
        """Make `n` bytes available; False if EOF came first."""
        while len(self._buffer) < n:
            try:
                data = await self._stream.receive_some(_RECEIVE_CHUNK)
            except trio.ClosedResourceError as exc:
                raise ConnectionClosed("closed") from exc
            except trio.BrokenResourceError as exc:
                raise ConnectionClosed("reset", str(exc)) from exc
            if not data:
                return False
            self._counter.bytes_received += len(data)  # type: ignore[attr-defined]
            self._buffer += data
        return True

    async def read_frame(self, *, at_boundary: bool) -> bytes | None:
        """The next Noise message (0..65535 bytes); None on EOF before its first byte if `at_boundary`.

        Raises TransportError("truncated") on EOF anywhere else.
        """
        if not await self._fill(LENGTH_PREFIX_BYTES):
            if at_boundary and not self._buffer:
                return None
            raise TransportError("truncated", "EOF inside a length prefix or message")
        length = int.from_bytes(self._buffer[:LENGTH_PREFIX_BYTES], "big")
        if not await self._fill(LENGTH_PREFIX_BYTES + length):
            raise TransportError("truncated", f"EOF inside a {length}-byte Noise message")
        out = bytes(self._buffer[LENGTH_PREFIX_BYTES:LENGTH_PREFIX_BYTES + length])
        del self._buffer[:LENGTH_PREFIX_BYTES + length]
        return out


class _Counter:
    def __init__(self) -> None:
        self.bytes_sent = 0
        self.bytes_received = 0


async def _secure(stream: trio.SocketStream, identity: Identity, *, initiator: bool,
                  expected_peer: PeerId | None, max_message_bytes: int,
                  handshake_timeout: float) -> SecureConnection:
    """Run the libp2p noise handshake on `stream`; close the stream and raise TransportError on failure."""
    counter = _Counter()
    reader = _WireReader(stream, counter)
    handshake = Libp2pNoiseHandshake(identity, initiator, expected_peer=expected_peer)
    try:
        with trio.fail_after(handshake_timeout):
            while not handshake.is_finished:
                if handshake.wants_write:
                    data = frame(handshake.write_message())
                    await stream.send_all(data)
                    counter.bytes_sent += len(data)
                else:
                    message = await reader.read_frame(at_boundary=False)
                    assert message is not None
                    handshake.read_message(message)
        transport = handshake.transport()
    except BaseException as exc:
        with trio.CancelScope(shield=True):
            await stream.aclose()
        if isinstance(exc, trio.TooSlowError):
            raise TransportError("handshake-timeout", f"{handshake_timeout} s") from exc
        if isinstance(exc, NoiseError):
            raise TransportError(exc.reason, exc.detail) from exc
        if isinstance(exc, (trio.BrokenResourceError, trio.ClosedResourceError)):
            raise ConnectionClosed("reset", "during the handshake") from exc
        raise
    assert handshake.remote_peer is not None
    return SecureConnection(stream, transport, handshake.remote_peer, max_message_bytes=max_message_bytes,
                            bytes_sent=counter.bytes_sent, bytes_received=counter.bytes_received,
                            buffered=reader.take_buffer())


async def connect(host: str, port: int, identity: Identity, *, expected_peer: PeerId | None = None,
                  max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                  handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT) -> SecureConnection:
    """Dial `host:port` and run the handshake as initiator; `handshake_timeout` in seconds.

    Raises TransportError: ``connect-failed`` (OSError from the dial), ``handshake-timeout``,
    ``peer-mismatch`` (the responder is not `expected_peer`), ``bad-identity-signature``, ...
    """
    try:
        stream = await trio.open_tcp_stream(host, port)
    except OSError as exc:
        raise TransportError("connect-failed", f"{host}:{port}: {exc}") from exc
    return await _secure(stream, identity, initiator=True, expected_peer=expected_peer,
                         max_message_bytes=max_message_bytes, handshake_timeout=handshake_timeout)


Handler = Callable[[SecureConnection], Awaitable[object]]


async def serve(host: str, port: int, identity: Identity, handler: Handler, *,
                max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
                task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Accept connections on `host:port` forever (use with ``await nursery.start(serve, ...)``).

    Reports the bound port through `task_status.started(port)` (so `port=0` works). Each connection gets
    its own task: the handshake as responder, then ``await handler(conn)``, then the connection is closed.
    A failed handshake, or a `TransportError` escaping the handler (the peer went away or misbehaved), is
    logged and ends that connection only; any other exception from the handler is a bug and propagates.
    """
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound_port = listeners[0].socket.getsockname()[1]

    async def serve_one(stream: trio.SocketStream) -> None:
        try:
            conn = await _secure(stream, identity, initiator=False, expected_peer=None,
                                 max_message_bytes=max_message_bytes, handshake_timeout=handshake_timeout)
        except TransportError as exc:
            log.info("inbound handshake failed: %s", exc)
            return
        try:
            await handler(conn)
        except TransportError as exc:
            log.info("connection from %s ended: %s", conn.remote_peer.short(), exc)
        finally:
            with trio.CancelScope(shield=True):
                await conn.aclose()

    async with trio.open_nursery() as nursery:
        task_status.started(bound_port)
        await trio.serve_listeners(serve_one, listeners, handler_nursery=nursery)

"""TCP transport on trio, secured by the libp2p ``/noise`` handshake (spec/design.md §6; spec/transport.md).

Wire format, bottom up (spec/transport.md has the byte layouts):

1. Noise messages, each prefixed by its 2-byte big-endian length (libp2p noise README, "Wire Format").
   The first three are the XX handshake (`peerloom.adapters.noise.Libp2pNoiseHandshake`); every later one is
   a transport message: AEAD ciphertext of at most 65519 plaintext bytes + 16-byte tag, ChaChaPoly unless
   both ends offered AESGCM in the handshake (spec/transport.md §1.1; `default_transport_ciphers`).
2. Each transport plaintext is exactly one *frame*: a 1-byte header ``kind << 4 | lane`` then a body.
   ``START`` opens an application message on a lane (4-byte big-endian total length, then the first
   fragment), ``CONTINUE`` carries the next fragment of the lane's open message, ``PING``/``PONG`` are
   keep-alives (8 opaque bytes), ``CREDIT`` grants the peer more bytes on a lane (flow control). Two lanes:
   0 (control) and 1 (bulk). Frames of different lanes interleave, so a small control message overtakes a
   large bulk message already on its way; within a lane messages arrive whole and in order. Each lane has
   its own credit window (`LANE_WINDOW`), returned only while the application keeps up with that lane, so a
   receiver that stops reading bulk stalls only bulk (spec/transport.md §4).

Decoding is sans-IO (`FrameDecoder`, `MessageAssembler`) so it can be fuzzed byte by byte; `SecureConnection`
adds the socket, the locks and the timers. `secure_stream` runs the handshake over any trio byte stream and
`Acceptor` is the inbound side (caps, admission, containment), so the HTTP and in-memory transports reuse
all of this (spec/transport.md §9-§11); `TcpTransport` is this module as an `adapters.transport.Transport`.
The errors, lanes and `PEER_FAULTS` are `adapters.transport`'s: import them from there.

Errors are `TransportError` with a stable ``reason``: ``connect-failed``, ``handshake-timeout``,
``message-too-large``, ``bad-frame`` (a frame breaking the rules of spec/transport.md §3), ``flow-control``
(the peer sent more than its credit), ``truncated``
(EOF inside a Noise message or an application message), ``idle-timeout``, ``broken`` (after an earlier
receive error), any `NoiseError` reason of the handshake (``bad-identity-signature``, ``peer-mismatch``,
``decrypt-failed``, ...) or of the transport (``decrypt-failed``, ``nonce-exhausted``). `ConnectionClosed`
(a `TransportError`) has reason ``eof`` (clean close by the peer), ``closed`` (closed locally) or ``reset``.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import select
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from peerloom.core.errors import PeerloomError
from peerloom.core.identity import Identity, PeerId
from peerloom.core.messages import format_peer_address, parse_peer_address

from .noise import (
    AESGCM_CIPHER,
    CHACHAPOLY,
    LENGTH_PREFIX_BYTES,
    MAX_MESSAGE_BYTES,
    MAX_TRANSPORT_PLAINTEXT,
    OPENSSL_AEADS,
    TAGLEN,
    Libp2pNoiseHandshake,
    NoiseError,
    NoiseTransport,
    frame,
)
from .transport import (
    LANE_BULK,
    LANE_CONTROL,
    ConnectionClosed,
    TransportError,
    first_transport_error,
)

__all__ = ["Acceptor", "FrameDecoder", "FrameMessage", "MessageAssembler", "SecureConnection", "SecureOptions",
           "TcpTransport", "connect", "encode_frames", "secure_stream", "serve"]

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 16 * 2**20
DEFAULT_HANDSHAKE_TIMEOUT = 10.0  # seconds
DEFAULT_KEEPALIVE_INTERVAL = 15.0  # seconds without receiving anything before we send a PING
DEFAULT_IDLE_TIMEOUT = 60.0  # seconds without receiving anything before the connection is dropped
DEFAULT_MAX_HANDSHAKES = 64  # concurrent inbound handshakes per `serve`
DEFAULT_MAX_HANDSHAKES_PER_IP = 8  # concurrent inbound handshakes per remote IP address
DEFAULT_MAX_CONNECTIONS = 256  # inbound connections (handshake or handler running) per `serve`
DEFAULT_MAX_CONNECTIONS_PER_IP = 64  # the same, per remote IP address (loopback demos share one IP)

APP_LENGTH_PREFIX_BYTES = 4
LANES = (LANE_CONTROL, LANE_BULK)
AUTO_CONTROL_MAX_BYTES = 64 * 1024  # send_message(lane=None): messages up to this size go on the control lane
KIND_START, KIND_CONTINUE, KIND_PING, KIND_PONG, KIND_CREDIT = 1, 2, 3, 4, 5
PING_BYTES = 8
CREDIT_BYTES = 4
# Flow control (spec/transport.md §4): each end may send this many bytes of message data per lane before the
# receiver grants more with CREDIT frames. A protocol constant: both ends start from it.
LANE_WINDOW = 4 * 2**20
MAX_CREDIT = 2**32 - 1  # a sender's credit on a lane may never exceed this (a CREDIT that would is bad-frame)
START_OVERHEAD = 1 + APP_LENGTH_PREFIX_BYTES  # header byte + total length
MAX_FRAGMENT = MAX_TRANSPORT_PLAINTEXT - 1  # 65518 bytes of message per CONTINUE frame
_WIRE_FRAME = LENGTH_PREFIX_BYTES + MAX_MESSAGE_BYTES  # 65537: the largest Noise message on the wire
_RECEIVE_BUFFER = 4 * _WIRE_FRAME  # preallocated receive buffer (bytes)
# Noise messages of a bulk message per turn on the socket (~1 MiB): a control message waits for at most one
# such turn. 16 rather than 4 about halves the sender's CPU beyond the AEAD (0.157 -> 0.133 s per 400 MB
# with 0.104 s of it ChaCha20-Poly1305, measured alone against a draining peer).
_BULK_BATCH_FRAMES = 16
_CONTROL_BATCH_FRAMES = 2  # a control message up to AUTO_CONTROL_MAX_BYTES fits in one turn


# Offer AES-256-GCM only where it beats ChaCha20-Poly1305 by this factor on this CPU, i.e. where AES runs in
# hardware (AES-NI, VAES, ARMv8 crypto): 16.7 against 3.5 GB/s on the development machine.
AESGCM_MIN_SPEEDUP = 1.5


@functools.cache
def default_transport_ciphers() -> tuple[str, ...]:
    """The transport ciphers this process offers by default (spec/transport.md §1.1): ``("AESGCM",)`` when
    OpenSSL's AES-256-GCM runs at least `AESGCM_MIN_SPEEDUP` times as fast as its ChaCha20-Poly1305 here
    (hardware AES), else ``()`` (ChaCha20-Poly1305 only, libp2p's cipher). Measured once per process: the
    best of 3 rounds of 16 encryptions of 64 KiB with each cipher, a few milliseconds in all."""
    block = bytes(MAX_TRANSPORT_PLAINTEXT)
    nonce = bytes(12)

    def seconds(cipher: str) -> float:
        aead = OPENSSL_AEADS[cipher](bytes(range(32)))
        best = math.inf
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(16):
                aead.encrypt(nonce, block, None)
            best = min(best, time.perf_counter() - start)
        return best

    faster = seconds(CHACHAPOLY) >= AESGCM_MIN_SPEEDUP * seconds(AESGCM_CIPHER)
    return (AESGCM_CIPHER,) if faster else ()


# --- sans-IO decoding ------------------------------------------------------------------------------------


class FrameDecoder:
    """Splits a byte stream into 2-byte-length-prefixed Noise messages, sans-IO, in a preallocated buffer.

    Feed with `feed(data)`, or zero-copy with ``n = recv_into(decoder.writable()); decoder.commit(n)``;
    then take messages with `next_frame()` until it returns None. Every byte sequence is a valid framing
    (a length is 0..65535), so nothing here raises; `pending` is the number of bytes of an incomplete
    message (0 at a message boundary). A returned memoryview is valid until the next `writable`/`feed`.
    """

    def __init__(self, capacity: int = _RECEIVE_BUFFER) -> None:
        if capacity < 2 * _WIRE_FRAME:
            raise ValueError(f"capacity must be at least {2 * _WIRE_FRAME} bytes")
        self._buffer = bytearray(capacity)
        self._view = memoryview(self._buffer)
        self._start = 0
        self._end = 0

    @property
    def pending(self) -> int:
        return self._end - self._start

    def writable(self) -> memoryview:
        """Free space at the end of the buffer (at least one whole Noise message); compacts if needed."""
        if len(self._buffer) - self._end < _WIRE_FRAME:
            size = self._end - self._start
            self._view[:size] = self._view[self._start:self._end]
            self._start, self._end = 0, size
        return self._view[self._end:]

    def commit(self, n: int) -> None:
        """Record that `n` bytes were written into the last `writable()` view."""
        if not 0 <= n <= len(self._buffer) - self._end:
            raise ValueError(f"commit of {n} bytes")
        self._end += n

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes; callers must drain `next_frame()` so that at most one partial message stays."""
        view = memoryview(data)
        while view:
            space = self.writable()
            if not space:
                raise ValueError("decoder full: drain next_frame() between feeds")
            n = min(len(space), len(view))
            space[:n] = view[:n]
            self.commit(n)
            view = view[n:]

    def next_frame(self) -> memoryview | None:
        """The next complete Noise message (0..65535 bytes, a view into the buffer), or None."""
        have = self._end - self._start
        if have < LENGTH_PREFIX_BYTES:
            return None
        length = self._buffer[self._start] << 8 | self._buffer[self._start + 1]
        if have < LENGTH_PREFIX_BYTES + length:
            return None
        begin = self._start + LENGTH_PREFIX_BYTES
        self._start = begin + length
        return self._view[begin:self._start]

    def take_rest(self) -> bytes:
        """The buffered bytes past the last message (handed from the handshake to the connection)."""
        out = bytes(self._view[self._start:self._end])
        self._start = self._end = 0
        return out


@attrs.frozen(kw_only=True)
class FrameMessage:
    """A whole application message arrived on `lane` (the decoder's event; the engine's event of that name
    is `peerloom.core.events.MessageReceived`)."""

    lane: int
    data: bytes


@attrs.frozen(kw_only=True)
class PingReceived:
    opaque: bytes


@attrs.frozen(kw_only=True)
class PongReceived:
    opaque: bytes


@attrs.frozen(kw_only=True)
class CreditReceived:
    """The peer lets us send `increment` more bytes of message data on `lane`."""

    lane: int
    increment: int


FrameEvent = FrameMessage | PingReceived | PongReceived | CreditReceived


class MessageAssembler:
    """Reassembles application messages from decrypted frames, sans-IO (spec/transport.md §3).

    `handle(plaintext)` takes one transport plaintext and returns a `FrameMessage` when it completes a
    message, a `PingReceived`/`PongReceived` for keep-alives, a `CreditReceived` for a CREDIT frame, or
    None. Raises TransportError ``bad-frame`` (empty frame, unknown kind or lane, START on a lane with an
    open message, CONTINUE without one or empty, a fragment longer than the rest of the message, a
    PING/PONG body that is not 8 bytes or not on lane 0, a CREDIT body that is not 4 bytes or is 0),
    ``message-too-large`` (the announced length exceeds `max_message_bytes`; checked before any buffer is
    sized for it) or ``flow-control`` (more message bytes on a lane than the window granted: `window`
    at start, plus every `grant`). `received[lane]` counts the message bytes taken on each lane. Memory:
    one reassembly buffer per lane, sized to the open message and kept between messages up to 2 MiB.

    Zero-copy path for the hot loop: `window(n)` offers a place inside the open bulk message where a
    plaintext of `n` bytes can be decrypted directly (its header byte lands on the byte before the
    fragment, saved here); then `handle_window(n)` processes it as `handle` would.
    """

    _KEEP_BYTES = 2 * 2**20  # reassembly buffers larger than this are released after their message

    def __init__(self, max_message_bytes: int, window: int = LANE_WINDOW) -> None:
        self.max_message_bytes = max_message_bytes
        self.received = [0, 0]  # message bytes taken per lane, ever
        self._allowance = [window, window]  # message bytes the peer may still send per lane
        self._length = [-1, -1]  # per lane: total length of the open message, -1 when none
        self._buffer = [bytearray(), bytearray()]
        self._have = [0, 0]
        self._saved = -1  # the byte under the window's header position

    def grant(self, lane: int, n: int) -> None:
        """We sent the peer a CREDIT of `n` bytes on `lane`: accept that many more."""
        self._allowance[lane] += n

    def _take(self, lane: int, n: int) -> None:
        if n > self._allowance[lane]:
            raise TransportError("flow-control", f"{n} bytes on lane {lane}, {self._allowance[lane]} allowed")
        self._allowance[lane] -= n
        self.received[lane] += n

    @property
    def at_boundary(self) -> bool:
        """True when no lane has a partly received message."""
        return self._length[0] < 0 and self._length[1] < 0

    def _complete(self, lane: int) -> FrameMessage:
        length, buffer = self._length[lane], self._buffer[lane]
        data = bytes(memoryview(buffer)[:length])
        if len(buffer) > self._KEEP_BYTES:
            self._buffer[lane] = bytearray()
        self._length[lane], self._have[lane] = -1, 0
        return FrameMessage(lane=lane, data=data)

    def window(self, n: int) -> memoryview | None:
        """Where to decrypt a plaintext of `n` bytes that is probably the bulk lane's next CONTINUE: a view
        starting one byte before the fragment's place, or None (no open bulk message, or it would not fit).
        The caller must then call `handle_window(n)` (or discard the assembler)."""
        lane = LANE_BULK
        have, length = self._have[lane], self._length[lane]
        if length < 0 or have < 1 or n < 2 or n - 1 > length - have:
            return None
        self._saved = self._buffer[lane][have - 1]
        return memoryview(self._buffer[lane])[have - 1:have - 1 + n]

    def handle_window(self, n: int) -> FrameEvent | None:
        """Process the `n`-byte plaintext decrypted into the last `window(n)`. Same results as `handle`."""
        lane, buffer, have = LANE_BULK, self._buffer[LANE_BULK], self._have[LANE_BULK]
        header = buffer[have - 1]
        buffer[have - 1] = self._saved
        if header == KIND_CONTINUE << 4 | lane:
            self._take(lane, n - 1)
            self._have[lane] = have + n - 1
            return self._complete(lane) if self._have[lane] == self._length[lane] else None
        plaintext = bytes([header]) + bytes(buffer[have:have + n - 1])
        return self.handle(plaintext)

    def handle(self, plaintext: bytes | bytearray | memoryview) -> FrameEvent | None:
        if not plaintext:
            raise TransportError("bad-frame", "empty frame")
        header = plaintext[0]
        kind, lane = header >> 4, header & 0x0F
        body = memoryview(plaintext)[1:]
        if kind in (KIND_PING, KIND_PONG):
            if lane != LANE_CONTROL or len(body) != PING_BYTES:
                raise TransportError("bad-frame", f"keep-alive header {header:#x}, {len(body)} bytes")
            return PingReceived(opaque=bytes(body)) if kind == KIND_PING else PongReceived(opaque=bytes(body))
        if lane not in LANES:
            raise TransportError("bad-frame", f"lane {lane}")
        if kind == KIND_CREDIT:
            increment = int.from_bytes(body, "big")
            if len(body) != CREDIT_BYTES or increment == 0:
                raise TransportError("bad-frame", f"CREDIT of {len(body)} bytes, increment {increment}")
            return CreditReceived(lane=lane, increment=increment)
        if kind == KIND_START:
            if self._length[lane] >= 0:
                raise TransportError("bad-frame", f"START on lane {lane} inside a message")
            if len(body) < APP_LENGTH_PREFIX_BYTES:
                raise TransportError("bad-frame", "START shorter than its length field")
            length = int.from_bytes(body[:APP_LENGTH_PREFIX_BYTES], "big")
            if length > self.max_message_bytes:
                raise TransportError("message-too-large", f"{length} > {self.max_message_bytes} bytes")
            fragment = body[APP_LENGTH_PREFIX_BYTES:]
            if len(fragment) > length:
                raise TransportError("bad-frame", f"fragment of {len(fragment)} bytes for a {length}-byte message")
            self._take(lane, len(fragment))
            if len(fragment) == length:
                return FrameMessage(lane=lane, data=bytes(fragment))
            if len(self._buffer[lane]) < length:
                self._buffer[lane] = bytearray(length)
            self._buffer[lane][:len(fragment)] = fragment
            self._length[lane], self._have[lane] = length, len(fragment)
            return None
        if kind == KIND_CONTINUE:
            length, have = self._length[lane], self._have[lane]
            if length < 0:
                raise TransportError("bad-frame", f"CONTINUE on lane {lane} without a message")
            if not body or len(body) > length - have:
                raise TransportError("bad-frame", f"fragment of {len(body)} bytes, {length - have} left")
            self._take(lane, len(body))
            self._buffer[lane][have:have + len(body)] = body
            self._have[lane] = have + len(body)
            return self._complete(lane) if self._have[lane] == length else None
        raise TransportError("bad-frame", f"kind {kind}")


def encode_frames(data: bytes | bytearray | memoryview, lane: int) -> list[bytes]:
    """The plaintext frames of one application message on `lane` (for tests and other implementations;
    the connection writes the same bytes straight into its send buffer)."""
    view = memoryview(data)
    first = MAX_TRANSPORT_PLAINTEXT - START_OVERHEAD
    frames = [bytes([KIND_START << 4 | lane]) + len(view).to_bytes(4, "big") + bytes(view[:first])]
    for pos in range(first, len(view), MAX_FRAGMENT):
        frames.append(bytes([KIND_CONTINUE << 4 | lane]) + bytes(view[pos:pos + MAX_FRAGMENT]))
    return frames


# --- the connection --------------------------------------------------------------------------------------


class SecureConnection:
    """One Noise-secured connection carrying whole application messages on two lanes, over a TCP socket
    or any other trio byte stream (the HTTP transport's WebSocket, an in-memory stream). Implements
    `adapters.transport.Connection`.

    `remote_peer` is the verified PeerId of the other end; `transport_cipher` the Noise cipher of the
    transport messages ("ChaChaPoly" or "AESGCM", spec/transport.md §1.1). `bytes_sent` /
    `bytes_received` count bytes on the socket (handshake included: length prefixes, Noise framing,
    ciphertext and tags).

    Sending: `send_message` may be called from several tasks at once. Messages of one lane go out whole and
    in call order (a lock per lane); the socket is shared turn by turn, a bulk message yielding it every
    16 Noise messages (about 1 MiB), so a control message waits at most one such turn.

    Flow control (spec/transport.md §4): per lane, the sender may have at most `LANE_WINDOW` bytes of
    message data that the receiver has not credited back; the receiver credits bytes back (CREDIT frames)
    only while the application keeps up with that lane (its queue of whole, unread messages is empty). So a
    receiver that stops reading the bulk lane stalls only the bulk lane of this connection: control
    messages keep flowing both ways, other connections are untouched, and what it buffers stays under
    ``LANE_WINDOW + max_message_bytes`` per lane.

    Receiving: `receive_message(lane)` returns the next message of one lane, or (lane None) of either lane
    in the order they completed; several tasks may receive at once (e.g. one per lane). Whoever needs
    bytes from the socket (a receiver, or a sender waiting for credit) reads for everybody, so a
    connection that is only sent on still reads its peer's credits. Keep-alive: after
    `keepalive_interval` seconds with nothing received we send a PING (answered by the peer with a PONG);
    after `idle_timeout` seconds with nothing received the connection is dropped with
    TransportError("idle-timeout"). After a receive error the connection is closed; queued messages are
    still delivered, then every `receive_message` raises.
    """

    def __init__(self, stream: trio.abc.Stream, transport: NoiseTransport, remote_peer: PeerId, *,
                 max_message_bytes: int, bytes_sent: int, bytes_received: int,
                 decoder: FrameDecoder | None = None, keepalive_interval: float = DEFAULT_KEEPALIVE_INTERVAL,
                 idle_timeout: float = DEFAULT_IDLE_TIMEOUT, remote_address: tuple[str, int] | None = None) -> None:
        self.remote_peer = remote_peer
        self.transport_cipher = transport.cipher
        self.max_message_bytes = max_message_bytes
        self.bytes_sent = bytes_sent
        self.bytes_received = bytes_received
        self.keepalive_interval = keepalive_interval
        self.idle_timeout = idle_timeout
        self.pings_sent = 0
        self.pongs_received = 0
        self._stream = stream
        self._remote_address = remote_address
        self._transport = transport
        self._decoder = decoder if decoder is not None else FrameDecoder()
        self._assembler = MessageAssembler(max_message_bytes)
        self._plain = memoryview(bytearray(MAX_TRANSPORT_PLAINTEXT))  # decrypt target, reused
        # Encrypt in place, reused; sized for a control turn and grown once to a bulk turn (~1 MiB) on the
        # first bulk send, so connections that only carry control messages stay small.
        self._send_view = memoryview(bytearray(_CONTROL_BATCH_FRAMES * _WIRE_FRAME))
        self._lane_locks = (trio.Lock(), trio.Lock())
        self._open_send = [False, False]  # per lane: part of a message is on the wire
        self._writing = False  # a socket write is in progress (cancelling it would cut a Noise message)
        self._wire_lock = trio.Lock()  # held while encrypting and writing: nonces must follow wire order
        self._receive_lock = trio.Lock()  # held by whoever reads the socket
        self._closed = False
        self._eof = False
        self._broken: TransportError | None = None
        self._broken_reported = False
        self._last_received = trio.current_time()
        self._last_ping = -math.inf
        self.transport_kind = "tcp" if isinstance(stream, trio.SocketStream) else "stream"
        # receiving side of flow control
        self._queues: tuple[deque[tuple[int, bytes]], deque[tuple[int, bytes]]] = (deque(), deque())
        self._queued_bytes = [0, 0]
        self._seq = 0
        self._credited = [0, 0]  # message bytes credited back to the peer per lane, ever
        # sending side of flow control
        self._credit = [LANE_WINDOW, LANE_WINDOW]
        # control frames waiting for the wire: credits per lane, a PONG, a PING
        self._pending_credit = [0, 0]
        self._pending_pong: bytes | None = None
        self._pending_ping: bytes | None = None
        self._recv_scope: trio.CancelScope | None = None
        self._changed = trio.Event()

    def __repr__(self) -> str:
        return f"SecureConnection({self.remote_peer.short()})"

    @property
    def remote_address(self) -> tuple[str, int] | None:
        """(ip, port) of the other end, or None once the socket is gone (for `AddressBook` accounting); for
        a stream that is not a TCP socket, the address given when the connection was made."""
        if not isinstance(self._stream, trio.SocketStream):
            return None if self._closed else self._remote_address
        try:
            host, port = self._stream.socket.getpeername()[:2]
        except OSError:
            return None
        return str(host), int(port)

    def queued_bytes(self, lane: int) -> int:
        """Bytes of whole messages received on `lane` that no `receive_message` has taken yet."""
        return self._queued_bytes[lane]

    def send_credit(self, lane: int) -> int:
        """Bytes of message data we may still send on `lane` before the peer credits more."""
        return self._credit[lane]

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -- sending --

    async def send_message(self, data: bytes | bytearray | memoryview, *, lane: int | None = None) -> None:
        """Send one application message of at most `max_message_bytes` bytes on `lane`.

        lane: LANE_CONTROL (0), LANE_BULK (1), or None: control if ``len(data) <= 65536`` else bulk.
        Blocks while the lane has no credit (the peer's application is not reading that lane) or TCP is
        full. Raises TransportError("message-too-large") before sending anything, ConnectionClosed
        ("closed", "reset") if the connection is gone, TransportError("nonce-exhausted") after 2^64-1 Noise
        messages, or the receive error that broke the connection while waiting for credit.
        Cancelled before any of its bytes were written (e.g. waiting for credit), the connection is intact;
        cancelled part-way, the message is half on the wire and the connection is closed.
        """
        size = len(data)
        if size > self.max_message_bytes:
            raise TransportError("message-too-large", f"{size} > {self.max_message_bytes} bytes")
        if lane is None:
            lane = LANE_CONTROL if size <= AUTO_CONTROL_MAX_BYTES else LANE_BULK
        if lane not in LANES:
            raise ValueError(f"lane must be 0 or 1, not {lane}")
        view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
        batch = _CONTROL_BATCH_FRAMES if lane == LANE_CONTROL else _BULK_BATCH_FRAMES
        async with self._lane_locks[lane]:
            if self._closed:
                raise ConnectionClosed("closed")
            try:
                pos = -1  # -1: START not written yet
                while pos < size:
                    if size and self._credit[lane] <= 0:
                        await self._wait_for_credit(lane)
                    async with self._wire_lock:
                        pos = await self._send_turn(view, lane, pos, batch)
                self._open_send[lane] = False
            except NoiseError as exc:
                await self._abort()
                raise TransportError(exc.reason, exc.detail) from exc
            except BaseException:
                # Half a message or half a Noise message on the wire cannot be taken back: hang up. A send
                # cancelled before writing anything (waiting for credit or the socket) leaves no trace.
                if self._open_send[lane] or self._writing:
                    await self._abort()
                raise

    async def _wait_for_credit(self, lane: int) -> None:
        """Read the socket (or wait for whoever is reading it) until `lane` has credit."""
        while self._credit[lane] <= 0:
            if self._closed or self._broken is not None:
                raise ConnectionClosed("closed") if self._broken is None else self._broken
            if self._receive_lock.locked():
                await self._changed.wait()
            else:
                await self._pump_once()

    async def _send_turn(self, view: memoryview, lane: int, pos: int, max_frames: int) -> int:
        """Encrypt up to `max_frames` frames of the message from `pos` (as far as the lane's credit goes)
        into the send buffer and write them, after any pending control frames; returns the new position.
        Called with the wire lock held."""
        if self._closed:
            raise ConnectionClosed("closed")
        control = self._encode_control()
        if control:
            await self._send_raw(control)
        if len(self._send_view) < max_frames * _WIRE_FRAME:
            self._send_view = memoryview(bytearray(max_frames * _WIRE_FRAME))
        buffer, out = self._send_view, 0
        size = len(view)
        credits, encrypt = self._credit, self._transport.encrypt_in_place
        for _ in range(max_frames):
            credit = credits[lane]
            if pos >= size or (pos >= 0 and credit <= 0):
                break
            start = out + LENGTH_PREFIX_BYTES
            if pos < 0:
                buffer[start] = KIND_START << 4 | lane
                buffer[start + 1:start + START_OVERHEAD] = size.to_bytes(4, "big")
                take = min(size, MAX_TRANSPORT_PLAINTEXT - START_OVERHEAD, credit)
                body, pos = start + START_OVERHEAD, 0
            else:
                buffer[start] = KIND_CONTINUE << 4 | lane
                take = min(size - pos, MAX_FRAGMENT, credit)
                body = start + 1
            end = body + take
            buffer[body:end] = view[pos:pos + take]
            pos += take
            credits[lane] = credit - take
            length = encrypt(buffer, start, end - start)
            buffer[out] = length >> 8
            buffer[out + 1] = length & 0xFF
            out = start + length
        if out:
            self._open_send[lane] = True
            await self._send_raw(buffer[:out])
        return pos

    def _encode_control(self) -> bytes:
        """Encrypt the pending CREDIT/PONG/PING frames (call with the wire lock held, then write them)."""
        plaintexts = []
        for lane in LANES:
            while self._pending_credit[lane]:
                n = min(self._pending_credit[lane], MAX_CREDIT)
                self._pending_credit[lane] -= n
                plaintexts.append(bytes([KIND_CREDIT << 4 | lane]) + n.to_bytes(CREDIT_BYTES, "big"))
        if self._pending_pong is not None:
            plaintexts.append(bytes([KIND_PONG << 4 | LANE_CONTROL]) + self._pending_pong)
            self._pending_pong = None
        if self._pending_ping is not None:
            plaintexts.append(bytes([KIND_PING << 4 | LANE_CONTROL]) + self._pending_ping)
            self._pending_ping = None
        return b"".join(frame(self._transport.encrypt(p)) for p in plaintexts)

    def _control_pending(self) -> bool:
        return bool(self._pending_credit[0] or self._pending_credit[1] or self._pending_pong is not None
                    or self._pending_ping is not None)

    async def _flush_control(self, done: trio.Event) -> None:
        """Write pending control frames; then stop the concurrent read that kept the socket drained."""
        try:
            async with self._wire_lock:  # waiting for the socket may be cancelled: nothing is written yet
                if not self._closed:
                    data = self._encode_control()
                    if data:
                        # Once encrypted, the frames must go out whole (nonces are spent): a cancelled
                        # receive must not cut them, so only the idle timeout may, and then we hang up.
                        with trio.CancelScope(shield=True, deadline=trio.current_time() + self.idle_timeout) \
                                as scope:
                            await self._send_raw(data)
                        if scope.cancelled_caught:
                            await self._abort()
        except (TransportError, NoiseError) as exc:
            log.debug("control frames to %s not sent: %s", self.remote_peer.short(), exc)  # the reader sees why
        finally:
            done.set()
            if self._recv_scope is not None:
                self._recv_scope.cancel()

    async def _send_raw(self, data: bytes | memoryview) -> None:
        self._writing = True
        try:
            await self._stream.send_all(data)
        except trio.ClosedResourceError as exc:
            raise ConnectionClosed("closed") from exc
        except trio.BrokenResourceError as exc:
            raise ConnectionClosed("reset", str(exc)) from exc
        self._writing = False
        self.bytes_sent += len(data)

    # -- receiving --

    async def receive_message(self, lane: int | None = None) -> bytes:
        """The next whole application message (bytes) of `lane`, or of either lane in the order they
        completed when `lane` is None.

        Raises ConnectionClosed("eof") when the peer closed cleanly between messages, ConnectionClosed
        ("closed"/"reset"), TransportError "message-too-large" (announced length over `max_message_bytes`,
        refused before the body is read), "bad-frame", "flow-control" (the peer sent more than its credit),
        "truncated" (EOF inside a Noise message or an application message), "decrypt-failed" (a tampered
        Noise message), "idle-timeout", or "broken" after an earlier error. Messages that arrived before
        an error are delivered first; a clean EOF stays ConnectionClosed("eof") on every later call.
        Cancel-safe: a cancelled call loses nothing and the next one resumes.
        """
        if lane is not None and lane not in LANES:
            raise ValueError(f"lane must be 0, 1 or None, not {lane}")
        while True:
            taken = self._peek(lane)
            if taken is not None:
                # Credit what the application has now caught up with before handing the message over.
                self._grant_credit(emptied=taken)
                if self._control_pending() and not self._receive_lock.locked() and not self._closed:
                    try:
                        await self._pump_once(flush_only=True)
                    except TransportError:
                        pass  # recorded in _broken: raised once the queued messages are taken
                return self._pop(taken)
            if self._broken is not None:
                self._raise_broken()
            if self._closed:
                raise ConnectionClosed("closed")
            if self._receive_lock.locked():
                await self._changed.wait()
            else:
                await self._pump_once()

    def _peek(self, lane: int | None) -> int | None:
        """The lane whose head message `receive_message(lane)` would take, or None."""
        queues = self._queues
        if lane is not None:
            return lane if queues[lane] else None
        if queues[0] and queues[1]:
            return 0 if queues[0][0][0] < queues[1][0][0] else 1
        return 0 if queues[0] else 1 if queues[1] else None

    def _pop(self, lane: int) -> bytes:
        data = self._queues[lane].popleft()[1]
        self._queued_bytes[lane] -= len(data)
        return data

    def _raise_broken(self) -> None:
        exc = self._broken
        assert exc is not None
        if not self._broken_reported:
            self._broken_reported = True
            raise exc
        if isinstance(exc, ConnectionClosed):
            raise ConnectionClosed(exc.reason, "earlier")
        raise TransportError("broken", exc.reason) from exc

    def _grant_credit(self, emptied: int | None = None) -> None:
        """Credit back received bytes on each lane whose queue is empty (or is about to be: `emptied` is a
        lane whose one queued message is being taken), in steps of at least half a window."""
        assembler = self._assembler
        for lane in LANES:
            queued = len(self._queues[lane]) - (1 if lane == emptied else 0)
            owed = assembler.received[lane] - self._credited[lane]
            if queued == 0 and owed >= LANE_WINDOW // 2:
                self._credited[lane] += owed
                assembler.grant(lane, owed)
                self._pending_credit[lane] += owed
                if self._recv_scope is not None:  # a reader is blocked in recv: let it flush the credit
                    self._recv_scope.cancel()

    async def _pump_once(self, *, flush_only: bool = False) -> None:
        """Read for everybody until at least one Noise message is processed, or (`flush_only`) until the
        pending control frames are written (takes the receive lock)."""
        try:
            async with self._receive_lock:
                if flush_only:
                    await self._flush_while_reading()
                else:
                    await self._pump()
        except TransportError as exc:
            if not (isinstance(exc, ConnectionClosed) and exc.reason == "closed"):
                self._broken = exc
            await self._abort()
            raise
        finally:
            self._notify()

    async def _pump(self) -> None:
        while True:
            if self._process_buffered():
                return
            if self._eof:
                if self._decoder.pending or not self._assembler.at_boundary:
                    raise TransportError("truncated", "EOF inside a Noise or application message")
                raise ConnectionClosed("eof")
            if self._control_pending() and not self._wire_lock.locked():
                if await self._flush_while_reading():
                    return
            elif await self._recv_more() is False:
                self._eof = True

    async def _flush_while_reading(self) -> int:
        """Write pending control frames while draining the socket, so two peers that both wait to write
        can never deadlock; returns the number of Noise messages processed meanwhile."""
        processed = 0
        try:
            async with trio.open_nursery() as nursery:
                done = trio.Event()
                nursery.start_soon(self._flush_control, done)
                while not done.is_set() and not self._eof:
                    if await self._recv_more() is False:
                        self._eof = True
                    processed += self._process_buffered()
        except BaseExceptionGroup as group:
            # The nursery wraps what its body or the flush raised; callers (and the per-connection handlers
            # above them) expect the TransportError itself, which ends this connection and nothing else.
            raise first_transport_error(group) or group from None
        return processed

    def _process_buffered(self) -> int:
        """Decrypt and dispatch every complete Noise message in the decoder; returns how many."""
        decoder, assembler, count = self._decoder, self._assembler, 0
        while (ciphertext := decoder.next_frame()) is not None:
            window = assembler.window(len(ciphertext) - TAGLEN)
            try:
                n = self._transport.decrypt_into(ciphertext, self._plain if window is None else window)
            except NoiseError as exc:
                raise TransportError(exc.reason, exc.detail) from exc
            if window is None:
                event = assembler.handle(self._plain[:n])
            else:
                event = assembler.handle_window(n)
            count += 1
            if isinstance(event, FrameMessage):
                self._queues[event.lane].append((self._seq, event.data))
                self._queued_bytes[event.lane] += len(event.data)
                self._seq += 1
            elif isinstance(event, CreditReceived):
                credit = self._credit[event.lane] + event.increment
                if credit > MAX_CREDIT:
                    raise TransportError("bad-frame", f"credit on lane {event.lane} over {MAX_CREDIT}")
                self._credit[event.lane] = credit
            elif isinstance(event, PingReceived):
                self._pending_pong = event.opaque  # at most one PONG owed: a PING flood costs one frame
            elif isinstance(event, PongReceived):
                self.pongs_received += 1
        if count:
            self._grant_credit()
            self._notify()
        return count

    async def _recv_more(self) -> bool | None:
        """Receive bytes into the decoder: True if some arrived, False on EOF, None if interrupted (control
        frames to write, or a PING came due). Enforces the idle timeout."""
        now = trio.current_time()
        idle_deadline = self._last_received + self.idle_timeout
        if now >= idle_deadline:
            raise TransportError("idle-timeout", f"nothing received for {self.idle_timeout} s")
        ping_deadline = max(self._last_received, self._last_ping) + self.keepalive_interval
        if now >= ping_deadline:
            self._last_ping = now
            self.pings_sent += 1
            self._pending_ping = os.urandom(PING_BYTES)
            return None
        with trio.move_on_at(min(idle_deadline, ping_deadline)) as scope:
            self._recv_scope = scope
            try:
                n = await _receive_into(self._stream, self._decoder.writable())
            except trio.ClosedResourceError as exc:
                raise ConnectionClosed("closed") from exc
            except (OSError, trio.BrokenResourceError) as exc:
                if self._closed:
                    raise ConnectionClosed("closed") from exc
                raise ConnectionClosed("reset", str(exc)) from exc
            finally:
                self._recv_scope = None
            if n:
                self._decoder.commit(n)
                self.bytes_received += n
                self._last_received = trio.current_time()
            return n > 0
        return None

    async def _abort(self) -> None:
        self._closed = True
        self._notify()
        with trio.CancelScope(shield=True):
            await self._stream.aclose()

    async def aclose(self) -> None:
        """Close the socket. Idempotent; pending and later sends/receives raise ConnectionClosed."""
        self._closed = True
        self._notify()
        await self._stream.aclose()


# --- handshake, dial, listen -----------------------------------------------------------------------------


class _Counter:
    def __init__(self) -> None:
        self.bytes_sent = 0
        self.bytes_received = 0


async def _receive_into(stream: trio.abc.Stream, buffer: memoryview) -> int:
    """Read from `stream` into `buffer`: zero-copy `recv_into` on a TCP socket, the stream's own
    `receive_into` where it has one (the HTTP transport's WebSocket), else `receive_some` (memory streams).
    Returns 0 at EOF; raises OSError or trio.BrokenResourceError/ClosedResourceError."""
    if isinstance(stream, trio.SocketStream):
        return await stream.socket.recv_into(buffer)
    receive_into = getattr(stream, "receive_into", None)  # http_transport.WebSocketStream: one copy fewer
    if receive_into is not None:
        return int(await receive_into(buffer))
    data = await stream.receive_some(len(buffer))
    buffer[:len(data)] = data
    return len(data)


async def _read_handshake_frame(stream: trio.abc.Stream, decoder: FrameDecoder, counter: _Counter) -> bytes:
    while (message := decoder.next_frame()) is None:
        try:
            n = await _receive_into(stream, decoder.writable())
        except (OSError, trio.BrokenResourceError) as exc:
            raise ConnectionClosed("reset", "during the handshake") from exc
        if not n:
            raise TransportError("truncated", "EOF during the handshake")
        decoder.commit(n)
        counter.bytes_received += n
    return bytes(message)


async def secure_stream(stream: trio.abc.Stream, identity: Identity, *, initiator: bool,
                        expected_peer: PeerId | None, max_message_bytes: int,
                        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
                        keepalive_interval: float = DEFAULT_KEEPALIVE_INTERVAL,
                        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
                        transport_ciphers: tuple[str, ...] | None = None,
                        remote_address: tuple[str, int] | None = None,
                        start_timeout: float | None = None,
                        on_started: Callable[[], str | None] | None = None) -> SecureConnection:
    """Run the libp2p noise handshake on any trio byte `stream` (a TCP socket, an in-memory stream, a
    WebSocket) and return the `SecureConnection` over it; close the stream and raise TransportError on
    failure (``handshake-timeout`` after `handshake_timeout` seconds, ``peer-mismatch``, ...).
    `remote_address` is what `SecureConnection.remote_address` reports for a stream that is not a socket.

    Responder only (spec/transport.md §13): the peer's first handshake message must arrive within
    `start_timeout` seconds (else ``start-timeout``), and `on_started()` is asked after it, before any
    public-key work: a reason it returns (``handshake-rate``) ends the handshake with that reason."""
    counter = _Counter()
    decoder = FrameDecoder()
    offer = default_transport_ciphers() if transport_ciphers is None else transport_ciphers
    handshake = Libp2pNoiseHandshake(identity, initiator, expected_peer=expected_peer, transport_ciphers=offer)
    try:
        with trio.fail_after(handshake_timeout):
            if not initiator and start_timeout is not None:
                with trio.move_on_after(start_timeout):
                    handshake.read_message(await _read_handshake_frame(stream, decoder, counter))
                if not handshake.wants_write:  # nothing arrived in time
                    raise TransportError("start-timeout", f"no handshake message within {start_timeout} s")
            if not initiator and on_started is not None and (refused := on_started()) is not None:
                raise TransportError(refused, "refused before the handshake")
            while not handshake.is_finished:
                if handshake.wants_write:
                    data = frame(handshake.write_message())
                    await stream.send_all(data)
                    counter.bytes_sent += len(data)
                else:
                    handshake.read_message(await _read_handshake_frame(stream, decoder, counter))
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
                            decoder=decoder, keepalive_interval=keepalive_interval, idle_timeout=idle_timeout,
                            remote_address=remote_address)


async def connect(host: str, port: int, identity: Identity, *, expected_peer: PeerId | None = None,
                  max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                  handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
                  keepalive_interval: float = DEFAULT_KEEPALIVE_INTERVAL,
                  idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
                  transport_ciphers: tuple[str, ...] | None = None) -> SecureConnection:
    """Dial `host:port` and run the handshake as initiator; timeouts and intervals in seconds.

    `transport_ciphers`: the transport ciphers offered besides ChaChaPoly, preferred first
    (spec/transport.md §1.1); None = `default_transport_ciphers()`, () = ChaChaPoly only.

    Raises TransportError: ``connect-failed`` (OSError from the dial), ``handshake-timeout``,
    ``peer-mismatch`` (the responder is not `expected_peer`), ``bad-identity-signature``, ...
    """
    try:
        with trio.fail_after(handshake_timeout):
            stream = await trio.open_tcp_stream(host, port)
    except (OSError, trio.TooSlowError) as exc:
        raise TransportError("connect-failed", f"{host}:{port}: {exc!r}") from exc
    return await secure_stream(stream, identity, initiator=True, expected_peer=expected_peer,
                               max_message_bytes=max_message_bytes, handshake_timeout=handshake_timeout,
                               keepalive_interval=keepalive_interval, idle_timeout=idle_timeout,
                               transport_ciphers=transport_ciphers)


Handler = Callable[[SecureConnection], Awaitable[object]]


@attrs.frozen(kw_only=True)
class SecureOptions:
    """Settings shared by the transports that run `secure_stream` (tcp, http, memory); seconds for times.

    `admit(ip)` may refuse an inbound connection before its handshake (e.g. `AddressBook.admit_inbound`);
    `on_handshake_failed(ip, error)` hears about failed inbound handshakes. See `serve` for the caps.

    `limiter` (an `adapters.limits.ConnectionLimiter`) applies one set of limits to every listener that
    shares it (spec/transport.md §13); without one, each listener gets its own, built from the caps here.
    `protected(peer)` says whether an authenticated inbound peer is *known*; the limiter keeps slots for
    known peers that strangers cannot take (None: every peer counts as known)."""

    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT
    keepalive_interval: float = DEFAULT_KEEPALIVE_INTERVAL
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT
    transport_ciphers: tuple[str, ...] | None = None
    max_handshakes: int = DEFAULT_MAX_HANDSHAKES
    max_handshakes_per_ip: int = DEFAULT_MAX_HANDSHAKES_PER_IP
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_connections_per_ip: int = DEFAULT_MAX_CONNECTIONS_PER_IP
    admit: Callable[[str], bool] | None = None
    on_handshake_failed: Callable[[str, TransportError], object] | None = None
    limiter: Any = None
    protected: Callable[[PeerId], bool] | None = None

    def make_limiter(self) -> Any:
        """`limiter`, or a fresh `ConnectionLimiter` with this object's caps (and the default handshake rate
        and start deadline of `adapters.limits.Limits`)."""
        if self.limiter is not None:
            return self.limiter
        from .limits import ConnectionLimiter, Limits

        pending, default = min(self.max_handshakes, self.max_connections), Limits()
        return ConnectionLimiter(Limits(
            max_pending=pending, max_pending_per_ip=min(self.max_handshakes_per_ip, pending),
            max_inbound=self.max_connections, max_inbound_per_ip=min(self.max_connections_per_ip, self.max_connections),
            max_strangers=default.max_peers, handshake_start_s=min(self.handshake_timeout, default.handshake_start_s)))


def _readable_probe(stream: trio.abc.Stream) -> Callable[[], bool] | None:
    """For a socket stream: a check, without reading, whether bytes (or EOF) wait to be read."""
    if not isinstance(stream, trio.SocketStream):
        return None
    fd = stream.socket.fileno()

    def probe() -> bool:
        poller = select.poll()
        try:
            poller.register(fd, select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return False

    return probe


# TransportError reasons of an inbound handshake that are this node's own refusals (spec/transport.md §13),
# not something the peer did wrong: never reported to `on_handshake_failed`.
LIMIT_REASONS = frozenset({"handshake-rate", "start-timeout"})


class Acceptor:
    """Inbound side of every stream transport: caps and admission before any byte is read, the responder
    handshake, then ``await handler(conn)`` with containment (spec/transport.md §5, §6, §13).

    `accept(stream, remote)` serves one accepted byte stream from `remote` ((ip, port); the ip is what the
    per-IP caps and `admit` see) and returns when the handler has returned and the connection is closed.
    Never raises for anything the peer or the handler does (cancellation aside). The limits are those of
    `options.limiter` (shared across listeners) or the listener's own (`SecureOptions.make_limiter`)."""

    def __init__(self, identity: Identity, handler: Callable[[Any], Awaitable[object]], *,
                 max_message_bytes: int, options: SecureOptions) -> None:
        self.identity = identity
        self.handler = handler
        self.max_message_bytes = max_message_bytes
        self.options = options
        self.limiter = options.make_limiter()

    async def accept(self, stream: trio.abc.Stream, remote: tuple[str, int], slot: Any = None) -> None:
        """Serve `stream`. `slot`: the limiter's slot when the caller already counted the socket (and closes
        it with the socket, as the HTTP transport does); else it is counted here."""
        options, ip, limiter = self.options, remote[0], self.limiter
        own = slot is None
        scope = trio.CancelScope()
        if own:
            token = trio.lowlevel.current_trio_token()
            slot = limiter.open(ip, now=time.monotonic(), evict=lambda: token.run_sync_soon(scope.cancel),
                                probe=_readable_probe(stream))
            if isinstance(slot, str):
                log.debug("refused a connection from %s: %s", ip, slot)
                await stream.aclose()
                return
        try:
            if options.admit is not None and not options.admit(ip):
                log.info("refused a connection from %s: not admitted", ip)
                await stream.aclose()
                return
            with scope:
                conn = await self._handshake(stream, remote, slot)
            if scope.cancelled_caught:  # evicted while idle to make room for a newcomer
                with trio.CancelScope(shield=True):
                    await stream.aclose()
                return
            if conn is None:
                return
            known = options.protected is None or options.protected(conn.remote_peer)
            refused = limiter.established(slot, known=known)
            if refused is not None:
                log.debug("refused %s from %s: %s", conn.remote_peer.short(), ip, refused)  # counted (§13)
                with trio.CancelScope(shield=True):
                    await conn.aclose()
                return
            await self._serve(conn)
        finally:
            if own:
                limiter.close(slot)

    async def _handshake(self, stream: trio.abc.Stream, remote: tuple[str, int], slot: Any) -> SecureConnection | None:
        options, ip = self.options, remote[0]
        try:
            return await secure_stream(stream, self.identity, initiator=False, expected_peer=None,
                                       max_message_bytes=self.max_message_bytes,
                                       handshake_timeout=options.handshake_timeout,
                                       keepalive_interval=options.keepalive_interval,
                                       idle_timeout=options.idle_timeout,
                                       transport_ciphers=options.transport_ciphers, remote_address=remote,
                                       start_timeout=self.limiter.limits.handshake_start_s,
                                       on_started=lambda: self.limiter.started(slot, now=time.monotonic()))
        except TransportError as exc:
            if exc.reason in LIMIT_REASONS:
                if exc.reason == "start-timeout":
                    self.limiter.refuse(exc.reason)
                log.debug("inbound handshake from %s refused: %s", ip, exc)
                return None
            log.info("inbound handshake from %s failed: %s", ip, exc)
            if options.on_handshake_failed is not None:
                options.on_handshake_failed(ip, exc)
            return None

    async def _serve(self, conn: SecureConnection) -> None:
        try:
            await self.handler(conn)
        except TransportError as exc:
            log.info("connection from %s ended: %s", conn.remote_peer.short(), exc)
        except BaseExceptionGroup as group:
            # A handler's nursery: the connection's own end (eof as the peer goes) may come beside a Cancelled
            # (the listener is being cancelled at that moment). The errors end this connection only
            # (containment); only the rest (Cancelled, KeyboardInterrupt) goes on up.
            errors, rest = group.split(Exception)
            if errors is not None:
                self._ended(conn, errors)
            if rest is not None:
                raise rest from None
        except Exception as exc:  # containment (spec/transport.md §6): it ends this connection only
            self._ended(conn, exc)
        finally:
            with trio.CancelScope(shield=True):
                await conn.aclose()

    @staticmethod
    def _ended(conn: SecureConnection, exc: Exception) -> None:
        transport = first_transport_error(exc) if isinstance(exc, BaseExceptionGroup) else None
        if transport is not None:
            log.info("connection from %s ended: %s", conn.remote_peer.short(), transport)
        else:
            log.error("connection from %s ended by an error in its handler", conn.remote_peer.short(),
                      exc_info=exc)


async def serve(host: str, port: int, identity: Identity, handler: Handler, *,
                max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
                max_handshakes: int = DEFAULT_MAX_HANDSHAKES,
                max_handshakes_per_ip: int = DEFAULT_MAX_HANDSHAKES_PER_IP,
                max_connections: int = DEFAULT_MAX_CONNECTIONS,
                max_connections_per_ip: int = DEFAULT_MAX_CONNECTIONS_PER_IP,
                admit: Callable[[str], bool] | None = None,
                on_handshake_failed: Callable[[str, TransportError], object] | None = None,
                keepalive_interval: float = DEFAULT_KEEPALIVE_INTERVAL,
                idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
                transport_ciphers: tuple[str, ...] | None = None,
                limiter: Any = None, protected: Callable[[PeerId], bool] | None = None,
                task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Accept connections on `host:port` forever (use with ``await nursery.start(serve, ...)``).

    Reports the bound port through `task_status.started(port)` (so `port=0` works). Each connection gets
    its own task: the handshake as responder (at most `handshake_timeout` seconds), then
    ``await handler(conn)``, then the connection is closed. At most `max_handshakes` handshakes run at once,
    and at most `max_handshakes_per_ip` from one remote address; when a cap is full, the oldest socket that
    has sent nothing yet is closed to make room, and a newcomer is closed at once, before any byte is read,
    only when every pending socket has started its handshake (slowloris defence: a flood costs the attacker
    a socket each and us nothing beyond the cap, and cannot keep an honest dialer out). The first handshake
    message is due within `Limits.handshake_start_s` (5 s) and each address gets a token bucket of handshakes
    (spec/transport.md §13). Likewise at most `max_connections` inbound connections are open at once
    (handshaking or in the handler), at most `max_connections_per_ip` from one address, and `admit(ip)`
    (e.g. an `AddressBook`'s ban list) may refuse an address. A failed handshake is reported to
    `on_handshake_failed(ip, error)` (e.g. `AddressBook.inbound_handshake_failed`) and logged. Any exception
    escaping the handler (a TransportError, an exception group from its nurseries, or a bug, logged with its
    traceback) ends that connection only, never `serve` (spec/transport.md §6). `transport_ciphers` as for
    `connect`. `limiter` and `protected` as in `SecureOptions` (a shared `ConnectionLimiter` replaces the
    caps above; spec/transport.md §13).
    """
    options = SecureOptions(handshake_timeout=handshake_timeout, keepalive_interval=keepalive_interval,
                            idle_timeout=idle_timeout, transport_ciphers=transport_ciphers,
                            max_handshakes=max_handshakes, max_handshakes_per_ip=max_handshakes_per_ip,
                            max_connections=max_connections, max_connections_per_ip=max_connections_per_ip,
                            admit=admit, on_handshake_failed=on_handshake_failed, limiter=limiter,
                            protected=protected)
    acceptor = Acceptor(identity, handler, max_message_bytes=max_message_bytes, options=options)
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:  # name the address: "port in use" is a user error the CLI reports in one line
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    bound_port = listeners[0].socket.getsockname()[1]

    async def serve_one(stream: trio.SocketStream) -> None:
        try:
            host, port = stream.socket.getpeername()[:2]
        except OSError:
            await stream.aclose()
            return
        await acceptor.accept(stream, (str(host), int(port)))

    async with trio.open_nursery() as nursery:
        task_status.started(bound_port)
        await trio.serve_listeners(serve_one, listeners, handler_nursery=nursery)


class TcpTransport:
    """`Transport` over TCP + Noise (spec/transport.md): addresses ``/ip4/H/tcp/P``, ``/ip6/H/tcp/P`` and
    the legacy ``H:P``. `options` holds the timeouts, the inbound caps and the admission hooks."""

    kind = "tcp"

    def __init__(self, options: SecureOptions | None = None) -> None:
        self.options = options or SecureOptions()

    def handles(self, address: str) -> bool:
        try:
            return parse_peer_address(address)[0] == "tcp"
        except PeerloomError:
            return False

    async def dial(self, address: str, identity: Identity, *, expected_peer: PeerId | None = None,
                   max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> SecureConnection:
        """Connect to a tcp `address`; raises TransportError (``bad-address`` for a malformed one)."""
        host, port = _tcp_endpoint(address)
        o = self.options
        return await connect(host, port, identity, expected_peer=expected_peer,
                             max_message_bytes=max_message_bytes, handshake_timeout=o.handshake_timeout,
                             keepalive_interval=o.keepalive_interval, idle_timeout=o.idle_timeout,
                             transport_ciphers=o.transport_ciphers)

    async def listen(self, address: str, identity: Identity, handler: Callable[[Any], Awaitable[object]], *,
                     max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                     task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """`serve` on a tcp `address` (port 0 picks one); reports the bound address, e.g.
        ``/ip4/127.0.0.1/tcp/40123``. Raises OSError if the address cannot be bound."""
        host, port = _tcp_endpoint(address, listening=True)
        o = self.options

        async def started(*, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
            await serve(host, port, identity, handler, max_message_bytes=max_message_bytes,
                        handshake_timeout=o.handshake_timeout, max_handshakes=o.max_handshakes,
                        max_handshakes_per_ip=o.max_handshakes_per_ip, max_connections=o.max_connections,
                        max_connections_per_ip=o.max_connections_per_ip, admit=o.admit,
                        on_handshake_failed=o.on_handshake_failed, keepalive_interval=o.keepalive_interval,
                        idle_timeout=o.idle_timeout, transport_ciphers=o.transport_ciphers,
                        limiter=o.limiter, protected=o.protected, task_status=task_status)

        async with trio.open_nursery() as nursery:
            bound = await nursery.start(started)
            task_status.started(format_peer_address("tcp", host, bound))


def _tcp_endpoint(address: str, *, listening: bool = False) -> tuple[str, int]:
    """(host, port) of a tcp address. Listening accepts port 0 and the wildcard hosts, which a peer's
    address never has. Raises TransportError("bad-address")."""
    if listening:
        text = address
        if text.startswith(("/ip4/", "/ip6/")):
            parts = text.split("/")
            if len(parts) == 5 and parts[3] == "tcp" and parts[4].isdigit():
                return parts[2], int(parts[4])
        elif "://" not in text:
            host, sep, port_text = text.rpartition(":")
            if sep and port_text.isdigit():
                return host.strip("[]"), int(port_text)
        raise TransportError("bad-address", f"cannot listen on {address!r} with tcp")
    try:
        kind, host, port = parse_peer_address(address)
    except PeerloomError as exc:
        raise TransportError("bad-address", f"{address!r}: {exc}") from None
    if kind != "tcp":
        raise TransportError("bad-address", f"{address!r} is not a tcp address")
    return host, port

"""Fuzzing every transport decoder (spec/transport.md §6): only the documented error types may escape.

Decoders: the NoiseHandshakePayload protobuf and the transport-cipher offer in its extensions (NoiseError
"bad-payload"), the handshake messages
(NoiseError), the 2-byte Noise framing (`FrameDecoder`, which accepts every byte sequence), the frame layer
(`MessageAssembler`: TransportError) and the whole receive path of a `SecureConnection` on a socket pair
(TransportError). Byte-at-a-time feeding must give the same result as feeding at once. Profiles: "quick" by
default, ``HYPOTHESIS_PROFILE=long`` for a long run by hand (tests/conftest.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from peerloom.adapters.noise import (
    CipherState,
    HandshakePayload,
    Libp2pNoiseHandshake,
    NoiseError,
    NoiseTransport,
    decode_handshake_payload,
    decode_transport_ciphers,
    encode_transport_ciphers,
    frame,
)
from peerloom.adapters.tcp import (
    KIND_CONTINUE,
    KIND_CREDIT,
    KIND_PING,
    KIND_PONG,
    KIND_START,
    FrameDecoder,
    FrameMessage,
    MessageAssembler,
    SecureConnection,
    default_transport_ciphers,
    encode_frames,
)
from peerloom.adapters.transport import TransportError
from peerloom.core.identity import Identity

ROOT = Path(__file__).resolve().parents[2]
KEY_A, KEY_B = bytes([1]) * 32, bytes([2]) * 32
PEER = Identity(bytes([3]) * 32).peer_id


# --- handshake layer -------------------------------------------------------------------------------------


@given(st.binary(max_size=600))
def test_payload_decoder_raises_only_bad_payload(data: bytes) -> None:
    try:
        assert isinstance(decode_handshake_payload(data), HandshakePayload)
    except NoiseError as exc:
        assert exc.reason == "bad-payload"


_OFFER_KEY = bytes([0xE2, 0x84, 0x0A])  # field 20556, wire type 2: varint of 164450
_OFFER_PIECES = st.one_of(
    st.binary(max_size=12),
    st.sampled_from([b"AESGCM", b"ChaChaPoly", b"x" * 40, "é".encode()]).map(
        lambda name: _OFFER_KEY + bytes([len(name)]) + name),
    st.just(b"\x12\x07/yamux1"), st.just(bytes([0xE0, 0x84, 0x0A, 5])))  # a muxer; the offer field as a varint


@given(st.lists(_OFFER_PIECES, max_size=12).map(b"".join))
def test_cipher_offer_decoder_raises_only_bad_payload(data: bytes) -> None:
    """Hostile NoiseExtensions: the offer decoder returns at most 8 short printable names or says
    bad-payload; a well-formed offer round-trips."""
    try:
        names = decode_transport_ciphers(data)
    except NoiseError as exc:
        assert exc.reason == "bad-payload"
        return
    assert len(names) <= 8 and all(0 < len(n) <= 32 and n.isascii() and n.isprintable() for n in names)
    known = tuple(n for n in names if n in ("AESGCM", "ChaChaPoly"))
    assert decode_transport_ciphers(encode_transport_ciphers(known)) == known


@given(st.integers(0, 2), st.binary(max_size=300))
def test_handshake_reading_random_message_raises_only_noise_error(step: int, data: bytes) -> None:
    """Random bytes in place of message 1, 2 or 3 of an otherwise honest handshake."""
    init = Libp2pNoiseHandshake(Identity(KEY_A), True, static_seed=KEY_A, ephemeral_seed=KEY_B)
    resp = Libp2pNoiseHandshake(Identity(KEY_B), False, static_seed=KEY_B, ephemeral_seed=KEY_A)
    parties = [(init, resp), (resp, init), (init, resp)]
    for writer, reader in parties[:step]:
        reader.read_message(writer.write_message())
    writer, reader = parties[step]
    writer.write_message()
    try:
        reader.read_message(data)
    except NoiseError:
        pass
    else:
        assert step == 0  # message 1 is an ephemeral key: any 32+ bytes are accepted


# --- 2-byte Noise framing --------------------------------------------------------------------------------


def _drain(decoder: FrameDecoder) -> list[bytes]:
    out = []
    while (message := decoder.next_frame()) is not None:
        out.append(bytes(message))
    return out


@given(st.binary(max_size=3000), st.lists(st.integers(1, 700), max_size=20))
def test_frame_decoder_byte_at_a_time_equals_all_at_once(data: bytes, cuts: list[int]) -> None:
    whole = FrameDecoder()
    whole.feed(data)
    expected = _drain(whole)
    for sizes in ([1] * len(data), cuts or [1]):
        decoder, got, pos, i = FrameDecoder(), [], 0, 0
        while pos < len(data):
            step = sizes[i % len(sizes)]
            decoder.feed(data[pos:pos + step])
            got += _drain(decoder)
            pos, i = pos + step, i + 1
        assert got == expected
        assert decoder.pending == whole.pending
        # what was decoded plus what is pending re-encodes to the input
        assert b"".join(frame(m) for m in got) == data[:len(data) - decoder.pending]


@given(st.lists(st.binary(max_size=70_000), max_size=4))
def test_frame_decoder_round_trips_any_noise_messages(messages: list[bytes]) -> None:
    messages = [m[:65535] for m in messages]
    decoder = FrameDecoder()
    got = []
    for message in messages:
        decoder.feed(frame(message))
        got += _drain(decoder)
    assert got == messages and decoder.pending == 0


# --- frame layer -----------------------------------------------------------------------------------------

frame_headers = st.integers(0, 255) | st.sampled_from(
    [KIND_START << 4, KIND_START << 4 | 1, KIND_CONTINUE << 4, KIND_CONTINUE << 4 | 1, KIND_PING << 4,
     KIND_PONG << 4, KIND_CREDIT << 4, KIND_CREDIT << 4 | 1])
plaintexts = st.one_of(
    st.binary(max_size=40),
    st.builds(lambda h, n, body: bytes([h]) + n.to_bytes(4, "big") + body, frame_headers,
              st.integers(0, 60), st.binary(max_size=40)),
    st.builds(lambda h, body: bytes([h]) + body, frame_headers, st.binary(max_size=40)),
)


def _apply(assembler: MessageAssembler, plaintext: bytes, *, use_window: bool) -> object:
    """One frame through the plain path, or through the zero-copy window path where it is offered."""
    try:
        window = assembler.window(len(plaintext)) if use_window else None
        if window is None:
            return assembler.handle(plaintext)
        window[:] = plaintext
        return assembler.handle_window(len(plaintext))
    except TransportError as exc:
        assert exc.reason in ("bad-frame", "message-too-large", "flow-control")
        return ("error", exc.reason)


@given(st.lists(plaintexts, max_size=30))
def test_assembler_raises_only_transport_error_and_window_path_agrees(frames: list[bytes]) -> None:
    # A small window so fuzzed frames reach the flow-control check too.
    plain, windowed = MessageAssembler(50, window=120), MessageAssembler(50, window=120)
    for plaintext in frames:
        a = _apply(plain, plaintext, use_window=False)
        b = _apply(windowed, plaintext, use_window=True)
        assert a == b
        if isinstance(a, tuple):  # an error: the connection would be dropped here
            break
        if isinstance(a, FrameMessage):
            assert len(a.data) <= 50


@given(st.lists(st.tuples(st.integers(0, 1), st.binary(max_size=200_000)), max_size=6), st.randoms())
def test_interleaved_lanes_reassemble_in_order(messages: list[tuple[int, bytes]], rnd) -> None:
    queues: list[list[bytes]] = [[], []]
    for lane, message in messages:
        queues[lane] += encode_frames(message, lane)
    assembler, got = MessageAssembler(200_000), []
    while queues[0] or queues[1]:
        lane = rnd.choice([q for q in (0, 1) if queues[q]])
        event = _apply(assembler, queues[lane].pop(0), use_window=True)
        if event is not None:
            assert isinstance(event, FrameMessage)
            got.append((event.lane, event.data))
    for lane in (0, 1):
        assert [m for ln, m in got if ln == lane] == [m for ln, m in messages if ln == lane]
    assert assembler.at_boundary


# --- the whole receive path on a socket pair -------------------------------------------------------------


def _transports(cipher: str = "ChaChaPoly") -> tuple[NoiseTransport, NoiseTransport]:
    return (NoiseTransport(send=CipherState(KEY_A, cipher), receive=CipherState(KEY_B, cipher)),
            NoiseTransport(send=CipherState(KEY_B, cipher), receive=CipherState(KEY_A, cipher)))


def _receive_all(wire: bytes, *, chunk: int, cipher: str = "ChaChaPoly") -> list[object]:
    """Write `wire` to one end of a socket pair (`chunk` bytes per send), close it, and collect what a
    SecureConnection on the other end returns until it raises."""
    _, ours = _transports(cipher)
    results: list[object] = []

    async def main() -> None:
        a, b = trio.socket.socketpair()
        conn = SecureConnection(trio.SocketStream(b), ours, PEER, max_message_bytes=100_000, bytes_sent=0,
                                bytes_received=0)
        writer = trio.SocketStream(a)

        async def write() -> None:
            try:
                for pos in range(0, len(wire), chunk):
                    await writer.send_all(wire[pos:pos + chunk])
                await writer.send_eof()
            except trio.BrokenResourceError:
                pass  # the receiver gave up on us first

        async with trio.open_nursery() as nursery:
            nursery.start_soon(write)
            with trio.fail_after(60):  # a hang guard, generous: the suite runs beside other tests
                while True:
                    try:
                        results.append(await conn.receive_message())
                    except TransportError as exc:
                        results.append(("error", exc.reason))
                        break
            nursery.cancel_scope.cancel()
        await writer.aclose()
        await conn.aclose()

    trio.run(main)
    return results


@given(st.binary(max_size=2000))
def test_connection_on_random_wire_bytes_raises_only_transport_error(wire: bytes) -> None:
    results = _receive_all(wire, chunk=max(1, len(wire) // 3))
    assert results[-1][0] == "error"


@given(st.lists(plaintexts, max_size=12), st.integers(0, 3))
def test_connection_on_random_frames_raises_only_transport_error(frames: list[bytes], split: int) -> None:
    """Authentic Noise messages with fuzzed frame contents, delivered whole or one byte at a time."""
    theirs, _ = _transports()
    wire = b"".join(frame(theirs.encrypt(p)) for p in frames)
    results = _receive_all(wire, chunk=[1, 7, 100, 65537][split])
    *messages, last = results
    assert last[0] == "error" and last[1] in ("eof", "bad-frame", "message-too-large", "truncated")
    assert all(isinstance(m, bytes) for m in messages)


@pytest.mark.parametrize("cipher", ["ChaChaPoly", "AESGCM"])
def test_connection_byte_at_a_time_delivers_messages(cipher: str) -> None:
    theirs, _ = _transports(cipher)
    messages = [b"", b"x", bytes(range(256)) * 40, b"y" * 66_000]
    wire = b"".join(frame(theirs.encrypt(p)) for m in messages for p in encode_frames(m, len(m) > 65536))
    assert _receive_all(wire, chunk=1, cipher=cipher) == [*messages, ("error", "eof")]


# --- the benchmark script ----------------------------------------------------------------------------------


def test_bench_transport_small_run_prints_the_json_keys() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "transport.py"), "--bytes", "5000000"],
                         capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result) == {"artifact_bytes", "noise_gbps", "plain_gbps", "ratio", "receiver_peak_rss_bytes",
                           "cipher", "chachapoly_gbps", "chachapoly_ratio", "http_gbps", "http_ratio",
                           "http_vs_noise"}
    assert result["artifact_bytes"] == 5_000_000
    assert result["noise_gbps"] > 0 and result["plain_gbps"] > 0 and result["receiver_peak_rss_bytes"] > 0
    assert result["chachapoly_gbps"] > 0 and result["http_gbps"] > 0  # HTTP in the same run (spec/transport.md §10)
    assert result["http_ratio"] == pytest.approx(result["http_gbps"] / result["plain_gbps"], rel=0.01)
    assert result["http_vs_noise"] == pytest.approx(result["http_gbps"] / result["noise_gbps"], rel=0.01)
    assert result["cipher"] == ("AESGCM" if default_transport_ciphers() else "ChaChaPoly")


@pytest.mark.parametrize("size", [0, 1, 65514, 65515, 131032, 131033])
def test_encode_frames_boundaries(size: int) -> None:
    message = bytes(i % 7 for i in range(size))
    frames = encode_frames(message, 1)
    assert all(len(f) <= 65519 for f in frames)
    assembler = MessageAssembler(size)
    events = [assembler.handle(f) for f in frames]
    assert events[-1] == FrameMessage(lane=1, data=message) and not any(events[:-1])

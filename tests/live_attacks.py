"""Live-process fuzzing (`make fuzz-live`): attacks on the TCP+Noise port and the HTTP edge of real
`peerloom node` processes on 127.0.0.1, each followed by checks that every process is alive, still serves
an honest newcomer and that windows still certify.

Every attack is an async function `attack(target, rng, seconds)`; each loop in it is bounded in count and
time. `tests/e2e/test_hostile_peers.py` runs each one briefly in CI; `make fuzz-live` runs each for a minute
against a smoke fleet (`python -m tests.live_attacks --seconds 60`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import cbor2
import trio

from peerloom.adapters import tcp
from peerloom.adapters.noise import frame
from peerloom.adapters.transport import LANE_CONTROL, TransportError
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.identity import Identity
from peerloom.core.messages import Hello, Signed, decode_message, encode_message
from peerloom.core.objects import JoinRequest, Revision, seal

PING = bytes([tcp.KIND_PING << 4 | LANE_CONTROL])


@dataclass
class Target:
    """One node under attack: its TCP port, its HTTP edge port (or None) and the revision it serves."""

    port: int
    http_port: int | None
    revision: Revision


Attack = Callable[[Target, random.Random, float], Awaitable[None]]


async def attacker(port: int) -> tcp.SecureConnection:
    return await tcp.connect("127.0.0.1", port, Identity(os.urandom(32)), handshake_timeout=5.0)


async def write_plaintexts(conn: tcp.SecureConnection, plaintexts: list[bytes]) -> None:
    """Encrypt each plaintext as one Noise transport message (one frame) and write them raw, never reading."""
    await conn._stream.send_all(b"".join(frame(conn._transport.encrypt(p)) for p in plaintexts))


async def _quietly(coro: Awaitable[object]) -> None:
    """Run one attacker step; the node ending the connection is the expected outcome, not an error."""
    try:
        await coro
    except (TransportError, OSError, trio.BrokenResourceError, trio.ClosedResourceError):
        pass


async def garbage_before_handshake(target: Target, rng: random.Random, seconds: float) -> None:
    """Random bytes, and random Noise-framed messages, instead of a handshake."""
    with trio.move_on_after(seconds):
        for _ in range(10_000):
            stream = await trio.open_tcp_stream("127.0.0.1", target.port)
            payload = rng.randbytes(rng.randrange(1, 4096)) if rng.random() < 0.5 else frame(rng.randbytes(64))
            await _quietly(stream.send_all(payload))
            await stream.aclose()
            await trio.sleep(0.01)


async def garbage_after_handshake(target: Target, rng: random.Random, seconds: float) -> None:
    """A finished handshake, then bytes that do not decrypt (and a PING flood first, half of the time:
    the node writes PONGs while it reads, the path of finding 1)."""
    with trio.move_on_after(seconds):
        for _ in range(1000):
            conn = await attacker(target.port)
            if rng.random() < 0.5:
                await _quietly(write_plaintexts(conn, [PING + rng.randbytes(8) for _ in range(5000)]))
            await _quietly(conn._stream.send_all(frame(rng.randbytes(rng.randrange(17, 2000)))))
            await trio.sleep(0.05)
            await conn._stream.aclose()


async def random_frames(target: Target, rng: random.Random, seconds: float) -> None:
    """Correctly encrypted frames of random kinds and lanes with random bodies (kind 15 included)."""
    with trio.move_on_after(seconds):
        for _ in range(1000):
            conn = await attacker(target.port)
            frames = [bytes([rng.randrange(256)]) + rng.randbytes(rng.randrange(0, 64)) for _ in range(20)]
            frames.insert(0, bytes([15 << 4 | LANE_CONTROL]) + b"\x00" * 8)
            await _quietly(write_plaintexts(conn, frames[: rng.randrange(1, len(frames) + 1)]))
            await trio.sleep(0.05)
            await conn._stream.aclose()


def _random_cbor(rng: random.Random, depth: int = 0) -> object:
    choice = rng.randrange(7 if depth < 3 else 4)
    if choice == 0:
        return rng.randrange(-(2**40), 2**40)
    if choice == 1:
        return rng.randbytes(rng.randrange(0, 40))
    if choice == 2:
        return rng.choice(["signed", "hello", "chunk-get", "updates-get", "next-head", "x" * rng.randrange(0, 30)])
    if choice == 3:
        return rng.choice([None, True, False, 1.5, float("nan")])
    if choice == 4:
        return [_random_cbor(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    if choice == 5:
        return {str(rng.randrange(10)): _random_cbor(rng, depth + 1) for _ in range(rng.randrange(0, 4))}
    return [rng.choice(["signed", "hello", "next-head", "chunk-get"]), _random_cbor(rng, depth + 1)]


async def random_messages(target: Target, rng: random.Random, seconds: float) -> None:
    """Well-framed application messages: random CBOR bodies, unknown message kinds, random bytes."""
    with trio.move_on_after(seconds):
        for _ in range(1000):
            conn = await attacker(target.port)
            for _ in range(rng.randrange(1, 30)):
                body = cbor2.dumps(_random_cbor(rng)) if rng.random() < 0.8 else rng.randbytes(rng.randrange(200))
                await _quietly(conn.send_message(body))
            await trio.sleep(0.05)
            await _quietly(conn.aclose())


async def flood_never_read(target: Target, rng: random.Random, seconds: float) -> None:
    """Large valid messages as fast as the node grants credit, on several connections, never reading."""
    with trio.move_on_after(seconds):
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(_flood_one, target, seconds)


async def _flood_one(target: Target, seconds: float) -> None:
    conn = await attacker(target.port)
    blob = cbor2.dumps(["signed", os.urandom(1 << 20)])
    with trio.move_on_after(seconds):
        for _ in range(10_000):
            try:
                await conn.send_message(blob)
            except (TransportError, OSError):
                return


async def half_open(target: Target, rng: random.Random, seconds: float) -> None:
    """Connections that send half a handshake (or nothing) and hang there, many at once."""
    streams = []
    with trio.move_on_after(seconds):
        for i in range(300):
            try:
                stream = await trio.open_tcp_stream("127.0.0.1", target.port)
            except OSError:
                break
            if i % 2:
                await _quietly(stream.send_all(b"\x00\x20" + rng.randbytes(10)))  # a frame cut short
            streams.append(stream)
        await trio.sleep(seconds)
    for stream in streams:
        await stream.aclose()


async def join_flood(target: Target, rng: random.Random, seconds: float) -> None:
    """Signed joins from fresh keys, over TCP and over the HTTP edge."""
    joins = []
    for _ in range(400):
        who = Identity(os.urandom(32))
        joins.append((who, seal(who, JoinRequest(revision=target.revision.id, window=1, capacity=4))))

    with trio.move_on_after(seconds):
        for who, envelope in joins[:200]:
            conn = await tcp.connect("127.0.0.1", target.port, who, handshake_timeout=5.0)
            await _quietly(conn.send_message(encode_message(Signed(envelope=envelope))))
            await _quietly(conn.aclose())
        if target.http_port is not None:
            for _, envelope in joins[200:]:
                await trio.to_thread.run_sync(_http_post, target.http_port, "/v1/join", envelope.to_bytes())


def _http_post(port: int, path: str, body: bytes) -> None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/cbor\r\n"
                         f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
            sock.recv(4096)
    except OSError:
        pass


async def http_oversized_and_slow(target: Target, rng: random.Random, seconds: float) -> None:
    """Oversized uploads, requests whose headers never end, and bodies that trickle."""
    if target.http_port is None:
        return
    with trio.move_on_after(seconds):
        async with trio.open_nursery() as nursery:
            for i in range(12):
                nursery.start_soon(_slow_http, target.http_port, i, seconds)


async def _slow_http(port: int, i: int, seconds: float) -> None:
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError:
        return
    with trio.move_on_after(seconds):
        try:
            if i % 3 == 0:  # 1 GB announced, sent as fast as the edge reads
                await stream.send_all(b"POST /v1/updates HTTP/1.1\r\nHost: x\r\nContent-Type: application/cbor\r\n"
                                      b"Content-Length: 1000000000\r\n\r\n")
                chunk = b"\0" * 65536
                for _ in range(16_000):
                    await stream.send_all(chunk)
            elif i % 3 == 1:  # headers one byte at a time, never finished
                for byte in b"GET /v1/heads/latest HTTP/1.1\r\nX-Slow: " + b"a" * 10_000:
                    await stream.send_all(bytes([byte]))
                    await trio.sleep(0.5)
            else:  # a small body that trickles
                await stream.send_all(b"POST /v1/join HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\n\r\n")
                for _ in range(2000):
                    await stream.send_all(b"\0")
                    await trio.sleep(1.0)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    await stream.aclose()


ATTACKS: list[Attack] = [garbage_before_handshake, garbage_after_handshake, random_frames, random_messages,
                         flood_never_read, half_open, join_flood, http_oversized_and_slow]


async def honest_hello(port: int) -> None:
    """An honest newcomer completes the handshake and gets the node's Hello within 10 s. Like any dialer it
    retries a refused dial with a short backoff: right after an attack from the same address, that address's
    handshake bucket may still be empty (spec/transport.md §13)."""
    with trio.fail_after(20):
        while True:
            try:
                conn = await tcp.connect("127.0.0.1", port, Identity(os.urandom(32)), handshake_timeout=10.0)
                break
            except TransportError:
                await trio.sleep(0.5)
    with trio.fail_after(10):
        assert isinstance(decode_message(await conn.receive_message(), max_bytes=1 << 20), Hello)
    await conn.aclose()


def certified(node) -> int:
    """The highest window a node's event log says it certified (skipped heads do not count)."""
    heads = [e.get("window", 0) for e in node.events() if e.get("event") == "head" and not e.get("skipped")]
    return max(heads, default=0)


def wait_certified(node, window: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while certified(node) < window and time.monotonic() < deadline:
        time.sleep(0.1)
    return certified(node) >= window


async def _until_refused(attack: Attack, target: Target, rng: random.Random, seconds: float) -> None:
    """Run one attack; a dial the node refuses (its limits, spec/transport.md §13) ends it early."""
    try:
        await attack(target, rng, seconds)
    except* TransportError:
        pass


async def _at_once(attack: Attack, targets: list[Target], rngs: list[random.Random], seconds: float) -> None:
    async with trio.open_nursery() as nursery:
        for target, rng in zip(targets, rngs, strict=True):
            nursery.start_soon(_until_refused, attack, target, rng, seconds)


def campaign(nodes, targets: list[Target], attacks: list[Attack], seconds: float, seed: int = 0) -> list[dict]:
    """Run each attack against every target at once for `seconds`, then check: all processes alive, each target
    serves an honest newcomer, and the first node (a validator) certifies a new window. Returns one record
    per attack; raises AssertionError at the first failed check."""
    rng = random.Random(seed)
    records = []
    for attack in attacks:
        before = certified(nodes[0])
        started = time.monotonic()
        trio.run(_at_once, attack, targets, [random.Random(rng.random()) for _ in targets], seconds)
        dead = [n.name for n in nodes if n.process.poll() is not None]
        assert not dead, f"{attack.__name__} ended {dead}: " + \
            (nodes[0].directory / "node.log").read_text()[-2000:]
        for target in targets:
            trio.run(honest_hello, target.port)
        assert wait_certified(nodes[0], before + 1, 90), f"no window certified after {attack.__name__}"
        records.append({"attack": attack.__name__, "seconds": round(time.monotonic() - started, 1),
                        "certified_before": before, "certified_after": certified(nodes[0])})
    return records


@contextlib.contextmanager
def attacked_fleet(root: Path, *, trainers: int, window_s: float) -> Iterator[tuple[list, list[Target]]]:
    """A started fleet of 1 validator (serving the HTTP edge) and `trainers` trainers that has certified
    its first window, with one Target per node; every node is stopped on exit."""
    from tests.node_cluster import free_port, make_fleet

    nodes = make_fleet(root, validators=1, trainers=trainers, quorum=1, window_s=window_s)
    http_port = free_port()
    nodes[0].write_config(http={"enabled": True, "listen": f"127.0.0.1:{http_port}"})
    for node in nodes:
        # Every attacker dials from 127.0.0.1: the per-address handshake bucket (spec/transport.md §13) would
        # end most attacks at the door, and these attacks are about what a peer that got in can do.
        node.write_config(limits={"handshake_rate": 10_000.0, "handshake_burst": 10_000})
    revision = Revision.verify(SignedEnvelope.from_bytes((root / "manifest.cbor").read_bytes()))
    try:
        for node in nodes:
            node.start()
        ports = [node.wait_port() for node in nodes]
        assert wait_certified(nodes[0], 1, 120), "the fleet never certified a window"
        yield nodes, [Target(port, http_port if i == 0 else None, revision) for i, port in enumerate(ports)]
    finally:
        for node in nodes:
            node.stop()


def head_events(node) -> list[dict]:
    return [e for e in node.events() if e.get("event") == "head"]


def accuracy_at(node, window: int) -> float:
    """The test accuracy of the node's certified head of `window` (NaN if it has none)."""
    return next((e["metrics"].get("test_accuracy", float("nan")) for e in head_events(node)
                 if e["window"] == window and not e.get("skipped")), float("nan"))


def longest_skip_run(node) -> int:
    """The most consecutive windows whose final head was skipped, in the node's event log."""
    run = best = 0
    for event in sorted(head_events(node), key=lambda e: e["window"]):
        run = run + 1 if event.get("skipped") else 0
        best = max(best, run)
    return best


def main(argv: list[str] | None = None) -> int:
    """`make fuzz-live`: first an undisturbed fleet of 1 validator (with the HTTP edge) and 3 trainers up to
    window `--check-window`, then the same fleet under each attack for `--seconds` against every node at
    once. Prints one JSON line per attack and a summary; exit 1 unless every process stayed alive, at most
    2 windows in a row went without a certified head, and the accuracy at `--check-window` is within 2
    points of the undisturbed run's."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-window", type=int, default=40)
    parser.add_argument("--dir", type=Path, default=Path("peerloom-fuzz-live"))
    args = parser.parse_args(argv)
    root = Path(args.dir) / f"run-{int(time.time())}"
    root.parent.mkdir(parents=True, exist_ok=True)
    with attacked_fleet(root.with_name(root.name + "-undisturbed"), trainers=3, window_s=2.0) as (nodes, _):
        assert wait_certified(nodes[0], args.check_window, 600), "the undisturbed fleet stalled"
        undisturbed = accuracy_at(nodes[0], args.check_window)
    with attacked_fleet(root, trainers=3, window_s=2.0) as (nodes, targets):
        for record in campaign(nodes, targets, ATTACKS, args.seconds, args.seed):
            print(json.dumps(record), flush=True)
        wait_certified(nodes[0], args.check_window, 300)
        summary = {"attacks": len(ATTACKS), "alive": all(n.process.poll() is None for n in nodes),
                   "certified": certified(nodes[0]), "longest_skip_run": longest_skip_run(nodes[0]),
                   "check_window": args.check_window, "undisturbed_accuracy": undisturbed,
                   "attacked_accuracy": accuracy_at(nodes[0], args.check_window)}
    summary["ok"] = summary["alive"] and summary["longest_skip_run"] <= 2 and \
        abs(summary["attacked_accuracy"] - undisturbed) <= 0.02
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

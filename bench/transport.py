"""Transport benchmark (spec/transport.md §8): move an artifact between two processes on 127.0.0.1 over TCP+Noise,
over the HTTP transport (a WebSocket carrying the same Noise stream, aiohttp on its own thread;
spec/transport.md §10), and the same bytes over a plain TCP socket, in the same run; print one JSON object
on the last line.

    python bench/transport.py [--bytes 400000000] [--message-bytes 1048576] [--seed 1] [--repeat 3] [--quick]

Output keys: artifact_bytes, noise_gbps, plain_gbps (GB = 1e9 bytes, from the sender's first byte to the
receiver's acknowledgement of the last), ratio (noise / plain), receiver_peak_rss_bytes (the peak RSS of the
Noise receiver process, from getrusage); then cipher (the transport cipher the two nodes negotiated with
their default offers, spec/transport.md §1.1: "AESGCM" on a CPU with hardware AES, else "ChaChaPoly"), and
chachapoly_gbps / chachapoly_ratio for the same transfer with both ends forced to ChaCha20-Poly1305, the
only cipher of libp2p's /noise, measured in the same run (where ChaChaPoly is what the defaults negotiate,
both pairs measure the same configuration); http_gbps, http_ratio (http / plain) and http_vs_noise
(http / noise) for the HTTP transport with the default cipher offers. The artifact is a seeded
pseudo-random 1 MiB block repeated and streamed in messages of at most --message-bytes (≤ 1 MiB), so
neither side ever holds the whole artifact; the receiver checks every message's length and first and last
8 bytes. Each mode gets a fresh receiver process so the RSS figure is the Noise path's alone; each mode
runs --repeat times (alternating) and the median time is reported. Standard error also gets the spread of
the ratio over the alternating pairs (min, median, max of plain time / Noise time), since a shared
machine's load moves both figures. --quick: 20 MB, one round.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import resource
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from peerloom.adapters import tcp
from peerloom.adapters.http_transport import HttpTransport
from peerloom.adapters.tcp import SecureOptions
from peerloom.core.identity import Identity

HOST = "127.0.0.1"
MiB = 1 << 20


def _block(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def _expected(block: bytes, offset: int, size: int) -> tuple[bytes, bytes]:
    """First and last 8 bytes of artifact[offset:offset+size] where the artifact repeats `block`."""
    n = len(block)
    first = bytes(block[(offset + i) % n] for i in range(min(8, size)))
    last = bytes(block[(offset + size - min(8, size) + i) % n] for i in range(min(8, size)))
    return first, last


NOISE_MODES = {"noise": None, "noise-chachapoly": ()}  # mode -> the transport_ciphers both ends offer


def _receiver(mode: str, total: int, seed: int, message_bytes: int, conn) -> None:
    """Child process: listen, report the port through `conn`, receive `total` bytes, ack, report RSS."""
    block = _block(seed, MiB)

    async def main() -> None:
        done = trio.Event()
        errors: list[str] = []

        async def check(offset: int, data: bytes | memoryview) -> None:
            if (bytes(data[:8]), bytes(data[-8:])) != _expected(block, offset, len(data)):
                errors.append(f"bad bytes at {offset}")

        if mode in NOISE_MODES or mode == "http":
            async def handler(sc: tcp.SecureConnection) -> None:
                got = 0
                while got < total:
                    data = await sc.receive_message()
                    await check(got, data)
                    got += len(data)
                reply = {"got": got, "errors": errors, "cipher": sc.transport_cipher}
                await sc.send_message(json.dumps(reply).encode())
                done.set()

            async with trio.open_nursery() as nursery:
                if mode == "http":
                    bound = await nursery.start(lambda task_status: HttpTransport().listen(
                        f"http://{HOST}:0", Identity(bytes([1]) * 32), handler, max_message_bytes=message_bytes,
                        task_status=task_status))
                    port = int(bound.rpartition(":")[2])
                else:
                    port = await nursery.start(lambda task_status: tcp.serve(
                        HOST, 0, Identity(bytes([1]) * 32), handler, max_message_bytes=message_bytes,
                        transport_ciphers=NOISE_MODES[mode], task_status=task_status))
                conn.send(port)
                await done.wait()
                nursery.cancel_scope.cancel()
        else:
            listeners = await trio.open_tcp_listeners(0, host=HOST)
            conn.send(listeners[0].socket.getsockname()[1])
            stream = await listeners[0].accept()
            buffer = bytearray(message_bytes)
            view = memoryview(buffer)
            got = 0
            while got < total:
                want = min(message_bytes, total - got)
                have = 0
                while have < want:
                    n = await stream.socket.recv_into(view[have:want])
                    if not n:
                        raise SystemExit("plain: EOF")
                    have += n
                await check(got, view[:want])
                got += want
            await stream.send_all(json.dumps({"got": got, "errors": errors}).encode())
            await stream.aclose()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        conn.send(peak)

    trio.run(main)


def _pieces(block: bytes, total: int, message_bytes: int) -> Iterator[memoryview | bytes]:
    """`total` bytes cut from the repeating `block` in messages of at most `message_bytes`.

    Both modes send exactly these pieces, so the ratio compares transports and nothing else.
    """
    view = memoryview(block)
    sent = 0
    while sent < total:
        size = min(message_bytes, total - sent)
        offset = sent % len(block)
        if offset + size <= len(block):
            yield view[offset:offset + size]
        else:
            yield bytes(view[offset:]) + bytes(view[:size - (len(block) - offset)])
        sent += size


async def _send(mode: str, port: int, total: int, block: bytes, message_bytes: int) -> tuple[float, str]:
    """(seconds, transport cipher) of one transfer; the cipher is "" for the plain socket."""
    if mode in NOISE_MODES or mode == "http":
        if mode == "http":
            sc = await HttpTransport(SecureOptions()).dial(f"http://{HOST}:{port}", Identity(bytes([2]) * 32),
                                                           max_message_bytes=message_bytes)
        else:
            sc = await tcp.connect(HOST, port, Identity(bytes([2]) * 32), max_message_bytes=message_bytes,
                                   transport_ciphers=NOISE_MODES[mode])
        start = time.perf_counter()
        for piece in _pieces(block, total, message_bytes):
            await sc.send_message(piece)
        reply = json.loads(await sc.receive_message())
        elapsed = time.perf_counter() - start
        await sc.aclose()
    else:
        stream = await trio.open_tcp_stream(HOST, port)
        start = time.perf_counter()
        for piece in _pieces(block, total, message_bytes):
            await stream.send_all(piece)
        reply = json.loads(await stream.receive_some(4096))
        elapsed = time.perf_counter() - start
        await stream.aclose()
    if reply["got"] != total or reply["errors"]:
        raise SystemExit(f"{mode}: receiver reports {reply}")
    return elapsed, reply.get("cipher", "")


def run(mode: str, total: int, seed: int, message_bytes: int) -> tuple[float, int, str]:
    """(seconds, receiver peak RSS bytes, transport cipher) for one transfer of `total` bytes."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(mode, total, seed, message_bytes, child))
    proc.start()
    try:
        port = parent.recv()
        elapsed, cipher = trio.run(_send, mode, port, total, _block(seed, MiB), message_bytes)
        peak = parent.recv()
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    return elapsed, peak, cipher


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=400_000_000, help="artifact size in bytes")
    parser.add_argument("--message-bytes", type=int, default=MiB, help="application message size (≤ 1 MiB)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3, help="transfers per mode; the median time is used")
    parser.add_argument("--quick", action="store_true", help="20 MB, one round (a smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.bytes, args.repeat = 20_000_000, 1
    if not 0 < args.message_bytes <= MiB:
        parser.error("--message-bytes must be in 1..1048576")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    runs: dict[str, list[tuple[float, int, str]]] = {"plain": [], "noise": [], "noise-chachapoly": [], "http": []}
    for _ in range(args.repeat):  # alternate the modes so drift on the machine hits them all alike
        for mode, results in runs.items():
            results.append(run(mode, args.bytes, args.seed, args.message_bytes))
    seconds = {mode: statistics.median(t for t, _, _ in results) for mode, results in runs.items()}
    gbps = {mode: args.bytes / s / 1e9 for mode, s in seconds.items()}
    ciphers = {c for _, _, c in runs["noise"]}
    if len(ciphers) != 1 or {c for _, _, c in runs["noise-chachapoly"]} != {"ChaChaPoly"}:
        raise SystemExit(f"unexpected transport ciphers: {ciphers}")
    peak = max(p for _, p, _ in runs["noise"] + runs["noise-chachapoly"])
    for mode in ("noise", "noise-chachapoly", "http"):
        pairs = sorted(p / n for (p, _, _), (n, _, _) in zip(runs["plain"], runs[mode], strict=True))
        print(f"{mode}: plain {seconds['plain']:.3f} s, {mode} {seconds[mode]:.3f} s; ratio of each "
              f"alternating pair: min {pairs[0]:.3f}, median {statistics.median(pairs):.3f}, "
              f"max {pairs[-1]:.3f}", file=sys.stderr)
    print(json.dumps({"artifact_bytes": args.bytes, "noise_gbps": round(gbps["noise"], 4),
                      "plain_gbps": round(gbps["plain"], 4), "ratio": round(gbps["noise"] / gbps["plain"], 4),
                      "receiver_peak_rss_bytes": peak, "cipher": ciphers.pop(),
                      "chachapoly_gbps": round(gbps["noise-chachapoly"], 4),
                      "chachapoly_ratio": round(gbps["noise-chachapoly"] / gbps["plain"], 4),
                      "http_gbps": round(gbps["http"], 4), "http_ratio": round(gbps["http"] / gbps["plain"], 4),
                      "http_vs_noise": round(gbps["http"] / gbps["noise"], 4)}))


if __name__ == "__main__":
    main()

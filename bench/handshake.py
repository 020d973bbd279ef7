"""What one inbound Noise handshake costs the responder, and what a refusal costs (spec/transport.md §13).

Drives `adapters.noise.Libp2pNoiseHandshake` sans-IO, initiator and responder in one process, and times only
the responder's calls with the thread's CPU clock (`time.thread_time`): reading message 1, writing message 2
(an X25519 key pair, two DH, the signed payload encrypted) and reading message 3 (one DH, decryption and the
Ed25519 check of the initiator's identity). Baseline in the same run: what the node pays to refuse a
connection before the handshake (`limits.ConnectionLimiter.open` and `started` refusing on the empty token
bucket). Prints one JSON object; `--quick` runs fewer handshakes.

    python bench/handshake.py [--quick] [--count N]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peerloom.adapters.limits import ConnectionLimiter, Limits
from peerloom.adapters.noise import Libp2pNoiseHandshake
from peerloom.core.identity import Identity


def responder_seconds(responder_identity: Identity, initiator_identity: Identity) -> float:
    """CPU seconds the responder spends on one full handshake."""
    initiator = Libp2pNoiseHandshake(initiator_identity, True)
    responder = Libp2pNoiseHandshake(responder_identity, False)
    m1 = initiator.write_message()
    start = time.thread_time()
    responder.read_message(m1)
    m2 = responder.write_message()
    spent = time.thread_time() - start
    initiator.read_message(m2)
    m3 = initiator.write_message()
    start = time.thread_time()
    responder.read_message(m3)
    responder.transport()
    spent += time.thread_time() - start
    assert responder.remote_peer == initiator_identity.peer_id
    return spent


def refusal_seconds(count: int) -> float:
    """CPU seconds per refusal: a connection admitted as pending, then refused by the empty bucket."""
    limiter = ConnectionLimiter(Limits(handshake_rate=0.001, handshake_burst=1), nofile=1 << 16)
    start = time.thread_time()
    for _ in range(count):
        slot = limiter.open("192.0.2.1", now=0.0)
        assert not isinstance(slot, str)
        limiter.started(slot, now=0.0)
        limiter.close(slot)
    return (time.thread_time() - start) / count


def _server(count: int, ready: Any, out: Any) -> None:
    """A `tcp.serve` process (no limits in the way) that reports its own CPU seconds after `count` connections."""
    import trio

    from peerloom.adapters import tcp

    async def main() -> None:
        served = 0
        done = trio.Event()

        async def handler(conn: Any) -> None:
            nonlocal served
            served += 1
            if served == count:
                done.set()

        async with trio.open_nursery() as nursery:
            port = await nursery.start(functools.partial(
                tcp.serve, "127.0.0.1", 0, Identity(os.urandom(32)), handler, limiter=ConnectionLimiter(
                    Limits(handshake_rate=1e9, handshake_burst=1 << 30, max_pending_per_ip=64))))
            start = time.process_time()
            ready.send(port)
            await done.wait()
            out.send(time.process_time() - start)
            nursery.cancel_scope.cancel()

    trio.run(main)


def socket_seconds(count: int) -> float:
    """CPU seconds of a server process per inbound connection over loopback TCP (accept, handshake, close)."""
    import multiprocessing

    import trio

    from peerloom.adapters import tcp

    context = multiprocessing.get_context("spawn")
    ready_r, ready_w = context.Pipe(duplex=False)
    out_r, out_w = context.Pipe(duplex=False)
    server = context.Process(target=_server, args=(count, ready_w, out_w))
    server.start()
    port = ready_r.recv()

    async def dial() -> None:
        for _ in range(count):
            conn = await tcp.connect("127.0.0.1", port, Identity(os.urandom(32)))
            await conn.aclose()

    trio.run(dial)
    seconds = out_r.recv()
    server.join()
    return float(seconds) / count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--count", type=int, default=0)
    args = parser.parse_args(argv)
    count = args.count or (20 if args.quick else 300)
    me = Identity(os.urandom(32))
    strangers = [Identity(os.urandom(32)) for _ in range(count)]  # a fresh identity per handshake, as a flood
    samples = [responder_seconds(me, who) for who in strangers]
    refusal = refusal_seconds(count * 10)
    median = statistics.median(samples)
    over_tcp = socket_seconds(count)
    report = {"handshakes": count, "responder_cpu_ms_median": round(median * 1e3, 3),
              "responder_cpu_ms_p90": round(sorted(samples)[int(0.9 * (count - 1))] * 1e3, 3),
              "server_cpu_ms_per_tcp_connection": round(over_tcp * 1e3, 3),
              "handshakes_per_core_s": round(1 / median), "refusal_cpu_us": round(refusal * 1e6, 2),
              "ratio_handshake_to_refusal": round(median / refusal)}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Hostile peers cannot end a node process (issue 16, finding 1; spec/transport.md §6 containment).

Each attack runs against live `peerloom node` processes over TCP+Noise on 127.0.0.1: an unauthenticated
attacker completes the Noise handshake with a fresh key, then misbehaves. Afterwards every process is
alive, serves an honest newcomer (handshake and Hello), and the fleet still certifies windows.
"""

import os
import time

import pytest
import trio

from peerloom.adapters import tcp
from peerloom.adapters.noise import frame
from tests.live_attacks import PING, attacker, certified, honest_hello, write_plaintexts
from tests.node_cluster import make_fleet

pytestmark = pytest.mark.slow


async def ping_flood_then_garbage(port: int) -> None:
    """About 20,000 PINGs that are never read (so the node's PONGs back up and it writes while it reads),
    then a Noise message that does not decrypt."""
    conn = await attacker(port)
    with trio.move_on_after(10):
        for _ in range(20):
            await write_plaintexts(conn, [PING + os.urandom(8) for _ in range(1000)])
        await conn._stream.send_all(frame(os.urandom(64)))
    await trio.sleep(0.5)
    await conn._stream.aclose()


async def unknown_frame_kind(port: int) -> None:
    """A correctly encrypted frame of kind 15."""
    conn = await attacker(port)
    await write_plaintexts(conn, [bytes([15 << 4 | tcp.LANE_CONTROL]) + b"\x00" * 8])
    await trio.sleep(0.5)
    await conn._stream.aclose()


async def bad_credit_then_flood(port: int) -> None:
    """A CREDIT that overflows the window, written behind a PING flood."""
    conn = await attacker(port)
    credit = bytes([tcp.KIND_CREDIT << 4 | tcp.LANE_CONTROL]) + (2**32 - 1).to_bytes(4, "big")
    with trio.move_on_after(10):
        await write_plaintexts(conn, [PING + os.urandom(8) for _ in range(5000)] + [credit, credit])
    await trio.sleep(0.5)
    await conn._stream.aclose()


async def garbage_application_message(port: int) -> None:
    """Well-framed application messages whose bodies are random bytes and an unknown wire kind."""
    conn = await attacker(port)
    for body in (os.urandom(200), b"\x82\x0f\x40", b"\x82\x63zzz\xa0"):
        await conn.send_message(body)
    await trio.sleep(0.5)
    await conn.aclose()


ATTACKS = [ping_flood_then_garbage, unknown_frame_kind, bad_credit_then_flood, garbage_application_message]


def test_no_attack_ends_any_node_process_and_windows_go_on(tmp_path):
    nodes = make_fleet(tmp_path, validators=1, trainers=2, quorum=1, window_s=1.0)
    try:
        for node in nodes:
            node.start()
        ports = [node.wait_port() for node in nodes]
        validator = nodes[0]
        start = time.monotonic()
        while certified(validator) < 1 and time.monotonic() - start < 60:
            time.sleep(0.1)
        assert certified(validator) >= 1, validator.events()[-5:]
        for attack in ATTACKS:
            for node, port in zip(nodes, ports, strict=True):  # validator, and both trainers
                trio.run(attack, port)
                assert node.process.poll() is None, f"{attack.__name__} ended {node.name}: " + \
                    (node.directory / "node.log").read_text()[-2000:]
                trio.run(honest_hello, port)
        before = certified(validator)
        start = time.monotonic()
        while certified(validator) < before + 2 and time.monotonic() - start < 60:
            time.sleep(0.1)
        assert certified(validator) >= before + 2, "windows stopped after the attacks"
        assert all(node.process.poll() is None for node in nodes)
        errors = {e["reason"] for e in validator.events() if e["event"] == "connection-error"}
        assert {"decrypt-failed", "bad-frame"} <= errors, errors  # logged with a typed reason
    finally:
        for node in nodes:
            node.stop()


def test_live_fuzz_short_form_every_attack_on_every_role(tmp_path):
    """Issue 16 item 7, the CI form of `make fuzz-live`: each attack of tests/live_attacks.py for two
    seconds against the validator (TCP and HTTP edge) and both trainers; after each one every process is
    alive, serves an honest newcomer, and a new window certifies."""
    from tests.live_attacks import ATTACKS, attacked_fleet, campaign

    with attacked_fleet(tmp_path, trainers=2, window_s=1.0) as (nodes, targets):
        records = campaign(nodes, targets, ATTACKS, seconds=2.0)
        assert [r["attack"] for r in records] == [a.__name__ for a in ATTACKS]
        assert all(r["certified_after"] > r["certified_before"] for r in records)
        errors = {e["reason"] for e in nodes[0].events() if e["event"] == "connection-error"}
        assert {"decrypt-failed", "bad-frame"} <= errors, errors

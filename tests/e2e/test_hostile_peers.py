"""Hostile peers cannot end a node process (spec/transport.md §6 containment).

Each attack runs against live `peerloom node` processes over TCP+Noise on 127.0.0.1: an unauthenticated
attacker completes the Noise handshake with a fresh key, then misbehaves. Afterwards every process is
alive, serves an honest newcomer (handshake and Hello), and the fleet still certifies windows.
"""

import os

import pytest
import trio

from peerloom.adapters import tcp
from peerloom.adapters.noise import frame
from peerloom.adapters.transport import LANE_CONTROL, TransportError
from tests.live_attacks import PING, attacker, certified, honest_hello, wait_certified, write_plaintexts
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
    await write_plaintexts(conn, [bytes([15 << 4 | LANE_CONTROL]) + b"\x00" * 8])
    await trio.sleep(0.5)
    await conn._stream.aclose()


async def bad_credit_then_flood(port: int) -> None:
    """A CREDIT that overflows the window, written behind a PING flood."""
    conn = await attacker(port)
    credit = bytes([tcp.KIND_CREDIT << 4 | LANE_CONTROL]) + (2**32 - 1).to_bytes(4, "big")
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
        assert wait_certified(validator, 1, 60), validator.events()[-5:]
        for attack in ATTACKS:
            for node, port in zip(nodes, ports, strict=True):  # validator, and both trainers
                trio.run(attack, port)
                assert node.process.poll() is None, f"{attack.__name__} ended {node.name}: " + \
                    (node.directory / "node.log").read_text()[-2000:]
                trio.run(honest_hello, port)
        assert wait_certified(validator, certified(validator) + 2, 60), "windows stopped after the attacks"
        assert all(node.process.poll() is None for node in nodes)
        errors = {e["reason"] for e in validator.events() if e["event"] == "connection-error"}
        assert {"decrypt-failed", "bad-frame"} <= errors, errors  # logged with a typed reason
    finally:
        for node in nodes:
            node.stop()


def test_live_fuzz_short_form_every_attack_on_every_role(tmp_path):
    """The CI form of `make fuzz-live`: each attack of tests/live_attacks.py for two
    seconds against the validator (TCP and HTTP edge) and both trainers; after each one every process is
    alive, serves an honest newcomer, and a new window certifies."""
    from tests.live_attacks import ATTACKS, attacked_fleet, campaign

    with attacked_fleet(tmp_path, trainers=2, window_s=1.0) as (nodes, targets):
        records = campaign(nodes, targets, ATTACKS, seconds=2.0)
        assert [r["attack"] for r in records] == [a.__name__ for a in ATTACKS]
        assert all(r["certified_after"] > r["certified_before"] for r in records)
        errors = {e["reason"] for e in nodes[0].events() if e["event"] == "connection-error"}
        assert {"decrypt-failed", "bad-frame"} <= errors, errors


async def _http_attacker(port: int) -> tcp.SecureConnection:
    from peerloom.adapters.http_transport import HttpTransport
    from peerloom.core.identity import Identity

    return await HttpTransport().dial(f"http://127.0.0.1:{port}", Identity(os.urandom(32)))


async def http_noise_attacks(port: int) -> None:
    """Over the HTTP transport, after the Noise handshake: a frame of unknown kind, garbage messages, and a
    PING flood never read that ends in a frame that does not decrypt."""
    for attack in ("unknown-kind", "garbage", "flood"):
        try:
            conn = await _http_attacker(port)
            if attack == "unknown-kind":
                await write_plaintexts(conn, [bytes([15 << 4 | LANE_CONTROL]) + b"\x00" * 8])
            elif attack == "garbage":
                for body in (os.urandom(200), b"\x82\x0f\x40"):
                    await conn.send_message(body)
            else:
                with trio.move_on_after(5):
                    for _ in range(5):
                        await write_plaintexts(conn, [PING + os.urandom(8) for _ in range(1000)])
                    await conn._stream.send_all(frame(os.urandom(64)))
            await trio.sleep(0.3)
            await conn.aclose()
        except (TransportError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the node ending the connection is the expected outcome


def raw_websocket_garbage(port: int) -> None:
    """Before any handshake: binary garbage, a text message and a 3 MiB message on the WebSocket, and a plain
    HTTP request with a body on the upgrade path."""
    import asyncio

    import aiohttp

    from peerloom.adapters.http_transport import HTTP_PATH

    async def attack() -> None:
        url = f"http://127.0.0.1:{port}{HTTP_PATH}"
        async with aiohttp.ClientSession() as session:
            for payload in (os.urandom(300), "text", os.urandom(3 << 20)):
                try:
                    async with session.ws_connect(url, max_msg_size=0) as ws:
                        await (ws.send_str(payload) if isinstance(payload, str) else ws.send_bytes(payload))
                        await asyncio.wait_for(ws.receive(), 5)
                except (TimeoutError, aiohttp.ClientError, ConnectionError):
                    pass
            async with session.post(url, data=os.urandom(1000)) as response:
                assert response.status in (400, 404, 405), response.status

    asyncio.run(attack())


async def relay_garbage(port: int) -> None:
    """At the relay's listener: raw garbage before the handshake, then garbage control messages after it."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(os.urandom(4096))
    await stream.aclose()
    await garbage_application_message(port)


def test_no_attack_on_the_http_transport_or_the_relay_ends_the_node(tmp_path):
    """The validator also listens on the HTTP transport and relays (spec/transport.md §10, §12): attacks on those
    listeners end their connections only; the process lives, serves an honest newcomer, and certifies."""
    from tests.node_cluster import free_port

    nodes = make_fleet(tmp_path, validators=1, trainers=2, quorum=1, window_s=1.0)
    validator = nodes[0]
    http_port, relay_port = free_port(), free_port()
    config = dict(validator.config)
    tcp_listen = config.pop("listen")
    config["transport"] = [{"kind": "tcp", "listen": tcp_listen},
                           {"kind": "http", "listen": f"http://127.0.0.1:{http_port}"}]
    config["relay"] = {"enabled": True, "listen": f"/ip4/127.0.0.1/tcp/{relay_port}"}
    validator.config = config
    validator.write_config()
    try:
        for node in nodes:
            node.start()
        port = validator.wait_port()
        for node in nodes[1:]:
            node.wait_port()
        assert wait_certified(validator, 1, 60), validator.events()[-5:]
        for name, run in (("http-noise", lambda: trio.run(http_noise_attacks, http_port)),
                          ("raw-websocket", lambda: raw_websocket_garbage(http_port)),
                          ("relay", lambda: trio.run(relay_garbage, relay_port))):
            run()
            assert validator.process.poll() is None, f"{name} ended the validator: " + \
                (validator.directory / "node.log").read_text()[-2000:]
            trio.run(honest_hello, port)
        assert wait_certified(validator, certified(validator) + 2, 60), "windows stopped after the attacks"
        assert all(node.process.poll() is None for node in nodes)
        errors = {e["reason"] for e in validator.events() if e["event"] == "connection-error"}
        assert errors & {"bad-frame", "decrypt-failed"}, errors  # the HTTP transport's faults are typed too
    finally:
        for node in nodes:
            node.stop()

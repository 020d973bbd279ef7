"""The browser peer's protocol code (web/src, TypeScript) against the Python node's (spec/browser.md §1):
canonical CBOR byte for byte, envelope signatures, and the Noise XX handshake, framing, frames and lane
credit of the HTTP transport against a real `HttpTransport` listener. Runs the bundle `make web` built,
under node with the `ws` package (tests/web/webbuild.py)."""

from __future__ import annotations

import functools
import math

import trio

from peerloom.adapters.http_transport import HttpTransport
from peerloom.core import encoding
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.identity import Identity
from tests.web.webbuild import node_driver

VALUES = [
    0, 1, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**53 + 1, 2**64 - 1, -1, -24, -25, -(2**64),
    0.0, -0.0, 1.0, 1.5, -2.0, 65504.0, 1e-7, 5.960464477539063e-08, 6.103515625e-05, 0.1, 1e300, 3.4028234663852886e38,
    math.inf, -math.inf, math.nan, True, False, None, b"", b"\x00\xff" * 20, "", "peerloom", "é∑😀", "x" * 300,
    [], [1, [2, [3]]], {}, {"b": 1, "a": 2, "aa": 3, "": 4, "z" * 30: 5, "y" * 24: 6},
    {"window_s": 2.0, "lr": 0.005, "shards": [12, 12, 11], "nested": {"k": [b"\x01", None, True]}},
]

INVALID = {  # hex -> the reason Python's decoder gives
    "1817": "non-canonical",          # 23 in two bytes
    "fb3ff0000000000000": "non-canonical",  # 1.0 as a double
    "a2616101616101": "non-canonical",  # duplicate key... (Python: non-canonical too)
    "a2616201616101": "non-canonical",  # unsorted keys
    "c001": "bad-type",               # a tag
    "a10101": "bad-type",             # an integer map key
    "9f01ff": "malformed",            # indefinite length
    "5f": "malformed",                # truncated indefinite: TypeScript refuses the header (non-canonical)
    "62c328": "malformed",            # invalid UTF-8
    "0102": "malformed",              # trailing bytes
    "f7": "bad-type",                 # undefined
    "81" * 40 + "01": "too-deep",
}


def _python_reason(hex_: str) -> str:
    try:
        encoding.decode(bytes.fromhex(hex_), max_bytes=1 << 20)
    except Exception as exc:  # DecodeError
        return getattr(exc, "reason", type(exc).__name__)
    return "accepted"


def test_canonical_cbor_matches_python_byte_for_byte() -> None:
    vectors = [encoding.encode(v).hex() for v in VALUES]
    result = node_driver({"op": "cbor", "vectors": [{"hex": h} for h in vectors],
                          "invalid": [{"hex": h} for h in INVALID]})
    assert result["roundtrip"] == vectors
    python = [_python_reason(h) for h in INVALID]
    assert all(r != "accepted" for r in python)
    assert all(not r.startswith("crash") and r != "accepted" for r in result["rejected"]), result["rejected"]
    # the same reason as Python's decoder wherever Python's names one of wire.md §1's reasons
    same = {h: (p, t) for h, p, t in zip(INVALID, python, result["rejected"], strict=True) if p != t and h != "5f"}
    assert not same, same


def test_envelopes_signed_in_typescript_are_pythons_bytes() -> None:
    seed = bytes(range(32))
    body = {"revision": b"\x12\x20" + bytes(32), "window": 7, "capacity": 1}
    result = node_driver({"op": "sign", "seed": seed.hex(), "kind": "join", "body": encoding.encode(body).hex()})
    identity = Identity(seed)
    expected = SignedEnvelope.seal(identity, "join", 1, body)
    envelope = SignedEnvelope.from_bytes(bytes.fromhex(result["envelope"]))
    assert result["peer"] == identity.peer_id.to_text()
    assert envelope.signer == identity.peer_id
    assert envelope.open("join", 1) == body
    assert bytes.fromhex(result["id"]) == envelope.id
    assert expected.to_bytes() == bytes.fromhex(result["envelope"])  # Ed25519 is deterministic


SERVER = Identity(bytes([7]) * 32)
CLIENT_SEED = bytes([9]) * 32


def _echo_listener(run_client) -> tuple[dict, list]:
    """An HttpTransport listener whose handler sends each message back reversed on its lane; `run_client`
    (a blocking call given the bound address) runs in a thread. Returns its result and what the handler saw."""
    seen: list = []

    async def echo(conn, lane: int) -> None:
        while True:
            data = await conn.receive_message(lane)
            await conn.send_message(bytes(reversed(data)), lane=lane)

    async def handler(conn) -> None:
        seen.append(conn.remote_peer)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(echo, conn, 0)
            nursery.start_soon(echo, conn, 1)

    async def main() -> dict:
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(functools.partial(HttpTransport().listen, "http://127.0.0.1:0", SERVER,
                                                          handler, max_message_bytes=16 << 20))
            result = await trio.to_thread.run_sync(run_client, bound)
            nursery.cancel_scope.cancel()
        return result

    return trio.run(main), seen


def test_noise_handshake_frames_and_credit_against_the_python_http_transport() -> None:
    messages = [{"size": 0, "lane": 0}, {"size": 100, "lane": 0}, {"size": 70000, "lane": 1},
                {"size": 6 * 1024 * 1024 + 3, "lane": 1}, {"size": 65519, "lane": 0}]

    def client(bound: str) -> dict:
        return node_driver({"op": "echo", "address": bound, "seed": CLIENT_SEED.hex(),
                            "expect": SERVER.peer_id.to_bytes().hex(), "messages": messages}, timeout=120)

    result, seen = _echo_listener(client)
    assert "error" not in result, result
    assert result["remote"] == SERVER.peer_id.to_text()
    assert seen == [Identity(CLIENT_SEED).peer_id]
    assert all(r["ok"] for r in result["received"]), result["received"]
    for lane in (0, 1):  # whole and in order per lane
        assert [r["size"] for r in result["received"] if r["lane"] == lane] == [
            m["size"] for m in messages if m["lane"] == lane]


def test_a_wrong_expected_peer_is_peer_mismatch() -> None:
    def client(bound: str) -> dict:
        return node_driver({"op": "echo", "address": bound, "seed": CLIENT_SEED.hex(),
                            "expect": Identity(bytes([8]) * 32).peer_id.to_bytes().hex(),
                            "messages": [{"size": 1, "lane": 0}]})

    result, seen = _echo_listener(client)
    assert result["error"] == "peer-mismatch"
    assert seen == []


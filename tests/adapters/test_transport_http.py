"""What only the HTTP transport has (spec/transport.md §10): the WebSocket carrier's own faults are typed
peer faults, a plain HTTP request is answered without reaching the node, and a dial that never completes
its upgrade times out. The shared behaviour is in tests/adapters/test_transport_conformance.py."""

from __future__ import annotations

import functools

import aiohttp
import pytest
import trio

from peerloom.adapters.http_transport import HTTP_PATH, MAX_WS_MESSAGE, HttpTransport, _submit, _wait_future
from peerloom.adapters.tcp import SecureOptions
from peerloom.adapters.transport import PEER_FAULTS, TransportError
from peerloom.core.identity import Identity

SERVER = Identity(bytes([1]) * 32)
CLIENT = Identity(bytes([2]) * 32)


async def _raw_websocket(url: str, payload: str | bytes) -> None:
    """On the HTTP loop: open a WebSocket to `url`, send one message, wait for the server to close."""
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(url, max_msg_size=0) as ws:
            if isinstance(payload, str):
                await ws.send_str(payload)
            else:
                await ws.send_bytes(payload)
            await ws.receive(timeout=10)


@pytest.mark.parametrize(("payload", "reason"), [
    ("hello", "bad-frame"),  # a text message
    (b"\0" * (MAX_WS_MESSAGE + 1), "message-too-large"),  # over the WebSocket message limit
], ids=["text", "oversize"])
def test_websocket_faults_are_typed_peer_faults(payload: str | bytes, reason: str) -> None:
    errors: list[TransportError] = []

    async def main() -> None:
        # the server's handshake fails on the bad first message; its typed error reaches on_handshake_failed
        options = SecureOptions(on_handshake_failed=lambda ip, exc: errors.append(exc))
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(functools.partial(HttpTransport(options).listen, "http://127.0.0.1:0",
                                                          SERVER, lambda conn: trio.sleep_forever()))
            await _wait_future(_submit(_raw_websocket(bound + HTTP_PATH, payload)))
            with trio.fail_after(10):
                while not errors:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert errors[0].reason == reason and reason in PEER_FAULTS


def test_plain_http_requests_are_answered_without_reaching_the_node() -> None:
    async def get(url: str) -> int:
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            return response.status

    async def main() -> None:
        reached = []
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(functools.partial(HttpTransport().listen, "http://127.0.0.1:0", SERVER,
                                                          reached.append))
            assert await _wait_future(_submit(get(bound + HTTP_PATH))) == 400  # no upgrade asked
            assert await _wait_future(_submit(get(bound + "/other"))) == 404
            assert not reached
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_server_that_never_answers_the_upgrade_is_a_handshake_timeout() -> None:
    async def main() -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")  # accepts, never speaks HTTP
        port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, lambda stream: trio.sleep_forever(), listeners)
            with pytest.raises(TransportError) as info:
                await HttpTransport(SecureOptions(handshake_timeout=0.5)).dial(
                    f"http://127.0.0.1:{port}", CLIENT, max_message_bytes=1000)
            assert info.value.reason == "handshake-timeout"
            nursery.cancel_scope.cancel()

    trio.run(main)

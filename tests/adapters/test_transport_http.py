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
from tests.helpers import CLIENT, SERVER


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


def test_a_request_trickled_past_the_header_deadline_is_closed_and_counted() -> None:
    """spec/transport.md §13: the request line and headers must be complete within `http_header_timeout_s`
    of the accept. A client that trickles a request line is closed when that runs out and counted as
    ``header-timeout``, and its socket leaves the limiter's count."""
    import socket
    import time

    from peerloom.adapters.limits import ConnectionLimiter, Limits

    limiter = ConnectionLimiter(Limits(http_header_timeout_s=0.6))

    def trickle(port: int) -> tuple[float, float]:
        """Seconds from connect to the server's close; one byte every 0.1 s."""
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            start = time.monotonic()
            sock.settimeout(0.1)
            for byte in b"GET " + HTTP_PATH.encode() + b" HTTP/1.1\r\nHost: x\r\n" * 20:
                try:
                    if sock.recv(1024) == b"":
                        return time.monotonic() - start, 0.0
                except TimeoutError:
                    pass
                except ConnectionResetError:
                    return time.monotonic() - start, 0.0
                try:
                    sock.send(bytes([byte]))
                except (BrokenPipeError, ConnectionResetError):
                    return time.monotonic() - start, 0.0
            return float("inf"), 0.0

    async def main() -> float:
        async with trio.open_nursery() as nursery:
            transport = HttpTransport(SecureOptions(limiter=limiter))
            bound = await nursery.start(functools.partial(transport.listen, "http://127.0.0.1:0", SERVER,
                                                          lambda conn: trio.sleep_forever()))
            port = int(bound.rsplit(":", 1)[1])
            closed_after, _ = await trio.to_thread.run_sync(trickle, port)
            with trio.fail_after(5):
                while limiter.sockets:  # the closed socket's slot is released
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        return closed_after

    closed_after = trio.run(main)
    assert 0.5 <= closed_after < 3.0, closed_after  # at the deadline, not before it, not never
    assert limiter.refusals["header-timeout"] == 1

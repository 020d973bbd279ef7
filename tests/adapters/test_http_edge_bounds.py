"""Resource bounds of the HTTP edge (spec/transport.md §5): one memory budget for every upload in progress, bodies
spooled to disk, refusals that close instead of draining, header and body timeouts."""

from __future__ import annotations

import json
import socket
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from peerloom.adapters.http_edge import SPOOL_PREFIX, UPLOAD_BUFFER_BYTES, EdgeLimits, EdgeServer
from peerloom.core.encoding import encode
from peerloom.core.objects import make_artifact_ref
from tests.adapters.test_http_edge import error_code, leaseholder, post, signed_update
from tests.edge_fixtures import make_view

MiB = 1 << 20
FAST = {"rate": 10_000, "burst": 10_000}


def request_head(path: str, length: int | None, content_type: str = "application/cbor", extra: str = "") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Type: {content_type}"]
    lines.append(f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One whole response (the edge's error bodies carry a Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"closed before a response: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers.get("content-length", "0")):
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closes `sock` (EOF or reset) while we only read; None if it stays open."""
    start = time.monotonic()
    sock.settimeout(0.05)
    while time.monotonic() - start < seconds:
        try:
            if not sock.recv(65536):
                return time.monotonic() - start
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - start
    return None


def wait_until(predicate, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def spooled(view) -> list[str]:
    return [p.name for p in Path(view._dir).iterdir() if p.name.startswith(SPOOL_PREFIX)]


@pytest.fixture
def view(tmp_path):
    return make_view(tmp_path)


# --- refusals close the connection instead of draining the body ------------------------------------------

@pytest.mark.parametrize(("head", "status"), [
    (request_head("/v1/updates", 200_000_000), 413),
    (request_head("/v1/updates", None), 411),
    (request_head("/v1/updates", 60_000_000, "application/json"), 415),
    (request_head("/v1/join", 200_000_000), 413),
], ids=["413", "411", "415", "413-join"])
def test_refused_body_is_not_read(view, head, status):
    """After a 413 the server used to keep reading a 200 MB body. Now each refusal decided from the
    headers is answered with Connection: close and the socket is closed; a client that keeps writing is reset
    long before it has sent the body."""
    with EdgeServer(view, limits=EdgeLimits(**FAST)) as server:
        # The answer, then the end of the connection.
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(head)
            got, headers, body = read_response(sock)
            assert got == status and headers["connection"] == "close" and error_code(body)
            assert closed_within(sock, 3.0) is not None
        # A client that keeps sending: reset within a couple of seconds, after a few MB at most.
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(head)
            chunk = b"\xa5" * 65536
            sent, start, reset = 0, time.monotonic(), None
            sock.settimeout(0.2)
            while time.monotonic() - start < 8 and sent < 200_000_000:
                try:
                    sent += sock.send(chunk)
                except TimeoutError:
                    continue  # nobody reads: the kernel's buffers are full
                except OSError:
                    reset = time.monotonic() - start
                    break
            assert reset is not None and reset < 3.0, (reset, sent)
            assert sent < 40_000_000, sent


def test_small_refused_body_still_gets_its_answer(view):
    """The bounded linger: a client that writes a small body before reading sees the 413, not a reset."""
    with EdgeServer(view, limits=EdgeLimits(max_join_bytes=100, **FAST)) as server:
        for _ in range(5):
            status, _, body = post(server, "/v1/join", b"\x00" * 5000)
            assert status == 413 and error_code(body) == "too-large"


# --- timeouts ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("partial", [b"", b"POST /v1/upd", b"GET /healthz HTTP/1.1\r\nHost: x\r\n"],
                         ids=["nothing", "request-line", "headers"])
def test_slow_request_headers_time_out(view, partial):
    with EdgeServer(view, limits=EdgeLimits(header_timeout_s=0.5, **FAST)) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(partial)
            elapsed = closed_within(sock, 5.0)
            assert elapsed is not None and 0.3 < elapsed < 3.0, elapsed


def test_trickled_headers_time_out_and_complete_ones_do_not(view):
    with EdgeServer(view, limits=EdgeLimits(header_timeout_s=0.6, **FAST)) as server:
        # One byte every 0.1 s keeps the connection busy but never finishes the headers in time.
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            start, closed = time.monotonic(), False
            for byte in b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    closed = True
                    break
                if closed_within(sock, 0.1) is not None:
                    closed = True
                    break
            assert closed and time.monotonic() - start < 3.0
        # A kept-alive connection: the first request is served, the next one's headers have the same deadline.
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(sock)[0] == 200
            sock.sendall(b"GET /healthz HTTP/1.1\r\n")
            elapsed = closed_within(sock, 5.0)
            assert elapsed is not None and elapsed < 3.0


@pytest.mark.parametrize("path", ["/v1/updates", "/v1/join"])
def test_stalled_body_times_out(view, path):
    with EdgeServer(view, limits=EdgeLimits(body_timeout_s=0.5, **FAST)) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(request_head(path, 1000) + b"\xa2" * 10)
            start = time.monotonic()
            status, headers, body = read_response(sock)
            assert status == 408 and error_code(body) == "body-timeout" and headers["connection"] == "close"
            assert 0.3 < time.monotonic() - start < 3.0
            assert closed_within(sock, 3.0) is not None
        assert wait_until(lambda: server.edge._uploads == 0 and server.edge._reserved == 0)
        assert spooled(view) == []


# --- one memory budget for all uploads ------------------------------------------------------------------

def test_memory_budget_refuses_before_reading_and_is_given_back(view):
    """Only the number of uploads used to be capped, so 4 x 64 MiB bodies (and their copies) could
    be in memory at once. Now every upload reserves its Content-Length from one budget before its body is
    read; a request that does not fit is answered 503 at once, from its headers."""
    limits = EdgeLimits(max_upload_bytes=MiB, upload_memory_bytes=2 * MiB, max_concurrent_uploads=4, **FAST)
    with EdgeServer(view, limits=limits) as server:
        stalled = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(2)]
        try:
            for sock in stalled:
                sock.sendall(request_head("/v1/updates", MiB) + b"\xa2")
            assert wait_until(lambda: server.edge._reserved == 2 * MiB and server.edge._uploads == 2)
            # The bodies go to temporary files next to the node's artifacts, not into memory.
            assert wait_until(lambda: len(spooled(view)) == 2)
            # Headers only: the answer comes without a byte of the body.
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
                sock.sendall(request_head("/v1/updates", 100))
                status, headers, body = read_response(sock)
                assert status == 503 and error_code(body) == "memory-budget" and headers["retry-after"] == "1"
            # A client that writes its whole body first still sees the 503 (the body is discarded, not kept).
            status, headers, body = post(server, "/v1/updates", b"\x00" * MiB)
            assert status == 503 and error_code(body) == "memory-budget" and headers["Retry-After"] == "1"
        finally:
            for sock in stalled:
                sock.close()
        assert wait_until(lambda: server.edge._reserved == 0 and server.edge._uploads == 0)
        assert spooled(view) == []
        trainer = leaseholder(view)
        artifact = b"after the budget came back" * 1000
        body = encode({"envelope": signed_update(view, trainer, artifact), "artifact": artifact})
        assert post(server, "/v1/updates", body)[0] == 202
        assert spooled(view) == []


def test_expect_100_continue_invites_only_bodies_that_will_be_read(view):
    limits = EdgeLimits(max_upload_bytes=MiB, upload_memory_bytes=MiB, max_concurrent_uploads=4, **FAST)
    expect = "Expect: 100-continue\r\n"
    with EdgeServer(view, limits=limits) as server:
        # Over the limit: the final answer at once, no invitation to send 200 MB.
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(request_head("/v1/updates", 200_000_000, extra=expect))
            assert read_response(sock)[0] == 413
        # Room for it: 100 Continue, and the body is read.
        stalled = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        try:
            stalled.sendall(request_head("/v1/updates", MiB, extra=expect))
            assert stalled.recv(64).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
            assert wait_until(lambda: server.edge._reserved == MiB)
            # The budget is now full: the next one is told 503 instead of being invited.
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
                sock.sendall(request_head("/v1/updates", 1000, extra=expect))
                status, headers, body = read_response(sock)
                assert status == 503 and error_code(body) == "memory-budget" and headers["retry-after"] == "1"
        finally:
            stalled.close()
        assert wait_until(lambda: server.edge._reserved == 0)


def test_an_accepted_upload_holds_one_copy_of_its_body(view):
    """The whole path of an 8 MiB upload (receive, check, hand to the node, store) allocates about one copy
    of the body; reading it with `request.read()` and `decode()` allocated four."""
    trainer = leaseholder(view)
    artifact = bytes(range(256)) * (8 * MiB // 256)
    body = encode({"envelope": signed_update(view, trainer, artifact), "artifact": artifact})
    with EdgeServer(view, limits=EdgeLimits(max_upload_bytes=16 * MiB, **FAST)) as server:
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
                sock.sendall(request_head("/v1/updates", len(body)))
                sock.sendall(memoryview(body))
                status, _, answer = read_response(sock)
            peak = tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()
    assert status == 202, answer
    assert peak < len(body) + 2 * UPLOAD_BUFFER_BYTES, peak / len(body)
    # Stored whole and verified.
    stored = view.artifact_path(make_artifact_ref(artifact, 64 * 1024).digest)  # as `signed_update` names it
    assert stored is not None and stored.read_bytes() == artifact and len(view.updates) == 1
    assert spooled(view) == []


def test_a_timed_out_submission_keeps_its_room_until_the_node_lets_go(view):
    """The answer 503 ``timeout`` does not free the budget: the node's thread still holds the artifact."""
    gate = threading.Event()
    real = view.submit

    def slow_node(envelope, artifact):
        gate.wait(10)
        return real(envelope, artifact)

    view.submit = slow_node
    trainer = leaseholder(view)
    artifact = b"slow" * 10_000
    body = encode({"envelope": signed_update(view, trainer, artifact), "artifact": artifact})
    limits = EdgeLimits(submit_timeout_s=0.3, max_upload_bytes=64 * 1024, upload_memory_bytes=64 * 1024, **FAST)
    with EdgeServer(view, limits=limits) as server:
        status, _, answer = post(server, "/v1/updates", body)
        assert status == 503 and error_code(answer) == "timeout"
        assert server.edge._reserved == len(body) and server.edge._uploads == 1
        status, _, answer = post(server, "/v1/updates", body)
        assert status == 503 and error_code(answer) == "memory-budget"
        gate.set()
        assert wait_until(lambda: server.edge._reserved == 0 and server.edge._uploads == 0)
        assert post(server, "/v1/updates", body)[0] == 202
    assert len(view.updates) == 2  # the late one was stored too, after its answer


def test_a_client_that_disconnects_mid_body_frees_its_slot_and_file(view):
    with EdgeServer(view, limits=EdgeLimits(max_concurrent_uploads=1, **FAST)) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(request_head("/v1/updates", MiB) + b"\xa2" * (MiB // 2))
            assert wait_until(lambda: server.edge._uploads == 1 and len(spooled(view)) == 1)
        assert wait_until(lambda: server.edge._uploads == 0 and server.edge._reserved == 0)
        assert wait_until(lambda: spooled(view) == [])
        assert view.updates == []


# --- the spooled body is parsed as strictly as `decode` would -------------------------------------------

def _bodies(envelope: bytes, artifact: bytes) -> dict[str, bytes]:
    good = encode({"envelope": envelope, "artifact": artifact})
    art_key, env_key = b"\x68artifact", b"\x68envelope"
    long_head = b"\x59" + len(artifact).to_bytes(2, "big")  # a 2-byte length where 1 byte would do
    return {
        "reversed-keys": b"\xa2" + env_key + encode(envelope) + art_key + encode(artifact),
        "long-length": b"\xa2" + art_key + long_head + artifact + env_key + encode(envelope),
        "indefinite": b"\xa2" + art_key + b"\x5f" + encode(artifact) + b"\xff" + env_key + encode(envelope),
        "trailing": good + b"\x00",
        "truncated": good[:-1],
        "three-keys": encode({"envelope": envelope, "artifact": artifact, "x": b""}),
        "text-artifact": encode({"envelope": envelope, "artifact": "text"}),
        "array": encode([envelope, artifact]),
        "empty": b"",
        "length-past-end": b"\xa2" + art_key + b"\x5a\xff\xff\xff\xff",
    }


def test_malformed_upload_bodies_are_typed_400s(view):
    trainer = leaseholder(view)
    artifact = b"delta" * 10
    envelope = signed_update(view, trainer, artifact)
    want = {"reversed-keys": "non-canonical", "long-length": "non-canonical", "indefinite": "non-canonical",
            "trailing": "malformed", "truncated": "malformed", "three-keys": "bad-body",
            "text-artifact": "bad-body", "array": "bad-body", "empty": "malformed", "length-past-end": "malformed"}
    with EdgeServer(view, limits=EdgeLimits(**FAST)) as server:
        for name, body in _bodies(envelope, artifact).items():
            status, _, answer = post(server, "/v1/updates", body)
            assert status == 400 and error_code(answer) == want[name], (name, answer)
        assert view.updates == [] and spooled(view) == []
        assert post(server, "/v1/updates", encode({"envelope": envelope, "artifact": artifact}))[0] == 202


def test_limits_validate_themselves():
    assert EdgeLimits().memory_bound_bytes == 256 * MiB + 8 * UPLOAD_BUFFER_BYTES
    with pytest.raises(ValueError, match="upload_memory_bytes"):
        EdgeLimits(max_upload_bytes=64 * MiB, upload_memory_bytes=MiB)
    for name in ("header_timeout_s", "body_timeout_s", "max_concurrent_uploads", "max_upload_bytes"):
        with pytest.raises(ValueError, match=name):
            EdgeLimits(**{name: 0})


def test_openapi_documents_the_new_answers():
    from peerloom.adapters.http_edge import openapi_document

    responses = openapi_document()["paths"]["/v1/updates"]["post"]["responses"]
    assert {"408", "411", "413", "415", "503"} <= set(responses)
    assert json.dumps(responses["503"])

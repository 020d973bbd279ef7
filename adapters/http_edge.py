"""The HTTP edge: an aiohttp server that serves a node's chain and artifacts to light peers and dashboards
(spec/design.md §6). Its OpenAPI 3 document is served at ``/openapi.json`` (built by `openapi_document`).

It runs on its own thread with its own asyncio loop (the node runtime is trio) and talks to the node only
through an `EdgeView`. It binds 127.0.0.1 by default.

Endpoints (binary ids are lowercase hex of the 34-byte content id; peer ids are base58 text):

==========================  ====================================================================================
``GET /``                   read-only dashboard (head chain, loss/accuracy curve, peers, bytes); 200 text/html
``GET /healthz``            200 ``{"status": "ok", "peer", "roles", "window", "addresses"}`` (``addresses``:
                            the node's transport listen addresses, which `peerloom light` dials); ``status``
                            is ``disk-full`` while the store cannot be written (reads are still served,
                            ``POST /v1/updates`` answers 503 ``disk-full``)
``GET /metrics``            200 Prometheus text exposition (the node's registry plus the edge's own counters)
``GET /openapi.json``       200 this API as OpenAPI 3.0
``GET /v1/manifest``        200 the signed revision manifest (hex of the canonical SignedEnvelope), with its
                            ``privacy`` (DP-SGD's parameters and the epsilon budget, or null) and
                            ``private_data`` decoded (spec/protocol.md §10)
``GET /v1/heads/latest``    200 the latest certified head (canonical CBOR as hex + decoded summary: its
                            ``privacy`` ledger as ``{peer, steps, epsilon}``, its ``private`` trainers, ...)
``GET /v1/heads/{id}``      200 / 400 malformed id / 404 unknown head
``GET /v1/chain``           200 page of heads, ``?from=<window>&limit=<1..256>``; 400 on bad parameters
``GET /v1/certificates/{id}``  200 / 400 / 404 (genesis has no certificate)
``GET /v1/artifacts/{digest}``  200 whole artifact, 206 one byte range (``Range: bytes=a-b``, ``a-``, ``-n``),
                            416 unsatisfiable range (with ``Content-Range: bytes */size``), 304 when
                            ``If-None-Match`` names the ETag (the digest), 400, 404.
                            Several ranges in one header are ignored (200), as RFC 9110 §14.2 allows.
``GET /v1/leases/{peer}``   200 the peer's shards for the next window; 400 bad peer id
``POST /v1/updates``        application/cbor ``{"envelope": <SignedEnvelope bytes>, "artifact": <delta bytes>}``
``POST /v1/join``           application/cbor: the bytes of a signed ``join`` envelope
``POST /v1/revocations``    application/cbor: the bytes of the admission authority's signed ``revocation``
                            envelope (spec/auth.md §6); a validator's edge keeps it and forwards it
``GET /v1/peers``           200 peers the node knows (rejections of each), the node's last failed task
``GET /v1/history``         200 per-window statistics for the dashboard
``GET /v1/events``          text/event-stream; one ``head`` event now (or, with ``Last-Event-ID: <window>``,
                            every head after that window) and one per head promotion; 503 when
                            `EdgeLimits.max_sse_clients` streams are open
==========================  ====================================================================================

Posting, and what it may cost the node (spec/transport.md §5). The edge decides from the request's headers alone,
before reading a byte of the body: 411 without a Content-Length, 413 above `EdgeLimits.max_upload_bytes`
(`EdgeLimits.max_join_bytes` for joins), 415 for a content type other than application/cbor. Each of these
answers carries ``Connection: close`` and ends the connection: the edge reads at most 64 KiB more of the
body for at most 0.5 s (so a client that already sent a small body sees the answer rather than a reset)
and closes, rather than draining a body it will never take. An update whose headers pass then needs one of
`EdgeLimits.max_concurrent_uploads` slots and its Content-Length of room in `EdgeLimits.upload_memory_bytes`,
the one memory budget that every upload in progress draws from; without either it gets 503 with
``Retry-After: 1`` (code ``busy`` / ``memory-budget``), still before its body is read; a request that sent
``Expect: 100-continue`` gets ``100 Continue`` only when its body would be read, and otherwise its final
answer before it sends any of the body. After a 503 or a 429 for a body of acceptable size the edge
discards that body (at most its Content-Length, for at most `EdgeLimits.body_timeout_s`, at most
`EdgeLimits.max_concurrent_uploads` such bodies at once) so that a client that writes its whole body before
reading sees the answer, then closes.

An admitted body is streamed to a temporary file in bounded chunks (``.edge-upload-*.tmp`` next to the
artifacts the node serves, or `EdgeServer`'s `spool_dir`), so receiving it holds at most
`UPLOAD_BUFFER_BYTES` of memory. The file is then read head by head as the canonical CBOR map
``{"artifact": bytes, "envelope": bytes}`` (400 ``malformed`` / ``non-canonical`` / ``bad-body``), the
envelope's kind and Ed25519 signature are checked (400 wrong kind, 403 bad signature) before the artifact is
read into memory (the room it reserved) and matched against the announced delta (400
``artifact-mismatch``), and the node verifies everything again: 202 accepted, 422 rejected by the node (the
error code is the node's reason), 503 when it does not answer within `EdgeLimits.submit_timeout_s`. A slot
and its room come back only when every worker thread handling that upload has returned, so an upload that
timed out or whose client left still counts until its bytes are freed. The memory that request bodies hold
is therefore at most `EdgeLimits.memory_bound_bytes` = ``upload_memory_bytes + 2 x max_concurrent_uploads x
UPLOAD_BUFFER_BYTES`` (264 MiB by default; `bench/upload_memory.py` measures it). Outside it, per
connection and briefly: what aiohttp reads ahead of a request's handler (at most ~0.4 MiB, until the
refusal above closes the connection within 0.5 s) and join bodies (at most `EdgeLimits.max_join_bytes`).
The edge does not cap the number of connections. Nothing changes state without a signature that verifies.

Timeouts: a connection whose request line and headers are not complete `EdgeLimits.header_timeout_s` seconds
after it opened, or after the previous response on a kept-alive connection, is closed (`_HeaderDeadline`,
and aiohttp's keep-alive timer); a request whose body sends nothing for `EdgeLimits.body_timeout_s` seconds
is answered 408 ``body-timeout`` and closed.

Every client IP has a token bucket of `EdgeLimits.burst` requests refilled at `EdgeLimits.rate` requests per
second; an empty bucket gives 429 with ``Retry-After``. Errors are JSON:
``{"error": {"status": 404, "code": "unknown-head", "message": "..."}}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
from aiohttp import HttpVersion11, web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from peerloom.core.encoding import encode
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.errors import DecodeError, VerificationError
from peerloom.core.identity import PeerId
from peerloom.core.objects import (
    PROTOCOL_VERSION,
    AdmissionRevocation,
    Head,
    JoinRequest,
    QuorumCertificate,
    UpdateAnnouncement,
    make_artifact_ref,
)

from .edge_dashboard import DASHBOARD_HTML
from .edge_view import CertifiedEntry, EdgeView, PeerInfo, WindowStats
from .limits import TokenBuckets

log = logging.getLogger("peerloom.http_edge")

CID_HEX_CHARS = 68
MAX_PEER_TEXT = 64
MAX_PAGE = 256
CBOR = "application/cbor"
_STREAM_CHUNK = 256 * 1024
# What one upload holds in memory while its body is received, outside `EdgeLimits.upload_memory_bytes`:
# aiohttp's read buffer (it stops reading the socket past 128 KiB), one socket read (<= 256 KiB) and the
# file's write buffer, rounded up.
UPLOAD_BUFFER_BYTES = 1 << 20
SPOOL_PREFIX = ".edge-upload-"  # spooled bodies: ".edge-upload-XXXX.tmp", which ArtifactStore clears on opening
_LINGER_BYTES = 64 * 1024  # read at most this much of a refused body before closing ...
_LINGER_S = 0.5  # ... for at most this long
_BODY_ROUTES = ("/v1/updates", "/v1/join", "/v1/revocations")


@attrs.frozen(kw_only=True)
class EdgeLimits:
    """Limits of the edge. Sizes in bytes, times in seconds, rates in requests per second per client IP.

    `upload_memory_bytes` is the one memory budget of all uploads in progress: each reserves its
    Content-Length before its body is read and keeps it until the last thread handling it is done; at most
    `max_concurrent_uploads` uploads are in progress at once. `header_timeout_s` bounds the time from a
    connection's opening (or its previous response) to the end of the next request's headers;
    `body_timeout_s` the time a body may send nothing. Raises ValueError for a limit that is not positive,
    or a budget that cannot hold one upload of `max_upload_bytes`.
    """

    max_upload_bytes: int = 64 << 20
    max_join_bytes: int = 4096
    rate: float = 50.0
    burst: int = 100
    max_clients_tracked: int = 10_000
    max_sse_clients: int = 64
    sse_keepalive_s: float = 15.0
    submit_timeout_s: float = 15.0
    max_concurrent_uploads: int = 4
    upload_memory_bytes: int = 256 << 20
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0

    @property
    def memory_bound_bytes(self) -> int:
        """The most memory request bodies hold at once: `upload_memory_bytes` for the bodies being checked and
        handed to the node, plus `UPLOAD_BUFFER_BYTES` for each body being received (at most
        `max_concurrent_uploads` uploads) or discarded after a 429/503 (at most as many again)."""
        return self.upload_memory_bytes + 2 * self.max_concurrent_uploads * UPLOAD_BUFFER_BYTES

    def __attrs_post_init__(self) -> None:
        for field in attrs.fields(EdgeLimits):
            value = getattr(self, field.name)
            if not value > 0:
                raise ValueError(f"EdgeLimits.{field.name} must be positive, not {value!r}")
        if self.upload_memory_bytes < self.max_upload_bytes:
            raise ValueError(f"EdgeLimits.upload_memory_bytes ({self.upload_memory_bytes}) must hold one upload "
                             f"of max_upload_bytes ({self.max_upload_bytes})")


class ApiError(Exception):
    """An error answered as a typed JSON body with `status`."""

    def __init__(self, status: int, code: str, message: str = "", headers: dict[str, str] | None = None) -> None:
        super().__init__(message or code)
        self.status, self.code, self.message, self.headers = status, code, message or code, headers or {}


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    body = {"error": {"status": status, "code": code, "message": message}}
    return web.json_response(body, status=status, headers=headers)


# --- JSON views of protocol objects ---------------------------------------------------------------------

def certificate_json(cert: QuorumCertificate) -> dict[str, Any]:
    return {"head": cert.head.hex(), "window": cert.window, "round": cert.round,
            "signers": [p.to_text() for p, _ in cert.votes], "cbor": encode(cert.to_cbor()).hex()}


def head_json(entry: CertifiedEntry) -> dict[str, Any]:
    h: Head = entry.head
    return {
        "id": h.id.hex(), "window": h.window, "parent": None if h.parent is None else h.parent.hex(),
        "skipped": h.skipped, "revision": h.revision.hex(),
        "params": {"digest": h.params.digest.hex(), "size": h.params.size, "chunk_size": h.params.chunk_size},
        "params_digest": h.params_digest.hex(), "cohort": [c.hex() for c in h.cohort],
        "roster": [{"peer": p.to_text(), "capacity": c} for p, c in h.roster],
        "quarantine": [{"peer": p.to_text(), "until": until} for p, until in h.quarantine],
        "strikes": [{"peer": p.to_text(), "count": n, "window": w} for p, n, w in h.strikes],
        "rejected": [u.hex() for u in h.rejected],
        "evidence": [[a.signer.to_text(), b.signer.to_text()] for a, b in h.evidence],
        "left": [p.to_text() for p in h.left], "expired": [p.to_text() for p in h.expired], "metrics": dict(h.metrics),
        "private": [p.to_text() for p in h.private],
        "privacy": [{"peer": p.to_text(), "steps": steps, "epsilon": eps} for p, steps, eps in h.privacy],
        "cbor": h.to_bytes().hex(),
        "certificate": None if entry.certificate is None else certificate_json(entry.certificate),
    }


def peer_json(p: PeerInfo) -> dict[str, Any]:
    return {"peer": p.peer_id.to_text(), "roles": list(p.roles), "address": p.address, "connected": p.connected,
            "bytes_sent": p.bytes_sent, "bytes_received": p.bytes_received, "rejected": p.rejected,
            "last_rejection": p.last_rejection}


def window_json(w: WindowStats) -> dict[str, Any]:
    return {"window": w.window, "head": w.head_id.hex(), "skipped": w.skipped, "metrics": dict(w.metrics),
            "accepted": w.accepted, "rejected": w.rejected, "bytes_sent": w.bytes_sent,
            "bytes_received": w.bytes_received, "time": w.time}


def parse_cid(text: str) -> bytes:
    if len(text) != CID_HEX_CHARS or not text.startswith("1220"):
        raise ApiError(400, "bad-id", f"ids are {CID_HEX_CHARS} lowercase hex characters starting 1220")
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise ApiError(400, "bad-id", "not hex") from None


def parse_peer(text: str) -> PeerId:
    if not 0 < len(text) <= MAX_PEER_TEXT:
        raise ApiError(400, "bad-peer-id", "peer ids are base58 text")
    try:
        return PeerId.from_text(text)
    except DecodeError as exc:
        raise ApiError(400, "bad-peer-id", str(exc)) from None


def _query_int(request: web.Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 12 or not lo <= int(raw) <= hi:
        raise ApiError(400, "bad-parameter", f"{name} must be an integer in {lo}..{hi}")
    return int(raw)


def parse_range(header: str, size: int) -> tuple[int, int] | None:
    """The single byte range (start, end inclusive) a Range header asks of a `size`-byte body.

    None means "serve the whole body" (no header, another unit, several ranges or invalid syntax, all of
    which RFC 9110 §14.2 lets a server ignore). Raises ApiError 416 when the range is unsatisfiable.
    """
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first, dash, last = spec.strip().partition("-")
    if not dash or not (first.isdigit() or first == "") or not (last.isdigit() or last == ""):
        return None
    if len(first) > 20 or len(last) > 20:
        return None
    unsatisfiable = ApiError(416, "range-not-satisfiable", f"artifact has {size} bytes",
                             {"Content-Range": f"bytes */{size}"})
    if first == "":
        if last == "":
            return None
        n = int(last)
        if n == 0 or size == 0:
            raise unsatisfiable
        return max(0, size - n), size - 1
    start = int(first)
    if last != "" and int(last) < start:
        return None  # syntactically invalid: ignored
    if start >= size:
        raise unsatisfiable
    return start, size - 1 if last == "" else min(int(last), size - 1)


# --- the server -----------------------------------------------------------------------------------------

class HttpEdge:
    """The aiohttp application for one node. Use `EdgeServer` to run it on a thread."""

    def __init__(self, view: EdgeView, limits: EdgeLimits | None = None, *, spool_dir: Path | None = None) -> None:
        self.view = view
        self.limits = limits or EdgeLimits()
        self.spool_dir = spool_dir
        self.buckets = TokenBuckets(self.limits.rate, self.limits.burst, self.limits.max_clients_tracked)
        self.registry = CollectorRegistry()
        self.requests = Counter("peerloom_http_requests", "HTTP requests by route and status",
                                ("route", "status"), registry=self.registry)
        self.sse_clients = Gauge("peerloom_http_sse_clients", "Open server-sent event streams",
                                 registry=self.registry)
        self.submissions = Counter("peerloom_http_submissions", "Signed submissions by kind and outcome",
                                   ("kind", "outcome"), registry=self.registry)
        self._streams: set[asyncio.Queue[dict[str, Any] | None]] = set()
        self._uploads = 0  # uploads in progress (slots taken)
        self._reserved = 0  # bytes of `limits.upload_memory_bytes` they hold
        self._draining = 0  # refused bodies being discarded (at most `limits.max_concurrent_uploads`)
        # Connections whose first request's headers are not complete yet (see `_HeaderDeadline`).
        self._awaiting_headers: dict[asyncio.BaseTransport, _HeaderDeadline] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self.browser_data: Any = None  # adapters.edge_data.BrowserData, when the workload runs in a browser
        from .edge_data import WEB_DIST

        self.web_dist = WEB_DIST

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware],
                              client_max_size=self.limits.max_upload_bytes + 1024)
        r = app.router
        r.add_get("/", self.dashboard)
        r.add_get("/healthz", self.healthz)
        r.add_get("/metrics", self.metrics)
        r.add_get("/openapi.json", self.openapi)
        r.add_get("/v1/manifest", self.manifest)
        r.add_get("/v1/heads/latest", self.latest)
        r.add_get("/v1/heads/{head_id}", self.head)
        r.add_get("/v1/chain", self.chain)
        r.add_get("/v1/certificates/{head_id}", self.certificate)
        r.add_get("/v1/artifacts/{digest}", self.artifact)
        r.add_get("/v1/leases/{peer}", self.leases)
        r.add_post("/v1/updates", self.post_update, expect_handler=self._expect)
        r.add_post("/v1/join", self.post_join, expect_handler=self._expect)
        r.add_post("/v1/revocations", self.post_revocation, expect_handler=self._expect)
        r.add_get("/v1/peers", self.peers)
        r.add_get("/v1/history", self.history)
        r.add_get("/v1/events", self.events)
        r.add_get("/v1/data/index", self.data_index)
        r.add_get("/v1/data/train", self.data_train)
        r.add_get("/train", self.train_page)
        r.add_get("/train/{file}", self.train_file)
        app.on_startup.append(self._on_startup)
        app.on_shutdown.append(self._on_shutdown)
        return app

    # --- plumbing ---

    async def _on_startup(self, app: web.Application) -> None:
        self._loop = asyncio.get_running_loop()
        self._unsubscribe = self.view.subscribe(self._on_head_threadsafe)

    async def _on_shutdown(self, app: web.Application) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
        for queue in list(self._streams):
            queue.put_nowait(None)

    def _on_head_threadsafe(self, head: Head, cert: QuorumCertificate) -> None:
        """Called by the node on head promotion, from any thread."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._broadcast, CertifiedEntry(head=head, certificate=cert))

    def _broadcast(self, entry: CertifiedEntry) -> None:
        payload = head_json(entry)
        for queue in list(self._streams):
            try:
                queue.put_nowait(payload)
            except asyncio.QueueFull:  # a client that does not read is dropped, not buffered without bound
                self._streams.discard(queue)

    @web.middleware
    async def _middleware(self, request: web.Request,
                          handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        guard = self._awaiting_headers.pop(request.transport, None) if request.transport is not None else None
        if guard is not None:
            guard.headers_complete()
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unknown"
        status = 500
        try:
            try:
                wait = self.buckets.take(request.remote or "?", time.monotonic())
                if wait > 0:
                    raise ApiError(429, "rate-limited", f"over {self.limits.rate:g} requests/s",
                                   {"Retry-After": str(max(1, round(wait + 0.5)))})
                if request.method == "POST" and (problem := self._body_problem(request, route)) is not None:
                    raise problem
                response = await handler(request)
            except ApiError as exc:
                response = error_response(exc.status, exc.code, exc.message, exc.headers)
            except web.HTTPException as exc:
                if exc.status < 400:
                    status = exc.status
                    raise
                code = exc.reason.lower().replace(" ", "-")
                response = error_response(exc.status, code, exc.text or exc.reason,
                                          {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None)
            except (asyncio.CancelledError, ConnectionResetError):
                raise
            except Exception:
                log.exception("edge handler failed: %s %s", request.method, request.path)
                response = error_response(500, "internal", "internal error")
            status = response.status
            if request.body_exists and not request.content.is_eof():
                # Answered before the body was read (or while reading it): never drain what we will not take.
                wanted = request.method == "POST" and status in (429, 503) and \
                    self._body_problem(request, route) is None
                return await self._answer_and_close(request, response, drain=wanted)
            return response
        finally:
            self.requests.labels(route, str(status)).inc()

    async def _expect(self, request: web.Request) -> None:
        """``Expect: 100-continue`` (RFC 9110 §10.1.1): invite the body only when it would be read now; a
        request the edge will refuse (411, 413, 415, no upload slot or room) gets no 100 and its final
        answer instead, before the client has sent any of the body."""
        if request.version != HttpVersion11 or request.headers.get("Expect", "").lower() != "100-continue":
            raise web.HTTPExpectationFailed(text=f"unknown Expect: {request.headers.get('Expect', '')[:64]}")
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unknown"
        if self._body_problem(request, route) is not None:
            return
        if route == "/v1/updates" and self._no_room(request.content_length or 0) is not None:
            return
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0

    def _body_problem(self, request: web.Request, route: str) -> ApiError | None:
        """Why a POST's body will not be read, from its headers alone (411, 413, 415); None when it may be."""
        limit = self.limits.max_join_bytes if route in ("/v1/join", "/v1/revocations") else \
            self.limits.max_upload_bytes
        if request.content_length is None:
            return ApiError(411, "length-required", "send a Content-Length")
        if request.content_length > limit:
            return ApiError(413, "too-large", f"body over {limit} bytes")
        if route in _BODY_ROUTES and request.content_type != CBOR:
            return ApiError(415, "unsupported-media-type", f"send {CBOR}")
        return None

    async def _answer_and_close(self, request: web.Request, response: web.StreamResponse, *,
                                drain: bool) -> web.StreamResponse:
        """Send `response` to a request whose body is not (all) read, then close the connection.

        `drain` (a body of acceptable size refused for capacity: 429, 503): discard the rest of the body, at
        most its Content-Length (which passed the size check), for at most `limits.body_timeout_s`, so that a
        client that writes its whole body before reading gets the answer and its Retry-After. At most
        `limits.max_concurrent_uploads` bodies are discarded at once (each holds aiohttp's read buffer); the
        others, and every other refusal (411, 413, 415, 408, ...), discard at most `_LINGER_BYTES` for at most
        `_LINGER_S`, enough for a small body already on its way, and close: a larger body gets a reset.
        """
        response.force_close()
        drain = drain and self._draining < self.limits.max_concurrent_uploads
        limit, seconds = ((request.content_length or 0), self.limits.body_timeout_s) if drain else \
            (_LINGER_BYTES, _LINGER_S)
        self._draining += drain
        try:
            if not response.prepared:
                await response.prepare(request)
            await response.write_eof()
            async with asyncio.timeout(seconds):
                while limit > 0 and not request.content.is_eof():
                    chunk = await request.content.readany()
                    if not chunk:
                        break
                    limit -= len(chunk)
        except Exception:  # the connection ends either way (a timeout, a reset, a broken body)
            pass
        finally:
            self._draining -= drain
            request.protocol.force_close()
        return response

    # --- read endpoints ---

    # --- the browser peer (spec/browser.md §2, §5) ---

    def _browser_data(self) -> Any:
        if self.browser_data is None:
            raise ApiError(404, "not-browser-trainable",
                           f"this revision's workload ({self.view.revision.manifest.workload}) does not declare that "
                           "it can run in a browser: train with `peerloom light` or a trainer node instead")
        return self.browser_data

    def _browser_refusal(self) -> None:
        """ApiError 404 ``not-browser-trainable`` when a browser peer cannot train in this revision: its
        workload does not declare that it runs in a browser, or the manifest audits without admitting
        unauditable trainers (spec/browser.md §3)."""
        self._browser_data()
        m = self.view.revision.manifest
        if m.audit and not m.unauditable_trainers:
            raise ApiError(404, "not-browser-trainable",
                           "this revision audits every update (audit = true) and admits no unauditable trainers "
                           "(unauditable_trainers): a browser's training cannot be replayed")

    async def data_index(self, request: web.Request) -> web.Response:
        return web.json_response(self._browser_data().index())

    async def data_train(self, request: web.Request) -> web.Response:
        blob = self._browser_data().blob
        rng = parse_range(request.headers.get("Range", ""), len(blob)) if "Range" in request.headers else None
        start, end = rng if rng is not None else (0, len(blob) - 1)
        headers = {"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        if rng is not None:
            headers["Content-Range"] = f"bytes {start}-{end}/{len(blob)}"
        return web.Response(status=206 if rng is not None else 200, body=blob[start:end + 1], headers=headers)

    async def train_page(self, request: web.Request) -> web.Response:
        if "view" not in request.query:  # the viewer trains nothing
            self._browser_refusal()
        return self._bundle_file("index.html")

    async def train_file(self, request: web.Request) -> web.Response:
        return self._bundle_file(request.match_info["file"])

    def _bundle_file(self, name: str) -> web.Response:
        from .edge_data import BUNDLE_FILES, WEB_DIST

        if name not in BUNDLE_FILES:
            raise ApiError(404, "not-found", "no such file of the browser peer")
        path = self.web_dist / name
        if not path.is_file():
            raise ApiError(404, "bundle-not-built", f"the browser peer is not built: run `make web` ({path} is absent)"
                           if self.web_dist == WEB_DIST else f"{path} is absent")
        return web.Response(body=path.read_bytes(), content_type=BUNDLE_FILES[name],
                            headers={"Content-Security-Policy": "default-src 'self'; connect-src 'self' ws: wss:; "
                                                                "style-src 'self' 'unsafe-inline'"})

    async def dashboard(self, request: web.Request) -> web.Response:
        return web.Response(text=DASHBOARD_HTML, content_type="text/html",
                            headers={"Content-Security-Policy": "default-src 'self' 'unsafe-inline'"})

    async def healthz(self, request: web.Request) -> web.Response:
        latest = self.view.latest().head
        return web.json_response({"status": self.view.health(), "peer": self.view.peer_id.to_text(),
                                  "roles": sorted(self.view.roles), "window": latest.window,
                                  "addresses": list(self.view.addresses())})

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.view.registry) + generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document())

    async def manifest(self, request: web.Request) -> web.Response:
        rev = self.view.revision
        privacy = rev.manifest.privacy
        return web.json_response({"revision": rev.id.hex(), "authority": rev.authority.to_text(),
                                  "envelope": rev.envelope.to_bytes().hex(),
                                  "privacy": None if privacy is None else privacy.to_cbor(),
                                  "private_data": rev.manifest.private_data})

    async def latest(self, request: web.Request) -> web.Response:
        return web.json_response(head_json(self.view.latest()))

    async def head(self, request: web.Request) -> web.Response:
        entry = self.view.head(parse_cid(request.match_info["head_id"]))
        if entry is None:
            raise ApiError(404, "unknown-head", "no such certified head here")
        return web.json_response(head_json(entry))

    async def chain(self, request: web.Request) -> web.Response:
        start = _query_int(request, "from", 0, 0, 1 << 40)
        limit = _query_int(request, "limit", 64, 1, MAX_PAGE)
        entries = list(self.view.chain(start, limit + 1))
        more = len(entries) > limit
        entries = entries[:limit]
        nxt = entries[-1].head.window + 1 if more and entries else None
        return web.json_response({"heads": [head_json(e) for e in entries], "next": nxt})

    async def certificate(self, request: web.Request) -> web.Response:
        cert = self.view.certificate(parse_cid(request.match_info["head_id"]))
        if cert is None:
            raise ApiError(404, "unknown-certificate", "no certificate for that head here")
        return web.json_response(certificate_json(cert))

    async def leases(self, request: web.Request) -> web.Response:
        lease = self.view.leases(parse_peer(request.match_info["peer"]))
        return web.json_response({"peer": lease.peer.to_text(), "window": lease.window, "base": lease.base.hex(),
                                  "shards": list(lease.shards)})

    async def peers(self, request: web.Request) -> web.Response:
        return web.json_response({"self": self.view.peer_id.to_text(), "last_error": self.view.last_error(),
                                  "peers": [peer_json(p) for p in self.view.peers()]})

    async def history(self, request: web.Request) -> web.Response:
        return web.json_response({"windows": [window_json(w) for w in self.view.history()]})

    async def artifact(self, request: web.Request) -> web.StreamResponse:
        digest = parse_cid(request.match_info["digest"])
        path = self.view.artifact_path(digest)
        if path is None:
            raise ApiError(404, "unknown-artifact", "no such artifact here")
        etag = f'"{digest.hex()}"'
        if request.headers.get("If-None-Match", "") in (etag, "*"):
            return web.Response(status=304, headers={"ETag": etag})  # content-addressed: never changes
        size = Path(path).stat().st_size
        rng = parse_range(request.headers.get("Range", ""), size) if "Range" in request.headers else None
        start, end = rng if rng is not None else (0, size - 1)
        headers = {"Accept-Ranges": "bytes", "ETag": etag, "Content-Type": "application/octet-stream",
                   "Cache-Control": "public, max-age=31536000, immutable"}
        response = web.StreamResponse(status=206 if rng is not None else 200, headers=headers)
        if rng is not None:
            response.headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        response.content_length = end - start + 1 if size else 0
        await response.prepare(request)
        if request.method == "HEAD" or not size:
            return response
        with open(path, "rb") as fh:
            fh.seek(start)
            remaining = end - start + 1
            while remaining > 0:
                data = fh.read(min(_STREAM_CHUNK, remaining))
                if not data:
                    break
                await response.write(data)
                remaining -= len(data)
        await response.write_eof()
        return response

    async def events(self, request: web.Request) -> web.StreamResponse:
        if len(self._streams) >= self.limits.max_sse_clients:
            raise ApiError(503, "too-many-streams", f"at most {self.limits.max_sse_clients} event streams")
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(maxsize=64)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        self._streams.add(queue)
        self.sse_clients.inc()
        try:
            # A reconnecting client (Last-Event-ID = the last window it saw) first gets the heads it missed.
            last_seen = request.headers.get("Last-Event-ID", "")
            if last_seen.isascii() and last_seen.isdigit() and len(last_seen) <= 12:
                missed = self.view.chain(int(last_seen) + 1, MAX_PAGE)
            else:
                missed = [self.view.latest()]
            for entry in missed:
                await response.write(_sse(head_json(entry)))
            while queue in self._streams:
                try:
                    payload = await asyncio.wait_for(queue.get(), self.limits.sse_keepalive_s)
                except TimeoutError:
                    await response.write(b": keep-alive\n\n")
                    continue
                if payload is None:
                    break
                await response.write(_sse(payload))
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._streams.discard(queue)
            self.sse_clients.dec()
        return response

    # --- signed submissions ---

    async def _next_chunk(self, request: web.Request) -> bytes:
        """The next piece of the body (b"" at its end): ApiError 408 after `limits.body_timeout_s` without one."""
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                return await request.content.readany()
        except TimeoutError:
            raise ApiError(408, "body-timeout", f"no body bytes for {self.limits.body_timeout_s:g} s") from None

    async def _read_small(self, request: web.Request) -> bytes:
        """A body already checked to be small (a join: at most `limits.max_join_bytes`), in memory."""
        body = bytearray()
        while chunk := await self._next_chunk(request):
            body += chunk
        return bytes(body)

    def _spool_directory(self) -> Path:
        """Where bodies are spooled: `spool_dir`, else next to the artifacts the view serves (the node's store:
        the same disk, and ArtifactStore removes ``.*.tmp`` leftovers when it opens), else the temp dir."""
        if self.spool_dir is not None:
            return self.spool_dir
        served = self.view.artifact_path(self.view.latest().head.params.digest)
        return served.parent if served is not None else Path(tempfile.gettempdir())

    async def _spool(self, request: web.Request) -> Path:
        """Stream the body into a new temporary file, chunk by chunk; returns its path (the caller removes it).
        ApiError 408 when the body stalls, 503 ``spool-failed`` when the file cannot be written."""
        try:
            fd, name = tempfile.mkstemp(prefix=SPOOL_PREFIX, suffix=".tmp", dir=self._spool_directory())
        except OSError as exc:
            log.error("cannot spool an upload: %s", exc)
            raise ApiError(503, "spool-failed", "cannot store the upload now", {"Retry-After": "1"}) from None
        path = Path(name)
        try:
            with open(fd, "wb") as fh:
                while chunk := await self._next_chunk(request):
                    try:
                        fh.write(chunk)
                    except OSError as exc:
                        log.error("cannot spool an upload: %s", exc)
                        raise ApiError(503, "spool-failed", "cannot store the upload now",
                                       {"Retry-After": "1"}) from None
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return path

    def _no_room(self, size: int) -> ApiError | None:
        """503 when no upload slot is free or the budget lacks `size` bytes; None when an upload may start."""
        if self._uploads >= self.limits.max_concurrent_uploads:
            return ApiError(503, "busy", f"{self._uploads} uploads in progress", {"Retry-After": "1"})
        if self._reserved + size > self.limits.upload_memory_bytes:
            return ApiError(503, "memory-budget", f"{self._reserved} of {self.limits.upload_memory_bytes} bytes "
                            "of upload memory reserved", {"Retry-After": "1"})
        return None

    async def post_update(self, request: web.Request) -> web.Response:
        size = request.content_length or 0  # the middleware refused a POST without one (411) or over the limit
        if self.view.health() == "disk-full":
            raise ApiError(503, "disk-full", "the node's disk is full: no uploads until space is freed",
                           {"Retry-After": "30"})
        if (refusal := self._no_room(size)) is not None:
            raise refusal
        upload = _Upload(self, size)
        try:
            path = await self._spool(request)
            try:
                envelope, artifact = await upload.in_worker(self._check_update_file, path)
            finally:
                path.unlink(missing_ok=True)
            return await self._submit(UpdateAnnouncement.KIND, envelope, artifact, upload)
        finally:
            upload.release()

    async def post_join(self, request: web.Request) -> web.Response:
        return await self._post_small(request, JoinRequest)

    async def post_revocation(self, request: web.Request) -> web.Response:
        """The admission authority's signed revocation (spec/auth.md §6), judged by the engine like a join."""
        return await self._post_small(request, AdmissionRevocation)

    async def _post_small(self, request: web.Request, body_type: Any) -> web.Response:
        """A small signed envelope of `body_type` (a join or a revocation): strict decode, then the engine."""
        body = await self._read_small(request)
        envelope = _open_envelope(body, body_type.KIND)
        try:
            body_type.from_cbor(envelope.open(body_type.KIND, PROTOCOL_VERSION))
        except DecodeError as exc:
            raise ApiError(400, exc.reason, str(exc)) from None
        return await self._submit(body_type.KIND, body, None)

    def _check_update_file(self, path: Path) -> tuple[bytes, bytes]:
        """Parse and pre-check a spooled upload; returns (envelope, artifact) bytes. Runs on a worker thread.

        The body must be the canonical CBOR map ``{"artifact": bytes, "envelope": bytes}`` (RFC 8949
        §4.2.1: shortest heads, keys in that order), read head by head with every length checked against
        the file before anything is allocated for it. The envelope is read and its signature checked first;
        only then is the artifact read into memory (the room reserved for this upload) and matched against
        the announced delta. Raises ApiError 400 (``malformed``, ``non-canonical``, ``bad-body``,
        ``artifact-mismatch``, the envelope's decode reasons) or 403 (``bad-signature``).
        """
        with open(path, "rb") as fh:
            body = _CborFile(fh, os.fstat(fh.fileno()).st_size)
            try:
                parts = body.update_parts()
            except DecodeError as exc:
                raise ApiError(400, exc.reason, str(exc)) from None
            envelope = body.read_at(*parts["envelope"])
            env = _open_envelope(envelope, UpdateAnnouncement.KIND)
            try:
                ann = UpdateAnnouncement.from_cbor(env.open(UpdateAnnouncement.KIND, PROTOCOL_VERSION))
            except DecodeError as exc:
                raise ApiError(400, exc.reason, str(exc)) from None
            offset, size = parts["artifact"]
            if size != ann.delta.size:
                raise ApiError(400, "artifact-mismatch", "artifact bytes do not match the announced delta")
            artifact = body.read_at(offset, size)
        if make_artifact_ref(artifact, ann.delta.chunk_size) != ann.delta:
            raise ApiError(400, "artifact-mismatch", "artifact bytes do not match the announced delta")
        return envelope, artifact

    async def _submit(self, kind: str, envelope: bytes, artifact: bytes | None,
                      upload: _Upload | None = None) -> web.Response:
        try:
            if upload is not None:
                result = await upload.in_worker(self.view.submit, envelope, artifact,
                                                timeout=self.limits.submit_timeout_s)
            else:
                loop = asyncio.get_running_loop()
                result = await asyncio.wait_for(loop.run_in_executor(None, self.view.submit, envelope, artifact),
                                                self.limits.submit_timeout_s)
        except TimeoutError:
            self.submissions.labels(kind, "timeout").inc()
            raise ApiError(503, "timeout", "the node did not answer in time") from None
        if not result.accepted:
            self.submissions.labels(kind, "rejected").inc()
            raise ApiError(503 if result.reason == "timeout" else 422, result.reason or "rejected",
                           f"the node rejected the {kind}")
        self.submissions.labels(kind, "accepted").inc()
        return web.json_response({"accepted": True, "id": result.envelope_id.hex()}, status=202)


class _Upload:
    """One admitted upload: its slot and its `size` bytes of the memory budget, held until the handler and
    every worker thread it started have finished (a thread outlives a cancelled or timed-out await, and it
    may still hold the body's bytes)."""

    def __init__(self, edge: HttpEdge, size: int) -> None:
        self._edge, self._size, self._holders = edge, size, 1
        edge._uploads += 1
        edge._reserved += size

    def release(self) -> None:
        self._holders -= 1
        if self._holders == 0:
            self._edge._uploads -= 1
            self._edge._reserved -= self._size

    def _worker_done(self, future: asyncio.Future[Any]) -> None:
        if not future.cancelled():
            future.exception()  # retrieved here, so an abandoned worker's error is not logged as unhandled
        self.release()

    async def in_worker(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        """`fn(*args)` on the loop's executor, this upload held until it returns; TimeoutError after `timeout`."""
        future = asyncio.get_running_loop().run_in_executor(None, fn, *args)
        self._holders += 1
        future.add_done_callback(self._worker_done)
        return await asyncio.wait_for(asyncio.shield(future), timeout)


class _CborFile:
    """Reads the canonical CBOR upload body ``{"artifact": bytes, "envelope": bytes}`` from a file of `size`
    bytes, head by head, without reading the byte strings (spec/wire.md §1: deterministic encoding)."""

    _KEYS = (b"artifact", b"envelope")  # sorted by their encoded bytes, as deterministic encoding orders them

    def __init__(self, fh: Any, size: int) -> None:
        self._fh, self._size, self._pos = fh, size, 0

    def _take(self, n: int) -> bytes:
        if n > self._size - self._pos:
            raise DecodeError("malformed", f"body ends inside an item at byte {self._pos}")
        data = self._fh.read(n)
        if len(data) != n:
            raise DecodeError("malformed", "body shorter than its file")
        self._pos += n
        return data

    def _head(self) -> tuple[int, int]:
        """(major type, argument) of the next data item's head; definite lengths in their shortest form only."""
        first = self._take(1)[0]
        major, info = first >> 5, first & 0x1F
        if info < 24:
            return major, info
        if info > 27:
            raise DecodeError("malformed" if info < 31 else "non-canonical", f"additional information {info}")
        width = 1 << (info - 24)
        value = int.from_bytes(self._take(width), "big")
        if value < (24 if width == 1 else 1 << (4 * width)):
            raise DecodeError("non-canonical", "length not in its shortest form")
        return major, value

    def update_parts(self) -> dict[str, tuple[int, int]]:
        """{"artifact": (offset, size), "envelope": (offset, size)} of the two byte strings."""
        if self._size == 0:
            raise DecodeError("malformed", "empty body")
        if self._head() != (5, 2):
            raise DecodeError("bad-body", 'expected {"envelope": bytes, "artifact": bytes}')
        parts = {}
        for expected in self._KEYS:
            major, length = self._head()
            key = self._take(length) if major == 3 and length <= 16 else b""
            if key != expected:
                reason = "non-canonical" if key in self._KEYS else "bad-body"
                raise DecodeError(reason, 'expected the keys "artifact" then "envelope"')
            major, length = self._head()
            if major != 2:
                raise DecodeError("bad-body", f"{expected.decode()} must be a byte string")
            if length > self._size - self._pos:
                raise DecodeError("malformed", f"{expected.decode()} runs past the end of the body")
            parts[expected.decode()] = (self._pos, length)
            self._pos += length
            self._fh.seek(self._pos)
        if self._pos != self._size:
            raise DecodeError("malformed", f"{self._size - self._pos} bytes after the body")
        return parts

    def read_at(self, offset: int, size: int) -> bytes:
        """`size` bytes at `offset` (a range `update_parts` returned, so within the file)."""
        self._fh.seek(offset)
        data = self._fh.read(size)
        if len(data) != size:
            raise ApiError(400, "malformed", "body shorter than its file")
        return data


def _open_envelope(data: bytes, kind: str) -> SignedEnvelope:
    """Parse a SignedEnvelope of `kind` and check its signature: ApiError 400 malformed, 403 bad signature."""
    try:
        envelope = SignedEnvelope.from_bytes(data)
    except DecodeError as exc:
        raise ApiError(400, exc.reason, str(exc)) from None
    if envelope.kind != kind:
        raise ApiError(400, "wrong-kind", f"expected a {kind} envelope")
    try:
        envelope.open(kind, PROTOCOL_VERSION)
    except VerificationError as exc:
        raise ApiError(403 if exc.reason == "bad-signature" else 400, exc.reason, str(exc)) from None
    except DecodeError as exc:
        raise ApiError(400, exc.reason, str(exc)) from None
    return envelope


def _sse(payload: dict[str, Any]) -> bytes:
    return f"event: head\nid: {payload['window']}\ndata: {json.dumps(payload)}\n\n".encode()


class _HeaderDeadline(asyncio.Protocol):
    """aiohttp's protocol for one connection, wrapped to close the connection when its first request's line
    and headers are not complete `timeout` seconds after it opened (a client that sends part of a request
    and then nothing, or trickles it). The edge's middleware calls `headers_complete` when that request
    arrives. Later requests on a kept-alive connection are bounded by aiohttp's keep-alive timer, which
    `EdgeServer` sets to the same value."""

    def __init__(self, inner: asyncio.Protocol, timeout: float,
                 awaiting: dict[asyncio.BaseTransport, _HeaderDeadline], limiter: Any = None) -> None:
        self._inner, self._timeout, self._awaiting = inner, timeout, awaiting
        self._transport: asyncio.BaseTransport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._limiter = limiter  # an adapters.limits.ConnectionLimiter: the socket counts (scope "edge")
        self._slot: Any = None
        self._refused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._limiter is not None:  # spec/transport.md §13: refused at once, with the reason, over a limit
            peer = transport.get_extra_info("peername")
            slot = self._limiter.open(str(peer[0]) if peer else "unknown", now=time.monotonic(), scope="edge")
            if isinstance(slot, str):
                self._refused = True
                body = json.dumps({"error": "limit", "reason": slot}).encode()
                if isinstance(transport, asyncio.WriteTransport):
                    transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                                    % (len(body), body))
                transport.close()
                return
            self._slot = slot
        self._transport = transport
        self._awaiting[transport] = self
        self._timer = asyncio.get_running_loop().call_later(self._timeout, self._expire)
        self._inner.connection_made(transport)

    def headers_complete(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self._transport is not None:
            self._awaiting.pop(self._transport, None)
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        if not self._refused:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return None if self._refused else self._inner.eof_received()

    def pause_writing(self) -> None:
        if not self._refused:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if not self._refused:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        if self._slot is not None:
            self._limiter.close(self._slot)
        self.headers_complete()
        if self._transport is not None:
            self._awaiting.pop(self._transport, None)
        self._inner.connection_lost(exc)


class EdgeServer:
    """Runs an `HttpEdge` on a daemon thread with its own asyncio loop.

    `start()` returns once the socket is bound (`port` holds the bound port); `stop()` closes streams and
    the listener and joins the thread (within `shutdown_s` seconds). Binds 127.0.0.1 unless told otherwise.
    Upload bodies are spooled to temporary files in `spool_dir` (default: the directory of the artifacts
    the view serves, i.e. the node's artifact store; see `HttpEdge._spool_directory`).
    """

    def __init__(self, view: EdgeView, *, host: str = "127.0.0.1", port: int = 0,
                 limits: EdgeLimits | None = None, shutdown_s: float = 5.0, spool_dir: Path | None = None,
                 limiter: Any = None) -> None:
        self.edge = HttpEdge(view, limits, spool_dir=spool_dir)
        self.limiter = limiter  # adapters.limits.ConnectionLimiter: the edge's sockets count toward its limits
        self.host, self.port, self.shutdown_s = host, port, shutdown_s
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> EdgeServer:
        self._thread = threading.Thread(target=self._run, name="peerloom-http-edge", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:
            self._error = exc
            self._ready.set()
        finally:
            # Handlers of idle keep-alive connections may outlive the runner; end them before closing.
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

    async def _serve(self) -> None:
        self._stopped = asyncio.Event()
        limits = self.edge.limits
        # keepalive_timeout: a kept-alive connection must complete its next request's headers within the header
        # timeout; lingering_time: aiohttp's own drain of a body a handler left unread stays short.
        runner = web.AppRunner(self.edge.app(), handle_signals=False, access_log=None,
                               shutdown_timeout=self.shutdown_s, keepalive_timeout=limits.header_timeout_s,
                               lingering_time=_LINGER_S)
        await runner.setup()
        listener: asyncio.Server | None = None
        try:
            server = runner.server
            assert server is not None
            awaiting = self.edge._awaiting_headers
            listener = await asyncio.get_running_loop().create_server(
                lambda: _HeaderDeadline(server(), limits.header_timeout_s, awaiting, self.limiter), self.host,
                self.port, reuse_address=True)
            self.port = listener.sockets[0].getsockname()[1]
            self._ready.set()
            await self._stopped.wait()
        finally:
            if listener is not None:
                listener.close()
            await runner.cleanup()

    def stop(self) -> None:
        if self._loop is not None and self._stopped is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stopped.set)
        if self._thread is not None:
            self._thread.join(self.shutdown_s + 5)

    def __enter__(self) -> EdgeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- OpenAPI ----------------------------------------------------------------------------------------------

def _err(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _ok(description: str, schema: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}}


_CID = {"type": "string", "pattern": f"^1220[0-9a-f]{{{CID_HEX_CHARS - 4}}}$"}
_HEX = {"type": "string", "pattern": "^([0-9a-f]{2})*$"}
_RATE = {"429": _err("Rate limited (token bucket per client IP); see Retry-After")}


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.0.3 description of every endpoint of the edge."""
    id_param = {"name": "head_id", "in": "path", "required": True, "schema": _CID}
    signed_post = {
        "202": _ok("Accepted by the node", "Accepted"),
        "400": _err("Malformed body, wrong envelope kind or artifact mismatch"),
        "403": _err("Envelope signature does not verify"),
        "408": _err("The body sent nothing for body_timeout_s (the connection is closed)"),
        "411": _err("No Content-Length (the connection is closed)"),
        "413": _err("Body over the limit (the connection is closed)"),
        "415": _err("Not application/cbor (the connection is closed)"),
        "422": _err("The node rejected it (code = reason)"),
        "503": _err("The node did not answer in time, or no upload slot or room in the upload memory budget "
                    "(busy, memory-budget; see Retry-After)"), **_RATE,
    }
    schemas: dict[str, Any] = {
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["status", "code", "message"],
            "properties": {"status": {"type": "integer"}, "code": {"type": "string"},
                           "message": {"type": "string"}}}}},
        "Certificate": {"type": "object", "required": ["head", "window", "round", "signers", "cbor"], "properties": {
            "head": _CID, "window": {"type": "integer", "minimum": 0}, "round": {"type": "integer", "minimum": 0},
            "signers": {"type": "array", "items": {"type": "string"}}, "cbor": _HEX}},
        "Head": {"type": "object", "required": ["id", "window", "parent", "skipped", "params", "metrics", "cbor",
                                                "certificate"], "properties": {
            "id": _CID, "window": {"type": "integer", "minimum": 0}, "parent": {**_CID, "nullable": True},
            "skipped": {"type": "boolean"}, "revision": _CID,
            "params": {"type": "object", "properties": {"digest": _CID, "size": {"type": "integer"},
                                                        "chunk_size": {"type": "integer"}}},
            "params_digest": _CID, "cohort": {"type": "array", "items": _CID},
            "roster": {"type": "array", "items": {"type": "object", "properties": {
                "peer": {"type": "string"}, "capacity": {"type": "integer"}}}},
            "quarantine": {"type": "array", "items": {"type": "object", "required": ["peer", "until"], "properties": {
                "peer": {"type": "string"}, "until": {"type": "integer"}}}},
            "strikes": {"type": "array", "items": {"type": "object", "required": ["peer", "count", "window"],
                                                   "properties": {"peer": {"type": "string"},
                                                                  "count": {"type": "integer"},
                                                                  "window": {"type": "integer"}}}},
            "rejected": {"type": "array", "items": _CID},
            "evidence": {"type": "array", "items": {"type": "array", "items": {"type": "string"}}},
            "left": {"type": "array", "items": {"type": "string"}},
            "expired": {"type": "array", "items": {"type": "string"}},
            "private": {"type": "array", "items": {"type": "string"}},
            "privacy": {"type": "array", "items": {"type": "object", "required": ["peer", "steps", "epsilon"],
                                                   "properties": {"peer": {"type": "string"},
                                                                  "steps": {"type": "integer"},
                                                                  "epsilon": {"type": "number"}}}},
            "metrics": {"type": "object", "additionalProperties": {"type": "number"}},
            "cbor": _HEX, "certificate": {"allOf": [{"$ref": "#/components/schemas/Certificate"}],
                                          "nullable": True}}},
        "ChainPage": {"type": "object", "required": ["heads", "next"], "properties": {
            "heads": {"type": "array", "items": {"$ref": "#/components/schemas/Head"}},
            "next": {"type": "integer", "nullable": True}}},
        "Lease": {"type": "object", "required": ["peer", "window", "base", "shards"], "properties": {
            "peer": {"type": "string"}, "window": {"type": "integer"}, "base": _CID,
            "shards": {"type": "array", "items": {"type": "integer"}}}},
        "Peers": {"type": "object", "required": ["self", "last_error", "peers"], "properties": {
            "self": {"type": "string"}, "last_error": {"type": "string"},
            "peers": {"type": "array", "items": {"type": "object", "properties": {
                "peer": {"type": "string"}, "roles": {"type": "array", "items": {"type": "string"}},
                "address": {"type": "string"}, "connected": {"type": "boolean"},
                "bytes_sent": {"type": "integer"}, "bytes_received": {"type": "integer"},
                "rejected": {"type": "integer"}, "last_rejection": {"type": "string"}}}}}},
        "History": {"type": "object", "required": ["windows"], "properties": {"windows": {
            "type": "array", "items": {"type": "object", "properties": {
                "window": {"type": "integer"}, "head": _CID, "skipped": {"type": "boolean"},
                "metrics": {"type": "object", "additionalProperties": {"type": "number"}},
                "accepted": {"type": "integer"}, "rejected": {"type": "integer"},
                "bytes_sent": {"type": "integer"}, "bytes_received": {"type": "integer"},
                "time": {"type": "number"}}}}}},
        "Manifest": {"type": "object", "required": ["revision", "authority", "envelope"], "properties": {
            "revision": _CID, "authority": {"type": "string"}, "envelope": _HEX,
            "privacy": {"type": "object", "nullable": True, "properties": {
                k: {"type": "number"} for k in ("noise_multiplier", "max_grad_norm", "delta", "sample_rate",
                                                "epsilon_budget")}},
            "private_data": {"type": "boolean"}}},
        "Health": {"type": "object", "required": ["status"], "properties": {
            "status": {"type": "string"}, "peer": {"type": "string"},
            "roles": {"type": "array", "items": {"type": "string"}}, "window": {"type": "integer"},
            "addresses": {"type": "array", "items": {"type": "string"}}}},
        "Accepted": {"type": "object", "required": ["accepted", "id"], "properties": {
            "accepted": {"type": "boolean"}, "id": _HEX}},
    }
    paths: dict[str, Any] = {
        "/": {"get": {"summary": "Read-only dashboard", "operationId": "dashboard", "responses": {
            "200": {"description": "HTML page", "content": {"text/html": {"schema": {"type": "string"}}}},
            **_RATE}}},
        "/healthz": {"get": {"summary": "Liveness", "operationId": "healthz",
                             "responses": {"200": _ok("Alive", "Health"), **_RATE}}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "operationId": "metrics", "responses": {
            "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
            **_RATE}}},
        "/openapi.json": {"get": {"summary": "This document", "operationId": "openapi", "responses": {
            "200": {"description": "OpenAPI 3", "content": {"application/json": {"schema": {"type": "object"}}}},
            **_RATE}}},
        "/v1/manifest": {"get": {"summary": "The signed revision manifest", "operationId": "manifest",
                                 "responses": {"200": _ok("Manifest envelope", "Manifest"), **_RATE}}},
        "/v1/heads/latest": {"get": {"summary": "Latest certified head", "operationId": "latestHead",
                                     "responses": {"200": _ok("Head", "Head"), **_RATE}}},
        "/v1/heads/{head_id}": {"get": {"summary": "Certified head by id", "operationId": "headById",
                                        "parameters": [id_param], "responses": {
            "200": _ok("Head", "Head"), "400": _err("Malformed id"), "404": _err("Unknown head"), **_RATE}}},
        "/v1/chain": {"get": {"summary": "A page of the chain, ascending by window", "operationId": "chain",
                              "parameters": [
            {"name": "from", "in": "query", "schema": {"type": "integer", "minimum": 0}},
            {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE}}],
            "responses": {"200": _ok("Page", "ChainPage"), "400": _err("Bad parameter"), **_RATE}}},
        "/v1/certificates/{head_id}": {"get": {"summary": "Quorum certificate of a head",
                                               "operationId": "certificate", "parameters": [id_param], "responses": {
            "200": _ok("Certificate", "Certificate"), "400": _err("Malformed id"),
            "404": _err("Unknown head or genesis"), **_RATE}}},
        "/v1/artifacts/{digest}": {"get": {
            "summary": "Artifact bytes by content id; supports one byte range", "operationId": "artifact",
            "parameters": [{"name": "digest", "in": "path", "required": True, "schema": _CID},
                           {"name": "Range", "in": "header", "required": False, "schema": {"type": "string"}},
                           {"name": "If-None-Match", "in": "header", "required": False,
                            "schema": {"type": "string"}}],
            "responses": {
                "200": {"description": "Whole artifact",
                        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
                "206": {"description": "One range",
                        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
                "304": {"description": "Not modified (If-None-Match matched the ETag, the digest)"},
                "400": _err("Malformed digest"), "404": _err("Unknown artifact"),
                "416": _err("Range not satisfiable"), **_RATE}}},
        "/v1/leases/{peer}": {"get": {"summary": "A peer's leases for the next window", "operationId": "leases",
                                      "parameters": [{"name": "peer", "in": "path", "required": True,
                                                      "schema": {"type": "string"}}],
                                      "responses": {"200": _ok("Lease", "Lease"), "400": _err("Bad peer id"),
                                                    **_RATE}}},
        "/v1/updates": {"post": {
            "summary": "Upload a signed update announcement and its delta (light trainers)",
            "operationId": "postUpdate",
            "requestBody": {"required": True, "content": {CBOR: {"schema": {"type": "string", "format": "binary"}}}},
            "responses": signed_post}},
        "/v1/join": {"post": {
            "summary": "Ask to join the roster with a signed join envelope", "operationId": "postJoin",
            "requestBody": {"required": True, "content": {CBOR: {"schema": {"type": "string", "format": "binary"}}}},
            "responses": signed_post}},
        "/v1/revocations": {"post": {
            "summary": "Deliver the admission authority's signed revocation envelope",
            "operationId": "postRevocation",
            "requestBody": {"required": True, "content": {CBOR: {"schema": {"type": "string", "format": "binary"}}}},
            "responses": signed_post}},
        "/v1/peers": {"get": {"summary": "Peers the node knows", "operationId": "peers",
                              "responses": {"200": _ok("Peers", "Peers"), **_RATE}}},
        "/v1/history": {"get": {"summary": "Per-window statistics", "operationId": "history",
                                "responses": {"200": _ok("History", "History"), **_RATE}}},
        "/v1/events": {"get": {"summary": "Server-sent events: one `head` event per head promotion",
                               "operationId": "events", "responses": {
            "200": {"description": "Event stream",
                    "content": {"text/event-stream": {"schema": {"type": "string"}}}},
            "503": _err("Too many open streams"), **_RATE}}},
        "/v1/data/index": {"get": {"summary": "Browser peers: where each shard's samples start in /v1/data/train, "
                                              "and the workload's hyper-parameters (spec/browser.md §2)",
                                   "operationId": "dataIndex", "responses": {
            "200": {"description": "Data index", "content": {"application/json": {"schema": {"type": "object"}}}},
            "404": _err("The workload does not run in a browser"), **_RATE}}},
        "/v1/data/train": {"get": {"summary": "Browser peers: the training split in shard order (range requests)",
                                   "operationId": "dataTrain", "responses": {
            "200": {"description": "Records", "content": {"application/octet-stream": {"schema": {"type": "string"}}}},
            "206": {"description": "A range of records"},
            "404": _err("The workload does not run in a browser"), **_RATE}}},
        "/train": {"get": {"summary": "The browser peer's page (spec/browser.md §5)", "operationId": "trainPage",
                           "responses": {"200": {"description": "HTML"},
                                         "404": _err("The bundle is not built, or a browser cannot train in this "
                                                     "revision (not-browser-trainable)"),
                                         **_RATE}}},
        "/train/{file}": {"get": {"summary": "The browser peer's bundle", "operationId": "trainFile",
                                  "parameters": [{"name": "file", "in": "path", "required": True,
                                                  "schema": {"type": "string", "maxLength": 64}}],
                                  "responses": {"200": {"description": "A file of the bundle"},
                                                "404": _err("No such file, or the bundle is not built"), **_RATE}}},
    }
    return {"openapi": "3.0.3",
            "info": {"title": "peerloom HTTP edge", "version": "1",
                     "description": "Read a node's certified chain and artifacts; light trainers upload signed "
                                    "updates. Binary ids are hex of 34-byte content ids; peers are base58."},
            "paths": paths, "components": {"schemas": schemas}}

"""The HTTP edge: an aiohttp server that serves a node's chain and artifacts to light peers and dashboards
(DESIGN §6, issue 7). Its OpenAPI 3 document is served at ``/openapi.json`` (built by `openapi_document`).

It runs on its own thread with its own asyncio loop (the node runtime is trio) and talks to the node only
through an `EdgeView`. It binds 127.0.0.1 by default.

Endpoints (binary ids are lowercase hex of the 34-byte content id; peer ids are base58 text):

==========================  ====================================================================================
``GET /``                   read-only dashboard (head chain, loss/accuracy curve, peers, bytes); 200 text/html
``GET /healthz``            200 ``{"status": "ok", ...}``
``GET /metrics``            200 Prometheus text exposition (the node's registry plus the edge's own counters)
``GET /openapi.json``       200 this API as OpenAPI 3.0
``GET /v1/manifest``        200 the signed revision manifest (hex of the canonical SignedEnvelope)
``GET /v1/heads/latest``    200 the latest certified head (canonical CBOR as hex + decoded summary)
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
``GET /v1/peers``           200 peers the node knows
``GET /v1/history``         200 per-window statistics for the dashboard
``GET /v1/events``          text/event-stream; one ``head`` event now (or, with ``Last-Event-ID: <window>``,
                            every head after that window) and one per head promotion; 503 when
                            `EdgeLimits.max_sse_clients` streams are open
==========================  ====================================================================================

Posting: the edge decodes the body (at most `EdgeLimits.max_upload_bytes`, checked against Content-Length
before reading; 411 without one, 413 above it, 415 for another content type), checks the envelope's kind
and Ed25519 signature (400 malformed or wrong kind, 403 bad signature) and that the artifact matches the
announced delta (400), then hands it to the node, which verifies everything again: 202 accepted, 422
rejected by the node (the error code is the node's reason), 503 when the node does not answer in time or
`EdgeLimits.max_concurrent_uploads` uploads are already being read (so memory stays bounded).
Nothing changes state without a signature that verifies.

Every client IP has a token bucket of `EdgeLimits.burst` requests refilled at `EdgeLimits.rate` requests per
second; an empty bucket gives 429 with ``Retry-After``. Errors are JSON:
``{"error": {"status": 404, "code": "unknown-head", "message": "..."}}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from peerloom.core.encoding import content_id, decode, encode
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.errors import DecodeError, VerificationError
from peerloom.core.identity import PeerId
from peerloom.core.objects import PROTOCOL_VERSION, Head, JoinRequest, QuorumCertificate, UpdateAnnouncement

from .edge_dashboard import DASHBOARD_HTML
from .edge_view import CertifiedEntry, EdgeView, PeerInfo, WindowStats

log = logging.getLogger("peerloom.http_edge")

CID_HEX_CHARS = 68
MAX_PEER_TEXT = 64
MAX_PAGE = 256
CBOR = "application/cbor"
_STREAM_CHUNK = 256 * 1024


@attrs.frozen(kw_only=True)
class EdgeLimits:
    """Limits of the edge. Sizes in bytes, rates in requests per second per client IP."""

    max_upload_bytes: int = 64 << 20
    max_join_bytes: int = 4096
    rate: float = 50.0
    burst: int = 100
    max_clients_tracked: int = 10_000
    max_sse_clients: int = 64
    sse_keepalive_s: float = 15.0
    submit_timeout_s: float = 15.0
    max_concurrent_uploads: int = 4  # bodies held in memory at once: at most this many x max_upload_bytes


class ApiError(Exception):
    """An error answered as a typed JSON body with `status`."""

    def __init__(self, status: int, code: str, message: str = "", headers: dict[str, str] | None = None) -> None:
        super().__init__(message or code)
        self.status, self.code, self.message, self.headers = status, code, message or code, headers or {}


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    body = {"error": {"status": status, "code": code, "message": message}}
    return web.json_response(body, status=status, headers=headers)


class TokenBuckets:
    """Per-client token buckets (`burst` tokens, refilled at `rate` per second), least recently seen evicted."""

    def __init__(self, rate: float, burst: int, max_clients: int) -> None:
        self.rate, self.burst, self.max_clients = rate, burst, max_clients
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, client: str, now: float) -> float:
        """Take one token; returns 0.0 if allowed, else the seconds until a token is available."""
        tokens, last = self._buckets.pop(client, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / self.rate
        self._buckets[client] = (tokens, now)
        while len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)
        return wait


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
        "cbor": h.to_bytes().hex(),
        "certificate": None if entry.certificate is None else certificate_json(entry.certificate),
    }


def peer_json(p: PeerInfo) -> dict[str, Any]:
    return {"peer": p.peer_id.to_text(), "roles": list(p.roles), "address": p.address, "connected": p.connected,
            "bytes_sent": p.bytes_sent, "bytes_received": p.bytes_received}


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

    def __init__(self, view: EdgeView, limits: EdgeLimits | None = None) -> None:
        self.view = view
        self.limits = limits or EdgeLimits()
        self.buckets = TokenBuckets(self.limits.rate, self.limits.burst, self.limits.max_clients_tracked)
        self.registry = CollectorRegistry()
        self.requests = Counter("peerloom_http_requests", "HTTP requests by route and status",
                                ("route", "status"), registry=self.registry)
        self.sse_clients = Gauge("peerloom_http_sse_clients", "Open server-sent event streams",
                                 registry=self.registry)
        self.submissions = Counter("peerloom_http_submissions", "Signed submissions by kind and outcome",
                                   ("kind", "outcome"), registry=self.registry)
        self._streams: set[asyncio.Queue[dict[str, Any] | None]] = set()
        self._uploads = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._unsubscribe: Callable[[], None] | None = None

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
        r.add_post("/v1/updates", self.post_update)
        r.add_post("/v1/join", self.post_join)
        r.add_get("/v1/peers", self.peers)
        r.add_get("/v1/history", self.history)
        r.add_get("/v1/events", self.events)
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
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unknown"
        status = 500
        try:
            wait = self.buckets.take(request.remote or "?", time.monotonic())
            if wait > 0:
                raise ApiError(429, "rate-limited", f"over {self.limits.rate:g} requests/s",
                               {"Retry-After": str(max(1, round(wait + 0.5)))})
            if request.method == "POST":
                limit = self.limits.max_join_bytes if request.path == "/v1/join" else self.limits.max_upload_bytes
                if request.content_length is None:
                    raise ApiError(411, "length-required", "send a Content-Length")
                if request.content_length > limit:
                    raise ApiError(413, "too-large", f"body over {limit} bytes")
            response = await handler(request)
            status = response.status
            return response
        except ApiError as exc:
            status = exc.status
            return error_response(exc.status, exc.code, exc.message, exc.headers)
        except web.HTTPException as exc:
            status = exc.status
            if exc.status < 400:
                raise
            code = exc.reason.lower().replace(" ", "-")
            return error_response(exc.status, code, exc.text or exc.reason, {"Allow": exc.headers["Allow"]}
                                  if "Allow" in exc.headers else None)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("edge handler failed: %s %s", request.method, request.path)
            return error_response(500, "internal", "internal error")
        finally:
            self.requests.labels(route, str(status)).inc()

    # --- read endpoints ---

    async def dashboard(self, request: web.Request) -> web.Response:
        return web.Response(text=DASHBOARD_HTML, content_type="text/html",
                            headers={"Content-Security-Policy": "default-src 'self' 'unsafe-inline'"})

    async def healthz(self, request: web.Request) -> web.Response:
        latest = self.view.latest().head
        return web.json_response({"status": "ok", "peer": self.view.peer_id.to_text(),
                                  "roles": sorted(self.view.roles), "window": latest.window})

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.view.registry) + generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document())

    async def manifest(self, request: web.Request) -> web.Response:
        rev = self.view.revision
        return web.json_response({"revision": rev.id.hex(), "authority": rev.authority.to_text(),
                                  "envelope": rev.envelope.to_bytes().hex()})

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
        return web.json_response({"self": self.view.peer_id.to_text(),
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

    async def _read_cbor(self, request: web.Request) -> bytes:
        if request.content_type != CBOR:
            raise ApiError(415, "unsupported-media-type", f"send {CBOR}")
        return await request.read()

    async def post_update(self, request: web.Request) -> web.Response:
        if self._uploads >= self.limits.max_concurrent_uploads:
            raise ApiError(503, "busy", f"{self._uploads} uploads in progress", {"Retry-After": "1"})
        self._uploads += 1
        try:
            body = await self._read_cbor(request)
            loop = asyncio.get_running_loop()
            envelope, artifact = await loop.run_in_executor(None, self._check_update, body)
            del body
            return await self._submit(UpdateAnnouncement.KIND, envelope, artifact)
        finally:
            self._uploads -= 1

    async def post_join(self, request: web.Request) -> web.Response:
        body = await self._read_cbor(request)
        envelope = _open_envelope(body, JoinRequest.KIND)
        try:
            JoinRequest.from_cbor(envelope.open(JoinRequest.KIND, PROTOCOL_VERSION))
        except DecodeError as exc:
            raise ApiError(400, exc.reason, str(exc)) from None
        return await self._submit(JoinRequest.KIND, body, None)

    def _check_update(self, body: bytes) -> tuple[bytes, bytes]:
        """Decode and pre-check an upload (runs on a worker thread: it hashes up to the upload limit)."""
        try:
            obj = decode(body, max_bytes=self.limits.max_upload_bytes)
        except DecodeError as exc:
            raise ApiError(400, exc.reason, str(exc)) from None
        if not (isinstance(obj, dict) and set(obj) == {"envelope", "artifact"}
                and isinstance(obj["envelope"], bytes) and isinstance(obj["artifact"], bytes)):
            raise ApiError(400, "bad-body", 'expected {"envelope": bytes, "artifact": bytes}')
        envelope = _open_envelope(obj["envelope"], UpdateAnnouncement.KIND)
        try:
            ann = UpdateAnnouncement.from_cbor(envelope.open(UpdateAnnouncement.KIND, PROTOCOL_VERSION))
        except DecodeError as exc:
            raise ApiError(400, exc.reason, str(exc)) from None
        artifact: bytes = obj["artifact"]
        if len(artifact) != ann.delta.size or content_id(artifact) != ann.delta.digest:
            raise ApiError(400, "artifact-mismatch", "artifact bytes do not match the announced delta")
        return obj["envelope"], artifact

    async def _submit(self, kind: str, envelope: bytes, artifact: bytes | None) -> web.Response:
        loop = asyncio.get_running_loop()
        try:
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


class EdgeServer:
    """Runs an `HttpEdge` on a daemon thread with its own asyncio loop.

    `start()` returns once the socket is bound (`port` holds the bound port); `stop()` closes streams and
    the listener and joins the thread (within `shutdown_s` seconds). Binds 127.0.0.1 unless told otherwise.
    """

    def __init__(self, view: EdgeView, *, host: str = "127.0.0.1", port: int = 0,
                 limits: EdgeLimits | None = None, shutdown_s: float = 5.0) -> None:
        self.edge = HttpEdge(view, limits)
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
        runner = web.AppRunner(self.edge.app(), handle_signals=False, access_log=None,
                               shutdown_timeout=self.shutdown_s)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
            server = site._server
            assert server is not None
            self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
            self._ready.set()
            await self._stopped.wait()
        finally:
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
        "411": _err("No Content-Length"), "413": _err("Body over the limit"),
        "415": _err("Not application/cbor"), "422": _err("The node rejected it (code = reason)"),
        "503": _err("The node did not answer in time, or too many uploads at once"), **_RATE,
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
            "metrics": {"type": "object", "additionalProperties": {"type": "number"}},
            "cbor": _HEX, "certificate": {"allOf": [{"$ref": "#/components/schemas/Certificate"}],
                                          "nullable": True}}},
        "ChainPage": {"type": "object", "required": ["heads", "next"], "properties": {
            "heads": {"type": "array", "items": {"$ref": "#/components/schemas/Head"}},
            "next": {"type": "integer", "nullable": True}}},
        "Lease": {"type": "object", "required": ["peer", "window", "base", "shards"], "properties": {
            "peer": {"type": "string"}, "window": {"type": "integer"}, "base": _CID,
            "shards": {"type": "array", "items": {"type": "integer"}}}},
        "Peers": {"type": "object", "required": ["self", "peers"], "properties": {
            "self": {"type": "string"}, "peers": {"type": "array", "items": {"type": "object", "properties": {
                "peer": {"type": "string"}, "roles": {"type": "array", "items": {"type": "string"}},
                "address": {"type": "string"}, "connected": {"type": "boolean"},
                "bytes_sent": {"type": "integer"}, "bytes_received": {"type": "integer"}}}}}},
        "History": {"type": "object", "required": ["windows"], "properties": {"windows": {
            "type": "array", "items": {"type": "object", "properties": {
                "window": {"type": "integer"}, "head": _CID, "skipped": {"type": "boolean"},
                "metrics": {"type": "object", "additionalProperties": {"type": "number"}},
                "accepted": {"type": "integer"}, "rejected": {"type": "integer"},
                "bytes_sent": {"type": "integer"}, "bytes_received": {"type": "integer"},
                "time": {"type": "number"}}}}}},
        "Manifest": {"type": "object", "required": ["revision", "authority", "envelope"], "properties": {
            "revision": _CID, "authority": {"type": "string"}, "envelope": _HEX}},
        "Health": {"type": "object", "required": ["status"], "properties": {
            "status": {"type": "string"}, "peer": {"type": "string"},
            "roles": {"type": "array", "items": {"type": "string"}}, "window": {"type": "integer"}}},
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
        "/v1/peers": {"get": {"summary": "Peers the node knows", "operationId": "peers",
                              "responses": {"200": _ok("Peers", "Peers"), **_RATE}}},
        "/v1/history": {"get": {"summary": "Per-window statistics", "operationId": "history",
                                "responses": {"200": _ok("History", "History"), **_RATE}}},
        "/v1/events": {"get": {"summary": "Server-sent events: one `head` event per head promotion",
                               "operationId": "events", "responses": {
            "200": {"description": "Event stream",
                    "content": {"text/event-stream": {"schema": {"type": "string"}}}},
            "503": _err("Too many open streams"), **_RATE}}},
    }
    return {"openapi": "3.0.3",
            "info": {"title": "peerloom HTTP edge", "version": "1",
                     "description": "Read a node's certified chain and artifacts; light trainers upload signed "
                                    "updates. Binary ids are hex of 34-byte content ids; peers are base58."},
            "paths": paths, "components": {"schemas": schemas}}

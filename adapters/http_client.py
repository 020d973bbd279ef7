"""HTTP client adapter of a node's REST edge (`adapters.http_edge`; spec/design.md §6).

`EdgeClient` speaks the edge's JSON/CBOR API (see `adapters.http_edge`) with the standard library's
urllib, and trusts nothing it receives: the manifest must be signed by the expected authority, a head
must carry a quorum certificate that verifies against the manifest (or be the manifest's genesis), and
artifacts are fetched in byte ranges of the artifact's chunk size, each range checked against the chunk
digests of the head's `ArtifactRef` before it is kept.

`LightTrainer.step()` does one window: read the latest certified head, join the roster if absent, compute
its own leases from the head (the same function every peer uses, cross-checked with the edge's answer),
fetch the params, train on the leased shards with the manifest's workload (through the same
`ComputeExecutor` a full node runs), sign the update announcement and upload it with its delta.
It stays as the reference client of the REST submit path (``POST /v1/join``, ``/v1/updates``) for
third-party clients, which tests/adapters/test_node_edge.py drives against a node; `peerloom light` no
longer uses it (it runs an ordinary trainer node over the HTTP transport, `peerloom.light`).
"""

from __future__ import annotations

import http.client
import json
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from peerloom.core.audit import train_seed
from peerloom.core.encoding import decode, encode
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.errors import VerificationError
from peerloom.core.identity import Identity, PeerId
from peerloom.core.leases import lease_window, leases_of
from peerloom.core.objects import (
    ArtifactRef,
    Head,
    JoinRequest,
    QuorumCertificate,
    Revision,
    UpdateAnnouncement,
    artifact_id,
    seal,
)
from peerloom.core.tasks import TrainResult, TrainTask

from .storage import ArtifactStore

MAX_JSON_BYTES = 32 << 20


class EdgeError(Exception):
    """The edge answered with an error status. `code` is the typed error code of its JSON body."""

    def __init__(self, status: int, code: str, message: str = "", *, retry_after: float = 0.0) -> None:
        super().__init__(f"HTTP {status} {code}: {message}")
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after


class EdgeClient:
    """Blocking client of one HTTP edge at `base_url` (e.g. ``http://127.0.0.1:8080``).

    Raises `EdgeError` for error statuses, `VerificationError` for anything that fails verification, and
    `OSError` (urllib's URLError) when the edge cannot be reached. `timeout_s` applies to every request;
    429 answers (the edge's per-client rate limit) are retried after their Retry-After.
    """

    def __init__(self, base_url: str, *, timeout_s: float = 30.0, max_retries: int = 5,
                 max_wait_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_retries, self.max_wait_s = max_retries, max_wait_s

    # --- plumbing ---

    def _request(self, path: str, *, data: bytes | None = None, headers: dict[str, str] | None = None,
                 max_bytes: int = MAX_JSON_BYTES) -> tuple[int, dict[str, str], bytes]:
        """One request; a 429 is retried after its Retry-After (at most `max_retries` times, each wait capped
        at `max_wait_s`)."""
        for attempt in range(self.max_retries + 1):
            try:
                return self._request_once(path, data=data, headers=headers, max_bytes=max_bytes)
            except EdgeError as exc:
                if exc.status != 429 or attempt == self.max_retries:
                    raise
                time.sleep(min(self.max_wait_s, max(0.05, exc.retry_after)))
        raise AssertionError("unreachable")

    def _request_once(self, path: str, *, data: bytes | None, headers: dict[str, str] | None,
                      max_bytes: int) -> tuple[int, dict[str, str], bytes]:
        req = urllib.request.Request(self.base_url + path, data=data, headers=headers or {},
                                     method="POST" if data is not None else "GET")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                body = resp.read(max_bytes + 1)
                if len(body) > max_bytes:
                    raise VerificationError("too-large", f"{path} answered over {max_bytes} bytes")
                return resp.status, dict(resp.headers), body
        except urllib.error.HTTPError as exc:
            raw = exc.read(65536)
            retry = exc.headers.get("Retry-After", "")
            retry_after = float(retry) if retry.isdigit() else 1.0
            try:
                err = json.loads(raw)["error"]
                code, message = str(err["code"]), str(err["message"])
            except (ValueError, KeyError, TypeError):
                code, message = "http-error", raw[:200].decode(errors="replace")
            raise EdgeError(exc.code, code, message, retry_after=retry_after) from None

    def get_json(self, path: str) -> Any:
        return json.loads(self._request(path)[2])

    # --- reads (verified) ---

    def revision(self, authority: PeerId) -> Revision:
        """The manifest the edge serves, verified to be signed by `authority`."""
        doc = self.get_json("/v1/manifest")
        return Revision.verify(SignedEnvelope.from_bytes(bytes.fromhex(doc["envelope"])), authority)

    def _entry(self, doc: dict[str, Any], revision: Revision) -> tuple[Head, QuorumCertificate | None]:
        head = Head.from_cbor(decode(bytes.fromhex(doc["cbor"]), max_bytes=1 << 24))
        if doc["certificate"] is None:
            if head.id != revision.genesis().id:
                raise VerificationError("no-certificate", f"head of window {head.window}")
            return head, None
        cert = QuorumCertificate.from_cbor(decode(bytes.fromhex(doc["certificate"]["cbor"]), max_bytes=1 << 24))
        cert.verify(revision, head)
        return head, cert

    def latest(self, revision: Revision) -> tuple[Head, QuorumCertificate | None]:
        """The latest certified head, its certificate verified against `revision` (None for genesis)."""
        return self._entry(self.get_json("/v1/heads/latest"), revision)

    def chain(self, revision: Revision, start: int = 0, limit: int = 64) -> list[tuple[Head, QuorumCertificate | None]]:
        """One page of certified heads from window `start`, each verified."""
        page = self.get_json(f"/v1/chain?from={start}&limit={limit}")
        return [self._entry(doc, revision) for doc in page["heads"]]

    def leases(self, peer: PeerId) -> dict[str, Any]:
        """The edge's view of `peer`'s leases: ``{"window", "base", "shards"}`` (not trusted by itself)."""
        return dict(self.get_json(f"/v1/leases/{peer.to_text()}"))

    def artifact(self, ref: ArtifactRef, *, range_bytes: int = 8 << 20) -> bytes:
        """The bytes of `ref`, fetched in Range requests of about `range_bytes` (a whole number of chunks)
        and verified chunk by chunk, then as a whole. VerificationError names the first bad chunk."""
        out = bytearray(ref.size)
        step = ref.chunk_size * max(1, range_bytes // ref.chunk_size)
        for start in range(0, ref.size, step):
            end = min(ref.size, start + step) - 1
            status, _, body = self._request(f"/v1/artifacts/{ref.digest.hex()}",
                                                  headers={"Range": f"bytes={start}-{end}"}, max_bytes=step)
            if status != 206 or len(body) != end - start + 1:
                raise VerificationError("bad-range", f"status {status}, {len(body)} bytes for {start}-{end}")
            for offset in range(0, len(body), ref.chunk_size):
                index = (start + offset) // ref.chunk_size
                if not ref.chunk_ok(index, body[offset:offset + ref.chunk_size]):
                    raise VerificationError("bad-chunk", f"chunk {index} of {ref.digest.hex()[:16]}")
            out[start:end + 1] = body
        data = bytes(out)
        if artifact_id(ref.size, ref.chunk_size, ref.chunks) != ref.digest:  # every chunk was checked above
            raise VerificationError("corrupt-artifact", ref.digest.hex())
        return data

    # --- signed writes ---

    def submit_update(self, envelope: SignedEnvelope, artifact: bytes) -> str:
        """Upload a signed update and its delta; returns the envelope id (hex). EdgeError when refused."""
        body = encode({"envelope": envelope.to_bytes(), "artifact": artifact})
        return str(json.loads(self._request("/v1/updates", data=body,
                                            headers={"Content-Type": "application/cbor"})[2])["id"])

    def join(self, envelope: SignedEnvelope) -> str:
        """Send a signed join request; returns the envelope id (hex). EdgeError when refused."""
        return str(json.loads(self._request("/v1/join", data=envelope.to_bytes(),
                                            headers={"Content-Type": "application/cbor"})[2])["id"])

    def follow(self, revision: Revision, *, last_window: int | None = None,
               max_event_bytes: int = 1 << 22) -> Iterator[tuple[Head, QuorumCertificate | None]]:
        """Yield certified heads as the edge promotes them (server-sent events from ``/v1/events``), each
        verified against `revision`. With `last_window`, heads after it are replayed first. Blocks between
        events; ends when the edge closes the stream. Raises like the other reads."""
        parts = urllib.parse.urlsplit(self.base_url)
        conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=None)
        headers = {"Accept": "text/event-stream"}
        if last_window is not None:
            headers["Last-Event-ID"] = str(last_window)
        try:
            conn.request("GET", "/v1/events", headers=headers)
            resp = conn.getresponse()
            if resp.status != 200:
                raise EdgeError(resp.status, "no-event-stream", resp.read(200).decode(errors="replace"))
            data: list[str] = []
            size = 0
            while True:
                raw = resp.readline(max_event_bytes + 1)
                if not raw:
                    return
                size += len(raw)
                if size > max_event_bytes:
                    raise VerificationError("too-large", f"event over {max_event_bytes} bytes")
                line = raw.decode().rstrip("\r\n")
                if line.startswith("data:"):
                    data.append(line[5:].lstrip(" "))
                elif line == "" and data:
                    yield self._entry(json.loads("\n".join(data)), revision)
                    data, size = [], 0
                elif line == "":
                    size = 0
        finally:
            conn.close()


@attrs.frozen(kw_only=True)
class StepResult:
    """What one `LightTrainer.step` did: the window, the leased shards, and the update id if uploaded."""

    window: int
    shards: tuple[int, ...]
    joined: bool = False
    update_id: str = ""
    train_loss: float = float("nan")


class LightTrainer:
    """A trainer that needs nothing but HTTP access to one edge and its own key.

    `workload` and `shards` (shard -> sample indices) default to the manifest's named workload
    (`backends.registry.build_workload`); `workdir` holds its small artifact store (a temp dir by default).
    """

    def __init__(self, client: EdgeClient, identity: Identity, *, authority: PeerId, capacity: int = 1,
                 workload: Any = None, shards: Any = None, workdir: Path | None = None) -> None:
        self.client = client
        self.identity = identity
        self.authority = authority
        self.capacity = capacity
        self.revision = client.revision(authority)
        manifest = self.revision.manifest
        if manifest.audit_segments:
            # Its auditors fetch a trainer's checkpoints from the trainer itself (spec/protocol.md §6.3); a
            # trainer that only dials HTTP serves nothing, so every audit of it would fail.
            raise VerificationError("no-segment-audits", "this revision has segment audits (audit_segments), "
                                    "which need trainers that serve their checkpoints: run `peerloom node`")
        if workload is None:
            from peerloom.backends.registry import build_workload

            workload, shards = build_workload(manifest.workload, manifest.workload_seed, len(manifest.shards))
        from .compute import ComputeExecutor

        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="peerloom-light-")
            root = Path(self._tmp.name)
        else:
            root = Path(workdir)
        self.store = ArtifactStore(root, chunk_size=manifest.chunk_size)
        self.executor = ComputeExecutor(self.store, manifest, workload, shards)
        self.last_window = -1
        self.joined_at = -1

    def step(self) -> StepResult:
        """Take part in the window after the latest certified head (at most one update per window)."""
        head, _ = self.client.latest(self.revision)
        window = head.window + 1
        me = self.identity.peer_id
        joined = False
        if me not in {p for p, _ in head.roster} and self.joined_at != window:
            self.client.join(seal(self.identity, JoinRequest(revision=self.revision.id, window=window,
                                                             capacity=self.capacity)))
            self.joined_at, joined = window, True
        lease_w = lease_window(window, self.revision.manifest)  # an older head with overlap (§5.2)
        lease_head = head if lease_w == head.window else self.client.chain(self.revision, lease_w, 1)[0][0]
        shards = leases_of(lease_head, self.revision.manifest, window).get(me, ())
        offered = self.client.leases(me)
        if offered["base"] == head.id.hex() and tuple(offered["shards"]) != shards:
            raise VerificationError("bad-lease", "the edge's leases differ from the lease function")
        if not shards or window == self.last_window:
            return StepResult(window=window, shards=shards, joined=joined)
        if not self.store.has(head.params.digest):
            self.store.put(self.client.artifact(head.params))
        # The protocol fixes the training seed (core/audit.py), so validators can recompute the update.
        result = self.executor.run(TrainTask(params=head.params, shards=shards,
                                             seed=train_seed(head.id, window, shards, me), window=window,
                                             inner_steps=self.revision.manifest.inner_steps))
        assert isinstance(result, TrainResult)
        delta = result.delta
        ann = UpdateAnnouncement(revision=self.revision.id, window=window, base=head.id, shards=shards,
                                 delta=delta, delta_digest=result.delta_digest, train_loss=float(result.train_loss))
        update_id = self.client.submit_update(seal(self.identity, ann), self.store.get(delta.digest))
        self.last_window = window
        return StepResult(window=window, shards=shards, joined=joined, update_id=update_id,
                          train_loss=ann.train_loss)

    def run(self, *, updates: int, timeout_s: float = 300.0, poll_s: float = 0.5) -> list[StepResult]:
        """Step until `updates` updates were uploaded or `timeout_s` seconds passed; returns the steps that
        uploaded or joined. Polls the latest head every `poll_s` seconds (a step per window at most)."""
        results: list[StepResult] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and sum(1 for r in results if r.update_id) < updates:
            result = self.step()
            if result.update_id or result.joined:
                results.append(result)
            time.sleep(poll_s)
        return results

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()

"""The HTTP edge against an in-memory node view: every endpoint, range requests, limits, signatures, SSE."""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from peerloom.adapters.http_edge import ApiError, EdgeLimits, EdgeServer, openapi_document, parse_range
from peerloom.core.chain import verify_chain
from peerloom.core.encoding import content_id, decode, encode
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.leases import leases_of
from peerloom.core.objects import (
    Head,
    JoinRequest,
    QuorumCertificate,
    UpdateAnnouncement,
    make_artifact_ref,
    seal,
)
from tests.edge_fixtures import advance, make_view
from tests.helpers import ident


def fetch(url: str, *, method: str = "GET", data: bytes | None = None, headers: dict[str, str] | None = None):
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


@pytest.fixture
def world(tmp_path):
    view = make_view(tmp_path)
    heads = advance(view, 5)
    with EdgeServer(view, limits=EdgeLimits(rate=1000, burst=1000)) as server:
        yield view, heads, server


def error_code(body: bytes) -> str:
    err = json.loads(body)["error"]
    assert set(err) == {"status", "code", "message"}
    return err["code"]


def test_binds_loopback_and_documents_every_route(world):
    _view, _, server = world
    assert server.host == "127.0.0.1"
    status, _, body = fetch(server.url + "/openapi.json")
    doc = json.loads(body)
    assert status == 200 and doc["openapi"].startswith("3.")
    routes = {r.resource.canonical for r in server.edge.app().router.routes()}
    assert routes == set(doc["paths"]) == set(openapi_document()["paths"])
    status, _, body = fetch(server.url + "/healthz")
    assert status == 200 and json.loads(body)["window"] == 5


def test_latest_head_verifies_against_the_manifest(world):
    view, heads, server = world
    _, _, body = fetch(server.url + "/v1/heads/latest")
    latest = json.loads(body)
    head = Head.from_cbor(decode(bytes.fromhex(latest["cbor"]), max_bytes=1 << 20))
    cert = QuorumCertificate.from_cbor(decode(bytes.fromhex(latest["certificate"]["cbor"]), max_bytes=1 << 20))
    assert head.id.hex() == latest["id"] == heads[-1].id.hex()
    cert.verify(view.revision, head)
    assert latest["metrics"]["test_accuracy"] == pytest.approx(0.7)
    # The manifest the edge serves is the signed one.
    _, _, body = fetch(server.url + "/v1/manifest")
    env = SignedEnvelope.from_bytes(bytes.fromhex(json.loads(body)["envelope"]))
    assert env.id == view.revision.id


def test_head_and_certificate_by_id(world):
    view, heads, server = world
    status, _, body = fetch(server.url + f"/v1/heads/{heads[1].id.hex()}")
    assert status == 200 and json.loads(body)["window"] == 2
    status, _, body = fetch(server.url + f"/v1/certificates/{heads[1].id.hex()}")
    assert status == 200 and json.loads(body)["signers"] == [view.peer_id.to_text()]
    genesis = view.revision.genesis().id.hex()
    assert fetch(server.url + f"/v1/heads/{genesis}")[0] == 200
    status, _, body = fetch(server.url + f"/v1/certificates/{genesis}")
    assert status == 404 and error_code(body) == "unknown-certificate"
    status, _, body = fetch(server.url + "/v1/heads/" + "1220" + "ab" * 32)
    assert status == 404 and error_code(body) == "unknown-head"
    for bad in ("xyz", "1220" + "zz" * 32, "00" * 34):
        status, _, body = fetch(server.url + f"/v1/heads/{bad}")
        assert status == 400 and error_code(body) == "bad-id"


def test_chain_pages_verify_as_a_chain(world):
    view, heads, server = world
    got, start = [], 1
    while start is not None:
        status, _, body = fetch(server.url + f"/v1/chain?from={start}&limit=2")
        page = json.loads(body)
        assert status == 200 and len(page["heads"]) <= 2
        got += page["heads"]
        start = page["next"]
    entries = [(Head.from_cbor(decode(bytes.fromhex(h["cbor"]), max_bytes=1 << 20)),
                QuorumCertificate.from_cbor(decode(bytes.fromhex(h["certificate"]["cbor"]), max_bytes=1 << 20)))
               for h in got]
    assert [h.id for h, _ in entries] == [h.id for h in heads]
    assert len(verify_chain(view.revision, entries)) == 6
    for query in ("from=-1", "limit=0", "limit=257", "from=abc", "limit=1e3"):
        status, _, body = fetch(server.url + f"/v1/chain?{query}")
        assert status == 400 and error_code(body) == "bad-parameter"


def test_artifact_ranges(world):
    view, _heads, server = world
    data = b"params of window 5 " * 100
    digest = view.put_artifact(data)  # already there (a head's params): its artifact id
    url = server.url + f"/v1/artifacts/{digest.hex()}"
    status, headers, body = fetch(url)
    assert status == 200 and body == data and headers["Accept-Ranges"] == "bytes"
    for spec, want in (("bytes=10-19", data[10:20]), ("bytes=1890-", data[1890:]), ("bytes=-7", data[-7:]),
                       ("bytes=0-999999", data)):
        status, headers, body = fetch(url, headers={"Range": spec})
        assert status == 206 and body == want, spec
        assert headers["Content-Range"].endswith(f"/{len(data)}")
    for spec in ("bytes=1900-", "bytes=5000-6000", "bytes=-0"):
        status, headers, body = fetch(url, headers={"Range": spec})
        assert status == 416 and headers["Content-Range"] == f"bytes */{len(data)}", spec
        assert error_code(body) == "range-not-satisfiable"
    for ignored in ("bytes=0-1,5-6", "items=0-3", "bytes=9-3", "bytes=abc"):
        status, _, body = fetch(url, headers={"Range": ignored})
        assert status == 200 and body == data, ignored
    assert fetch(server.url + f"/v1/artifacts/{content_id(b'nope').hex()}")[0] == 404
    status, headers, body = fetch(url, headers={"If-None-Match": f'"{digest.hex()}"'})
    assert status == 304 and body == b""
    assert fetch(url, headers={"If-None-Match": '"other"'})[0] == 200


def test_parse_range_edges():
    assert parse_range("bytes=0-0", 1) == (0, 0)
    assert parse_range("bytes=-5", 3) == (0, 2)
    assert parse_range("bytes= 2-", 4) == (2, 3)
    with pytest.raises(ApiError) as info:
        parse_range("bytes=0-", 0)
    assert info.value.status == 416 and info.value.code == "range-not-satisfiable"


def test_leases_match_the_lease_function(world):
    view, heads, server = world
    trainer = ident(10)
    status, _, body = fetch(server.url + f"/v1/leases/{trainer.peer_id.to_text()}")
    lease = json.loads(body)
    assert status == 200 and lease["window"] == 6 and lease["base"] == heads[-1].id.hex()
    assert tuple(lease["shards"]) == leases_of(heads[-1], view.revision.manifest).get(trainer.peer_id, ())
    for bad in ("0OIl", "x" * 100, "12D3KooW"):
        status, _, body = fetch(server.url + f"/v1/leases/{bad}")
        assert status == 400 and error_code(body) == "bad-peer-id"


def signed_update(view, trainer, artifact: bytes, *, shards=None) -> bytes:
    lease = view.leases(trainer.peer_id)
    ann = UpdateAnnouncement(revision=view.revision.id, window=lease.window, base=lease.base,
                             shards=lease.shards if shards is None else shards,
                             delta=make_artifact_ref(artifact, 64 * 1024), delta_digest=content_id(artifact),
                             train_loss=0.5)
    return seal(trainer, ann).to_bytes()


def leaseholder(view):
    holders = leases_of(view.latest().head, view.revision.manifest)
    return next(t for t in (ident(10), ident(11)) if t.peer_id in holders)


def post(server, path, body: bytes, content_type="application/cbor"):
    return fetch(server.url + path, method="POST", data=body, headers={"Content-Type": content_type})


def test_signed_update_is_accepted_and_tampered_ones_change_nothing(world):
    view, _, server = world
    trainer = leaseholder(view)
    artifact = b"delta bytes" * 50
    envelope = signed_update(view, trainer, artifact)
    # Bad signature: flip the last byte of the envelope (inside the signature).
    tampered = envelope[:-1] + bytes([envelope[-1] ^ 1])
    status, _, body = post(server, "/v1/updates", encode({"envelope": tampered, "artifact": artifact}))
    assert status == 403 and error_code(body) == "bad-signature"
    status, _, body = post(server, "/v1/updates", encode({"envelope": envelope, "artifact": artifact + b"x"}))
    assert status == 400 and error_code(body) == "artifact-mismatch"
    for junk in (b"", b"\xff\x00", encode({"envelope": b"x", "artifact": b""}), encode([1, 2])):
        status, _, body = post(server, "/v1/updates", junk)
        assert 400 <= status < 500, junk
    assert post(server, "/v1/updates", b"{}", "application/json")[0] == 415
    stored_as = make_artifact_ref(artifact, 64 * 1024).digest
    assert view.updates == [] and view.artifact_path(stored_as) is None
    status, _, body = post(server, "/v1/updates", encode({"envelope": envelope, "artifact": artifact}))
    assert status == 202 and json.loads(body)["id"] == SignedEnvelope.from_bytes(envelope).id.hex()
    assert len(view.updates) == 1 and view.artifact_path(stored_as) is not None
    # A validly signed update the node rejects (not the leaseholder's shards) is 422 with the node's reason.
    bad = signed_update(view, trainer, artifact, shards=(99,))
    status, _, body = post(server, "/v1/updates", encode({"envelope": bad, "artifact": artifact}))
    assert status == 422 and error_code(body) == "bad-lease"
    assert len(view.updates) == 1


def test_join_needs_a_signature(world):
    view, _, server = world
    newcomer = ident(42)
    join = seal(newcomer, JoinRequest(revision=view.revision.id, window=1, capacity=2)).to_bytes()
    tampered = join[:-1] + bytes([join[-1] ^ 0x80])
    assert post(server, "/v1/join", tampered)[0] == 403
    wrong_kind = signed_update(view, leaseholder(view), b"x")
    assert post(server, "/v1/join", wrong_kind[:4000])[0] in (400, 413)
    assert view.joins == []
    status, _, _ = post(server, "/v1/join", join)
    assert status == 202 and view.joins == [(newcomer.peer_id, 2)]


def raw_request(server, head: bytes) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return int(data.split(b" ", 2)[1]), data


def test_size_limits_are_checked_before_reading(tmp_path):
    view = make_view(tmp_path)
    with EdgeServer(view, limits=EdgeLimits(max_upload_bytes=1000)) as server:
        # Declares 10 MB but sends nothing: answered at once from the header.
        status, _ = raw_request(server, b"POST /v1/updates HTTP/1.1\r\nHost: x\r\nContent-Type: application/cbor\r\n"
                                        b"Content-Length: 10000000\r\n\r\n")
        assert status == 413
        status, _ = raw_request(server, b"POST /v1/updates HTTP/1.1\r\nHost: x\r\nContent-Type: application/cbor\r\n"
                                        b"Transfer-Encoding: chunked\r\n\r\n")
        assert status == 411
        status, _, body = post(server, "/v1/join", b"\x00" * 5000)
        assert status == 413 and error_code(body) == "too-large"
    with EdgeServer(view, limits=EdgeLimits(max_concurrent_uploads=1)) as server:
        # One upload that sends its headers and then stalls holds the only upload slot: the next gets 503.
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as stalled:
            stalled.sendall(b"POST /v1/updates HTTP/1.1\r\nHost: x\r\nContent-Type: application/cbor\r\n"
                            b"Content-Length: 100\r\n\r\n")
            deadline = time.monotonic() + 5
            while server.edge._uploads == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            status, headers, body = post(server, "/v1/updates", b"\x00")
            assert status == 503 and error_code(body) == "busy" and headers["Retry-After"] == "1"
        deadline = time.monotonic() + 5
        while server.edge._uploads and time.monotonic() < deadline:
            time.sleep(0.01)
        assert post(server, "/v1/updates", b"\x00")[0] == 400


def test_rate_limit_per_client(tmp_path):
    view = make_view(tmp_path)
    with EdgeServer(view, limits=EdgeLimits(rate=0.5, burst=3)) as server:
        statuses = [fetch(server.url + "/healthz")[0] for _ in range(5)]
        assert statuses[:3] == [200, 200, 200] and statuses[3:] == [429, 429]
        status, headers, body = fetch(server.url + "/healthz")
        assert status == 429 and int(headers["Retry-After"]) >= 1 and error_code(body) == "rate-limited"


def test_typed_errors_for_unknown_paths_and_methods(world):
    _, _, server = world
    status, _, body = fetch(server.url + "/v2/nothing")
    assert status == 404 and error_code(body) == "not-found"
    status, _headers, body = fetch(server.url + "/v1/heads/latest", method="POST", data=b"")
    assert status == 405 and error_code(body) == "method-not-allowed"


def test_metrics_serve_node_and_edge_registries(world):
    _, _, server = world
    fetch(server.url + "/healthz")
    status, headers, body = fetch(server.url + "/metrics")
    text = body.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert "peerloom_windows_total 0.0" in text
    assert 'peerloom_http_requests_total{route="/healthz",status="200"}' in text


def test_server_sent_events_follow_promotions(world):
    view, heads, server = world
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", "/v1/events")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"

    def next_event() -> dict:
        lines = []
        while True:
            line = resp.readline().decode().rstrip("\n")
            if line == "" and lines:
                break
            if line and not line.startswith(":"):
                lines.append(line)
        assert lines[0] == "event: head"
        return json.loads(next(x for x in lines if x.startswith("data: "))[6:])

    assert next_event()["id"] == heads[-1].id.hex()
    new = advance(view, 2)
    assert [next_event()["id"], next_event()["id"]] == [h.id.hex() for h in new]
    conn.close()
    # Reconnecting with Last-Event-ID replays the heads after that window, then follows.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", "/v1/events", headers={"Last-Event-ID": "4"})
    resp = conn.getresponse()
    assert [next_event()["window"] for _ in range(3)] == [5, 6, 7]
    conn.close()


def test_every_head_endpoint_renders_a_chain_with_quarantines_strikes_leaves_and_expiries(tmp_path):
    """Quarantine records were once rendered as peer ids, so any head holding one was a 500
    on /v1/heads/latest, /v1/heads/{id} and /v1/chain, and the event stream stopped."""
    view = make_view(tmp_path)
    heads = advance(view, 3, records=True)
    with EdgeServer(view, limits=EdgeLimits(rate=1000, burst=1000)) as server:
        pages = [fetch(server.url + "/v1/heads/latest"), fetch(server.url + f"/v1/heads/{heads[0].id.hex()}")]
        for status, _, body in pages:
            assert status == 200, body
        latest = json.loads(pages[0][2])
        assert latest["quarantine"] == [{"peer": ident(20).peer_id.to_text(), "until": 6}]
        assert latest["strikes"][0] == {"peer": ident(20).peer_id.to_text(), "count": 3, "window": 3}
        assert latest["left"] == [ident(22).peer_id.to_text()] and latest["expired"] == [ident(23).peer_id.to_text()]
        assert latest["rejected"] == [heads[-1].rejected[0].hex()]
        status, _, body = fetch(server.url + "/v1/chain?from=0")
        assert status == 200 and [h["window"] for h in json.loads(body)["heads"]][-3:] == [1, 2, 3]
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/v1/events", headers={"Last-Event-ID": "0"})
        resp = conn.getresponse()
        data = []
        while len(data) < 3:
            line = resp.readline().decode()
            if line.startswith("data: "):
                data.append(json.loads(line[6:]))
        assert [d["window"] for d in data] == [1, 2, 3] and all(d["quarantine"] for d in data)
        conn.close()


def test_dashboard_page_is_self_contained(world):
    _, _, server = world
    status, headers, body = fetch(server.url + "/")
    page = body.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert 'id="chain-rows"' in page and 'id="curve"' in page
    assert "http://" not in page.replace("http://www.w3.org/", "") and "https://" not in page


def test_peers_carry_their_rejections_and_the_node_its_last_error(tmp_path):
    """`/v1/peers`: each peer's rejected input (count, the last reason with its numbers) and the node's last
    failed task, as `PeerInfo` and `set_last_error` give them; the document's schema names every field."""
    from peerloom.adapters.edge_view import PeerInfo

    view = make_view(tmp_path, trainers=())
    with EdgeServer(view, limits=EdgeLimits(rate=1000, burst=1000)) as server:
        body = json.loads(fetch(server.url + "/v1/peers")[2])
        assert body["last_error"] == "" and body["peers"] == []
        view.add_peer(PeerInfo(peer_id=ident(12).peer_id, roles=("trainer",), rejected=3,
                               last_rejection="screen-norm-outlier (norm 31 > 10 x median 2.9)"))
        view.set_last_error("train task failed: ValueError: sample 17")
        body = json.loads(fetch(server.url + "/v1/peers")[2])
    assert body["last_error"] == "train task failed: ValueError: sample 17"
    [peer] = body["peers"]
    assert (peer["rejected"], peer["last_rejection"]) == (3, "screen-norm-outlier (norm 31 > 10 x median 2.9)")
    schema = openapi_document()["components"]["schemas"]["Peers"]
    assert set(body) == set(schema["properties"])
    assert set(peer) == set(schema["properties"]["peers"]["items"]["properties"])


def test_node_edge_view_relays_only_checked_submissions(tmp_path):
    from peerloom.adapters.edge_view import NodeEdgeView, SubmitResult

    source = make_view(tmp_path)
    heads = advance(source, 3)
    relayed = []

    def relay(envelope, artifact):
        relayed.append((envelope.signer, artifact))
        return SubmitResult(accepted=True, envelope_id=envelope.id)

    entries = [(e.head, e.certificate) for e in source.chain(1, 10)]
    view = NodeEdgeView(peer_id=source.peer_id, roles=("validator",), revision=source.revision,
                        registry=source.registry, artifact_path=source.artifact_path, relay=relay,
                        peers=source.peers, entries=entries[:2])
    assert view.latest().head.id == heads[1].id and [w.window for w in view.history()] == [1, 2]
    seen = []
    view.subscribe(lambda h, c: seen.append(h.window))
    view.promote(heads[2], entries[2][1], accepted=3)
    view.promote(heads[1], entries[1][1])  # an old head is ignored
    assert seen == [3] and view.history()[-1].accepted == 3
    assert [e.head.window for e in view.chain(2, 5)] == [2, 3]
    with EdgeServer(view) as server:
        trainer = leaseholder(source)
        artifact = b"delta" * 10
        bad = signed_update(source, trainer, artifact, shards=(99,))
        status, _, body = post(server, "/v1/updates", encode({"envelope": bad, "artifact": artifact}))
        assert status == 422 and error_code(body) == "bad-lease" and relayed == []
        good = signed_update(source, trainer, artifact)
        status, _, _ = post(server, "/v1/updates", encode({"envelope": good, "artifact": artifact}))
        assert status == 202 and relayed == [(trainer.peer_id, artifact)]


def test_lease_table_is_computed_once_per_head(world, monkeypatch):
    import peerloom.adapters.edge_view as edge_view

    view, _, server = world
    calls = []
    real = edge_view.leases_of
    monkeypatch.setattr(edge_view, "leases_of",
                        lambda head, manifest, window=None: calls.append(head.window) or real(head, manifest, window))
    trainer = leaseholder(view)
    for _ in range(5):
        assert fetch(server.url + f"/v1/leases/{trainer.peer_id.to_text()}")[0] == 200
    bad = signed_update(view, trainer, b"x", shards=(99,))
    assert post(server, "/v1/updates", encode({"envelope": bad, "artifact": b"x"}))[0] == 422
    advance(view, 1)
    assert fetch(server.url + f"/v1/leases/{trainer.peer_id.to_text()}")[0] == 200
    assert calls == [5, 6]


def test_privacy_ledger_and_budget_in_the_heads_and_manifest_json(tmp_path):
    """A head's privacy ledger and private trainers, and the manifest's DP-SGD parameters and budget, as the
    dashboard reads them (spec/protocol.md §10); null / empty without them."""
    from tests.edge_fixtures import make_privacy_view

    view, head = make_privacy_view(tmp_path)
    with EdgeServer(view) as server:
        latest = json.loads(fetch(server.url + "/v1/heads/latest")[2])
        manifest = json.loads(fetch(server.url + "/v1/manifest")[2])
    assert latest["privacy"] == [{"peer": p.to_text(), "steps": s, "epsilon": e} for p, s, e in head.privacy]
    assert latest["private"] == [ident(11).peer_id.to_text()]
    assert manifest["privacy"] == {"noise_multiplier": 1.1, "max_grad_norm": 1.0, "delta": 1e-5,
                                   "sample_rate": 0.05, "epsilon_budget": 8.0}
    assert manifest["private_data"] is True
    schemas = openapi_document()["components"]["schemas"]
    assert set(latest) <= set(schemas["Head"]["properties"]) and set(manifest) == set(schemas["Manifest"]["properties"])
    assert set(latest["privacy"][0]) == set(schemas["Head"]["properties"]["privacy"]["items"]["properties"])
    assert set(manifest["privacy"]) == set(schemas["Manifest"]["properties"]["privacy"]["properties"])

    plain = make_view(tmp_path / "plain")
    advance(plain, 1)
    with EdgeServer(plain) as server:
        latest = json.loads(fetch(server.url + "/v1/heads/latest")[2])
        manifest = json.loads(fetch(server.url + "/v1/manifest")[2])
    assert (latest["privacy"], latest["private"]) == ([], [])
    assert (manifest["privacy"], manifest["private_data"]) == (None, False)


# --- the browser peer's routes (spec/browser.md §2, §3, §5) ----------------------------------------------

def _browser_edge(tmp_path, *, audit: bool = False, unauditable: bool = False, workload_options=None):
    """An edge whose revision has `audit` / `unauditable_trainers`, serving a stand-in bundle, with the
    browser data of a numpy digits workload built with `workload_options`."""
    import attrs as _attrs

    from peerloom.adapters.edge_data import BrowserData
    from peerloom.backends.datasets import load_digits_split, shard_indices
    from peerloom.backends.numpy.workload import make_digits_numpy_workload
    from peerloom.core.objects import Revision
    from tests.helpers import make_revision

    rev = make_revision(validators=(ident(1),), trainers=(ident(10),))
    if audit:
        authority = ident(200)
        manifest = _attrs.evolve(rev.manifest, audit=True, unauditable_trainers=unauditable)
        rev = Revision.verify(manifest.seal(authority), authority.peer_id)
    view = make_view(tmp_path, revision=rev)
    workload = make_digits_numpy_workload(seed=0, **(workload_options or {}))
    dist = tmp_path / "dist"
    dist.mkdir()
    (dist / "index.html").write_text("<html>peer</html>")
    server = EdgeServer(view)
    server.edge.web_dist = dist
    server.edge.browser_data = BrowserData.of(workload, shard_indices(len(load_digits_split(0)[0]), 4, 0), "digits")
    return server


def test_train_is_served_only_for_a_workload_that_declares_it_runs_in_a_browser(tmp_path):
    with _browser_edge(tmp_path) as server:
        status, _, body = fetch(server.url + "/train")
        assert status == 200 and body == b"<html>peer</html>"
        status, _, body = fetch(server.url + "/v1/data/index")
        assert status == 200 and json.loads(body)["record_bytes"] == 4 * 64 + 1
    # Adam state kept across windows: the page's kernel does not train it so, and the workload says so
    with _browser_edge(tmp_path / "kept", workload_options={"keep_optimizer_state": True}) as server:
        assert server.edge.browser_data is None
        for path in ("/train", "/v1/data/index", "/v1/data/train"):
            status, _, body = fetch(server.url + path)
            assert status == 404 and error_code(body) == "not-browser-trainable", path
        assert "does not declare that it can run in a browser" in json.loads(body)["error"]["message"]
        status, _, _ = fetch(server.url + "/train?view=1")  # the viewer trains nothing
        assert status == 200


def test_train_is_refused_under_audits_unless_the_manifest_admits_unauditable_trainers(tmp_path):
    with _browser_edge(tmp_path, audit=True) as server:
        status, _, body = fetch(server.url + "/train")
        assert status == 404 and error_code(body) == "not-browser-trainable"
        assert "unauditable_trainers" in json.loads(body)["error"]["message"]
    with _browser_edge(tmp_path / "admits", audit=True, unauditable=True) as server:
        status, _, _ = fetch(server.url + "/train")
        assert status == 200


def test_a_workload_declares_whether_it_runs_in_a_browser():
    from peerloom.backends.numpy.workload import make_digits_numpy_workload

    assert make_digits_numpy_workload(seed=0).browser is True
    assert make_digits_numpy_workload(seed=0, keep_optimizer_state=True).browser is False
    other = make_digits_numpy_workload(seed=0)
    other.betas = (0.8, 0.99)  # not the kernel's Adam
    assert other.browser is False

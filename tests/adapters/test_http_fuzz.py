"""Fuzz a running HTTP edge from its own OpenAPI document (schemathesis): no 5xx, responses conform to the
document, and no unsigned request changes state (spec/design.md §6).

Two edges: one over `InMemoryEdgeView` (fast, every default check, exact state comparison) and one served
by a real `peerloom node` validator process (slow: state compared through its endpoints and metrics) whose
chain holds strikes, quarantine, rejected updates, a join, a leave and expiries from a real fleet.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.specs.openapi.checks import positive_data_acceptance

from peerloom.adapters.http_edge import EdgeLimits, EdgeServer, openapi_document
from peerloom.core.encoding import encode
from peerloom.core.objects import JoinRequest, seal
from tests.edge_fixtures import advance, make_view
from tests.helpers import ident


@schemathesis.serializer("application/cbor")
def _cbor(ctx, value):
    """Request bodies are bytes; anything else schemathesis makes up (negative cases) is sent as JSON text."""
    return value if isinstance(value, bytes) else json.dumps(value, default=str).encode()


schema = schemathesis.openapi.from_dict(openapi_document())
# The event stream never ends by design; it is tested in test_http_edge.py.
schema = schema.exclude(path="/v1/events")


@attrs.define
class Edge:
    url: str
    revision_id: bytes
    unchanged: Callable[[], None]  # raises AssertionError if a submission was taken
    check_each: bool = True  # after every request (in memory), or once at the end (node: its rate limit)

    def after_post(self) -> None:
        if self.check_each:
            self.unchanged()


def _get(url: str) -> tuple[int, bytes]:
    """GET, waiting out the edge's rate limit (the fuzzer may have spent this client's tokens)."""
    for _ in range(30):
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            if e.code != 429:
                return e.code, e.read()
            time.sleep(float(e.headers.get("Retry-After", "1")))
    raise AssertionError(f"still rate limited: {url}")


def _memory_edge(tmp: Path):
    view = make_view(tmp)
    advance(view, 3, records=True)  # a chain with quarantines, strikes, leaves and expiries
    before = sorted(p.name for p in view._dir.iterdir())

    def unchanged() -> None:
        assert view.updates == [] and view.joins == [], "an unsigned request changed state"
        assert sorted(p.name for p in view._dir.iterdir()) == before

    with EdgeServer(view, limits=EdgeLimits(rate=100_000, burst=100_000, max_upload_bytes=1 << 16)) as server:
        yield Edge(url=server.url, revision_id=view.revision.id, unchanged=unchanged)
        counts = {(s.labels["route"], s.labels["status"]): s.value
                  for metric in server.edge.registry.collect() if metric.name == "peerloom_http_requests"
                  for s in metric.samples if s.name.endswith("_total")}
    # The fuzzer really reached the server, posted to both signed endpoints and got only 4xx there.
    assert sum(counts.values()) >= 200, counts
    for route in ("/v1/updates", "/v1/join"):
        statuses = {int(status) for (r, status) in counts if r == route}
        assert statuses and all(400 <= s < 500 for s in statuses), (route, statuses)
    unchanged()


RECORDS = ("strikes", "quarantine", "rejected", "left", "expired")  # head keys the fuzzed chain must hold


def _chain(url: str) -> list[dict]:
    heads, start = [], 0
    while True:
        page = json.loads(_get(f"{url}/v1/chain?from={start}&limit=256")[1])
        heads += page["heads"]
        if len(page["heads"]) < 256:
            return heads
        start = heads[-1]["window"] + 1


def _populate(nodes, url: str, joiner, leaver, timeout_s: float = 90.0) -> list[dict]:
    """Run the fleet until its chain holds every kind of record, stop the trainers (the leaver with a signed
    leave), and wait until idle expiry has emptied the roster; return the chain (GET /v1/chain)."""
    me = joiner.identity.peer_id.to_text()
    deadline, stopped = time.monotonic() + timeout_s, False
    while time.monotonic() < deadline:
        time.sleep(0.5)
        chain = _chain(url)
        held = {key for head in chain for key in RECORDS if head.get(key)}
        joined = any(me in json.dumps(head["roster"]) for head in chain)
        if not stopped and joined and {"strikes", "quarantine"} <= held:
            leaver.stop()  # leave_on_exit: a signed leave, recorded in a head's `left`
            for node in nodes:
                node.stop()
            stopped = True
        if stopped and set(RECORDS) <= held and chain[-1]["roster"] == []:
            return chain
    raise AssertionError(f"the fleet's chain lacks {sorted(set(RECORDS) - held)} (joined: {joined}, "
                         f"trainers stopped: {stopped}, window {chain[-1]['window'] if chain else 0})")


def _node_edge(tmp: Path):
    from peerloom.adapters.keys import generate_identity, save_identity
    from tests.node_cluster import Node, free_port, make_fleet

    # A real validator whose chain holds strikes, quarantine, rejected updates, a join, a leave and
    # expiries (spec/protocol.md §4.1): two honest trainers, a sign-flip-scale attacker (screened out every
    # window: strikes, then quarantine), a trainer that leaves on SIGTERM and a joiner outside the genesis
    # roster. Once the chain holds all of that the trainers stop, and expiry empties the roster. So while
    # it is fuzzed every window is skipped, and the roster and the artifact store change only if the edge
    # lets an unsigned join or update through.
    validator, honest, other, attacker, leaver = make_fleet(tmp, validators=1, trainers=4, quorum=1, window_s=1.0)
    port = free_port()
    validator.write_config(http={"enabled": True, "listen": f"127.0.0.1:{port}"})
    attacker.write_config(behaviour="sign-flip-scale")
    leaver.write_config(leave_on_exit=True, leave_grace_s=10.0)
    identity = generate_identity()
    joiner = Node("joiner", "trainer", identity, tmp / "joiner", port=free_port(), config=dict(honest.config))
    joiner.directory.mkdir()
    save_identity(identity, joiner.directory / "key")
    joiner.write_config(name="joiner", listen=f"127.0.0.1:{joiner.port}")
    trainers = [honest, other, attacker, joiner]
    artifacts = validator.directory / "store" / "artifacts"
    for node in (validator, *trainers, leaver):
        node.start()
    try:
        validator.wait_port()
        url = f"http://127.0.0.1:{port}"
        chain = _populate(trainers, url, joiner, leaver)
        assert any(head["quarantine"] for head in chain) and any(head["left"] for head in chain)
        before = {p.name for p in artifacts.iterdir()}
        revision_id = bytes.fromhex(json.loads(_get(url + "/v1/manifest")[1])["revision"])

        def accepted() -> list[str]:
            metrics = _get(url + "/metrics")[1].decode()
            return sorted(line for line in metrics.splitlines() if 'outcome="accepted"' in line)

        accepted_before = accepted()

        def unchanged() -> None:
            latest = json.loads(_get(url + "/v1/heads/latest")[1])
            assert latest["roster"] == [], "an unsigned join reached the roster"
            assert {p.name for p in artifacts.iterdir()} <= before, "an unsigned upload stored bytes"
            assert accepted() == accepted_before, "an unsigned update was accepted"

        yield Edge(url=url, revision_id=revision_id, unchanged=unchanged, check_each=False)
        unchanged()
        metrics = _get(url + "/metrics")[1].decode()
        served = [line for line in metrics.splitlines() if line.startswith("peerloom_http_requests_total")
                  and 'status="429"' not in line]
        # Past the rate limit, the fuzzer's uploads reached the handlers and were refused there.
        for route in ("/v1/updates", "/v1/join"):
            assert any(f'route="{route}",status="4' in line for line in served), route
        assert not any('status="5' in line for line in served)  # no 5xx on the populated chain
        status, _ = _get(url + "/healthz")
        assert status in (200, 429)  # still serving after the fuzzing
    finally:
        for node in (*trainers, leaver):
            node.stop()
        assert validator.stop() == 0


@pytest.fixture(scope="module", params=["memory", pytest.param("node", marks=pytest.mark.slow)])
def edge(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    yield from (_memory_edge(tmp) if request.param == "memory" else _node_edge(tmp))


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_openapi_fuzz(case, edge):
    # Every default check (5xx, status codes, content types, response schemas, negative data rejected) except
    # "schema-valid data is accepted": random hex ids, base58 strings and CBOR bytes are schema-valid yet
    # name nothing real, and 400/404 is the right answer to them.
    response = case.call_and_validate(base_url=edge.url, excluded_checks=[positive_data_acceptance])
    assert response.status_code < 500
    if case.method.upper() == "POST":
        edge.after_post()


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(envelope=st.one_of(st.binary(max_size=300), st.sampled_from(["tamper"])), artifact=st.binary(max_size=64),
       flip=st.integers(min_value=0, max_value=10_000))
def test_structured_unsigned_uploads_are_refused(edge, envelope, artifact, flip):
    """Bodies of the right shape whose envelope is garbage or a real envelope with one bit flipped: 4xx."""
    if envelope == "tamper":
        good = bytearray(seal(ident(10), JoinRequest(revision=edge.revision_id, window=1, capacity=1)).to_bytes())
        good[flip % len(good)] ^= 1 << (flip % 8)
        envelope = bytes(good)
    for path, body in (("/v1/updates", encode({"envelope": envelope, "artifact": artifact})), ("/v1/join", envelope)):
        req = urllib.request.Request(edge.url + path, data=body, method="POST",
                                     headers={"Content-Type": "application/cbor"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                status = r.status
        except urllib.error.HTTPError as e:
            status = e.code
        assert 400 <= status < 500, (path, status)
    edge.after_post()

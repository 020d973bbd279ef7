"""Fuzz the running HTTP edge from its own OpenAPI document (schemathesis): no 5xx, responses conform to the
document, and no unsigned request changes state (issue 7)."""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import positive_data_acceptance

from peerloom.adapters.edge_view import InMemoryEdgeView
from peerloom.adapters.http_edge import EdgeLimits, EdgeServer, openapi_document
from peerloom.core.encoding import encode
from peerloom.core.objects import JoinRequest, seal

from .edge_fixtures import advance, make_view
from .helpers import ident


@schemathesis.serializer("application/cbor")
def _cbor(ctx, value):
    """Request bodies are bytes; anything else schemathesis makes up (negative cases) is sent as JSON text."""
    return value if isinstance(value, bytes) else json.dumps(value, default=str).encode()


schema = schemathesis.openapi.from_dict(openapi_document())
# The event stream never ends by design; it is tested in test_http_edge.py.
schema = schema.exclude(path="/v1/events")


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    view = make_view(tmp_path_factory.mktemp("fuzz"))
    advance(view, 3)
    before = sorted(p.name for p in view._dir.iterdir())
    with EdgeServer(view, limits=EdgeLimits(rate=100_000, burst=100_000, max_upload_bytes=1 << 16)) as server:
        yield view, server
        counts = {(s.labels["route"], s.labels["status"]): s.value
                  for metric in server.edge.registry.collect() if metric.name == "peerloom_http_requests"
                  for s in metric.samples if s.name.endswith("_total")}
    # The fuzzer really reached the server, posted to both signed endpoints and got only 4xx there.
    assert sum(counts.values()) >= 200, counts
    for route in ("/v1/updates", "/v1/join"):
        statuses = {int(status) for (r, status) in counts if r == route}
        assert statuses and all(400 <= s < 500 for s in statuses), (route, statuses)
    # Nothing the fuzzer sent was signed, so nothing may have changed.
    assert view.updates == [] and view.joins == []
    assert sorted(p.name for p in view._dir.iterdir()) == before


def assert_unchanged(view: InMemoryEdgeView) -> None:
    assert view.updates == [] and view.joins == [], "an unsigned request changed state"


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_openapi_fuzz(case, edge):
    view, server = edge
    # Every default check (5xx, status codes, content types, response schemas, negative data rejected) except
    # "schema-valid data is accepted": random hex ids, base58 strings and CBOR bytes are schema-valid yet
    # name nothing real, and 400/404 is the right answer to them.
    response = case.call_and_validate(base_url=server.url, excluded_checks=[positive_data_acceptance])
    not_a_server_error  # noqa: B018 - kept imported: the check this test exists for runs among the defaults
    assert response.status_code < 500
    assert_unchanged(view)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(envelope=st.one_of(st.binary(max_size=300), st.sampled_from(["tamper"])), artifact=st.binary(max_size=64),
       flip=st.integers(min_value=0, max_value=10_000))
def test_structured_unsigned_uploads_are_refused(edge, envelope, artifact, flip):
    """Bodies of the right shape whose envelope is garbage or a real envelope with one bit flipped: 4xx."""
    view, server = edge
    import urllib.error
    import urllib.request

    if envelope == "tamper":
        good = bytearray(seal(ident(10), JoinRequest(revision=view.revision.id, capacity=1)).to_bytes())
        good[flip % len(good)] ^= 1 << (flip % 8)
        envelope = bytes(good)
    for path, body in (("/v1/updates", encode({"envelope": envelope, "artifact": artifact})), ("/v1/join", envelope)):
        req = urllib.request.Request(server.url + path, data=body, method="POST",
                                     headers={"Content-Type": "application/cbor"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                status = r.status
        except urllib.error.HTTPError as e:
            status = e.code
        # Join: a flipped bit can land in a field that is re-verified by the signature, so it must be refused.
        assert 400 <= status < 500, (path, status)
    assert_unchanged(view)

"""The REST edge's reference client (`LightTrainer` over `EdgeClient`) contributes accepted updates through
``POST /v1/join`` and ``/v1/updates`` (spec/design.md §6): the submit path third-party clients use. (`peerloom light`
now runs a trainer node over the HTTP transport instead: tests/peerloom/test_light.py.)

The edge here is backed by `InMemoryEdgeView`, which verifies submissions the way a node does (signature,
revision, window and base, lease, delta bytes); the node-backed run is tests/adapters/test_node_edge.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from peerloom.adapters.http_client import EdgeClient, EdgeError, LightTrainer
from peerloom.adapters.http_edge import EdgeLimits, EdgeServer
from peerloom.backends.numpy.screening import screen_delta
from peerloom.backends.numpy.tensors import from_safetensors, schema_of, tensor_digest, to_safetensors
from peerloom.backends.registry import build_workload
from peerloom.core.errors import VerificationError
from peerloom.core.leases import leases_of
from peerloom.core.objects import Head, Manifest, Revision, make_artifact_ref
from tests.edge_fixtures import VALIDATOR, certify, make_view
from tests.helpers import ident

AUTHORITY = ident(200)
LIGHT = ident(30)
NEWCOMER = ident(31)
OTHER = ident(32)  # holds most leases, so the light trainer trains on a few shards (fast)
CHUNK = 4096  # small chunks so the params artifact is fetched in several verified ranges


@pytest.fixture(scope="module")
def digits():
    workload, shards = build_workload("digits-mlp", 0, 16)
    return workload, shards


def digits_revision(workload, shards) -> tuple[Revision, bytes]:
    params = workload.initial_params(0)
    genesis = to_safetensors(params)
    ref = make_artifact_ref(genesis, CHUNK)
    manifest = Manifest(
        experiment="light", workload="digits-mlp", workload_seed=0, schema=schema_of(params),
        shards=tuple(len(s) for s in shards), validators=(VALIDATOR.peer_id,), quorum=1, window_s=5.0,
        min_updates=1, max_capacity=4, aggregation="mean", outer_optimizer="fedavg", outer_lr=1.0,
        chunk_size=CHUNK, genesis_params=ref, genesis_params_digest=tensor_digest(params),
        roster=tuple(sorted(((LIGHT.peer_id, 1), (OTHER.peer_id, 3)))))
    return Revision.verify(manifest.seal(AUTHORITY), AUTHORITY.peer_id), genesis


def certify_update(view, ann) -> Head:
    """Play the node: apply the accepted delta (FedAvg of one, outer lr 1) and certify the next head."""
    parent = view.latest().head
    params = from_safetensors(open(view.artifact_path(parent.params.digest), "rb").read())
    delta = from_safetensors(open(view.artifact_path(ann.delta.digest), "rb").read())
    new = {k: (params[k] - delta[k]).astype(np.float32) for k in params}
    data = to_safetensors(new)
    view.put_artifact(data)
    ref = make_artifact_ref(data, CHUNK)
    head = Head(revision=view.revision.id, parent=parent.id, window=parent.window + 1, skipped=False, params=ref,
                params_digest=tensor_digest(new), cohort=(view.updates[-1][1].id,), roster=parent.roster,
                metrics={"test_accuracy": 0.5})
    view.promote(head, certify(view.revision, head))
    return head


def digits_view(tmp_path, digits):
    """An edge view at the digits workload's genesis with no trainers, and the genesis bytes."""
    revision, genesis = digits_revision(*digits)
    return make_view(tmp_path, revision=revision, genesis=genesis, trainers=()), genesis


def test_light_trainer_contributes_accepted_updates_over_http_only(tmp_path, digits):
    workload, shards = digits
    view, _ = digits_view(tmp_path, digits)
    revision = view.revision
    with EdgeServer(view) as server:
        client = EdgeClient(server.url)
        trainer = LightTrainer(client, LIGHT, authority=AUTHORITY.peer_id, workload=workload, shards=shards,
                               workdir=tmp_path / "light")
        windows = []
        for _ in range(3):
            assert leases_of(view.latest().head, revision.manifest).get(LIGHT.peer_id)
            result = trainer.step()
            assert result.update_id, result
            ann, envelope = view.updates[-1]
            assert envelope.signer == LIGHT.peer_id and envelope.id.hex() == result.update_id
            assert ann.window == result.window and ann.base == view.latest().head.id
            assert ann.shards == leases_of(view.latest().head, revision.manifest)[LIGHT.peer_id] == result.shards
            delta = from_safetensors(open(view.artifact_path(ann.delta.digest), "rb").read())
            ok, reason, norm = screen_delta(delta, revision.manifest.schema)
            assert ok and norm > 0, reason
            assert tensor_digest(delta) == ann.delta_digest
            # A second step in the same window uploads nothing new.
            assert trainer.step().update_id == "" and len(view.updates) == len(windows) + 1
            windows.append(result.window)
            certify_update(view, ann)
        assert windows == [1, 2, 3] and view.rejected == []
        # `run` steps until it has uploaded the asked number of updates (window 4 here).
        assert leases_of(view.latest().head, revision.manifest).get(LIGHT.peer_id)
        results = trainer.run(updates=1, timeout_s=30, poll_s=0.05)
        assert [r.window for r in results if r.update_id] == [4] and len(view.updates) == 4
        trainer.close()


def test_a_newcomer_joins_over_http(tmp_path, digits):
    workload, shards = digits
    view, _ = digits_view(tmp_path, digits)
    with EdgeServer(view) as server:
        trainer = LightTrainer(EdgeClient(server.url), NEWCOMER, authority=AUTHORITY.peer_id, capacity=2,
                               workload=workload, shards=shards, workdir=tmp_path / "n")
        result = trainer.step()
        assert result.joined and result.shards == () and result.update_id == ""
        assert view.joins == [(NEWCOMER.peer_id, 2)] and view.updates == []


def test_client_refuses_what_does_not_verify(tmp_path, digits):
    view, _ = digits_view(tmp_path, digits)
    revision = view.revision
    with EdgeServer(view) as server:
        client = EdgeClient(server.url)
        with pytest.raises(VerificationError, match="wrong-authority"):
            client.revision(ident(77).peer_id)
        # Corrupt one byte of the stored genesis params: the ranged fetch catches the bad chunk.
        path = view.artifact_path(revision.manifest.genesis_params.digest)
        data = bytearray(path.read_bytes())
        data[CHUNK + 5] ^= 0xFF
        path.write_bytes(bytes(data))
        with pytest.raises(VerificationError, match="bad-chunk"):
            client.artifact(revision.manifest.genesis_params, range_bytes=2 * CHUNK)
        # A head certified by someone who is not a validator is refused.
        parent = view.latest().head
        forged = Head(revision=revision.id, parent=parent.id, window=1, skipped=False, params=parent.params,
                      params_digest=parent.params_digest, cohort=(parent.id,), roster=parent.roster)
        view.promote(forged, certify(revision, forged, validators=(ident(99),)))
        with pytest.raises(VerificationError, match="not-a-validator"):
            client.latest(revision)
        with pytest.raises(EdgeError) as info:
            client.get_json("/v1/heads/" + "12" * 34)
        assert info.value.status == 400 and info.value.code == "bad-id"


def test_ranged_fetch_rides_out_the_rate_limit(tmp_path, digits):
    view, genesis = digits_view(tmp_path, digits)
    revision = view.revision
    with EdgeServer(view, limits=EdgeLimits(rate=10, burst=2)) as server:
        ref = revision.manifest.genesis_params
        client = EdgeClient(server.url, max_wait_s=0.1)
        assert ref.num_chunks >= 6
        assert client.artifact(ref, range_bytes=CHUNK) == genesis  # one request per chunk: many 429s retried
        impatient = EdgeClient(server.url, max_retries=0)
        with pytest.raises(EdgeError) as info:
            for _ in range(5):
                impatient.get_json("/healthz")
        assert info.value.status == 429 and info.value.retry_after >= 1


def test_follow_verifies_heads_as_they_are_promoted(tmp_path):
    import threading

    from tests.edge_fixtures import advance

    view = make_view(tmp_path)
    heads = advance(view, 3)
    with EdgeServer(view) as server:
        client = EdgeClient(server.url)
        stream = client.follow(view.revision, last_window=1)
        assert [next(stream)[0].id for _ in range(2)] == [h.id for h in heads[1:]]
        timer = threading.Timer(0.2, advance, (view, 1))
        timer.start()
        head, cert = next(stream)
        assert head.window == 4 and cert is not None and cert.window == 4
        stream.close()
        timer.join()
        # A head certified by a non-validator breaks the stream with a VerificationError.
        parent = view.latest().head
        forged = Head(revision=view.revision.id, parent=parent.id, window=5, skipped=False, params=parent.params,
                      params_digest=parent.params_digest, cohort=(parent.id,), roster=parent.roster)
        view.promote(forged, certify(view.revision, forged, validators=(ident(99),)))
        with pytest.raises(VerificationError, match="not-a-validator"):
            next(client.follow(view.revision))

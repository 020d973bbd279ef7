"""Head agreement among several validators (Tendermint, spec/agreement.md) on the simulated cluster."""

from collections import defaultdict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from peerloom.backends.registry import build_workload
from peerloom.core import events as ev
from peerloom.core.chain import verify_chain
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.messages import Signed, decode_message, encode_message
from peerloom.core.objects import PREVOTE, ReductionProposal, seal, sign_vote
from peerloom.core.validator import proposer_of
from tests.engine_cluster import N_SHARDS, SEED, build, build_until, head_window
from tests.helpers import ident

VALIDATORS = ["validator", "v1", "v2", "v3"]


@pytest.fixture(scope="module")
def workload():
    return build_workload("digits-mlp", SEED, N_SHARDS)


class _VoteSpy:
    """A simulator observer that records every vote a validator puts on a live link."""

    def __init__(self):
        self.seen = defaultdict(set)

    def on_validator_message(self, sim, node, data):
        message = decode_message(data, max_bytes=1 << 24)
        if isinstance(message, Signed) and message.envelope.kind == "vote":
            body = message.envelope.open("vote", 1)
            self.seen[(message.envelope.signer, body["window"], body["round"], body["step"])].add(body["head"])

    def on_head(self, sim, node, head, cert):
        pass

    def on_tick(self, sim):
        pass


def record_votes(cluster):
    """Record every vote that crosses the network: {(signer, window, round, step): {head ids}}."""
    spy = _VoteSpy()
    cluster.sim.observers.append(spy)
    return spy.seen


def chains(cluster, names):
    return {n: [h.id for _, h, _ in cluster.nodes[n].heads] for n in names}


def test_four_validators_agree_on_every_head(tmp_path, workload):
    cluster = build(tmp_path, workload, trainers=3, validators=4, quorum=3)
    votes = record_votes(cluster)
    assert cluster.run_until(lambda c: all(head_window(c, n) >= 3 for n in c.nodes), max_time=120.0)
    by_node = chains(cluster, VALIDATORS)
    first = by_node["validator"][:3]
    assert all(ids[:3] == first for ids in by_node.values())
    chain = [(h, c) for _, h, c in cluster.nodes["validator"].heads][:3]
    verify_chain(cluster.revision, chain)
    assert all(len(cert.votes) >= 3 and not head.skipped for head, cert in chain)
    assert all(len(heads) == 1 for heads in votes.values())  # no honest validator ever signed two votes


def test_a_silent_validator_costs_only_timeouts(tmp_path, workload):
    cluster = build(tmp_path, workload, trainers=3, validators=4, quorum=3)
    cluster.crash("v3")  # never says anything: when it is proposer, that round times out
    assert cluster.run_until(lambda c: head_window(c) >= 4, max_time=300.0)
    heads = [h for _, h, _ in cluster.nodes["validator"].heads]
    assert [h.window for h in heads][:4] == [1, 2, 3, 4] and not any(h.skipped for h in heads[:4])
    # A silent proposer costs only its own rounds: every round before the certified one was v3's to propose
    # (which rounds those are is a hash of the parent, so this holds whatever the hash picks).
    silent, validators = cluster.nodes["v3"].identity.peer_id, cluster.revision.manifest.validators
    for _, head, cert in cluster.nodes["validator"].heads[:4]:
        assert all(proposer_of(head.parent, head.window, r, validators) == silent for r in range(cert.round))
        assert proposer_of(head.parent, head.window, cert.round, validators) != silent


def test_restarted_validator_never_double_votes(tmp_path, workload):
    cluster = build(tmp_path, workload, trainers=3, validators=4, quorum=3)
    votes = record_votes(cluster)
    voted = lambda c: any(k.startswith("vote/2/") for k in c.nodes["v1"].store.records())  # noqa: E731
    assert cluster.run_until(voted, max_time=120.0)
    cluster.crash("v1")
    cluster.restart("v1", ["validator", "v2", "v3", "reducer", "t0", "t1", "t2"])
    assert cluster.run_until(lambda c: all(head_window(c, n) >= 4 for n in VALIDATORS), max_time=300.0)
    assert all(len(heads) == 1 for heads in votes.values())
    by_node = chains(cluster, ["validator", "v2", "v3"])
    assert by_node["validator"][:4] == by_node["v2"][:4] == by_node["v3"][:4]
    assert any(e == "resume-agreement" for _, n, e, _ in cluster.logs if n == "v1")


def test_equivocating_validator_is_detected(tmp_path, workload):
    cluster = build_until(1, tmp_path, workload, trainers=2, validators=4, quorum=3, max_time=120.0)
    v = cluster.nodes["validator"].engine
    byzantine = cluster.nodes["v3"]
    window = v.head.window + 1
    for head_id in (b"\\x12\\x20" + b"\\1" * 32, b"\\x12\\x20" + b"\\2" * 32):
        vote = sign_vote(byzantine.identity, cluster.revision.id, window, 0, PREVOTE, head_id)
        v.handle(ev.MessageReceived(now=cluster.now, peer=byzantine.identity.peer_id,
                                    data=encode_message(Signed(envelope=vote))))
    assert v.stats["equivocations"] == 1 and v.rejected_by_reason["equivocation"] == 1


def test_wrong_reducer_aggregate_is_charged_and_validators_certify_their_own(tmp_path, workload):
    cluster = build_until(1, tmp_path, workload, trainers=2)
    v = cluster.nodes["validator"].engine
    reducer = cluster.nodes["reducer"]
    head = v.head
    bogus = seal(reducer.identity, ReductionProposal(
        revision=cluster.revision.id, window=head.window + 1, base=head.id, cohort=(), params=head.params,
        params_digest=head.params_digest))
    v.handle(ev.MessageReceived(now=cluster.now, peer=reducer.identity.peer_id,
                                data=encode_message(Signed(envelope=bogus))))
    assert cluster.run_until(lambda c: head_window(c) >= head.window + 1, max_time=cluster.now + 60.0)
    assert v.rejected_by_reason["proposal-mismatch"] >= 1
    assert v.head.params_digest != head.params_digest  # the validators' own reduction moved the model
    assert isinstance(bogus, SignedEnvelope)


@given(parent=st.binary(min_size=34, max_size=34), window=st.integers(1, 10_000), n=st.integers(1, 12))
def test_n_consecutive_rounds_have_n_different_proposers(parent, window, n):
    """spec/agreement.md §3: a rotation, so a silent validator costs one round of a window, not several in
    a row; round 0's proposer is the smallest hash, and the order is the same at every validator."""
    validators = tuple(ident(40 + i).peer_id for i in range(n))
    rounds = [proposer_of(parent, window, r, validators) for r in range(2 * n)]
    assert len(set(rounds[:n])) == n and rounds[n:] == rounds[:n]
    assert proposer_of(parent, window, 0, tuple(reversed(validators))) == rounds[0]

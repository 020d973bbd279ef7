"""Private-data trainers and the privacy ledger (spec/protocol.md §10): encodings, the ledger's derivation,
the budget rule, the `private` list, and what `peerloom verify` recomputes."""

import math

import attrs
import pytest

from peerloom.core.errors import DecodeError, LocalProtocolError, VerificationError
from peerloom.core.objects import Head, JoinRequest, Manifest, PrivacyParams, UpdateAnnouncement
from peerloom.core.privacy import budget_fault, ledger_epsilon, next_ledger, next_private, spent_steps
from peerloom.verify import check_ledger, check_private
from tests.helpers import child, ident, make_revision

PARAMS = PrivacyParams(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, sample_rate=0.1, epsilon_budget=2.0)


def accountant(noise_multiplier, sample_rate, steps, delta):
    """A stand-in with the shape of the RDP accountant's answer: grows with steps, falls with noise."""
    return math.sqrt(steps) * sample_rate / noise_multiplier + 1e-12 * delta


def private_revision(**changes):
    rev = make_revision(trainers=[ident(10), ident(11)])
    manifest = attrs.evolve(rev.manifest, inner_steps=4, privacy=PARAMS, private_data=True, **changes)
    return manifest


def test_privacy_fields_round_trip_and_are_absent_when_off():
    manifest = private_revision()
    body = manifest.to_cbor()
    assert body["private_data"] is True and body["privacy"]["epsilon_budget"] == 2.0
    assert Manifest.from_cbor(body) == manifest
    plain = make_revision().manifest
    assert "privacy" not in plain.to_cbor() and "private_data" not in plain.to_cbor()
    with pytest.raises(DecodeError):
        Manifest.from_cbor({**plain.to_cbor(), "private_data": False})  # one encoding per manifest
    join = JoinRequest(revision=b"\x12\x20" + b"\1" * 32, window=3, capacity=1, private=True)
    assert JoinRequest.from_cbor(join.to_cbor()) == join
    assert "private" not in attrs.evolve(join, private=False).to_cbor()
    with pytest.raises(DecodeError):
        JoinRequest.from_cbor({**join.to_cbor(), "private": False})


@pytest.mark.parametrize("field, value", [("noise_multiplier", 0.0), ("max_grad_norm", float("nan")),
                                          ("delta", 1.0), ("sample_rate", 1.5), ("epsilon_budget", -1.0)])
def test_privacy_parameters_out_of_range_are_refused(field, value):
    with pytest.raises(DecodeError, match=field):
        attrs.evolve(PARAMS, **{field: value})


def test_privacy_needs_fixed_inner_steps_and_no_segment_audits():
    manifest = private_revision()
    with pytest.raises(DecodeError, match="inner_steps"):
        attrs.evolve(manifest, inner_steps=0)


def test_the_ledger_grows_by_each_authors_steps_and_keeps_everyone_else():
    a, b, c = ident(10).peer_id, ident(11).peer_id, ident(12).peer_id
    rev = make_revision(trainers=[ident(10), ident(11)])
    genesis = rev.genesis()
    one = child(rev, genesis, privacy=next_ledger(genesis, {a: 4, b: 4}, PARAMS, accountant))
    assert [(p, s) for p, s, _ in one.privacy] == sorted([(a, 4), (b, 4)])
    two = child(rev, one, privacy=next_ledger(one, {a: 4, c: 4}, PARAMS, accountant))
    assert spent_steps(two, a) == 8 and spent_steps(two, b) == 4 and spent_steps(two, c) == 4
    assert dict((p, e) for p, _, e in two.privacy)[a] == ledger_epsilon(accountant, PARAMS, 8) == round(
        accountant(1.0, 0.1, 8, 1e-5), 9)
    assert Head.from_cbor(two.to_cbor()) == two and two.id != attrs.evolve(two, privacy=one.privacy).id


def test_an_update_past_the_budget_or_with_the_wrong_steps_is_refused():
    manifest = private_revision()
    rev = make_revision(trainers=[ident(10)])
    a = ident(10).peer_id
    genesis = rev.genesis()
    assert budget_fault(manifest, genesis, a, 4, accountant) == ""
    assert budget_fault(manifest, genesis, a, None, accountant) == "bad-privacy-steps"
    assert budget_fault(manifest, genesis, a, 3, accountant) == "bad-privacy-steps"
    # budget 2.0 at 0.1 * sqrt(steps): 400 steps is exactly at it, 404 past it
    spent = child(rev, genesis, privacy=((a, 396, ledger_epsilon(accountant, PARAMS, 396)),))
    assert budget_fault(manifest, spent, a, 4, accountant) == ""
    spent = child(rev, genesis, privacy=((a, 400, ledger_epsilon(accountant, PARAMS, 400)),))
    assert budget_fault(manifest, spent, a, 4, accountant) == "privacy-budget"
    assert budget_fault(make_revision().manifest, genesis, a, 4, None) == "bad-privacy-steps"
    assert budget_fault(make_revision().manifest, genesis, a, None, None) == ""


def test_a_member_keeps_its_private_flag_and_a_joiner_takes_its_joins():
    a, b, c = ident(10).peer_id, ident(11).peer_id, ident(12).peer_id
    rev = make_revision(trainers=[ident(10), ident(11)])
    parent = child(rev, rev.genesis(), private=(a,))
    roster = tuple(sorted([(a, 1), (b, 1), (c, 1)]))
    # b is a member without the flag: a later private join does not change it; c joins private
    assert next_private(parent, roster, {b, c}) == tuple(sorted([a, c]))
    assert next_private(parent, roster, set()) == (a,)


def test_an_engine_needs_an_accountant_for_a_privacy_manifest():
    from peerloom.core.engine import EngineConfig
    from peerloom.core.objects import Revision

    authority = ident(200)
    manifest = private_revision()
    revision = Revision.verify(manifest.seal(authority), authority.peer_id)
    with pytest.raises(LocalProtocolError, match="accountant"):
        EngineConfig(roles={"validator"}, revision=revision)
    EngineConfig(roles={"validator"}, revision=revision, accountant=accountant)
    plain = make_revision()
    with pytest.raises(LocalProtocolError, match="private"):
        EngineConfig(roles={"trainer"}, revision=plain, private_data=True)


def test_verify_recomputes_the_ledger_and_the_private_list():
    authority = ident(200)
    from peerloom.core.objects import Revision

    manifest = private_revision()
    revision = Revision.verify(manifest.seal(authority), authority.peer_id)
    a, b, c = ident(10).peer_id, ident(11).peer_id, ident(12).peer_id
    genesis = revision.genesis()
    good = child(revision, genesis, cohort=(b"\x12\x20" + b"\1" * 32, b"\x12\x20" + b"\2" * 32),
                 privacy=next_ledger(genesis, {a: 4, b: 4}, PARAMS, accountant), private=(c,),
                 roster=tuple(sorted([*genesis.roster, (c, 1)])))
    check_ledger(revision, good, genesis, accountant)
    check_private(revision, good, genesis)
    tampered = attrs.evolve(good, privacy=((good.privacy[0][0], 4, 0.0), good.privacy[1]))
    with pytest.raises(VerificationError, match="epsilon"):
        check_ledger(revision, tampered, genesis, accountant)
    short = attrs.evolve(good, cohort=good.cohort[:1])  # two entries grew, one update certified
    with pytest.raises(VerificationError, match="grew"):
        check_ledger(revision, short, genesis, accountant)
    over = attrs.evolve(good, privacy=tuple((p, 404, ledger_epsilon(accountant, PARAMS, 404))
                                            for p, _, _ in good.privacy))
    with pytest.raises(VerificationError):
        check_ledger(revision, over, genesis, accountant)
    flipped = child(revision, good, privacy=good.privacy, cohort=(), skipped=True, private=())  # c loses it
    with pytest.raises(VerificationError, match="private"):
        check_private(revision, flipped, good)
    plain = make_revision(trainers=[ident(10)])
    joined = tuple(sorted([*plain.genesis().roster, (c, 1)]))
    with pytest.raises(VerificationError, match="private"):
        check_private(plain, child(plain, plain.genesis(), private=(c,), roster=joined), plain.genesis())
    with pytest.raises(VerificationError, match="private"):  # a member of the parent's roster cannot turn private
        check_private(revision, child(revision, genesis, private=(a,)), genesis)


def test_an_update_announcement_carries_its_steps_only_under_privacy():
    rev = make_revision()
    ann = UpdateAnnouncement(revision=rev.id, window=1, base=rev.genesis().id, shards=(0,),
                             delta=rev.manifest.genesis_params, delta_digest=rev.manifest.genesis_params_digest,
                             train_loss=1.0, privacy_steps=4)
    assert UpdateAnnouncement.from_cbor(ann.to_cbor()) == ann
    assert "privacy_steps" not in attrs.evolve(ann, privacy_steps=None).to_cbor()


# --- a validator engine (tests/validator_harness.py) --------------------------------------------------

def dp_validator(budget=2.0, **manifest):
    from tests.validator_harness import Lone

    params = attrs.evolve(PARAMS, epsilon_budget=budget)
    v = Lone(trainers=2, manifest={"privacy": params, "inner_steps": 4, "idle_windows": 0, **manifest},
             config={"accountant": accountant})
    v.start(0.0)
    for t in v.trainers:
        v.greet(t, ("trainer",))
    return v


def one_head(v):
    """Screen what was announced, close the window at its deadline, reduce, evaluate: the promoted head."""
    v.screen_all()
    v.until_head(60.0)  # the deadline closes the window; the reduce task waits for us
    v.reduce()
    v.evaluate()
    v.until_head(120.0)
    (head,) = v.promoted()
    return head


def test_a_validator_refuses_updates_without_their_steps_or_past_the_budget_and_records_the_rest():
    v = dp_validator()
    a, b = v.trainers
    v.announce(a, privacy_steps=4)
    v.announce(b)  # no spend declared
    assert v.engine.rejected_by_reason["bad-privacy-steps"] == 1
    assert set(v.role.collector.by_id) == {e.envelope.id for e in v.role.collector.entries.values()}
    assert [x.envelope.signer for x in v.role.collector.entries.values()] == [a.peer_id]
    head = one_head(v)
    assert [(p, s) for p, s, _ in head.privacy] == [(a.peer_id, 4)]
    assert head.privacy[0][2] == ledger_epsilon(accountant, PARAMS, 4)

    tight = dp_validator(budget=0.1)  # 0.1 * sqrt(4) = 0.2 > 0.1: the first update is already too much
    tight.announce(tight.trainers[0], privacy_steps=4)
    assert tight.engine.rejected_by_reason["privacy-budget"] == 1
    assert not tight.role.collector.entries


def test_a_private_join_needs_a_manifest_that_admits_private_data_and_is_recorded_in_the_head():
    from peerloom.core.objects import JoinRequest
    from tests.validator_harness import Lone

    joiner = ident(30)
    for admits in (False, True):
        v = Lone(trainers=1, manifest={"private_data": admits, "idle_windows": 0})
        v.start(0.0)
        v.greet(v.trainers[0], ("trainer",))
        v.greet(joiner, ("trainer",))
        v.signed(joiner, JoinRequest(revision=v.revision.id, window=1, capacity=1, private=True))
        assert v.engine.rejected_by_reason["private-not-admitted"] == (0 if admits else 1)
        assert (joiner.peer_id in v.role.admission.private_joins) == admits
        if admits:
            v.announce(v.trainers[0])
            head = one_head(v)
            assert head.private == (joiner.peer_id,) and joiner.peer_id in head.roster_peers
            again = v.restarted(70.0)  # the flag of a held join survives a restart (engine snapshot)
            assert joiner.peer_id in again.role.admission.private_joins


# --- a simulated fleet (tests/engine_cluster.py's cluster) -------------------------------------------

def test_trainers_stop_at_their_budget_leave_and_the_chain_shows_why(tmp_path):
    """Each trainer may afford exactly two windows: it trains two, then leaves the roster with a signed leave
    instead of training a third (validators would refuse it, `privacy-budget`); the ledger records two
    windows' steps at an epsilon within the budget, and `check_rules` (peerloom verify) recomputes it with
    Opacus's accountant."""
    from peerloom.backends.privacy import accountant as rdp
    from peerloom.backends.registry import build_workload
    from peerloom.verify import check_rules
    from tests.engine_cluster import N_SHARDS, SEED, build, head_window

    h = 2
    params = PrivacyParams(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, sample_rate=0.1,
                           epsilon_budget=1.0)
    two, three = (rdp(1.0, 0.1, k * h, 1e-5) for k in (2, 3))
    params = attrs.evolve(params, epsilon_budget=(two + three) / 2)
    workload = build_workload("digits-mlp", SEED, N_SHARDS)
    cluster = build(tmp_path, workload, trainers=2, window_s=5.0, privacy=params, inner_steps=h,
                    idle_windows=0)
    assert cluster.run_until(lambda c: head_window(c) >= 4, max_time=200.0)
    chain = [(head, cert) for _, head, cert in cluster.nodes["validator"].heads]
    assert check_rules(cluster.revision, chain)
    last = chain[-1][0]
    trainers = {cluster.nodes[f"t{i}"].identity.peer_id for i in range(2)}
    assert {p: s for p, s, _ in last.privacy} == {p: 2 * h for p in trainers}
    assert all(e == round(two, 9) <= params.epsilon_budget for _, _, e in last.privacy)
    left = {p for head, _ in chain for p in head.left}
    assert left == trainers and not last.roster
    spent = [f for t, n, e, f in cluster.logs if e == "privacy-budget-spent"]
    assert len(spent) == 2


def test_the_manifest_flags_private_trainers_of_its_genesis_roster():
    """A genesis-roster trainer never joins: the manifest's `private` flags it, and the genesis head lists it."""
    from peerloom.core.objects import Revision

    a, b = ident(10).peer_id, ident(11).peer_id
    manifest = attrs.evolve(private_revision(), private=(a,))
    assert Manifest.from_cbor(manifest.to_cbor()) == manifest and manifest.to_cbor()["private"] == [a.to_bytes()]
    assert "private" not in private_revision().to_cbor()
    authority = ident(200)
    revision = Revision.verify(manifest.seal(authority), authority.peer_id)
    assert revision.genesis().private == (a,)
    for bad in ({"private": (ident(12).peer_id,)}, {"private": (b, a)}, {"private": (a,), "private_data": False}):
        with pytest.raises(DecodeError, match="private"):
            attrs.evolve(private_revision(), **bad)
    with pytest.raises(DecodeError):
        Manifest.from_cbor({**private_revision().to_cbor(), "private": []})


def test_private_trainers_announce_no_loss_and_the_heads_train_loss_leaves_them_out(tmp_path):
    """A loss computed on private records without noise would leak them (spec/protocol.md §10, privacy.md §1):
    a private-data trainer announces `train_loss` 0.0 and logs its real loss only on its own node, and the
    head's `train_loss` metric is the mean over public authors' updates (0.0 when every author is private)."""
    from peerloom.backends.registry import build_workload
    from tests.engine_cluster import N_SHARDS, SEED, build, head_window

    workload = build_workload("digits-mlp", SEED, N_SHARDS)
    public = build(tmp_path / "public", workload, trainers=2)
    assert public.run_until(lambda c: head_window(c) >= 2, max_time=60.0)
    heads = [h for _, h, _ in public.nodes["validator"].heads]
    assert all(h.metrics["train_loss"] > 0.0 for h in heads)

    private = build(tmp_path / "private", workload, trainers=2, private_data=True,
                    private=tuple(sorted(ident(10 + i).peer_id for i in range(2))),
                    engine_options={"private_data": True})
    assert private.run_until(lambda c: head_window(c) >= 2, max_time=60.0)
    heads = [h for _, h, _ in private.nodes["validator"].heads]
    assert all(h.private and h.metrics["train_loss"] == 0.0 and h.cohort for h in heads)
    announced = [f for _, node, event, f in private.logs if event == "announce" and node.startswith("t")]
    assert announced and all(f["train_loss"] > 0.0 for f in announced)  # the real loss stays in the local log
    recent = private.nodes["validator"].engine.recent_updates.values()
    assert recent and all(ann.train_loss == 0.0 for _, ann in recent)

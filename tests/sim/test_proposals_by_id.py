"""Head proposals that name the cohort's announcements by id (spec/agreement.md §3): validators fetch what
they lack with `updates-get`, a proposal nobody can complete times out like a silent proposer's, and a
small cohort still travels inside the proposal."""

from __future__ import annotations

from pathlib import Path

import pytest

from peerloom.core import effects as fx
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.errors import DecodeError
from peerloom.core.messages import (
    MAX_UPDATE_IDS,
    Signed,
    UpdatesRequest,
    decode_message,
    encode_message,
)
from peerloom.core.objects import HeadProposal, decode_body
from peerloom.core.validator import ValidatorRole
from peerloom.sim.scenario import load_scenario, run_scenario

SCENARIOS = Path(__file__).resolve().parents[2] / "sim" / "scenarios"
VALIDATORS = ("v0", "v1", "v2", "v3")


def _run(seed: int, **overrides):
    scenario = load_scenario(SCENARIOS / "proposals-by-id.toml")
    scenario.update(overrides)
    return run_scenario(scenario, seed=seed)


def _stat(result, name: str, nodes=VALIDATORS) -> int:
    return sum(result.sim.nodes[n].engine.stats[name] for n in nodes)


def _proposals(result, node: str) -> list[HeadProposal]:
    records = result.sim.nodes[node].engine.records
    return [HeadProposal.from_cbor(SignedEnvelope.from_bytes(v).open(HeadProposal.KIND, 1))
            for k, v in records.items() if k.startswith("proposal/")]


# --- the message -----------------------------------------------------------------------------------------


def test_updates_request_round_trips_and_refuses_bad_id_lists() -> None:
    ids = tuple(bytes([0x12, 0x20]) + bytes([i]) * 32 for i in range(3))
    request = UpdatesRequest(window=7, ids=ids)
    assert decode_message(encode_message(request), max_bytes=1 << 20) == request
    too_many = tuple(bytes([0x12, 0x20]) + i.to_bytes(32, "big") for i in range(MAX_UPDATE_IDS + 1))
    for bad in ((), ids[:1] * 2, too_many, (b"not a content id",)):
        with pytest.raises(DecodeError):
            decode_message(encode_message(UpdatesRequest(window=7, ids=bad)), max_bytes=1 << 20)


# --- the fetch, in the simulator ---------------------------------------------------------------------------


def test_validators_fetch_what_a_proposal_names_and_certify_it(first_proposer) -> None:
    """t0-t2 reach only P, the proposer of window 1, and t3 everyone but P; proposals carry no announcement.
    Window 1's head holds P's seven updates, so the other validators fetched the three they never heard; when
    another validator's head (five updates, t3's among them) is certified, P fetched t3's for it."""
    scenario = load_scenario(SCENARIOS / "proposals-by-id.toml")
    seed = 2
    partitioned = first_proposer(scenario, seed)  # P: built into the situation, whatever the seed
    others = [v for v in VALIDATORS if v != partitioned]
    scenario["faults"] = [
        {"at": 0.0, "kind": "partition", "groups": [["t0", "t1", "t2"], others]},
        {"at": 0.0, "kind": "partition", "groups": [["t3"], [partitioned]]},
        {"at": 60.0, "kind": "heal"},
    ]
    result = run_scenario(scenario, seed=seed)
    assert result.ok, result.summary["invariants"]
    cohorts = {w: len(h.cohort) for w, h in result.checkers.final.items()}
    assert cohorts[1] == 7, cohorts
    assert _stat(result, "updates_fetched", others) >= 3
    if 5 in cohorts.values():  # another validator proposed a head P could not have built alone
        assert _stat(result, "updates_fetched", (partitioned,)) >= 1
    assert _stat(result, "updates_served") >= _stat(result, "updates_fetched") > 0


def test_a_small_cohort_still_travels_inside_the_proposal() -> None:
    result = _run(seed=2, engine={})  # default proposal_carry_bytes: a few updates fit
    assert result.ok, result.summary["invariants"]
    proposals = [p for n in VALIDATORS for p in _proposals(result, n) if p.head.cohort]
    assert proposals and all(len(p.updates) == len(p.head.cohort) for p in proposals)
    assert _stat(result, "updates_fetched") == 0


def test_a_withholding_proposer_costs_rounds_not_safety() -> None:
    """v0 names announcements only it holds and answers no updates-get: its proposals cannot be checked,
    time out like a silent proposer's, and the other validators' heads certify without them. (Whether the
    others give up fetching before a later round decides, `proposals_unavailable`, is timing.)"""
    result = _run(seed=2, adversaries=[{"behaviour": "announcement-withholding", "nodes": ["v0"]}])
    assert type(result.sim.nodes["v0"].behaviour).__name__ == "AnnouncementWithholding"
    assert result.ok, result.summary["invariants"]  # safety, and windows again after the heal
    withheld = [p for p in _proposals(result, "v0") if p.head.cohort]
    final = {h.id for h in result.checkers.final.values()}
    assert withheld and not any(p.head.id in final for p in withheld)  # v0 proposed; none of it certified
    before_heal = [h for w, h in result.checkers.final.items() if result.checkers.final_at[w] < 60.0]
    assert len(before_heal) >= 3 and all(len(h.cohort) <= 5 for h in before_heal)  # t0-t2 never got in


def test_serving_skips_unknown_ids_other_windows_and_stops_at_the_quota() -> None:
    result = _run(seed=2, duration_s=3.0, liveness={})  # mid-window 1: updates collected, none final
    v0 = result.sim.nodes["v0"].engine
    role = next(r for r in v0.roles if isinstance(r, ValidatorRole))
    peer = result.sim.nodes["v1"].peer_id
    known = next(iter(role.collector.by_id))
    unknown = bytes([0x12, 0x20]) + bytes(32)
    while v0.next_effect() is not None:
        pass

    def sent() -> list[bytes]:
        out = []
        while (effect := v0.next_effect()) is not None:
            if isinstance(effect, fx.Send) and effect.peer == peer:
                message = decode_message(effect.data, max_bytes=1 << 24)
                assert isinstance(message, Signed)
                out.append(message.envelope.id)
        return out

    role.on_updates_request(peer, UpdatesRequest(window=role.window, ids=(known, unknown)))
    assert sent() == [known]
    role.on_updates_request(peer, UpdatesRequest(window=role.window + 1, ids=(known,)))
    assert sent() == []
    for _ in range(600):
        role.on_updates_request(peer, UpdatesRequest(window=role.window, ids=(known,)))
    assert len(sent()) == 511  # 512 requests per peer and window, one of them above
    assert v0.rejected_by_reason["updates-quota"] > 0


def test_a_proposal_never_carries_past_an_envelope_body_whatever_the_setting() -> None:
    import attrs

    result = _run(seed=2, duration_s=3.0, liveness={})
    engine = result.sim.nodes["v0"].engine
    role = next(r for r in engine.roles if isinstance(r, ValidatorRole))
    engine.config = attrs.evolve(engine.config, proposal_carry_bytes=4 << 20)
    head = engine.head
    big = tuple(SignedEnvelope(kind="update", version=1, body=bytes([i]) * 60_000, signer=engine.me,
                               signature=bytes(64)) for i in range(20))  # 1.2 MB together
    assert role.voting.head_proposal(1, 0, None, head, big[:10]).updates == big[:10]  # 600 KB: carried
    assert role.voting.head_proposal(1, 0, None, head, big).updates == ()  # over 1 MiB: by id


def test_late_or_duplicate_answers_cost_the_serving_validator_nothing() -> None:
    """Answers to updates-get may arrive twice (a retry went to a second provider) or after the proposal was
    given up: they are dropped, never counted as the serving validator's own announcements (whose quota,
    leases + slack, would soon charge an honest validator)."""
    result = _run(seed=2, duration_s=3.0, liveness={})
    v1 = result.sim.nodes["v1"].engine
    role = next(r for r in v1.roles if isinstance(r, ValidatorRole))
    server = result.sim.nodes["v0"].peer_id
    envelopes = [entry.envelope for entry in role.collector.by_id.values()]
    role.proposals.requested.update(u.id for u in envelopes)
    for _ in range(5):
        for envelope in envelopes:
            role.on_signed(server, envelope, decode_body(envelope))
    assert v1.rejected_by_reason["announce-quota"] == 0
    role.proposals.requested.clear()  # the same copies, unasked: the sender's announcement quota applies
    for _ in range(5):
        for envelope in envelopes:
            role.on_signed(server, envelope, decode_body(envelope))
    assert v1.rejected_by_reason["announce-quota"] > 0

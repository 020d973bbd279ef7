"""spec/wire.md §7 CDDL covers every message and signed object the code defines, and what the code
encodes validates against it with an independent CDDL validator (pycddl, a binding of cddl-rs).

Coverage: message kinds come from `core.messages.MESSAGE_TYPES`; envelope kinds from every class in
`peerloom.core` with a string `KIND` that is not a wire message, and every module constant `*_KIND`. So
a kind added in core without its CDDL rules fails here.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path
from typing import Any

import attrs
import cbor2
import pycddl
import pytest

import peerloom.core
import peerloom.core.objects as core_objects
from peerloom.core.chain import encode_chain_entry
from peerloom.core.encoding import content_id, encode
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.messages import (
    MESSAGE_TYPES,
    CertifiedHead,
    Chunk,
    ChunkMissing,
    ChunkRequest,
    Hello,
    PeerExchange,
    Signed,
    encode_message,
)
from peerloom.core.objects import (
    PRECOMMIT,
    PREVOTE,
    Head,
    HeadProposal,
    JoinRequest,
    QuorumCertificate,
    ReductionProposal,
    UpdateAnnouncement,
    make_artifact_ref,
    seal,
    sign_vote,
)
from tests.helpers import ident, make_revision

SPEC = Path(__file__).resolve().parents[2] / "spec" / "wire.md"
_RULE = re.compile(r"^([A-Za-z][A-Za-z0-9_-]*)\s*=", re.MULTILINE)


def spec_cddl() -> str:
    """The concatenated ```cddl blocks of spec/wire.md."""
    return "\n".join(re.findall(r"```cddl\n(.*?)```", SPEC.read_text(), re.DOTALL))


def rule_names() -> list[str]:
    return _RULE.findall(spec_cddl())


def envelope_kinds() -> set[str]:
    message_classes = set(MESSAGE_TYPES.values())
    kinds: set[str] = set()
    for info in pkgutil.iter_modules(peerloom.core.__path__):
        module = importlib.import_module(f"peerloom.core.{info.name}")
        for name, value in vars(module).items():
            if name.endswith("_KIND") and isinstance(value, str):
                kinds.add(value)
            elif isinstance(value, type) and value not in message_classes and \
                    isinstance(getattr(value, "KIND", None), str) and value.__module__ == module.__name__:
                kinds.add(value.KIND)
    return kinds


# --- coverage --------------------------------------------------------------------------------------------


def test_rules_are_defined_once():
    names = rule_names()
    assert names, "no ```cddl block in spec/wire.md"
    duplicates = sorted({n for n in names if names.count(n) > 1})
    assert not duplicates


def test_every_message_kind_has_a_rule_and_is_in_the_message_choice():
    names = set(rule_names())
    missing = sorted(f"message-{k}" for k in MESSAGE_TYPES if f"message-{k}" not in names)
    assert not missing
    choice = re.search(r"^message\s*=(.*?)\n\n", spec_cddl(), re.MULTILINE | re.DOTALL)
    assert choice is not None
    listed = set(re.findall(r"message-[a-z-]+", choice.group(1)))
    assert listed == {f"message-{k}" for k in MESSAGE_TYPES}


def test_every_envelope_kind_has_body_and_envelope_rules():
    kinds = envelope_kinds()
    # The known set at the time of writing; a new kind only has to be added to the spec, not here.
    assert {"manifest", "update", "vote", "join", "proposal", "head-proposal"} <= kinds
    names = set(rule_names())
    missing = sorted(r for k in kinds for r in (f"signed-{k}", f"envelope-{k}") if r not in names)
    assert not missing
    choice = re.search(r"^envelope\s*=(.*?)\n(?=\S)", spec_cddl(), re.MULTILINE | re.DOTALL)
    assert choice is not None
    assert set(re.findall(r"envelope-[a-z-]+", choice.group(1))) == {f"envelope-{k}" for k in kinds}
    # ... and each envelope rule names its own kind and body rule.
    for kind in kinds:
        rule = re.search(rf"^envelope-{kind}\s*=(.*?)\]", spec_cddl(), re.MULTILINE | re.DOTALL)
        assert rule is not None and f'"{kind}"' in rule.group(1) and f".cbor signed-{kind}," in rule.group(1)


def test_prose_lists_the_same_envelope_kinds():
    text = SPEC.read_text()
    line = re.search(r"Envelope kinds in version 1: (.*?)\n", text)
    assert line is not None
    assert set(re.findall(r"`([a-z-]+)`", line.group(1))) == envelope_kinds()


# --- validation with pycddl --------------------------------------------------------------------------------

# Workarounds for cddl-rs (behind pycddl 0.6.4), none of which weakens what is checked:
# - it mis-applies `.cbor` inside arrays ("array item at index 0 must be a byte string"), so the schema
#   handed to it has `bstr .cbor X` relaxed to `bstr`, and every envelope body is validated against its
#   `signed-<kind>` rule separately (recursively: updates of a head-proposal, votes in head evidence);
# - it panics on the `message` choice for some alternatives, so a message is validated against the rule
#   of its own kind, `message-<kind>` (the choice itself is checked to list every kind, above);
# - it does not treat maps as closed, so unknown keys are left to core's decoders (tested in core).
_CBOR_CONTROL = re.compile(r"bstr \.cbor [a-z-]+")
_SCHEMAS: dict[str, pycddl.Schema] = {}


def schema_for(rule: str) -> pycddl.Schema:
    if rule not in _SCHEMAS:
        _SCHEMAS[rule] = pycddl.Schema(f"root = {rule}\n" + _CBOR_CONTROL.sub("bstr", spec_cddl()))
    return _SCHEMAS[rule]


def envelopes_in(value: Any) -> list[list[Any]]:
    """Every signed envelope (5-array starting with a kind, version 1, body bytes) nested in `value`."""
    found = []
    if isinstance(value, list):
        if len(value) == 5 and isinstance(value[0], str) and value[1] == 1 and isinstance(value[2], bytes):
            found.append(value)
        for item in value:
            found.extend(envelopes_in(item))
    elif isinstance(value, dict):
        for item in value.values():
            found.extend(envelopes_in(item))
    return found


def validate(rule: str, data: bytes) -> int:
    """Validate `data` against `rule`, then every envelope body inside it; returns how many bodies."""
    if rule == "message":
        rule = f"message-{cbor2.loads(data)[0]}"
    schema_for(rule).validate_cbor(data)
    bodies = 0
    for kind, _, body, _, _ in envelopes_in(cbor2.loads(data)):
        bodies += 1 + validate(f"signed-{kind}", body)
    return bodies


def instances() -> list[tuple[str, bytes, int]]:
    """(rule, canonical bytes built by the code, expected number of envelope bodies inside)."""
    validators = [ident(i) for i in (1, 2, 3, 4)]
    trainer = ident(10)
    revision = make_revision(validators=validators, quorum=3, trainers=(trainer,), window_s=2)
    genesis = revision.genesis()
    cid = content_id(b"x")
    delta = make_artifact_ref(b"d" * 1000, 256)
    ann = UpdateAnnouncement(revision=revision.id, window=1, base=genesis.id, shards=(0, 2), delta=delta,
                             delta_digest=cid, train_loss=0.25)
    update = seal(trainer, ann)
    claims = []
    if "claim" in attrs.fields_dict(UpdateAnnouncement):  # claiming an expired lease (newer field)
        claims.append(("message", encode_message(Signed(envelope=seal(ident(13), attrs.evolve(
            ann, claim=trainer.peer_id)))), 1))
    head = Head(revision=revision.id, parent=genesis.id, window=1, skipped=False,
                params=make_artifact_ref(b"p" * 300, 128), params_digest=cid, cohort=(update.id,),
                roster=((trainer.peer_id, 2),), quarantine=((ident(11).peer_id, 9),),
                metrics={"test_loss": 0.5, "test_accuracy": 1}, strikes=((ident(12).peer_id, 1, 1),),
                rejected=(cid,), evidence=((sign_vote(validators[3], revision.id, 1, 0, PREVOTE, cid),
                                            sign_vote(validators[3], revision.id, 1, 0, PREVOTE, None)),),
                outer_state=make_artifact_ref(b"m" * 40, 128), outer_state_digest=cid)
    votes = {v.peer_id: sign_vote(v, revision.id, 1, 0, PRECOMMIT, head.id).signature for v in validators[:3]}
    cert = QuorumCertificate.from_votes(head.id, 1, 0, votes)
    proposal = seal(validators[0], HeadProposal(revision=revision.id, window=1, round=0, valid_round=None,
                                                head=head, updates=(update,), rejected=(update,)))
    reduction = seal(ident(20), ReductionProposal(revision=revision.id, window=1, base=genesis.id,
                                                  cohort=(update.id,), params=head.params, params_digest=cid))
    join = seal(trainer, JoinRequest(revision=revision.id, window=1, capacity=3))
    nil_vote = sign_vote(validators[1], revision.id, 1, 2, PREVOTE, None)
    newer = []
    if hasattr(core_objects, "AdmissionCertificate"):  # a join carrying an admission certificate (newer kind)
        admission = seal(ident(98), core_objects.AdmissionCertificate(revision=revision.id, peer=trainer.peer_id,
                                                                      max_capacity=2))
        newer.append(("message", encode_message(Signed(envelope=seal(trainer, JoinRequest(
            revision=revision.id, window=1, capacity=2, admission=admission)))), 2))
        newer.append(("envelope", admission.to_bytes(), 1))
    if hasattr(core_objects, "LeaveRequest"):  # a rostered trainer leaving (newer kind)
        newer.append(("message", encode_message(Signed(envelope=seal(trainer, core_objects.LeaveRequest(
            revision=revision.id, window=1)))), 1))
    if hasattr(core_objects, "Heartbeat"):  # a rostered trainer alive in a window (newer kind)
        newer.append(("message", encode_message(Signed(envelope=seal(trainer, core_objects.Heartbeat(
            revision=revision.id, window=1)))), 1))
    if "idle_windows" in attrs.fields_dict(core_objects.Manifest):  # idle expiry on (newer, optional field)
        newer.append(("envelope", attrs.evolve(revision.manifest, idle_windows=2).seal(ident(98)).to_bytes(), 1))
    if "expired" in attrs.fields_dict(Head):  # a head recording departures and idle expiries (newer fields)
        gone = attrs.evolve(head, left=(ident(14).peer_id,), expired=(ident(15).peer_id,))
        newer.append(("message", encode_message(CertifiedHead(head=gone, certificate=cert)), 2))
    if hasattr(core_objects, "AdmissionRevocation"):  # a revocation, alone and carried by a head (newer kind)
        revocation = seal(ident(98), core_objects.AdmissionRevocation(
            revision=revision.id, peers=tuple(sorted((ident(16).peer_id, ident(17).peer_id)))))
        newer.append(("message", encode_message(Signed(envelope=revocation)), 1))
        newer.append(("message", encode_message(CertifiedHead(head=attrs.evolve(head, revoked=(revocation,)),
                                                               certificate=cert)), 3))
    if hasattr(core_objects, "AuditFailure"):  # a failed sampled audit, alone and carried by a head (newer kind)
        verdicts = tuple(sorted((seal(v, core_objects.AuditFailure(revision=revision.id, update=update))
                                 for v in validators[:2]), key=lambda x: x.signer))
        newer.append(("message", encode_message(Signed(envelope=verdicts[0])), 2))  # the verdict and its update
        newer.append(("message", encode_message(CertifiedHead(head=attrs.evolve(head, audits=(verdicts,)),
                                                               certificate=cert)), 6))
        sampled = attrs.evolve(revision.manifest, audit=True, audit_rate=0.5, loss_check_samples=64,
                               loss_min_drop=0.01, inner_steps=8, audit_segments=4)
        newer.append(("envelope", sampled.seal(ident(98)).to_bytes(), 1))
        committed = attrs.evolve(ann, trajectory=make_artifact_ref(b"t" * 500, 256))
        newer.append(("message", encode_message(Signed(envelope=seal(trainer, committed))), 1))
        checkpoints = tuple(make_artifact_ref(bytes([i]) * 700, 256) for i in range(3))
        for residual in (None, delta):
            newer.append(("trajectory", encode(core_objects.Trajectory(checkpoints=checkpoints,
                                                                       residual=residual).to_cbor()), 0))
    if "next-head" in MESSAGE_TYPES:  # a head without its roster, for a peer holding the parent (newer kind)
        newer.append(("message", encode_message(MESSAGE_TYPES["next-head"].of(head, genesis, cert)), 2))
    if "updates-get" in MESSAGE_TYPES:  # announcements a head proposal names by id (newer kind)
        newer.append(("message", encode_message(MESSAGE_TYPES["updates-get"](window=1, ids=(update.id,))), 0))
        by_id = seal(validators[0], attrs.evolve(HeadProposal.from_cbor(proposal.open("head-proposal", 1)),
                                                 updates=(), rejected=()))
        newer.append(("message", encode_message(Signed(envelope=by_id)), 3))  # itself and 2 evidence votes
    return [
        ("message", encode_message(Hello(revision=revision.id, roles=("trainer", "validator"), head_window=7)), 0),
        ("message", encode_message(Hello(revision=revision.id, roles=("reducer",), head_window=0,
                                         listen="127.0.0.1:4001")), 0),
        ("message", encode_message(Hello(revision=revision.id, roles=("validator",), head_window=1,
                                         listen="127.0.0.1:4001", certificate=cert)), 0),
        ("message", encode_message(Hello(revision=revision.id, roles=("trainer",), head_window=0,  # via a relay
                                         listen=f"/ip4/127.0.0.1/tcp/7/p2p-circuit/{trainer.peer_id.to_text()}")), 0),
        ("message", encode_message(PeerExchange(peers=((trainer.peer_id, "127.0.0.1:4001"),
                                                       (validators[0].peer_id, "[::1]:65535")))), 0),
        ("message", encode_message(PeerExchange(peers=())), 0),
        ("message", encode_message(CertifiedHead(head=head, certificate=cert)), 2),  # evidence: 2 votes
        ("message", encode_message(CertifiedHead(head=genesis, certificate=QuorumCertificate(
            head=genesis.id, window=0, round=0, votes=()))), 0),
        ("message", encode_message(ChunkRequest(artifact=delta.digest, index=3)), 0),
        ("message", encode_message(Chunk(artifact=delta.digest, index=3, data=b"d" * 232)), 0),
        ("message", encode_message(ChunkMissing(artifact=delta.digest, index=0)), 0),
        ("message", encode_message(Signed(envelope=update)), 1),
        ("message", encode_message(Signed(envelope=proposal)), 5),  # itself, 2 evidence votes, 2 updates
        ("message", encode_message(Signed(envelope=reduction)), 1),
        ("message", encode_message(Signed(envelope=join)), 1),
        ("message", encode_message(Signed(envelope=nil_vote)), 1),
        *_chain_messages(head, cert),
        *claims,
        *newer,
        ("envelope", revision.envelope.to_bytes(), 1),
        ("chain-entry", encode_chain_entry(head, cert), 2),
        ("head", genesis.to_bytes(), 0),
        ("signing-preimage", encode(["peerloom/envelope/v1", "vote", 1, trainer.peer_id.to_bytes(), b"body"]), 0),
    ]


def _chain_messages(head: Head, cert: QuorumCertificate) -> list[tuple[str, bytes, int]]:
    """Chain sync messages, built through the registry (they are newer than the other kinds)."""
    out = []
    if "chain-get" in MESSAGE_TYPES:
        out.append(("message", encode_message(MESSAGE_TYPES["chain-get"](from_window=1, to_window=3)), 0))
    if "chain" in MESSAGE_TYPES:
        out.append(("message", encode_message(MESSAGE_TYPES["chain"](entries=((head, cert), (head, cert)))), 4))
    return out


def test_every_kind_is_among_the_instances():
    """The validation below exercises every message kind and every envelope kind."""
    seen_messages, seen_envelopes = set(), set()
    for rule, data, _ in instances():
        value = cbor2.loads(data)
        if rule == "message":
            seen_messages.add(value[0])
        seen_envelopes.update(e[0] for e in envelopes_in(value))
    assert seen_messages == set(MESSAGE_TYPES)
    assert seen_envelopes == envelope_kinds()


def test_code_built_instances_validate():
    for rule, data, bodies in instances():
        assert validate(rule, data) == bodies, rule


def _hello(**changes: Any) -> bytes:
    body = {"revision": content_id(b"r"), "roles": ["trainer"], "head_window": 0} | changes
    return encode(["hello", body])


@pytest.mark.parametrize("rule,data", [
    ("message", _hello(roles=["king"])),                       # unknown role
    ("message", _hello(head_window=-1)),                       # negative where u63
    ("message", _hello(revision=b"short")),                    # cid of the wrong size
    ("message", _hello(head_window=1, certificate={"head": content_id(b"h"), "window": 1, "round": 0})),
    ("listen-address", encode("127.0.0.1:1" + "0" * 54)),      # over 64 bytes
    ("listen-address", encode("memory://r/p2p-circuit/12D3KooW" + "1" * 45)),  # not a peer id's length
    ("message", encode(["peers", {"peers": [[b"\0" * 38, 4001]]}])),               # address not text
    ("message", encode(["peers", {"peers": [[b"\0" * 37, "127.0.0.1:1"]]}])),       # short peer id
    ("message", encode(["chunk-get", {"artifact": content_id(b"a"), "index": 1 << 25}])),
    ("message-chunk", encode(["nope", {}])),
    ("message-chain-get", encode(["chain-get", {"from_window": 0, "to_window": 1}])),  # windows start at 1
    ("envelope", encode(["update", 2, b"", b"\0" * 38, b"\0" * 64])),      # unknown version
    ("envelope", encode(["update", 1, b"", b"\0" * 38, b"\0" * 63])),      # short signature
    ("signed-vote", encode({"revision": content_id(b"r"), "window": 1, "round": 0, "step": "commit",
                            "head": None})),
    ("signed-join", encode({"revision": content_id(b"r"), "capacity": 1 << 17})),
])
def test_schema_refuses_what_the_decoder_refuses(rule, data):
    """Guards against a vacuous schema: each of these is refused by core's decoders too."""
    with pytest.raises(pycddl.ValidationError):
        schema_for(rule).validate_cbor(data)


def test_body_validation_catches_a_bad_body_inside_a_good_envelope():
    bad_body = SignedEnvelope.seal(ident(3), "join", 1, {"revision": content_id(b"r"), "capacity": -1})
    with pytest.raises(pycddl.ValidationError):
        validate("message", encode_message(Signed(envelope=bad_body)))


# --- closed maps: the code's field sets are exactly the CDDL's -------------------------------------------


def rule_map_keys(rule: str) -> tuple[set[str], set[str]]:
    """(required, optional) top-level keys of the map (or group) that `rule` defines (comments stripped;
    nested maps and arrays ignored; a key after ``?`` is optional; a group named inside, like
    ``head-fields``, contributes its keys)."""
    text = re.sub(r";[^\n]*", "", spec_cddl())
    match = re.search(rf"^{re.escape(rule)}\s*=\s*([{{(].*?)(?=^\S)", text + "\nEND", re.MULTILINE | re.DOTALL)
    assert match is not None, rule
    required, optional, depth, token, question, in_value = set(), set(), 0, "", False, False
    for ch in match.group(1):
        if ch in "{[(":
            depth += 1
        elif ch in "}])":
            if depth == 1 and token.strip() and not in_value:
                _add_group(token.strip(), required, optional)
                token = ""
            depth -= 1
        elif depth == 1 and ch == ":" and token.strip():
            (optional if question else required).add(token.strip())
            question, in_value = False, True
        if depth == 1 and ch == "?":
            question = True
        elif depth == 1 and ch == ",":
            if token.strip() and not in_value:
                _add_group(token.strip(), required, optional)
            question, in_value = False, False
        if depth == 1 and (ch.isalnum() or ch in "_-"):
            token += ch
        elif ch != ":":
            token = ""
    return required, optional


def _add_group(name: str, required: set[str], optional: set[str]) -> None:
    """A bare name inside a map is a group reference (e.g. ``head-fields``): add its keys."""
    more_required, more_optional = rule_map_keys(name)
    required |= more_required
    optional |= more_optional


def _keys_match(keys: set[str], rule: str) -> bool:
    required, optional = rule_map_keys(rule)
    return required <= keys <= required | optional


def test_code_maps_have_exactly_the_cddl_keys():
    """cddl-rs does not reject unknown keys, so compare the field sets directly: a field added in core
    without its CDDL (or the reverse) fails here."""
    checked = set()
    for _, data, _ in instances():
        value = cbor2.loads(data)
        for kind, _, body, _, _ in envelopes_in(value):
            assert _keys_match(set(cbor2.loads(body)), f"signed-{kind}"), kind
            checked.add(f"signed-{kind}")
        heads = [v["head"] for v in [value, value[1] if isinstance(value, list) else None]
                 if isinstance(v, dict) and "head" in v and isinstance(v["head"], dict)]
        for head in heads:
            assert _keys_match(set(head), "head")
            assert _keys_match(set(head["params"]), "artifact")
            checked.update({"head", "artifact"})
        if isinstance(value, list) and value[0] == "head":
            assert _keys_match(set(value[1]["certificate"]), "certificate")
            checked.add("certificate")
        if isinstance(value, list) and value[0] == "next-head":
            assert _keys_match(set(value[1]["header"]), "head-header")
            checked.add("head-header")
    assert checked >= {f"signed-{k}" for k in envelope_kinds()} | {"head", "artifact", "certificate"} | (
        {"head-header"} if "next-head" in MESSAGE_TYPES else set())

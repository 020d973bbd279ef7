"""Protocol objects (spec/protocol.md §2), part two: the revision, heads and quorum certificates (and the votes
and admission revocations these carry). Imported through `core/objects.py`."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs

from . import _fields as f
from .encoding import content_id, encode
from .envelope import SignedEnvelope, signing_preimage
from .errors import DecodeError, VerificationError
from .identity import Identity, PeerId
from .manifest import (
    MAX_COHORT,
    MAX_HEAD_REVOCATIONS,
    MAX_PEERS,
    MAX_REVOKED_PEERS,
    MAX_ROSTER,
    PROTOCOL_VERSION,
    ArtifactRef,
    Manifest,
    PrivacyRecord,
    RosterEntry,
    _strictly_ascending,
    roster_from_cbor,
    roster_to_cbor,
)


@attrs.frozen(kw_only=True)
class Revision:
    """A verified manifest together with its envelope, its id and the authority that signed it."""

    envelope: SignedEnvelope
    manifest: Manifest

    @property
    def id(self) -> bytes:
        return self.envelope.id

    @property
    def authority(self) -> PeerId:
        return self.envelope.signer

    @classmethod
    def verify(cls, envelope: SignedEnvelope, authority: PeerId | None = None) -> Revision:
        """Check the manifest's signature (and signer, when the authority is known).

        Raises VerificationError or DecodeError.
        """
        if authority is not None and envelope.signer != authority:
            raise VerificationError("wrong-authority", str(envelope.signer))
        return cls(envelope=envelope, manifest=Manifest.from_cbor(envelope.open(Manifest.KIND, PROTOCOL_VERSION)))

    def genesis(self) -> Head:
        """The head of window 0, as the manifest defines it (one instance per revision)."""
        return self._genesis

    @functools.cached_property
    def _genesis(self) -> Head:
        m = self.manifest
        return Head(revision=self.id, parent=None, window=0, skipped=False, params=m.genesis_params,
                    params_digest=m.genesis_params_digest, cohort=(), roster=m.roster, private=m.private)


# --- heads and certificates --------------------------------------------------------------------------


QuarantineRecord = tuple[PeerId, int]  # (peer, first window in which it may hold a lease again)
StrikeRecord = tuple[PeerId, int, int]  # (peer, screening rejections counted, window of the latest)
Evidence = tuple[SignedEnvelope, SignedEnvelope]  # two conflicting votes of one validator, sorted by id
AuditEvidence = tuple[SignedEnvelope, ...]  # `AuditFailure` verdicts on one update, sorted by signer
MAX_HEAD_AUDITS = 16  # failed audits one head carries


def _peer_records(body: dict[str, Any], key: str, width: int) -> tuple[Any, ...]:
    out = []
    for item in f.array(body, key, max_len=MAX_ROSTER):
        if not (isinstance(item, list) and len(item) == width):
            raise DecodeError("bad-field", f"{key} entries are {width}-element arrays")
        rec = {str(i): v for i, v in enumerate(item)}
        out.append((f.peer(rec, "0"), *(f.uint(rec, str(i)) for i in range(1, width))))
    if not _strictly_ascending([r[0] for r in out]):
        raise DecodeError("bad-field", f"{key} must be sorted by peer id without duplicates")
    return tuple(out)


def _sorted_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    return dict(sorted(metrics.items()))


@attrs.frozen(kw_only=True)
class Head:
    """A block of the chain: the model after window `window` (spec/design.md §4, spec/protocol.md §2).

    `skipped` heads record a window that closed with too few updates: params unchanged, empty cohort.
    `roster` names the trainers (peer, capacity) that hold leases in window `window + 1`.
    `metrics` are validation numbers (e.g. ``test_loss``, ``test_accuracy``) computed by validators.
    `quarantine` holds (peer, release window) records sorted by peer: a peer is quarantined for window
    `window + 1` iff its release window is greater. `strikes` counts screening rejections per trainer
    (peer, count, latest window); `rejected` lists the update ids this window rejected by deterministic
    screening (their envelopes travel in the head proposal); `evidence` holds equivocation evidence (two
    conflicting signed votes of one validator). `outer_state` is the outer optimizer's state artifact
    (DiLoCo momentum; None for FedAvg and at genesis, meaning zeros) and `outer_state_digest` its tensor
    digest. `left` lists (sorted) the trainers of the parent's roster that left with a signed `LeaveRequest`;
    `expired` lists (sorted, disjoint from `left`) those the proposer has not heard from in the last
    `idle_windows` windows (manifest; spec/protocol.md §5), and unproven leaseholders of this window that
    delivered no update (§4.1); `revoked` holds (sorted by id, absent when empty) the admission authority's
    revocation envelopes (`AdmissionRevocation`) that remove rostered peers: each names at least one peer of
    the parent's roster, and no peer they name is in this roster (spec/auth.md §6). The roster shrinks by
    exactly `left`, `expired` and the revoked peers, and by no other peer.
    `audits` holds (absent when empty, sorted by update id, each author once) the verdicts of failed sampled
    audits (`AuditFailure` envelopes of distinct validators, sorted by signer) whose authors this head
    quarantines (spec/protocol.md §6.2).
    `unproven` lists (sorted) the rostered trainers that joined and have not yet had an update in a certified
    cohort (spec/protocol.md §4.1); they hold a bounded share of the leases. Every field is derived
    deterministically from the parent and the window's inputs (`core/quarantine.py`), so every validator
    recomputes the same head.
    `private` lists (sorted, absent when empty) the rostered trainers whose join declared private data
    (spec/protocol.md §10): their updates get no recomputation audit. `privacy` (manifests with `privacy`;
    sorted by peer, absent when empty) is the privacy ledger: (peer, DP-SGD steps, epsilon) for every trainer
    that has had an update certified in this revision, epsilon being the RDP accountant's at the manifest's
    parameters for that many steps, rounded to 1e-9 (`core/privacy.py`). It keeps trainers that left, so a
    trainer's budget spans the revision.
    """

    revision: bytes
    parent: bytes | None
    window: int
    skipped: bool
    params: ArtifactRef
    params_digest: bytes
    cohort: tuple[bytes, ...]
    roster: tuple[RosterEntry, ...]
    quarantine: tuple[QuarantineRecord, ...] = ()
    metrics: Mapping[str, float] = attrs.field(factory=dict, converter=_sorted_metrics)
    strikes: tuple[StrikeRecord, ...] = ()
    rejected: tuple[bytes, ...] = ()
    evidence: tuple[Evidence, ...] = ()
    outer_state: ArtifactRef | None = None
    outer_state_digest: bytes | None = None
    left: tuple[PeerId, ...] = ()
    expired: tuple[PeerId, ...] = ()
    unproven: tuple[PeerId, ...] = ()
    revoked: tuple[SignedEnvelope, ...] = ()
    audits: tuple[AuditEvidence, ...] = ()
    private: tuple[PeerId, ...] = ()
    privacy: tuple[PrivacyRecord, ...] = ()

    @functools.cached_property
    def revoked_peers(self) -> frozenset[PeerId]:
        """The peers the `revoked` envelopes name (`revocation_peers`)."""
        return revocation_peers(self.revoked)

    @property
    def quarantined(self) -> frozenset[PeerId]:
        """Peers that hold no lease and no cohort slot in window `window + 1`."""
        return frozenset(p for p, until in self.quarantine if until > self.window + 1)

    @functools.cached_property
    def roster_digest(self) -> bytes:
        """Content id of the roster's canonical encoding (what the header names the roster by)."""
        return roster_digest(self.roster)

    def header_cbor(self) -> dict[str, Any]:
        """The head without its roster, which it names by `roster_digest` (spec/protocol.md §2): what the
        head id hashes, and what a `next-head` message carries."""
        return {
            "revision": self.revision, "parent": self.parent, "window": self.window, "skipped": self.skipped,
            "params": self.params.to_cbor(), "params_digest": self.params_digest, "cohort": list(self.cohort),
            "roster_digest": self.roster_digest,
            "quarantine": [[p.to_bytes(), until] for p, until in self.quarantine],
            "metrics": dict(self.metrics),
            "strikes": [[p.to_bytes(), n, w] for p, n, w in self.strikes], "rejected": list(self.rejected),
            "evidence": [[a.to_cbor(), b.to_cbor()] for a, b in self.evidence],
            "outer_state": None if self.outer_state is None else self.outer_state.to_cbor(),
            "outer_state_digest": self.outer_state_digest, "left": [p.to_bytes() for p in self.left],
            **({"expired": [p.to_bytes() for p in self.expired]} if self.expired else {}),
            **({"unproven": [p.to_bytes() for p in self.unproven]} if self.unproven else {}),
            **({"revoked": [r.to_cbor() for r in self.revoked]} if self.revoked else {}),
            **({"audits": [[v.to_cbor() for v in verdicts] for verdicts in self.audits]} if self.audits else {}),
            **({"private": [p.to_bytes() for p in self.private]} if self.private else {}),
            **({"privacy": [[p.to_bytes(), steps, eps] for p, steps, eps in self.privacy]} if self.privacy else {}),
        }

    def to_cbor(self) -> dict[str, Any]:
        """The whole head: its header and its roster."""
        return self.header_cbor() | {"roster": roster_to_cbor(self.roster)}

    @classmethod
    def from_cbor(cls, obj: Any) -> Head:
        """Parse a whole head. Raises DecodeError (``roster-mismatch`` when the roster is not the one
        `roster_digest` names)."""
        if not isinstance(obj, dict) or "roster" not in obj:
            raise DecodeError("bad-fields", "head: missing roster")
        roster = roster_from_cbor(obj, "roster", 1 << 16)
        return cls.from_fields(head_fields({k: v for k, v in obj.items() if k != "roster"}), roster)

    @classmethod
    def from_fields(cls, fields: dict[str, Any], roster: tuple[RosterEntry, ...]) -> Head:
        """The head of parsed header `fields` (`head_fields`) with `roster`. Raises DecodeError
        ``roster-mismatch`` unless `roster` has the header's roster digest."""
        head = cls(**{k: v for k, v in fields.items() if k != "roster_digest"}, roster=roster)
        if head.roster_digest != fields["roster_digest"]:
            raise DecodeError("roster-mismatch", f"window {head.window}")
        return head

    def to_bytes(self) -> bytes:
        """The canonical encoding (computed once per instance: heads are immutable)."""
        return self._encoded

    @functools.cached_property
    def _encoded(self) -> bytes:
        return encode(self.to_cbor())

    @functools.cached_property
    def id(self) -> bytes:
        """Content id of the canonical encoding of the head's header (`header_cbor`): the roster counts
        through its digest, so a header and a roster checked against it prove the whole head."""
        return content_id(encode(self.header_cbor()))

    @functools.cached_property
    def private_peers(self) -> frozenset[PeerId]:
        """The peers of `private` as a set: trainers whose updates get no recomputation audit (§10)."""
        return frozenset(self.private)

    @functools.cached_property
    def roster_peers(self) -> frozenset[PeerId]:
        """The peers of `roster` as a set (computed once per instance)."""
        return frozenset(p for p, _ in self.roster)


_HEADER_KEYS = frozenset({"revision", "parent", "window", "skipped", "params", "params_digest", "cohort",
                          "roster_digest", "quarantine", "metrics", "strikes", "rejected", "evidence", "outer_state",
                          "outer_state_digest", "left"})
# present only when not empty
_HEADER_OPTIONAL = frozenset({"expired", "unproven", "revoked", "audits", "private", "privacy"})
_HEAD_KEYS = _HEADER_KEYS | {"roster"}


def roster_digest(roster: Sequence[RosterEntry]) -> bytes:
    """Content id of a roster's canonical encoding (a CBOR array of [peer id, capacity], sorted by peer)."""
    return content_id(encode(roster_to_cbor(roster)))


def head_fields(obj: Any) -> dict[str, Any]:
    """Parse and check a head header (a head without its roster; spec/wire.md §7): the `Head` fields but
    the roster, plus ``roster_digest``. Raises DecodeError."""
    keys = _HEADER_KEYS | (_HEADER_OPTIONAL & set(obj)) if isinstance(obj, dict) else _HEADER_KEYS
    body = f.exact_keys(obj, keys, "head")
    cohort = f.array(body, "cohort", max_len=MAX_COHORT)
    for i in range(len(cohort)):
        f.cid({"c": cohort[i]}, "c")
    rejected = f.array(body, "rejected", max_len=MAX_COHORT)
    for r in rejected:
        f.cid({"c": r}, "c")
    if rejected != sorted(set(rejected)):
        raise DecodeError("bad-field", "rejected must be sorted distinct update ids")
    metrics = body["metrics"]
    if not isinstance(metrics, dict) or len(metrics) > 64 or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in metrics.values()):
        raise DecodeError("bad-field", "metrics must map names to numbers")
    evidence = []
    for item in f.array(body, "evidence", max_len=64):
        if not (isinstance(item, list) and len(item) == 2):
            raise DecodeError("bad-field", "evidence entries are [vote, vote]")
        evidence.append((SignedEnvelope.from_cbor(item[0]), SignedEnvelope.from_cbor(item[1])))
    state = body["outer_state"]
    left = tuple(f.peer({"p": p}, "p") for p in f.array(body, "left", max_len=MAX_ROSTER))
    if list(left) != sorted(set(left)):
        raise DecodeError("bad-field", "left must be sorted distinct peer ids")
    expired = tuple(f.peer({"p": p}, "p") for p in f.array(body, "expired", max_len=MAX_ROSTER)) \
        if "expired" in body else ()
    if "expired" in body and not expired:
        raise DecodeError("bad-field", "expired is absent when empty")  # one encoding per head
    if list(expired) != sorted(set(expired)) or set(expired) & set(left):
        raise DecodeError("bad-field", "expired must be sorted distinct peer ids, none of them in left")
    unproven = tuple(f.peer({"p": p}, "p") for p in f.array(body, "unproven", max_len=MAX_ROSTER)) \
        if "unproven" in body else ()
    if ("unproven" in body and not unproven) or list(unproven) != sorted(set(unproven)):
        raise DecodeError("bad-field", "unproven must be sorted distinct peer ids, absent when empty")
    revoked = tuple(SignedEnvelope.from_cbor(r) for r in f.array(body, "revoked", max_len=MAX_HEAD_REVOCATIONS)) \
        if "revoked" in body else ()
    if ("revoked" in body and not revoked) or not _strictly_ascending([r.id for r in revoked]):
        raise DecodeError("bad-field", "revoked must be envelopes sorted by id, distinct, absent when empty")
    audits = []
    for item in (f.array(body, "audits", max_len=MAX_HEAD_AUDITS) if "audits" in body else ()):
        if not (isinstance(item, list) and 1 <= len(item) <= MAX_PEERS):
            raise DecodeError("bad-field", "audits entries are non-empty arrays of verdicts")
        audits.append(tuple(SignedEnvelope.from_cbor(v) for v in item))
    if "audits" in body and not audits:
        raise DecodeError("bad-field", "audits is absent when empty")
    private = tuple(f.peer({"p": p}, "p") for p in f.array(body, "private", max_len=MAX_ROSTER)) \
        if "private" in body else ()
    if ("private" in body and not private) or not _strictly_ascending(private):
        raise DecodeError("bad-field", "private must be sorted distinct peer ids, absent when empty")
    privacy = _privacy_records(body) if "privacy" in body else ()
    return dict(
        revision=f.cid(body, "revision"), parent=f.optional_cid(body, "parent"),
        window=f.uint(body, "window"), skipped=f.boolean(body, "skipped"),
        params=ArtifactRef.from_cbor(body["params"]), params_digest=f.cid(body, "params_digest"),
        cohort=tuple(cohort), roster_digest=f.cid(body, "roster_digest"),
        quarantine=_peer_records(body, "quarantine", 2),
        metrics={k: float(v) for k, v in metrics.items()},
        strikes=_peer_records(body, "strikes", 3), rejected=tuple(rejected), evidence=tuple(evidence),
        outer_state=None if state is None else ArtifactRef.from_cbor(state),
        outer_state_digest=f.optional_cid(body, "outer_state_digest"), left=left, expired=expired,
        unproven=unproven, revoked=revoked, audits=tuple(audits), private=private, privacy=privacy,
    )


def _privacy_records(body: dict[str, Any]) -> tuple[PrivacyRecord, ...]:
    """A head's privacy ledger: non-empty [peer, steps, epsilon] entries sorted by peer, epsilon finite >= 0."""
    out = []
    for item in f.array(body, "privacy", max_len=MAX_ROSTER):
        if not (isinstance(item, list) and len(item) == 3):
            raise DecodeError("bad-field", "privacy entries are [peer, steps, epsilon]")
        rec = {"peer": item[0], "steps": item[1], "epsilon": item[2]}
        epsilon = f.number(rec, "epsilon")
        if not 0.0 <= epsilon < float("inf"):
            raise DecodeError("bad-field", "privacy epsilon must be finite and >= 0")
        out.append((f.peer(rec, "peer"), f.uint(rec, "steps", maximum=1 << 40), epsilon))
    if not out or not _strictly_ascending([r[0] for r in out]):
        raise DecodeError("bad-field", "privacy must be sorted by peer id without duplicates, absent when empty")
    return tuple(out)


VOTE_KIND = "vote"
PREVOTE, PRECOMMIT = "prevote", "precommit"


def vote_body(revision: bytes, window: int, round_: int, step: str, head_id: bytes | None) -> dict[str, Any]:
    """Body of a Tendermint vote (spec/agreement.md §3); `head_id` None is a vote for nil."""
    return {"revision": revision, "window": window, "round": round_, "step": step, "head": head_id}


@attrs.frozen(kw_only=True)
class Vote:
    """The body of a Tendermint vote (`vote_body`, kind ``vote``). Decoding checks its field set and the types
    of `round` (an int >= 0), `step` (prevote or precommit) and `head` (an id, or None for nil). `revision`
    is kept as sent (None when it is not bytes: a wrong revision), and `window` likewise (None when it is not
    an integer: such a vote is for no window we collect, dropped uncharged); the voting module judges both."""

    KIND: ClassVar[str] = VOTE_KIND

    revision: bytes | None
    window: int | None
    round: int
    step: str
    head: bytes | None

    @classmethod
    def from_cbor(cls, obj: Any) -> Vote:
        if not isinstance(obj, dict) or set(obj) != {"revision", "window", "round", "step", "head"}:
            raise DecodeError("bad-fields", "vote")
        revision, window, round_, step, head = obj["revision"], obj["window"], obj["round"], obj["step"], obj["head"]
        if step not in (PREVOTE, PRECOMMIT) or not isinstance(round_, int) or isinstance(round_, bool) or \
                round_ < 0 or not (head is None or isinstance(head, bytes)):
            raise DecodeError("bad-field", "vote")
        return cls(revision=revision if isinstance(revision, bytes) else None,
                   window=window if isinstance(window, int) else None, round=round_, step=step, head=head)


def sign_vote(identity: Identity, revision: bytes, window: int, round_: int, step: str,
              head_id: bytes | None) -> SignedEnvelope:
    """A validator's prevote or precommit. An honest validator signs at most one per (window, round, step)."""
    return SignedEnvelope.seal(identity, VOTE_KIND, PROTOCOL_VERSION,
                               vote_body(revision, window, round_, step, head_id))


@attrs.frozen(kw_only=True)
class QuorumCertificate:
    """Precommits of a quorum of the revision's validators for one head in one round (spec/design.md §4,
    spec/agreement.md §4).

    `votes` holds (validator, signature) pairs sorted by validator; each signature is a vote envelope's
    signature over ``vote_body(revision, window, round, "precommit", head)``.
    """

    head: bytes
    window: int
    round: int
    votes: tuple[tuple[PeerId, bytes], ...]

    def verify(self, revision: Revision, head: Head) -> None:
        """Raise VerificationError unless this certifies `head` under `revision`'s validator set and quorum."""
        if head.revision != revision.id:
            raise VerificationError("wrong-revision", "head names another revision")
        if self.head != head.id or self.window != head.window:
            raise VerificationError("wrong-head", "certificate is for another head")
        self.verify_votes(revision)

    def verify_votes(self, revision: Revision) -> None:
        """Raise VerificationError unless a quorum of `revision`'s validators precommitted head id `self.head`
        in window `self.window`: evidence that such a head was certified, without the head itself (a
        `hello`'s certificate, spec/protocol.md §8)."""
        m = revision.manifest
        signers = [p for p, _ in self.votes]
        if signers != sorted(set(signers)):
            raise VerificationError("bad-certificate", "signers must be sorted and distinct")
        allowed = set(m.validators)
        body = encode(vote_body(revision.id, self.window, self.round, PRECOMMIT, self.head))
        for signer, sig in self.votes:
            if signer not in allowed:
                raise VerificationError("not-a-validator", str(signer))
            if not signer.verify(signing_preimage(VOTE_KIND, PROTOCOL_VERSION, signer, body), sig):
                raise VerificationError("bad-signature", f"vote of {signer}")
        if len(self.votes) < m.quorum:
            raise VerificationError("no-quorum", f"{len(self.votes)} of {m.quorum} votes")

    def to_cbor(self) -> dict[str, Any]:
        return {"head": self.head, "window": self.window, "round": self.round,
                "votes": [[p.to_bytes(), s] for p, s in self.votes]}

    @classmethod
    def from_cbor(cls, obj: Any) -> QuorumCertificate:
        body = f.exact_keys(obj, frozenset({"head", "window", "round", "votes"}), "certificate")
        votes = []
        for item in f.array(body, "votes", max_len=MAX_PEERS):
            if not (isinstance(item, list) and len(item) == 2):
                raise DecodeError("bad-field", "votes are [validator, signature]")
            v = {"p": item[0], "s": item[1]}
            votes.append((f.peer(v, "p"), f.raw(v, "s", size=64)))
        return cls(head=f.cid(body, "head"), window=f.uint(body, "window"), round=f.uint(body, "round"),
                   votes=tuple(votes))

    @classmethod
    def from_votes(cls, head: bytes, window: int, round_: int, votes: Mapping[PeerId, bytes]) -> QuorumCertificate:
        return cls(head=head, window=window, round=round_, votes=tuple(sorted(votes.items())))


# --- signed bodies of trainer, reducer and join messages ---------------------------------------------


@attrs.frozen(kw_only=True)
class AdmissionRevocation:
    """The manifest's admission authority revokes the admission of `peers` (1..MAX_REVOKED_PEERS distinct
    peer ids, sorted) to revision `revision` (spec/auth.md §6, spec/protocol.md §5). Self-authenticating in
    its envelope (kind ``revocation``), so any peer may forward it: validators refuse joins of a revoked
    peer, and the next head drops revoked rostered peers, carrying the envelope as its justification."""

    KIND: ClassVar[str] = "revocation"

    revision: bytes
    peers: tuple[PeerId, ...]

    def to_cbor(self) -> dict[str, Any]:
        return {"revision": self.revision, "peers": [p.to_bytes() for p in self.peers]}

    @classmethod
    def from_cbor(cls, obj: Any) -> AdmissionRevocation:
        body = f.exact_keys(obj, frozenset({"revision", "peers"}), "revocation")
        peers = tuple(f.peer({"p": p}, "p") for p in f.array(body, "peers", max_len=MAX_REVOKED_PEERS))
        if not peers or not _strictly_ascending(peers):
            raise DecodeError("bad-field", "revocation peers: 1 or more sorted distinct peer ids")
        return cls(revision=f.cid(body, "revision"), peers=peers)


def revocation_peers(envelopes: Sequence[SignedEnvelope]) -> frozenset[PeerId]:
    """The peers that revocation `envelopes` name. Raises DecodeError/VerificationError for an envelope that
    is not a well-formed, well-signed revocation (its signer is checked by `check_revocation`)."""
    peers: set[PeerId] = set()
    for envelope in envelopes:
        peers.update(AdmissionRevocation.from_cbor(envelope.open(AdmissionRevocation.KIND, PROTOCOL_VERSION)).peers)
    return frozenset(peers)


def check_revocation(envelope: SignedEnvelope, revision_id: bytes, manifest: Manifest,
                     revocation: AdmissionRevocation | None = None) -> AdmissionRevocation:
    """The revocation in `envelope`, signed by the manifest's admission authority for revision `revision_id`;
    raises VerificationError ``bad-revocation`` (another signer, bad signature, another revision, malformed
    body). `revocation` is its body when the caller decoded it already (`core.bodies.decode_body`)."""
    authority = manifest.admission_authority
    if authority is None or envelope.signer != authority:
        raise VerificationError("bad-revocation", "not signed by the admission authority")
    try:
        envelope.verify(AdmissionRevocation.KIND, PROTOCOL_VERSION)
        if revocation is None:
            revocation = AdmissionRevocation.from_cbor(envelope.body_map())
    except (DecodeError, VerificationError) as exc:
        raise VerificationError("bad-revocation", f"{exc.reason}: {exc.detail}") from exc
    if revocation.revision != revision_id:
        raise VerificationError("bad-revocation", "another revision")
    return revocation

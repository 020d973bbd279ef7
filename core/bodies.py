"""Protocol objects (spec/protocol.md §2), part three: the signed bodies trainers and validators send (update
announcements, trajectories, admission certificates, joins, leaves, heartbeats, reduction and head proposals,
audit failures), and `decode_body`, which decodes a signed envelope's body by its kind into one of them
(`SignedBody`). Imported through `core/objects.py`."""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import attrs

from . import _fields as f
from .certified import AdmissionRevocation, Head, Vote
from .envelope import SignedEnvelope
from .errors import DecodeError, VerificationError
from .identity import Identity, PeerId
from .manifest import MAX_AUDIT_SEGMENTS, MAX_COHORT, MAX_SHARDS, PROTOCOL_VERSION, ArtifactRef, Manifest


@attrs.frozen(kw_only=True)
class UpdateAnnouncement:
    """A trainer's signed claim: "for `window`, from `base`, on my leased `shards`, here is my delta".

    `delta` is the safetensors artifact of the pseudo-gradient (base params minus trained params, DiLoCo
    convention); `delta_digest` its canonical tensor digest. `train_loss` is informational only.
    `claim` names the leaseholder whose expired lease this update claims as next-ranked trainer (None for
    an update on the author's own lease; the key is then absent from the encoding). `trajectory` (under
    segment audits, else None and absent) is the artifact of the author's `Trajectory`: its committed
    training checkpoints and error-feedback residual (spec/protocol.md §6.3). `prior` (overlapped windows
    only, else None and absent) is the id of the author's own update of window `window - 1`, certified in
    the window's parent and missing from the older `base`: training started from the base moved by it
    (`core.audit.start_args`, spec/protocol.md §5.2). `privacy_steps` (manifests with `privacy` only, else None
    and absent) is the trainer's privacy spend for the window: the DP-SGD steps it took at the manifest's
    parameters, which must be the manifest's `inner_steps` (spec/protocol.md §10). `unauditable` (present,
    as true, only when set) says its training cannot be replayed (a browser peer): taken only where the
    manifest has `unauditable_trainers` (or no audits), and then never audited (spec/protocol.md §6.4).
    """

    KIND: ClassVar[str] = "update"

    revision: bytes
    window: int
    base: bytes
    shards: tuple[int, ...]
    delta: ArtifactRef
    delta_digest: bytes
    train_loss: float
    claim: PeerId | None = None
    trajectory: ArtifactRef | None = None
    prior: bytes | None = None
    privacy_steps: int | None = None
    unauditable: bool = False

    def to_cbor(self) -> dict[str, Any]:
        body = {"revision": self.revision, "window": self.window, "base": self.base, "shards": list(self.shards),
                "delta": self.delta.to_cbor(), "delta_digest": self.delta_digest, "train_loss": self.train_loss}
        if self.claim is not None:
            body["claim"] = self.claim.to_bytes()
        if self.trajectory is not None:
            body["trajectory"] = self.trajectory.to_cbor()
        if self.prior is not None:
            body["prior"] = self.prior
        if self.privacy_steps is not None:
            body["privacy_steps"] = self.privacy_steps
        if self.unauditable:
            body["unauditable"] = True
        return body

    @classmethod
    def from_cbor(cls, obj: Any) -> UpdateAnnouncement:
        keys = frozenset({"revision", "window", "base", "shards", "delta", "delta_digest", "train_loss"})
        optional = {"claim", "trajectory", "prior", "privacy_steps", "unauditable"} & set(obj) \
            if isinstance(obj, dict) else set()
        body = f.exact_keys(obj, keys | optional, "update")
        unauditable = _flag(body, "unauditable", "update")
        shards = f.array(body, "shards", max_len=MAX_SHARDS)
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shards) or \
                shards != sorted(set(shards)):
            raise DecodeError("bad-field", "shards must be sorted distinct shard numbers")
        return cls(revision=f.cid(body, "revision"), window=f.uint(body, "window"), base=f.cid(body, "base"),
                   shards=tuple(shards), delta=ArtifactRef.from_cbor(body["delta"]),
                   delta_digest=f.cid(body, "delta_digest"), train_loss=f.number(body, "train_loss"),
                   claim=f.peer(body, "claim") if "claim" in body else None,
                   trajectory=ArtifactRef.from_cbor(body["trajectory"]) if "trajectory" in body else None,
                   prior=f.cid(body, "prior") if "prior" in body else None,
                   privacy_steps=f.uint(body, "privacy_steps", maximum=1 << 24) if "privacy_steps" in body else None,
                   unauditable=unauditable)


def _flag(body: dict[str, Any], key: str, what: str) -> bool:
    """An optional flag: present only as true (one encoding per body)."""
    if key not in body:
        return False
    if not f.boolean(body, key):
        raise DecodeError("bad-field", f"{what}: {key} is absent when false")
    return True


def unauditable_fault(manifest: Manifest, unauditable: bool) -> str:
    """``unauditable-not-admitted`` for a join or update that says `unauditable` under audits without the
    manifest's `unauditable_trainers` (spec/protocol.md §6.4), else ""."""
    return "unauditable-not-admitted" if unauditable and manifest.audit and not manifest.unauditable_trainers \
        else ""


@attrs.frozen(kw_only=True)
class Trajectory:
    """What a trainer commits to under segment audits (spec/protocol.md §6.3), stored as the canonical CBOR
    artifact its update names in `trajectory`: `checkpoints[j - 1]` is the artifact (safetensors) of its
    whole training state after inner step ``b_j`` (`core.audit.segment_bounds`), ``j = 1 .. S``, the last
    one holding the trained params the delta was taken from; `residual` is its error-feedback residual as it
    stood before this update's encoding (None for codecs without error feedback)."""

    checkpoints: tuple[ArtifactRef, ...]
    residual: ArtifactRef | None = None

    def to_cbor(self) -> dict[str, Any]:
        return {"checkpoints": [c.to_cbor() for c in self.checkpoints],
                "residual": None if self.residual is None else self.residual.to_cbor()}

    @classmethod
    def from_cbor(cls, obj: Any) -> Trajectory:
        body = f.exact_keys(obj, frozenset({"checkpoints", "residual"}), "trajectory")
        checkpoints = f.array(body, "checkpoints", max_len=MAX_AUDIT_SEGMENTS)
        if not checkpoints:
            raise DecodeError("bad-field", "a trajectory commits to at least one checkpoint")
        return cls(checkpoints=tuple(ArtifactRef.from_cbor(c) for c in checkpoints),
                   residual=None if body["residual"] is None else ArtifactRef.from_cbor(body["residual"]))


@attrs.frozen(kw_only=True)
class AdmissionCertificate:
    """The manifest's admission authority admits `peer` to revision `revision` with a declared capacity of
    at most `max_capacity` (spec/protocol.md §5). Carried, in its envelope, by the peer's `JoinRequest`.

    Optional (absent from the encoding when None, so a certificate without them encodes as before they
    existed): `expires_window`, the last window a join carrying it may name (validators check the join's own
    `window`, so every validator reaches the same verdict on the same join; spec/auth.md §4), and `login`, a
    32-byte digest of the login it was issued to (spec/auth.md §3), which binds the peer to that login for
    revocation without putting the login's name on the wire.
    """

    KIND: ClassVar[str] = "admission"

    revision: bytes
    peer: PeerId
    max_capacity: int
    expires_window: int | None = None
    login: bytes | None = None

    def to_cbor(self) -> dict[str, Any]:
        body: dict[str, Any] = {"revision": self.revision, "peer": self.peer.to_bytes(),
                                "max_capacity": self.max_capacity}
        if self.expires_window is not None:
            body["expires_window"] = self.expires_window
        if self.login is not None:
            body["login"] = self.login
        return body

    @classmethod
    def from_cbor(cls, obj: Any) -> AdmissionCertificate:
        optional = {"expires_window", "login"} & set(obj) if isinstance(obj, dict) else set()
        body = f.exact_keys(obj, frozenset({"revision", "peer", "max_capacity"} | optional), "admission")
        return cls(revision=f.cid(body, "revision"), peer=f.peer(body, "peer"),
                   max_capacity=f.uint(body, "max_capacity", maximum=1 << 16),
                   expires_window=f.uint(body, "expires_window") if "expires_window" in body else None,
                   login=f.raw(body, "login", size=32) if "login" in body else None)


def check_admission(envelope: SignedEnvelope | None, revision_id: bytes, manifest: Manifest,
                    peer: PeerId, window: int | None = None) -> AdmissionCertificate:
    """The admission certificate `envelope` admits `peer` to revision `revision_id` for a join naming
    `window` (None: expiry not checked, e.g. a node checking its own file at start); raises
    VerificationError ``join-not-admitted`` (missing, not signed by the manifest's admission authority,
    bad signature, another revision or peer, capacity 0, `window` after its `expires_window`) or
    DecodeError (malformed body)."""
    authority = manifest.admission_authority
    if envelope is None or authority is None or envelope.signer != authority:
        raise VerificationError("join-not-admitted", "no certificate of the admission authority")
    try:
        cert = AdmissionCertificate.from_cbor(envelope.open(AdmissionCertificate.KIND, PROTOCOL_VERSION))
    except VerificationError as exc:
        raise VerificationError("join-not-admitted", f"{exc.reason}: {exc.detail}") from exc
    if cert.revision != revision_id or cert.peer != peer or cert.max_capacity < 1:
        raise VerificationError("join-not-admitted", "certificate is for another revision or peer")
    if window is not None and cert.expires_window is not None and window > cert.expires_window:
        raise VerificationError("join-not-admitted", f"certificate expired after window {cert.expires_window}")
    return cert


@attrs.frozen(kw_only=True)
class JoinRequest:
    """A trainer asks to be put in the roster of the next head with a declared `capacity` (1..max).

    `window` is the window being collected when it asked (it asks again each window until rostered):
    validators take a join for their current window or up to 2 ahead, so an old join replayed after the
    trainer left has no effect (spec/protocol.md §5). `admission` is its admission certificate envelope
    (`AdmissionCertificate`), needed when the manifest's admission policy is "certificate"; the key is
    absent from the encoding when None. `private` says the trainer trains on data only it holds
    (spec/protocol.md §10; present, as true, only when set): validators take it only under a manifest with
    `private_data`, and the head lists the trainer in `private`. `unauditable` (present, as true, only when
    set) says the trainer's training cannot be replayed (a browser peer): under audits validators take the
    join only where the manifest has `unauditable_trainers` (spec/protocol.md §6.4).
    """

    KIND: ClassVar[str] = "join"

    revision: bytes
    window: int
    capacity: int
    admission: SignedEnvelope | None = None
    private: bool = False
    unauditable: bool = False

    def to_cbor(self) -> dict[str, Any]:
        body: dict[str, Any] = {"revision": self.revision, "window": self.window, "capacity": self.capacity}
        if self.admission is not None:
            body["admission"] = self.admission.to_cbor()
        if self.private:
            body["private"] = True
        if self.unauditable:
            body["unauditable"] = True
        return body

    @classmethod
    def from_cbor(cls, obj: Any) -> JoinRequest:
        keys = frozenset({"revision", "window", "capacity"})
        optional = {"admission", "private", "unauditable"} & set(obj) if isinstance(obj, dict) else set()
        body = f.exact_keys(obj, keys | optional, "join")
        private = f.boolean(body, "private") if "private" in body else False
        if "private" in body and not private:
            raise DecodeError("bad-field", "join: private is absent when false")
        return cls(revision=f.cid(body, "revision"), window=f.uint(body, "window"),
                   capacity=f.uint(body, "capacity", maximum=1 << 16),
                   admission=SignedEnvelope.from_cbor(body["admission"]) if "admission" in body else None,
                   private=private, unauditable=_flag(body, "unauditable", "join"))


@attrs.frozen(kw_only=True)
class LeaveRequest:
    """A rostered trainer leaves: the head of window `window` drops it from the roster (spec/protocol.md §5).

    `window` is the window being collected when the trainer asked; validators ignore a leave for a window
    they have already certified, so an old leave cannot be replayed against a peer that joined again.
    """

    KIND: ClassVar[str] = "leave"

    revision: bytes
    window: int

    def to_cbor(self) -> dict[str, Any]:
        return {"revision": self.revision, "window": self.window}

    @classmethod
    def from_cbor(cls, obj: Any) -> LeaveRequest:
        body = f.exact_keys(obj, frozenset({"revision", "window"}), "leave")
        return cls(revision=f.cid(body, "revision"), window=f.uint(body, "window"))


@attrs.frozen(kw_only=True)
class Heartbeat:
    """A rostered trainer is alive in window `window` (spec/protocol.md §5): sent to the validators once per
    window when the manifest's `idle_windows` > 0; validators relay it one hop to each other."""

    KIND: ClassVar[str] = "heartbeat"

    revision: bytes
    window: int

    def to_cbor(self) -> dict[str, Any]:
        return {"revision": self.revision, "window": self.window}

    @classmethod
    def from_cbor(cls, obj: Any) -> Heartbeat:
        body = f.exact_keys(obj, frozenset({"revision", "window"}), "heartbeat")
        return cls(revision=f.cid(body, "revision"), window=f.uint(body, "window"))


@attrs.frozen(kw_only=True)
class ReductionProposal:
    """A reducer's proposed aggregate for a window: cohort (canonical order) and resulting params."""

    KIND: ClassVar[str] = "proposal"

    revision: bytes
    window: int
    base: bytes
    cohort: tuple[bytes, ...]
    params: ArtifactRef
    params_digest: bytes

    def to_cbor(self) -> dict[str, Any]:
        return {"revision": self.revision, "window": self.window, "base": self.base, "cohort": list(self.cohort),
                "params": self.params.to_cbor(), "params_digest": self.params_digest}

    @classmethod
    def from_cbor(cls, obj: Any) -> ReductionProposal:
        body = f.exact_keys(obj, frozenset({"revision", "window", "base", "cohort", "params", "params_digest"}),
                            "proposal")
        cohort = f.array(body, "cohort", max_len=MAX_COHORT)
        for c in cohort:
            f.cid({"c": c}, "c")
        return cls(revision=f.cid(body, "revision"), window=f.uint(body, "window"), base=f.cid(body, "base"),
                   cohort=tuple(cohort), params=ArtifactRef.from_cbor(body["params"]),
                   params_digest=f.cid(body, "params_digest"))


@attrs.frozen(kw_only=True)
class AuditFailure:
    """A validator's verdict that a sampled audit of a certified update failed (spec/protocol.md §6.2): it
    re-ran `update`'s training from its base and the result did not reproduce the announced delta.

    `update` is the trainer's signed update announcement itself, so the verdict is transferable: anyone
    holding the manifest checks a head's `audits` from the head alone (`core/audit.py`). The signer is one
    of the manifest's validators; `n - quorum + 1` verdicts of distinct validators (at least one honest)
    quarantine the update's author.
    """

    KIND: ClassVar[str] = "audit-failure"

    revision: bytes
    update: SignedEnvelope

    def to_cbor(self) -> dict[str, Any]:
        return {"revision": self.revision, "update": self.update.to_cbor()}

    @classmethod
    def from_cbor(cls, obj: Any) -> AuditFailure:
        body = f.exact_keys(obj, frozenset({"revision", "update"}), "audit-failure")
        return cls(revision=f.cid(body, "revision"), update=SignedEnvelope.from_cbor(body["update"]))


Sealable = UpdateAnnouncement | JoinRequest | ReductionProposal | AdmissionCertificate | AdmissionRevocation \
    | LeaveRequest | Heartbeat | AuditFailure


def seal(identity: Identity, obj: Sealable | HeadProposal) -> SignedEnvelope:
    return SignedEnvelope.seal(identity, obj.KIND, PROTOCOL_VERSION, obj.to_cbor())


@attrs.frozen(kw_only=True)
class HeadProposal:
    """A round's proposer proposes the next head (Tendermint PROPOSAL, spec/agreement.md §3).

    `updates` are the signed announcements of every cohort member and `rejected` those of
    `head.rejected`, so each validator can fetch, screen and re-reduce them itself - or both are empty
    when they would not fit, and validators fetch the announcements the head names by id (`updates-get`,
    spec/agreement.md §3). `valid_round` is the round in which the proposer saw a quorum of prevotes for
    this head (None if it never did).
    """

    KIND: ClassVar[str] = "head-proposal"

    revision: bytes
    window: int
    round: int
    valid_round: int | None
    head: Head
    updates: tuple[SignedEnvelope, ...]
    rejected: tuple[SignedEnvelope, ...] = ()

    def to_cbor(self) -> dict[str, Any]:
        return {"revision": self.revision, "window": self.window, "round": self.round,
                "valid_round": self.valid_round, "head": self.head.to_cbor(),
                "updates": [u.to_cbor() for u in self.updates], "rejected": [u.to_cbor() for u in self.rejected]}

    @classmethod
    def from_cbor(cls, obj: Any) -> HeadProposal:
        body = f.exact_keys(obj, frozenset({"revision", "window", "round", "valid_round", "head", "updates",
                                            "rejected"}), "head-proposal")
        valid_round = None if body["valid_round"] is None else f.uint(body, "valid_round")
        updates = tuple(SignedEnvelope.from_cbor(u) for u in f.array(body, "updates", max_len=MAX_COHORT))
        rejected = tuple(SignedEnvelope.from_cbor(u) for u in f.array(body, "rejected", max_len=MAX_COHORT))
        return cls(revision=f.cid(body, "revision"), window=f.uint(body, "window"), round=f.uint(body, "round"),
                   valid_round=valid_round, head=Head.from_cbor(body["head"]), updates=updates, rejected=rejected)


SignedBody = (UpdateAnnouncement | Vote | HeadProposal | JoinRequest | LeaveRequest | Heartbeat | AdmissionRevocation
              | ReductionProposal | AuditFailure)
"""The body of a signed envelope a peer may send in a `Signed` message, decoded by `decode_body`."""

SIGNED_BODIES: dict[str, type[SignedBody]] = {cls.KIND: cls for cls in (
    UpdateAnnouncement, Vote, HeadProposal, JoinRequest, LeaveRequest, Heartbeat, AdmissionRevocation,
    ReductionProposal, AuditFailure)}

B = TypeVar("B", UpdateAnnouncement, Vote, HeadProposal, JoinRequest, LeaveRequest, Heartbeat, AdmissionRevocation,
            ReductionProposal, AuditFailure)


def decode_body(envelope: SignedEnvelope) -> SignedBody:
    """The typed body of `envelope`, decoded once by its kind (its signature is not checked here: the
    handler of the kind checks it, after the checks that may drop the message unverified).

    Raises VerificationError ``unexpected-envelope`` (a kind no peer sends in a `Signed` message) or
    ``unknown-version``, or DecodeError; for a revocation, VerificationError ``bad-revocation`` (the reason
    `check_revocation` gives every bad revocation)."""
    cls = SIGNED_BODIES.get(envelope.kind)
    if cls is None:
        raise VerificationError("unexpected-envelope", envelope.kind)
    try:
        if envelope.version != PROTOCOL_VERSION:
            raise VerificationError("unknown-version", f"{envelope.kind} v{envelope.version}")
        return cls.from_cbor(envelope.body_map())
    except (DecodeError, VerificationError) as exc:
        if cls is AdmissionRevocation:
            raise VerificationError("bad-revocation", f"{exc.reason}: {exc.detail}") from exc
        raise


def decode_as(envelope: SignedEnvelope, cls: type[B]) -> B:
    """`envelope`'s body as a `cls`, decoded through `decode_body` (its signature unchecked): for envelopes
    that do not arrive in a `Signed` message (stored, replayed, our own) and go to the handler of their kind.
    Raises VerificationError ``wrong-kind`` for another kind, else as `decode_body`."""
    if envelope.kind != cls.KIND:
        raise VerificationError("wrong-kind", f"expected {cls.KIND}, got {envelope.kind}")
    body = decode_body(envelope)
    assert isinstance(body, cls)
    return body


def open_body(envelope: SignedEnvelope, cls: type[B]) -> B:
    """`envelope`'s body as a `cls`, its kind, version and signature checked first (like
    `SignedEnvelope.open`), then decoded through `decode_body`: for envelopes carried inside another object
    or read back from a record. Raises VerificationError/DecodeError."""
    envelope.verify(cls.KIND, PROTOCOL_VERSION)
    return decode_as(envelope, cls)

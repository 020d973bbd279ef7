"""Protocol objects (spec/design.md §3-4, spec/protocol.md §2).

Each object has `to_cbor()` (a plain CBOR-ready value) and `from_cbor()` (strict: exact field sets,
typed fields, bounded lengths; DecodeError on anything else). Objects that move trust are carried in
`SignedEnvelope`s; their envelope kind is `KIND`.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs

from . import _fields as f
from .encoding import content_id, encode
from .envelope import SignedEnvelope, signing_preimage
from .errors import DecodeError, VerificationError
from .identity import Identity, PeerId

PROTOCOL_VERSION = 1
MAX_CHUNK_BYTES = 1 << 20
MAX_ARTIFACT_BYTES = 1 << 32
MAX_TENSORS = 4096
MAX_PEERS = 4096  # validators, votes
MAX_ROSTER = 16384  # trainers: roster entries and per-trainer records (a 16,384-entry head is ~700 KB)
MAX_COHORT = 4096
# A window leases every shard once and takes one update per leaseholder, so a cohort is at most the number
# of shards: bounding shards by MAX_COHORT keeps every window's cohort within what a head may hold.
MAX_SHARDS = MAX_COHORT
# Protocol names of aggregation rules and outer optimizers a manifest may choose (spec/protocol.md §7).
AGGREGATION_RULES = ("mean", "median", "trimmed_mean", "krum", "multi_krum", "centered_clip", "norm_clip")
OUTER_OPTIMIZERS = ("fedavg", "diloco")
# Update codecs a manifest may name (backends' `CODECS`; core cannot import backends, tests check they
# match) and those whose trainers keep an error-feedback residual: the biased ones (Karimireddy et al.
# 2019, arXiv 1901.09847). spec/protocol.md §6.
CODECS = ("none", "fp16", "bf16", "int8", "topk", "sign")
ERROR_FEEDBACK_CODECS = ("topk", "sign")
# Admission policies (spec/protocol.md §5): "open" rosters any joiner; "certificate" only joiners carrying
# an `AdmissionCertificate` signed by the manifest's `admission_authority`.
ADMISSION_POLICIES = ("open", "certificate")
# Screening reasons of cohort-relative outliers (the reduce task's cohort screening).
MAX_OVERLAP = 1  # the largest `overlap`: how many windows an update's base may lag its window's parent
MAX_NORM_MADS = 64  # the largest `norm_mads`: the power of a cohort's spread is a product of that many floats
OUTLIER_REASONS = frozenset({"screen-norm-outlier", "screen-cosine"})
# DiLoCo outer Nesterov momentum default (Douillard et al., arXiv 2311.08105); FedAvg has none.
DILOCO_MOMENTUM = 0.9


# --- artifacts ---------------------------------------------------------------------------------------

@attrs.frozen(kw_only=True)
class ArtifactRef:
    """Names an immutable byte string: its content id (`artifact_id`), size and per-chunk SHA-256 digests.

    The bytes are split into `chunk_size`-byte chunks (the last may be shorter); each chunk fetched from
    an untrusted peer is checked against `chunks[i]` on arrival, so a bad chunk is charged to its sender.
    """

    digest: bytes
    size: int
    chunk_size: int
    chunks: tuple[bytes, ...]

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def chunk_length(self, index: int) -> int:
        """Length in bytes of chunk `index`."""
        if not 0 <= index < len(self.chunks):
            raise IndexError(index)
        return min(self.chunk_size, self.size - index * self.chunk_size)

    def chunk_ok(self, index: int, data: bytes | memoryview) -> bool:
        """True iff `data` is exactly chunk `index` (length and SHA-256)."""
        if not 0 <= index < len(self.chunks) or len(data) != self.chunk_length(index):
            return False
        return hashlib.sha256(data).digest() == self.chunks[index]

    def to_cbor(self) -> dict[str, Any]:
        return {"digest": self.digest, "size": self.size, "chunk_size": self.chunk_size,
                "chunks": list(self.chunks)}

    @classmethod
    def from_cbor(cls, obj: Any) -> ArtifactRef:
        """Decode and check a ref, including that `digest` is the `artifact_id` of its size and chunks
        (DecodeError("bad-field") otherwise: a ref that could never be fetched is refused before any byte
        of it is, and charged to whoever signed it)."""
        body = f.exact_keys(obj, frozenset({"digest", "size", "chunk_size", "chunks"}), "artifact")
        size = f.uint(body, "size", maximum=MAX_ARTIFACT_BYTES)
        chunk_size = f.uint(body, "chunk_size", maximum=MAX_CHUNK_BYTES)
        if chunk_size == 0:
            raise DecodeError("bad-field", "chunk_size must be positive")
        expected = -(-size // chunk_size)
        chunks = f.array(body, "chunks", max_len=expected)
        if len(chunks) != expected or not all(isinstance(c, bytes) and len(c) == 32 for c in chunks):
            raise DecodeError("bad-field", f"chunks must be {expected} SHA-256 digests")
        digest = f.cid(body, "digest")
        if digest != artifact_id(size, chunk_size, chunks):
            raise DecodeError("bad-field", "artifact digest is not the id of its size and chunks")
        return cls(digest=digest, size=size, chunk_size=chunk_size, chunks=tuple(chunks))


def artifact_id(size: int, chunk_size: int, chunks: Sequence[bytes]) -> bytes:
    """The content id naming an artifact (spec/wire.md §5): the `cid` of the canonical CBOR of ``[size,
    chunk_size, [SHA-256 of each chunk]]``, one level of a Merkle tree over the chunks (as an IPFS CID
    names a node listing its children). Whoever holds a ref checks it without the bytes, and the bytes are
    hashed once, chunk by chunk, whether they are stored or fetched (spec/design.md §6, Storage)."""
    return content_id(encode([size, chunk_size, list(chunks)]))


def make_artifact_ref(data: bytes | memoryview, chunk_size: int) -> ArtifactRef:
    """Describe `data` as an artifact with `chunk_size`-byte chunks (hashes the bytes once, chunk by chunk)."""
    view = memoryview(data)
    chunks = tuple(hashlib.sha256(view[i:i + chunk_size]).digest() for i in range(0, len(view), chunk_size))
    return ArtifactRef(digest=artifact_id(len(view), chunk_size, chunks), size=len(view), chunk_size=chunk_size,
                       chunks=chunks)


# --- manifest ----------------------------------------------------------------------------------------

TensorSpec = tuple[str, str, tuple[int, ...]]
RosterEntry = tuple[PeerId, int]
PrivacyRecord = tuple[PeerId, int, float]  # a head's privacy ledger entry: (peer, DP-SGD steps, epsilon)


def roster_to_cbor(roster: Sequence[RosterEntry]) -> list[list[Any]]:
    return [[p.to_bytes(), cap] for p, cap in roster]


def roster_from_cbor(body: dict[str, Any], key: str, max_capacity: int) -> tuple[RosterEntry, ...]:
    entries = []
    for item in f.array(body, key, max_len=MAX_ROSTER):
        if not (isinstance(item, list) and len(item) == 2):
            raise DecodeError("bad-field", f"{key} entries are [peer, capacity]")
        entry = f.exact_keys({"peer": item[0], "capacity": item[1]}, frozenset({"peer", "capacity"}), key)
        entries.append((f.peer(entry, "peer"), f.uint(entry, "capacity", maximum=max_capacity)))
    if not _strictly_ascending([p for p, _ in entries]):
        raise DecodeError("bad-field", f"{key} must be sorted by peer id without duplicates")
    return tuple(entries)


def _strictly_ascending(items: Sequence[Any]) -> bool:
    """Sorted without duplicates, in one linear pass (rosters hold thousands of peers)."""
    return all(a < b for a, b in itertools.pairwise(items))


@attrs.frozen(kw_only=True)
class PrivacyParams:
    """The DP-SGD parameters a manifest fixes for every trainer (spec/protocol.md §10; Abadi et al. 2016,
    arXiv 1607.00133): each inner step Poisson-samples the leased samples with probability `sample_rate`,
    clips each per-sample gradient to L2 norm `max_grad_norm`, and adds Gaussian noise of standard deviation
    `noise_multiplier` x `max_grad_norm` to their sum. Validators account each trainer's privacy loss with
    the RDP accountant at `delta` and refuse an update that would take it past `epsilon_budget` over the
    revision (`privacy-budget`). All values are floats; DecodeError for one out of range."""

    noise_multiplier: float
    max_grad_norm: float
    delta: float
    sample_rate: float
    epsilon_budget: float

    def __attrs_post_init__(self) -> None:
        for ok, name, rule in ((0.0 < self.noise_multiplier < 1e6, "noise_multiplier", "in (0, 1e6)"),
                               (0.0 < self.max_grad_norm < 1e6, "max_grad_norm", "in (0, 1e6)"),
                               (0.0 < self.delta < 1.0, "delta", "in (0, 1)"),
                               (0.0 < self.sample_rate <= 1.0, "sample_rate", "in (0, 1]"),
                               (0.0 < self.epsilon_budget < 1e6, "epsilon_budget", "in (0, 1e6)")):
            if not ok:  # NaN fails every comparison, so it lands here too
                raise DecodeError("bad-field", f"privacy {name} must be {rule}, got {getattr(self, name)!r}")

    def to_cbor(self) -> dict[str, Any]:
        return {"noise_multiplier": self.noise_multiplier, "max_grad_norm": self.max_grad_norm,
                "delta": self.delta, "sample_rate": self.sample_rate, "epsilon_budget": self.epsilon_budget}

    @classmethod
    def from_cbor(cls, obj: Any) -> PrivacyParams:
        body = f.exact_keys(obj, _PRIVACY_KEYS, "privacy")
        return cls(**{key: f.number(body, key) for key in _PRIVACY_KEYS})


_PRIVACY_KEYS = frozenset({"noise_multiplier", "max_grad_norm", "delta", "sample_rate", "epsilon_budget"})


def byzantine_quorum(n: int) -> int:
    """Smallest quorum q of n validators with 3q > 2n (spec/agreement.md §2): tolerates n - q Byzantine."""
    return 2 * n // 3 + 1


@attrs.frozen(kw_only=True)
class Manifest:
    """A revision of an experiment, signed by the experiment's authority key (spec/design.md §4).

    Its envelope's content id is the revision id that every other object names.
    `shards[i]` is the number of samples in shard i (sample weights come from these, never from peers);
    `window_s` is the collection time of a window in seconds; FedAvg = outer SGD with `outer_lr` 1.0.
    """

    KIND: ClassVar[str] = "manifest"

    experiment: str
    workload: str
    workload_seed: int
    schema: tuple[TensorSpec, ...]
    shards: tuple[int, ...]
    validators: tuple[PeerId, ...]
    quorum: int
    window_s: float
    min_updates: int
    max_capacity: int
    aggregation: str
    outer_optimizer: str
    outer_lr: float
    chunk_size: int
    genesis_params: ArtifactRef
    genesis_params_digest: bytes
    roster: tuple[RosterEntry, ...]
    # Screening thresholds (spec/protocol.md §6). 0 disables the absolute norm bound and the cohort-relative
    # norm ratio; min_cosine -1 disables the cosine test. Cohort screening's norm bound is the larger of
    # `norm_ratio` and the cohort's spread of norms to the power `norm_mads` (median absolute deviations of the
    # log norms) times the median norm; 0 (absent from the encoding, as in revisions before the field) is the
    # fixed ratio alone.
    max_update_norm: float = 0.0
    norm_ratio: float = 10.0
    min_cosine: float = -1.0
    norm_mads: int = 6
    # Quarantine (spec/protocol.md §9): `quarantine_strikes` screening rejections within `strike_windows`
    # windows quarantine a trainer for `quarantine_windows` windows.
    quarantine_strikes: int = 3
    strike_windows: int = 5
    quarantine_windows: int = 10
    # Outer optimizer: momentum (DiLoCo: Nesterov 0.9; FedAvg: 0) and trainers' inner steps H (0 = the
    # workload's own local epochs).
    outer_momentum: float = attrs.field(
        default=attrs.Factory(lambda self: DILOCO_MOMENTUM if self.outer_optimizer == "diloco" else 0.0,
                              takes_self=True))
    inner_steps: int = 0
    # Lease expiry (spec/protocol.md §4): `lease_s` seconds after a window opens, a lease with no update
    # may be claimed by the trainer ranked second for its shards. 0 disables claims.
    lease_s: float = 0.0
    # Recomputation audits (spec/protocol.md §6, core/audit.py): validators and reducers re-run every
    # update's training and reject one whose cosine to the recomputation is below `audit_min_cosine`.
    audit: bool = False
    audit_min_cosine: float = 0.99
    # Sampled audits (spec/protocol.md §6.2): with `audit` and `audit_rate` > 0, updates are screened without
    # a replay, and after a head certifies them each cohort update is audited with probability `audit_rate`,
    # selected by the certifying head's id (`core/audit.py`); a failed audit quarantines its author in a
    # later head. 0 (absent from the encoding) keeps the inline audit of every update.
    audit_rate: float = 0.0
    # Segment audits (spec/protocol.md §6.3): with `audit_segments` S > 0 trainers commit to S checkpoints
    # of their inner loop (`UpdateAnnouncement.trajectory`) and a sampled audit replays one segment of
    # H / S inner steps instead of the whole training. 0 (absent from the encoding): whole replays.
    audit_segments: int = 0
    # Loss check (spec/protocol.md §6.1): validators and reducers compute the workload's loss with an update
    # applied and applied the opposite way on `loss_check_samples` of the author's leased samples (forward
    # passes only) and reject (`screen-loss`, not a strike) one that does not point downhill by at least
    # `loss_min_drop` (relative). 0 samples (absent from the encoding) is off.
    loss_check_samples: int = 0
    loss_min_drop: float = 0.0
    # Update codec (spec/protocol.md §6): trainers announce their delta encoded with `codec` (one of
    # `CODECS`); `codec_fraction` is top-k's kept share of each tensor's elements, in (0, 1].
    codec: str = "none"
    codec_fraction: float = 0.01
    # Admission (spec/protocol.md §5): with "certificate", a join adds its signer to the roster only with
    # an `AdmissionCertificate` for that peer signed by `admission_authority`.
    admission: str = "open"
    admission_authority: PeerId | None = None
    # Idle expiry (spec/protocol.md §5): a rostered trainer that no validator has heard from (heartbeat,
    # update or join) for `idle_windows` windows is dropped from the roster, recorded in the head's
    # `expired`. 0 disables expiry (and heartbeats); the key is then absent from the encoding, so a revision
    # without expiry encodes (and hashes) as before the field existed.
    idle_windows: int = 3
    # Liveness under Sybils (spec/protocol.md §4.1): trainers that have not yet had an update in a certified
    # cohort (a head's `unproven`) hold at most `unproven_share` of a window's shards while a proven trainer
    # is eligible (1.0: no cap; the key is then absent from the encoding), and a head adds at most
    # `max_joins` trainers to the roster (0: no limit; absent from the encoding).
    unproven_share: float = 0.25
    max_joins: int = 16
    # Overlapped windows (spec/protocol.md §5.2): a trainer may train window w from a certified head up to
    # `overlap` windows older than w - 1 (its update's base), so it starts window w + 1 as soon as it has
    # published w; the leases of window w are drawn from the head of window w - 1 - overlap. 0 (absent from
    # the encoding): every update is trained from the window's parent.
    overlap: int = 0
    # Private data and differential privacy (spec/protocol.md §10): with `private_data`, trainers that train
    # on data only they hold may join (their join says `private`; the head lists them in `private`); their
    # updates get no recomputation audit. With `privacy`, every trainer trains with DP-SGD under these
    # parameters, announces its steps, and heads keep each trainer's privacy ledger. False / None (absent
    # from the encoding): neither.
    private_data: bool = False
    privacy: PrivacyParams | None = None
    # The trainers of the genesis `roster` that train on private data (sorted; needs `private_data`; absent
    # when empty): the genesis head lists them in `private`, as a later head lists a joiner whose join says so.
    private: tuple[PeerId, ...] = ()

    def __attrs_post_init__(self) -> None:
        n = len(self.validators)
        if not 1 <= self.quorum <= n:
            raise DecodeError("bad-field", f"quorum {self.quorum} outside 1..{n}")
        if 3 * self.quorum <= 2 * n:
            # Byzantine quorums (spec/agreement.md §2): any two quorums must share an honest validator
            # while up to n - quorum validators are faulty, which needs 3 * quorum > 2 * n.
            raise DecodeError("bad-field", f"quorum {self.quorum} of {n} validators cannot be safe")
        if self.aggregation not in AGGREGATION_RULES or self.outer_optimizer not in OUTER_OPTIMIZERS:
            raise DecodeError("bad-field", f"unknown rule {self.aggregation!r} or optimizer {self.outer_optimizer!r}")
        if len(self.shards) > MAX_SHARDS:
            raise DecodeError("bad-field", f"{len(self.shards)} shards: at most {MAX_SHARDS} (the cohort limit)")
        if self.window_s <= 0 or self.min_updates < 1 or self.max_capacity < 1:
            raise DecodeError("bad-field", "window_s, min_updates and max_capacity must be positive")
        for ok, name, rule in ((self.max_update_norm >= 0, "max_update_norm", ">= 0"),
                               (self.norm_ratio >= 0, "norm_ratio", ">= 0 (0: off)"),
                               (-1.0 <= self.min_cosine <= 1.0, "min_cosine", "in [-1, 1] (-1: off)"),
                               (0.0 <= self.outer_momentum < 1.0, "outer_momentum", "in [0, 1)"),
                               (self.outer_lr > 0, "outer_lr", "> 0")):
            if not ok:  # NaN fails every comparison, so it lands here too
                raise DecodeError("bad-field", f"{name} must be {rule}, got {getattr(self, name)!r}")
        if not 0.0 <= self.lease_s < self.window_s:
            raise DecodeError("bad-field", "lease_s must be in [0, window_s)")
        if self.quarantine_strikes < 1 or self.strike_windows < 1 or self.quarantine_windows < 1:
            raise DecodeError("bad-field", "quarantine thresholds must be positive")
        if not -1.0 <= self.audit_min_cosine <= 1.0:
            raise DecodeError("bad-field", "audit_min_cosine must be in [-1, 1]")
        if self.outer_optimizer == "fedavg" and self.outer_momentum != 0.0:
            raise DecodeError("bad-field", "fedavg has no outer momentum; use diloco")
        if self.codec not in CODECS or not 0.0 < self.codec_fraction <= 1.0:
            raise DecodeError("bad-field", f"unknown codec {self.codec!r} or codec_fraction outside (0, 1]")
        if self.admission not in ADMISSION_POLICIES or \
                (self.admission == "certificate") != (self.admission_authority is not None):
            raise DecodeError("bad-field", "admission must be 'open' (no authority) or 'certificate' (an authority)")
        if self.idle_windows < 0:
            raise DecodeError("bad-field", "idle_windows must be >= 0")
        if not 0 <= self.norm_mads <= MAX_NORM_MADS:
            raise DecodeError("bad-field", f"norm_mads must be in 0..{MAX_NORM_MADS}, got {self.norm_mads!r}")
        if not 0.0 < self.unproven_share <= 1.0 or self.max_joins < 0:
            raise DecodeError("bad-field", "unproven_share must be in (0, 1] and max_joins >= 0")
        if not 0.0 <= self.audit_rate <= 1.0 or (self.audit_rate > 0.0 and not self.audit):
            raise DecodeError("bad-field", "audit_rate must be in [0, 1], and > 0 only with audit")
        if self.loss_check_samples < 0 or not 0.0 <= self.loss_min_drop < 1.0 or \
                (self.loss_min_drop > 0.0 and not self.loss_check_samples):
            raise DecodeError("bad-field", "loss_check_samples must be >= 0 and loss_min_drop in [0, 1) (and "
                                           "0 without a loss check)")
        if self.audit_segments and not (self.audit_rate > 0.0 and 1 <= self.audit_segments
                                        <= min(self.inner_steps, MAX_AUDIT_SEGMENTS)):
            raise DecodeError("bad-field", f"audit_segments needs sampled audits (audit_rate > 0) and "
                                           f"1 <= audit_segments <= min(inner_steps, {MAX_AUDIT_SEGMENTS})")
        if self.audit and self.codec in ERROR_FEEDBACK_CODECS and not self.audit_segments:
            # The error-feedback residual is private trainer state no validator can recompute, unless the
            # trainer commits to it in its trajectory (segment audits, §6.3).
            raise DecodeError("bad-field", f"audits of error-feedback codec {self.codec!r} need audit_segments")
        if not 0 <= self.overlap <= MAX_OVERLAP or (self.overlap and self.lease_s):
            # Next-ranked claims fill a lease within its window's first `lease_s` seconds; an overlapped
            # trainer trains a window before it opens, so the two do not combine.
            raise DecodeError("bad-field", f"overlap must be in 0..{MAX_OVERLAP}, and 0 with lease_s > 0")
        if self.private and (not self.private_data or not _strictly_ascending(self.private)
                             or not set(self.private) <= {p for p, _ in self.roster}):
            raise DecodeError("bad-field", "private must be sorted distinct peers of the roster, with private_data")
        if self.privacy is not None and (not self.inner_steps or self.audit_segments):
            # The accountant counts DP-SGD steps, so a window's must be fixed (H); a segment audit would
            # resume DP-SGD mid-window from a committed state, which the DP workload does not support.
            raise DecodeError("bad-field", "privacy needs inner_steps > 0 and no audit_segments")

    def to_cbor(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "experiment": self.experiment, "workload": self.workload, "workload_seed": self.workload_seed,
            "schema": [[n, d, list(s)] for n, d, s in self.schema], "shards": list(self.shards),
            "validators": [v.to_bytes() for v in self.validators], "quorum": self.quorum,
            "window_s": self.window_s, "min_updates": self.min_updates, "max_capacity": self.max_capacity,
            "aggregation": self.aggregation, "outer_optimizer": self.outer_optimizer,
            "outer_lr": self.outer_lr, "chunk_size": self.chunk_size,
            "genesis_params": self.genesis_params.to_cbor(),
            "genesis_params_digest": self.genesis_params_digest, "roster": roster_to_cbor(self.roster),
            "max_update_norm": self.max_update_norm, "norm_ratio": self.norm_ratio, "min_cosine": self.min_cosine,
            "quarantine_strikes": self.quarantine_strikes, "strike_windows": self.strike_windows,
            "quarantine_windows": self.quarantine_windows, "outer_momentum": self.outer_momentum,
            "inner_steps": self.inner_steps, "lease_s": self.lease_s, "audit": self.audit,
            "audit_min_cosine": self.audit_min_cosine, "codec": self.codec, "codec_fraction": self.codec_fraction,
            "admission": self.admission,
            "admission_authority": None if self.admission_authority is None else self.admission_authority.to_bytes(),
        }
        # Keys whose "off" value is left out, so one setting has one encoding (and older revisions keep theirs).
        if self.idle_windows:
            body["idle_windows"] = self.idle_windows
        if self.unproven_share != 1.0:
            body["unproven_share"] = self.unproven_share
        if self.max_joins:
            body["max_joins"] = self.max_joins
        if self.audit_rate:
            body["audit_rate"] = self.audit_rate
        if self.audit_segments:
            body["audit_segments"] = self.audit_segments
        if self.loss_check_samples:
            body["loss_check_samples"] = self.loss_check_samples
        if self.loss_min_drop:
            body["loss_min_drop"] = self.loss_min_drop
        if self.norm_mads:
            body["norm_mads"] = self.norm_mads
        if self.overlap:
            body["overlap"] = self.overlap
        if self.private_data:
            body["private_data"] = True
        if self.privacy is not None:
            body["privacy"] = self.privacy.to_cbor()
        if self.private:
            body["private"] = [p.to_bytes() for p in self.private]
        return body

    @classmethod
    def from_cbor(cls, obj: Any) -> Manifest:
        optional = _MANIFEST_OPTIONAL & set(obj) if isinstance(obj, dict) else set()
        body = f.exact_keys(obj, _MANIFEST_KEYS | optional, "manifest")
        idle_windows = f.uint(body, "idle_windows", maximum=1 << 16) if "idle_windows" in body else 0
        unproven_share = f.number(body, "unproven_share") if "unproven_share" in body else 1.0
        max_joins = f.uint(body, "max_joins", maximum=1 << 16) if "max_joins" in body else 0
        audit_rate = f.number(body, "audit_rate") if "audit_rate" in body else 0.0
        audit_segments = f.uint(body, "audit_segments", maximum=MAX_AUDIT_SEGMENTS) if "audit_segments" in body else 0
        loss_check_samples = f.uint(body, "loss_check_samples", maximum=1 << 20) if "loss_check_samples" in body else 0
        loss_min_drop = f.number(body, "loss_min_drop") if "loss_min_drop" in body else 0.0
        norm_mads = f.uint(body, "norm_mads", maximum=MAX_NORM_MADS) if "norm_mads" in body else 0
        overlap = f.uint(body, "overlap", maximum=MAX_OVERLAP) if "overlap" in body else 0
        private_data = f.boolean(body, "private_data") if "private_data" in body else False
        privacy = PrivacyParams.from_cbor(body["privacy"]) if "privacy" in body else None
        private = tuple(f.peer({"p": p}, "p") for p in f.array(body, "private", max_len=MAX_ROSTER)) \
            if "private" in body else ()
        if "private" in body and not private:
            raise DecodeError("bad-field", "private is absent when empty")
        if ("idle_windows" in body and idle_windows == 0) or ("unproven_share" in body and unproven_share == 1.0) \
                or ("max_joins" in body and max_joins == 0) or ("audit_rate" in body and audit_rate == 0.0) \
                or ("audit_segments" in body and audit_segments == 0) \
                or ("loss_check_samples" in body and loss_check_samples == 0) \
                or ("loss_min_drop" in body and loss_min_drop == 0.0) or ("norm_mads" in body and norm_mads == 0) \
                or ("overlap" in body and overlap == 0) or ("private_data" in body and not private_data):
            raise DecodeError("bad-field", "idle_windows, unproven_share, max_joins, audit_rate, loss_check_samples, "
                                           "loss_min_drop, norm_mads, overlap and private_data are absent when off")
        schema = []
        for item in f.array(body, "schema", max_len=MAX_TENSORS):
            if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                    and isinstance(item[1], str) and isinstance(item[2], list)
                    and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in item[2])):
                raise DecodeError("bad-field", "schema entries are [name, dtype, [dims]]")
            schema.append((item[0], item[1], tuple(item[2])))
        shards = f.array(body, "shards", max_len=MAX_SHARDS)
        if not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shards):
            raise DecodeError("bad-field", "shard sizes must be positive integers")
        validators = f.array(body, "validators", max_len=MAX_PEERS)
        max_capacity = f.uint(body, "max_capacity", maximum=64)
        return cls(
            experiment=f.text(body, "experiment"), workload=f.text(body, "workload"),
            workload_seed=f.uint(body, "workload_seed"), schema=tuple(schema), shards=tuple(shards),
            validators=tuple(f.peer({"v": v}, "v") for v in validators), quorum=f.uint(body, "quorum"),
            window_s=f.number(body, "window_s"), min_updates=f.uint(body, "min_updates"),
            max_capacity=max_capacity, aggregation=f.text(body, "aggregation"),
            outer_optimizer=f.text(body, "outer_optimizer"), outer_lr=f.number(body, "outer_lr"),
            chunk_size=f.uint(body, "chunk_size", maximum=MAX_CHUNK_BYTES),
            genesis_params=ArtifactRef.from_cbor(body["genesis_params"]),
            genesis_params_digest=f.cid(body, "genesis_params_digest"),
            roster=roster_from_cbor(body, "roster", max_capacity),
            max_update_norm=f.number(body, "max_update_norm"), norm_ratio=f.number(body, "norm_ratio"),
            min_cosine=f.number(body, "min_cosine"),
            quarantine_strikes=f.uint(body, "quarantine_strikes", maximum=1 << 16),
            strike_windows=f.uint(body, "strike_windows", maximum=1 << 16),
            quarantine_windows=f.uint(body, "quarantine_windows", maximum=1 << 20),
            outer_momentum=f.number(body, "outer_momentum"), inner_steps=f.uint(body, "inner_steps", maximum=1 << 24),
            lease_s=f.number(body, "lease_s"), audit=f.boolean(body, "audit"),
            audit_min_cosine=f.number(body, "audit_min_cosine"), codec=f.text(body, "codec"),
            codec_fraction=f.number(body, "codec_fraction"), admission=f.text(body, "admission"),
            admission_authority=None if body["admission_authority"] is None else f.peer(body, "admission_authority"),
            idle_windows=idle_windows, unproven_share=unproven_share, max_joins=max_joins,
            audit_rate=audit_rate, loss_check_samples=loss_check_samples, loss_min_drop=loss_min_drop,
            audit_segments=audit_segments, norm_mads=norm_mads, overlap=overlap, private_data=private_data,
            privacy=privacy, private=private,
        )

    def seal(self, authority: Identity) -> SignedEnvelope:
        return SignedEnvelope.seal(authority, self.KIND, PROTOCOL_VERSION, self.to_cbor())


_MANIFEST_KEYS = frozenset({
    "experiment", "workload", "workload_seed", "schema", "shards", "validators", "quorum", "window_s",
    "min_updates", "max_capacity", "aggregation", "outer_optimizer", "outer_lr", "chunk_size",
    "genesis_params", "genesis_params_digest", "roster", "max_update_norm", "norm_ratio", "min_cosine",
    "quarantine_strikes", "strike_windows", "quarantine_windows", "outer_momentum", "inner_steps",
    "lease_s", "audit", "audit_min_cosine", "codec", "codec_fraction",
    "admission", "admission_authority",
})
_MANIFEST_OPTIONAL = frozenset({"idle_windows", "unproven_share", "max_joins", "audit_rate", "loss_check_samples",
                                "loss_min_drop", "audit_segments", "norm_mads", "overlap", "private_data",
                                "privacy", "private"})  # present only when not off


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
    parameters, which must be the manifest's `inner_steps` (spec/protocol.md §10).
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
        return body

    @classmethod
    def from_cbor(cls, obj: Any) -> UpdateAnnouncement:
        keys = frozenset({"revision", "window", "base", "shards", "delta", "delta_digest", "train_loss"})
        optional = {"claim", "trajectory", "prior", "privacy_steps"} & set(obj) if isinstance(obj, dict) else set()
        body = f.exact_keys(obj, keys | optional, "update")
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
                   privacy_steps=f.uint(body, "privacy_steps", maximum=1 << 24) if "privacy_steps" in body else None)


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


MAX_REVOKED_PEERS = 64  # peers one revocation names
MAX_HEAD_REVOCATIONS = 16  # revocation envelopes one head carries
MAX_AUDIT_SEGMENTS = 64  # checkpoints one trajectory commits to


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


def check_revocation(envelope: SignedEnvelope, revision_id: bytes, manifest: Manifest) -> AdmissionRevocation:
    """The revocation in `envelope`, signed by the manifest's admission authority for revision `revision_id`;
    raises VerificationError ``bad-revocation`` (another signer, bad signature, another revision, malformed
    body)."""
    authority = manifest.admission_authority
    if authority is None or envelope.signer != authority:
        raise VerificationError("bad-revocation", "not signed by the admission authority")
    try:
        revocation = AdmissionRevocation.from_cbor(envelope.open(AdmissionRevocation.KIND, PROTOCOL_VERSION))
    except (DecodeError, VerificationError) as exc:
        raise VerificationError("bad-revocation", f"{exc.reason}: {exc.detail}") from exc
    if revocation.revision != revision_id:
        raise VerificationError("bad-revocation", "another revision")
    return revocation


@attrs.frozen(kw_only=True)
class JoinRequest:
    """A trainer asks to be put in the roster of the next head with a declared `capacity` (1..max).

    `window` is the window being collected when it asked (it asks again each window until rostered):
    validators take a join for their current window or up to 2 ahead, so an old join replayed after the
    trainer left has no effect (spec/protocol.md §5). `admission` is its admission certificate envelope
    (`AdmissionCertificate`), needed when the manifest's admission policy is "certificate"; the key is
    absent from the encoding when None. `private` says the trainer trains on data only it holds
    (spec/protocol.md §10; present, as true, only when set): validators take it only under a manifest with
    `private_data`, and the head lists the trainer in `private`.
    """

    KIND: ClassVar[str] = "join"

    revision: bytes
    window: int
    capacity: int
    admission: SignedEnvelope | None = None
    private: bool = False

    def to_cbor(self) -> dict[str, Any]:
        body: dict[str, Any] = {"revision": self.revision, "window": self.window, "capacity": self.capacity}
        if self.admission is not None:
            body["admission"] = self.admission.to_cbor()
        if self.private:
            body["private"] = True
        return body

    @classmethod
    def from_cbor(cls, obj: Any) -> JoinRequest:
        keys = frozenset({"revision", "window", "capacity"})
        optional = {"admission", "private"} & set(obj) if isinstance(obj, dict) else set()
        body = f.exact_keys(obj, keys | optional, "join")
        private = f.boolean(body, "private") if "private" in body else False
        if "private" in body and not private:
            raise DecodeError("bad-field", "join: private is absent when false")
        return cls(revision=f.cid(body, "revision"), window=f.uint(body, "window"),
                   capacity=f.uint(body, "capacity", maximum=1 << 16),
                   admission=SignedEnvelope.from_cbor(body["admission"]) if "admission" in body else None,
                   private=private)


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

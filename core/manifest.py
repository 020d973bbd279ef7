"""Protocol objects (spec/protocol.md §2), part one: the protocol's limits, artifact references and the
manifest. Imported through `core/objects.py`."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from typing import Any, ClassVar

import attrs

from . import _fields as f
from .encoding import content_id, encode
from .envelope import SignedEnvelope
from .errors import DecodeError
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
MAX_REVOKED_PEERS = 64  # peers one revocation names
MAX_HEAD_REVOCATIONS = 16  # revocation envelopes one head carries
MAX_AUDIT_SEGMENTS = 64  # checkpoints one trajectory commits to


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
    # Unauditable trainers (spec/protocol.md §6.4): with `audit`, a trainer whose training cannot be replayed
    # bit for bit (a browser peer, spec/browser.md §3) may join and announce updates that say `unauditable`;
    # those get no recomputation audit, only the checks every update gets (screening, the loss check).
    # Needs `audit`; False (absent from the encoding): a join or update that says `unauditable` under audits
    # is refused (`unauditable-not-admitted`).
    unauditable_trainers: bool = False
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
        if self.unauditable_trainers and not self.audit:
            raise DecodeError("bad-field", "unauditable_trainers needs audit (without audits every trainer is one)")
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
        if self.unauditable_trainers:
            body["unauditable_trainers"] = True
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
        unauditable = f.boolean(body, "unauditable_trainers") if "unauditable_trainers" in body else False
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
                or ("overlap" in body and overlap == 0) or ("private_data" in body and not private_data) \
                or ("unauditable_trainers" in body and not unauditable):
            raise DecodeError("bad-field", "idle_windows, unproven_share, max_joins, audit_rate, loss_check_samples, "
                                           "loss_min_drop, norm_mads, overlap, private_data and "
                                           "unauditable_trainers are absent when off")
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
            privacy=privacy, private=private, unauditable_trainers=unauditable,
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
                                "privacy", "private", "unauditable_trainers"})  # present only when not off

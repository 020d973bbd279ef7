"""Compute tasks (spec/design.md §2, "Compute"): one class per task kind the engine asks a host to run, and one per
result the host feeds back.

A role starts a task with `Engine.run_task(task, owner, work)`; the engine emits `effects.RunTask` carrying it, and
the host runs it off the engine (`adapters.compute.ComputeExecutor.run`: a `match` over `Task` ending in
`typing.assert_never`, so a new task kind fails type checking until every executor handles it) and feeds back
`events.TaskFinished` with the kind's result class, or `events.TaskFailed`. Tasks and results never leave the
node: they are not wire formats, and nothing persists them.

| task | `kind` (task ids, logs, the simulator's task times) | result |
|---|---|---|
| `TrainTask` | ``train`` | `TrainResult` |
| `ScreenTask` | ``screen`` | `ScreenResult` |
| `AuditTask` | ``audit`` | `AuditResult` |
| `AuditPlanTask` | ``audit-plan`` | `AuditPlanResult` |
| `ReduceTask` | ``reduce`` | `ReduceResult` |
| `EvaluateTask` | ``evaluate`` | `EvaluateResult` |

Artifacts are named by `ArtifactRef`; digests are 32-byte SHA-256 values (a tensor digest is
`peerloom.backends.numpy.tensors.tensor_digest`). All classes are frozen, keyword-only value objects; don't
subclass them.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from .identity import PeerId
from .objects import ArtifactRef

# --- what several tasks share ------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class EagerStart:
    """Where an overlapped update's training starts (spec/protocol.md §5.2; `core.audit.start_args`): the base's
    params moved to ``params - scale * outer_state - decode(prior)`` per element in float64, rounded once to the
    params' dtype. `prior`: the author's own earlier delta the base lacks; `outer_state`: the base's DiLoCo
    momentum (None: no state term); `scale`: ``outer_lr * outer_momentum ** 2``, or 0.0 without a state."""
    prior: ArtifactRef
    outer_state: ArtifactRef | None
    scale: float


@attrs.frozen(kw_only=True)
class Recomputation:
    """A trainer's training exactly as it had to run it, for an audit to recompute (core/audit.py): from
    `params` (moved by `start` when not None) on the samples of the leased `shards`, with `seed`
    (`core.audit.train_seed`), `inner_steps` optimizer steps (the manifest's H; 0: the workload's own epochs)
    in `window` (which fixes the global step, spec/protocol.md §5.1; None: none passed). The recomputation's
    cosine to the announced update must be at least `min_cosine`."""
    params: ArtifactRef
    shards: tuple[int, ...]
    seed: int
    window: int | None = None
    inner_steps: int = 0
    min_cosine: float
    start: EagerStart | None = None


@attrs.frozen(kw_only=True)
class LossCheck:
    """The loss check of a screen (spec/protocol.md §6.1): the workload's loss on `samples` of the author's
    leased samples (of `shards`; all when fewer), drawn with `seed` (`core.audit.loss_batch_seed`), at the base
    `params` (moved by `start` when not None) with the update applied and applied the opposite way; it passes
    when the loss drops by at least `min_drop` (a fraction of the two losses' sum)."""
    params: ArtifactRef
    shards: tuple[int, ...]
    seed: int
    samples: int
    min_drop: float
    start: EagerStart | None = None


@attrs.frozen(kw_only=True)
class SegmentPlan:
    """The committed checkpoints one segment audit needs (spec/protocol.md §6.3), read from the author's
    `Trajectory`: `start` (None: the segment starts from the base params), `stop` (the segment's end), `final`
    (the last checkpoint, whose difference to the base the delta encodes) and `residual` (the error-feedback
    residual the encoding started from; None unless the codec uses error feedback)."""
    start: ArtifactRef | None
    stop: ArtifactRef
    final: ArtifactRef
    residual: ArtifactRef | None

    def refs(self) -> tuple[ArtifactRef, ...]:
        """The artifacts named, in field order, None left out (duplicates kept)."""
        return tuple(r for r in (self.start, self.stop, self.final, self.residual) if r is not None)


@attrs.frozen(kw_only=True)
class SegmentAudit:
    """One committed segment to replay: the checkpoints of `plan`, inner steps `from_step` to `to_step`
    (``b_j``, ``b_{j+1}``: `core.audit.segment_bounds`)."""
    plan: SegmentPlan
    from_step: int
    to_step: int


@attrs.frozen(kw_only=True)
class Outlier:
    """A candidate cohort screening struck (spec/protocol.md §6): its `index` in the reduce task's `deltas`,
    `reason` (``norm-outlier`` or ``cosine``: the engine's ``screen-*`` codes without the prefix) and `detail`
    (the numbers, for humans)."""
    index: int
    reason: str
    detail: str = ""


# --- the tasks and their results ---------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class TrainTask:
    """Train on the leased `shards` from `params` (moved by `start` when not None) with `seed`
    (`core.audit.train_seed`), `inner_steps` optimizer steps (the manifest's H; 0: the workload's default) in
    `window` (the global step; None: none passed), and store the delta encoded with the manifest's codec.
    `author` is whose error-feedback residual the encoding carries (None: a shared one). With `segments` S > 0
    (segment audits, spec/protocol.md §6.3) the training state after each segment is stored too."""
    kind: ClassVar[str] = "train"
    params: ArtifactRef
    shards: tuple[int, ...]
    seed: int
    window: int | None = None
    inner_steps: int = 0
    author: PeerId | None = None
    segments: int = 0
    start: EagerStart | None = None


@attrs.frozen(kw_only=True)
class TrainResult:
    """A trained update: its `delta` artifact (the manifest's codec), `delta_digest` (tensor digest of the
    encoded tensors) and `train_loss` (the workload's). With segments: the `trajectory` artifact and every
    artifact the trainer must serve for audits (`committed`: checkpoints, residual, trajectory); else None
    and ()."""
    delta: ArtifactRef
    delta_digest: bytes
    train_loss: float
    trajectory: ArtifactRef | None = None
    committed: tuple[ArtifactRef, ...] = ()

    @property
    def unsynced(self) -> tuple[bytes, ...]:
        """The digests of what the task stored without fsync that the trainer's claim names (the delta and the
        trajectory): a host makes them durable before the claim (`ClaimRecord.artifacts`, spec/design.md §6)."""
        return (self.delta.digest,) + (() if self.trajectory is None else (self.trajectory.digest,))


@attrs.frozen(kw_only=True)
class ScreenTask:
    """Screen one announced update (spec/protocol.md §6): decode `delta` with the manifest's codec, check its
    schema, that its values are finite, its tensor digest against `delta_digest`, its L2 norm against
    `max_norm` (0.0: no bound), then the `loss_check` and the inline `audit` when not None."""
    kind: ClassVar[str] = "screen"
    delta: ArtifactRef
    delta_digest: bytes
    max_norm: float = 0.0
    loss_check: LossCheck | None = None
    audit: Recomputation | None = None


@attrs.frozen(kw_only=True)
class ScreenResult:
    """The verdict of a screen: `ok`, or the `reason` it failed (``undecodable``, ``schema``, ``non-finite``,
    ``digest-mismatch``, ``norm-bound``, ``loss``, ``audit``; "" when ok); `norm` the global L2 norm (NaN
    when undecodable, of another schema or not finite); `detail` free text (the loss check's numbers)."""
    ok: bool
    reason: str
    norm: float
    detail: str = ""


@attrs.frozen(kw_only=True)
class AuditTask:
    """A sampled audit's recomputation (spec/protocol.md §6.2) of the update whose stored delta is `delta`:
    the whole training `audit` describes, or with `segment` only that committed segment (§6.3)."""
    kind: ClassVar[str] = "audit"
    delta: ArtifactRef
    audit: Recomputation
    segment: SegmentAudit | None = None


@attrs.frozen(kw_only=True)
class AuditResult:
    """An audit's verdict: `ok`, or `reason` (``audit``, ``segment``, ``inconsistent``, ``bad-checkpoint``,
    ``undecodable``, ``schema``; "" when ok)."""
    ok: bool
    reason: str = ""


@attrs.frozen(kw_only=True)
class AuditPlanTask:
    """Read the author's stored `trajectory` (hostile bytes) and name what segment `segment` (0-based, below
    `segments`) of a segment audit needs (spec/protocol.md §6.3)."""
    kind: ClassVar[str] = "audit-plan"
    trajectory: ArtifactRef
    segment: int
    segments: int


@attrs.frozen(kw_only=True)
class AuditPlanResult:
    """The segment's `plan`, or ``ok`` False with `reason` ``bad-trajectory`` (and no plan) when the artifact
    is not a trajectory of `segments` checkpoints (with a residual exactly when the codec uses error
    feedback)."""
    ok: bool
    reason: str = ""
    plan: SegmentPlan | None = None


@attrs.frozen(kw_only=True)
class ReduceTask:
    """Cohort screening, aggregation and the outer step (spec/protocol.md §6-7) of the candidates `deltas`
    (canonical order, weighted by `weights`, sample counts) onto `params`: `rule` (the manifest's aggregation),
    `outer_optimizer` (``fedavg`` or ``diloco``) with `outer_lr`, `outer_momentum` and the parent head's
    `outer_state` (None: zeros); cohort screening with `norm_ratio` (0.0: off), `min_cosine` (-1.0: off) and
    `norm_mads` (0: the fixed ratio alone)."""
    kind: ClassVar[str] = "reduce"
    params: ArtifactRef
    deltas: tuple[ArtifactRef, ...]
    weights: tuple[int, ...]
    rule: str
    outer_optimizer: str
    outer_lr: float
    outer_momentum: float = 0.9
    outer_state: ArtifactRef | None = None
    norm_ratio: float = 0.0
    min_cosine: float = -1.0
    norm_mads: int = 0


@attrs.frozen(kw_only=True)
class ReduceResult:
    """The reduction: new `params` and their tensor digest, the new optimizer state (`outer_state`, its digest;
    None under FedAvg or when nothing was kept), the cohort screening's `outliers` (by candidate index) and the
    candidate indices `kept` (ascending). With nothing kept, `params` are the task's own."""
    params: ArtifactRef
    params_digest: bytes
    outer_state: ArtifactRef | None = None
    outer_state_digest: bytes | None = None
    outliers: tuple[Outlier, ...] = ()
    kept: tuple[int, ...] = ()


@attrs.frozen(kw_only=True)
class EvaluateTask:
    """Evaluate the head params `params` on the workload's test data."""
    kind: ClassVar[str] = "evaluate"
    params: ArtifactRef


@attrs.frozen(kw_only=True)
class EvaluateResult:
    """Every metric the workload reports, by name, in its order (``loss`` and ``accuracy`` for the bundled
    workloads; 1 to 63 of them); heads carry each as ``test_<name>``."""
    metrics: dict[str, float]


Task = TrainTask | ScreenTask | AuditTask | AuditPlanTask | ReduceTask | EvaluateTask
"""Every compute task an engine asks for (`effects.RunTask.task`)."""

TaskResult = TrainResult | ScreenResult | AuditResult | AuditPlanResult | ReduceResult | EvaluateResult
"""What a finished task gives back (`events.TaskFinished.result`): the result class of its kind."""

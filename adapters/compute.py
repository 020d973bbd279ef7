"""Executes the engine's `RunTask` effects with a backend workload and the artifact store.

Task kinds and their results are the classes of `peerloom.core.tasks` (`ComputeExecutor.run`). Tensors cross the store
as safetensors bytes (never pickle); results name the artifacts they stored.

Update codecs (spec/protocol.md §6): a trainer's delta artifact is the manifest's `codec` encoding of its
pseudo-gradient (`peerloom.backends.numpy.codecs`); screening, reduction and audits decode it against the
manifest's schema. For the biased codecs (`ERROR_FEEDBACK_CODECS`: top-k, sign) the trainer keeps an
error-feedback residual per trainer across windows. Given a `state_dir` (a node's store), the executor
keeps it on disk too (`residual-<peer id>.safetensors`, written atomically after every encoding), so a
restarted trainer carries on with what earlier windows dropped instead of losing it; a file whose
tensors do not match the manifest's schema is ignored.

Compute backends (node config key ``compute``): ``"numpy"`` (the default) or ``"torch"`` runs screening
statistics, cohort screening, aggregation and the outer optimizer step; the two produce the same bytes
(`peerloom.backends._robust`; tests/backends/test_aggregation.py, tests/backends/test_outer.py), so
validators with either agree on every head. Tensors stay float32 numpy arrays on the CPU between tasks
(the torch backend works on CPU tensors sharing or copying their memory); codecs decode with numpy in both.
Training and evaluation run wherever the workload runs (its device).

Compute threads (node config key ``compute_threads``): the kernels of screening, aggregation and the outer
step run on that many threads (`peerloom.backends._robust.Workspace`; default `default_compute_threads`,
the machine's cores up to `peerloom.backends._robust.MAX_THREADS`; 1 runs them on the task's own thread).
The bytes are the same on any count (spec/design.md §5 "Threads never change the bytes").

Private-data trainers (spec/protocol.md §10; node config key ``data``): the node builds the executor with
`shards` from `peerloom.backends.sharding.private_shards_for` (a lease is a sample count of the trainer's own
data) and a `seed_key`, and every train task then trains with `private_seed` of the public train seed
instead of the seed itself: noise and sampling drawn from a public seed could be recomputed by anyone
(spec/privacy.md §1), and nobody replays a private update, so nothing needs to reproduce them.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Protocol, assert_never

import numpy as np

from peerloom.backends._robust import MAX_THREADS, median_of
from peerloom.backends.numpy import codecs as np_codecs
from peerloom.backends.numpy import reduce as np_reduce
from peerloom.backends.numpy.aggregate import aggregate, outer_step, screening_stats, workspace
from peerloom.backends.numpy.screening import schema_matches, screen_stored
from peerloom.backends.numpy.stored import StoredTensors, TensorFileWriter, open_stored, stored_digest
from peerloom.backends.numpy.tensors import (
    from_safetensors,
    safetensors_parts,
    safetensors_views,
    schema_of,
    tensor_digest,
    to_safetensors,
)
from peerloom.backends.workload import LossCheckable, Resumable, Workload, has, streams_delta, takes_step
from peerloom.core.encoding import decode, encode
from peerloom.core.errors import DecodeError, VerificationError
from peerloom.core.identity import PeerId
from peerloom.core.objects import ERROR_FEEDBACK_CODECS, ArtifactRef, Manifest, Trajectory
from peerloom.core.tasks import (
    AuditPlanResult,
    AuditPlanTask,
    AuditResult,
    AuditTask,
    EagerStart,
    EvaluateResult,
    EvaluateTask,
    LossCheck,
    Outlier,
    Recomputation,
    ReduceResult,
    ReduceTask,
    ScreenResult,
    ScreenTask,
    SegmentAudit,
    SegmentPlan,
    Task,
    TaskResult,
    TrainResult,
    TrainTask,
)

from .storage import ArtifactStore, atomic_write

COMPUTE_BACKENDS = ("numpy", "torch")
APPLY_BLOCK = 1 << 20  # elements per block when a streamed delta is applied (`ComputeExecutor._applied`)
MAX_EVAL_METRICS = 63
"""A head holds at most 64 metrics (spec/wire.md): the workload's, as ``test_<name>``, and ``train_loss``."""


def default_compute_threads() -> int:
    """The machine's cores (``os.cpu_count()``), at most `peerloom.backends._robust.MAX_THREADS`."""
    return max(1, min(os.cpu_count() or 1, MAX_THREADS))


class NumpyCompute:
    """Screening statistics, aggregation and outer steps on numpy arrays (`peerloom.backends.numpy.aggregate`),
    their kernels on `threads` threads. ValueError unless ``1 <= threads <= MAX_THREADS``."""

    name = "numpy"

    def __init__(self, threads: int = 1) -> None:
        if not 1 <= threads <= MAX_THREADS:
            raise ValueError(f"compute threads must be in [1, {MAX_THREADS}], got {threads}")
        self.threads = threads

    def aggregate(self, rule: str, deltas: list[dict[str, np.ndarray]], weights: list[int]) -> dict[str, np.ndarray]:
        return aggregate(rule, deltas, weights, threads=self.threads)

    streams = True
    """Takes `peerloom.backends.numpy.stored` tensors (read and written block by block) for any tensor dict."""

    def outer(self, optimizer: str, params: dict[str, np.ndarray], centre: dict[str, np.ndarray],
              state: dict[str, np.ndarray] | None, lr: float, momentum: float, *, out: dict[str, Any] | None = None,
              out_state: dict[str, Any] | None = None) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
        if optimizer == "fedavg":
            return np_reduce.outer_sgd_step(params, centre, lr, out=out, threads=self.threads), None
        return outer_step(optimizer, params, centre, state, lr=lr, momentum=momentum, out=out, out_state=out_state,
                          threads=self.threads)

    def stats(self, delta: dict[str, np.ndarray], reference: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
        return screening_stats(delta, reference=reference, threads=self.threads)


class TorchCompute(NumpyCompute):
    """The same on torch CPU tensors (`peerloom.backends.torch.aggregate`, `.reduce`), byte for byte; numpy in,
    numpy out. Needs torch (ImportError otherwise)."""

    name = "torch"
    streams = False  # torch kernels take whole torch tensors

    def __init__(self, threads: int = 1) -> None:
        super().__init__(threads)
        import torch

        from peerloom.backends.torch import aggregate as torch_aggregate
        from peerloom.backends.torch import reduce as torch_reduce

        self._torch, self._aggregate, self._reduce = torch, torch_aggregate, torch_reduce

    def _in(self, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
        # from_numpy shares memory; a read-only array (decoded from bytes) is copied first, never written.
        return {n: self._torch.from_numpy(a if a.flags.writeable else a.copy()) for n, a in tensors.items()}

    @staticmethod
    def _out(tensors: dict[str, Any]) -> dict[str, np.ndarray]:
        return {n: t.numpy() for n, t in tensors.items()}

    def aggregate(self, rule: str, deltas: list[dict[str, np.ndarray]], weights: list[int]) -> dict[str, np.ndarray]:
        return self._out(self._aggregate.aggregate(rule, [self._in(d) for d in deltas], weights, threads=self.threads))

    def outer(self, optimizer: str, params: dict[str, np.ndarray], centre: dict[str, np.ndarray],
              state: dict[str, np.ndarray] | None, lr: float, momentum: float, *, out: dict[str, Any] | None = None,
              out_state: dict[str, Any] | None = None) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
        if out is not None or out_state is not None:  # `streams` is False: the executor never hands it any
            raise ValueError("torch compute returns new tensors: it takes no out or out_state")
        if optimizer == "fedavg":
            return self._out(self._reduce.outer_sgd_step(self._in(params), self._in(centre), lr,
                                                         threads=self.threads)), None
        new, new_state = self._aggregate.outer_step(optimizer, self._in(params), self._in(centre),
                                                    None if state is None else self._in(state), lr=lr,
                                                    momentum=momentum, threads=self.threads)
        return self._out(new), None if new_state is None else self._out(new_state)

    def stats(self, delta: dict[str, np.ndarray], reference: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
        return self._aggregate.screening_stats(self._in(delta),
                                               reference=None if reference is None else self._in(reference),
                                               threads=self.threads)


def compute_backend(name: str, threads: int = 1) -> NumpyCompute:
    """The compute backend called `name` (one of `COMPUTE_BACKENDS`), its kernels on `threads` threads.
    ValueError for another name or a thread count outside [1, MAX_THREADS]; ImportError for ``"torch"``
    without torch installed."""
    if name == "numpy":
        return NumpyCompute(threads)
    if name == "torch":
        return TorchCompute(threads)
    raise ValueError(f"compute must be one of {', '.join(COMPUTE_BACKENDS)}, got {name!r}")


class Store(Protocol):
    """Where `ComputeExecutor` reads and writes tensors as artifacts: an `ArtifactStore` (files on disk, which the
    numpy backend reads and writes block by block: `ComputeExecutor._streams`) or the simulator's in-memory
    `sim.disk.SimDisk`. `put_parts` stores the concatenation of `parts`; ``durable=False`` may skip the fsyncs
    (spec/design.md §6, Storage)."""

    def has(self, digest: bytes) -> bool: ...
    def get(self, digest: bytes) -> bytes: ...
    def put(self, data: bytes | memoryview) -> ArtifactRef: ...
    def put_parts(self, parts: Sequence[bytes | memoryview], *, durable: bool = True) -> ArtifactRef: ...


SINK_BLOCK = 1 << 20
"""Elements per block when a streamed pseudo-gradient is written into its artifact (`_train_streamed`)."""


class ComputeExecutor:
    """Runs the compute tasks (`peerloom.core.tasks`: train, screen, audit, audit-plan, reduce, evaluate)
    synchronously (hosts put it on a worker thread), with `workload` (a `peerloom.backends.workload.Workload`;
    None for an executor that only reduces and screens without a loss check or audit).

    `compute` picks the backend of screening statistics, aggregation and outer steps (``"numpy"`` or
    ``"torch"``, module docstring) and `compute_threads` how many threads their kernels run on (None:
    `default_compute_threads`); training and evaluation are the workload's. `shards` maps a shard number to
    the workload's sample indices. `seed_key` (a private-data trainer's: its identity's private seed, 32
    bytes) makes train tasks use `private_seed` (module docstring); None trains with the task's seed.
    """

    def __init__(self, store: Store, manifest: Manifest, workload: Workload | None,
                 shards: Sequence[Sequence[int]], *, state_dir: Path | None = None, compute: str = "numpy",
                 compute_threads: int | None = None, seed_key: bytes | None = None) -> None:
        self.store = store
        self.manifest = manifest
        self.workload = workload  # None: an executor that only screens without a loss check or audit, and reduces
        self.shards = shards
        self.seed_key = seed_key
        self.state_dir = state_dir
        self.compute = compute_backend(compute, default_compute_threads() if compute_threads is None
                                       else compute_threads)
        # Error-feedback residual per trainer (its peer id; None when the task names none), across windows.
        self.residuals: dict[PeerId | None, np_codecs.ErrorFeedback] = {}
        self._params: tuple[bytes, dict[str, np.ndarray]] | None = None  # `load_params`
        self._start: tuple[Any, dict[str, np.ndarray]] | None = None  # `start_params`
        self._scratch: dict[str, np.ndarray] | None = None  # `_applied`
        # Seconds of the last task's parts, where its kind names some (`run_timed`)
        self.parts: dict[str, float] = {}

    def _residual_path(self, author: PeerId | None) -> Path | None:
        if self.state_dir is None or author is None:
            return None
        return self.state_dir / f"residual-{author.to_text()}.safetensors"

    def _load_residual(self, author: PeerId | None) -> np_codecs.ErrorFeedback | None:
        """The residual `author` left on disk, if it matches the manifest's schema (our own file)."""
        path = self._residual_path(author)
        if path is None or not path.exists():
            return None
        try:
            tensors = from_safetensors(path.read_bytes())
        except (OSError, ValueError, DecodeError):
            return None
        expected = {name: tuple(shape) for name, _, shape in self.manifest.schema}
        if {n: tuple(t.shape) for n, t in tensors.items()} != expected or \
                any(t.dtype != np.float32 for t in tensors.values()):
            return None
        return np_codecs.ErrorFeedback(tensors)

    def _save_residual(self, author: PeerId | None, state: np_codecs.ErrorFeedback) -> None:
        path = self._residual_path(author)
        if path is not None:
            atomic_write(path, to_safetensors(state.residual))

    def load(self, ref: ArtifactRef) -> dict[str, np.ndarray]:
        """The stored artifact's tensors: read-only views into its bytes, read once (no parse copy)."""
        return safetensors_views(self.store.get(ref.digest))

    def load_mapped(self, ref: ArtifactRef) -> dict[str, np.ndarray]:
        """`load` from a read-only memory map of the file where the store is on disk (`ArtifactStore.map`): nothing
        copied or allocated up front (`load_params`: a head's params, read by several tasks). An input read once
        is better streamed (`open`): a mapped file's touched pages count in this process's RSS."""
        if isinstance(self.store, ArtifactStore):
            return safetensors_views(self.store.map(ref.digest))
        return self.load(ref)

    def load_params(self, ref: ArtifactRef) -> dict[str, np.ndarray]:
        """`load_mapped` of a params artifact, kept until another is loaded or a start is computed
        (`start_params`; spec/design.md §5, Memory): an auditing validator replays every update of a window
        from the same params, one mapping instead of one per task. Content-addressed and read-only, so a kept
        copy is never stale."""
        if self._params is None or self._params[0] != ref.digest:
            self._params = None  # drop the old one before reading the next
            self._params = (ref.digest, self.load_mapped(ref))
        return self._params[1]

    def start_params(self, params_ref: ArtifactRef, start: EagerStart | None) -> dict[str, np.ndarray]:
        """The params a training, a loss check or an audit starts from: `params_ref`'s (`load_params`), or
        with a `start` (`core.audit.start_args`, an overlapped update with a prior; spec/protocol.md §5.2)
        ``params - scale * outer_state - decode(prior delta)``: per element in float64, in that order,
        rounded once to the params' dtype, into a buffer this executor reuses. The last one is kept, as
        `load_params` keeps its params (a screen's loss check and audit start from the same point). Its
        inputs are read block by block from their files where the store streams (`open`): a model size
        each, read once, that would otherwise sit in memory (or, mapped, in this process's RSS) beside it. The
        params `load_params` kept are let go of first."""
        if start is None:
            return self.load_params(params_ref)
        state_ref = start.outer_state
        key = (params_ref.digest, start.prior.digest, None if state_ref is None else state_ref.digest,
               float(start.scale))
        if self._start is not None and self._start[0] == key:
            return self._start[1]
        buffers = self._start[1] if self._start is not None else {}
        self._start = None
        # The start takes the kept params' place: mapped and touched, they are a model size of RSS, so they go
        # first and the params are read from their file (in the page cache if they were mapped), never the two
        # model sizes side by side.
        self._params = None
        with ExitStack() as stack:
            params = self.open(params_ref, stack)
            prior, state = self._start_inputs(start, stack)
            out = eager_start(params, state, prior, float(start.scale), out=buffers, threads=self.compute.threads)
        self._start = (key, out)
        return out

    def loss_base(self, check: LossCheck, stack: ExitStack) -> dict[str, Any]:
        """The params a loss check applies the update to (spec/protocol.md §6.1), for reading block by block
        where the store streams (`_streams`): the params kept by `load_params` if they are `check.params`'s,
        else their file (`open`), and with a `check.start` each tensor a `StartTensor` over the start's inputs,
        so no model-size start is held (a lossy prior is decoded whole). Elsewhere `start_params`."""
        if not self._streams():
            return self.start_params(check.params, check.start)
        params = self._params[1] if self._params is not None and self._params[0] == check.params.digest else \
            self.open(check.params, stack)
        start = check.start
        if start is None:
            return params
        prior, state = self._start_inputs(start, stack)
        return {name: StartTensor(p, None if state is None else state[name], prior[name], float(start.scale),
                                  p.shape, p.dtype) for name, p in params.items()}

    def _start_inputs(self, start: EagerStart, stack: ExitStack) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """(prior, outer state) of an eager start, read block by block where the store streams (`open`); a
        lossy prior is loaded and decoded whole."""
        encoded = self.open(start.prior, stack) if self.manifest.codec == "none" else self.load(start.prior)
        state = None if start.outer_state is None else self.open(start.outer_state, stack)
        return self._decode(encoded), state

    def _streams(self) -> bool:
        """Whether tasks read and write stored tensors block by block (spec/design.md §5, Memory): the numpy
        backend over an `ArtifactStore` on disk (not the simulator's in-memory disk)."""
        return self.compute.streams and isinstance(self.store, ArtifactStore)

    def open(self, ref: ArtifactRef, stack: ExitStack) -> dict[str, Any]:
        """The stored artifact's tensors for the backend's kernels: `open_stored` file tensors, closed with
        `stack`, where the backend streams (`_streams`); else loaded whole (`load`). VerificationError(
        "corrupt-artifact") when the file's size is not the artifact's."""
        if self._streams():
            assert isinstance(self.store, ArtifactStore)
            if not self.store.has(ref.digest):
                raise KeyError(ref.digest.hex())
            path = self.store.path_of(ref.digest)
            if path.stat().st_size != ref.size:
                raise VerificationError("corrupt-artifact", f"{ref.digest.hex()}: not {ref.size} bytes")
            stored = open_stored(path)
            if stored is not None:
                return stack.enter_context(stored)
        return self.load(ref)

    def writer(self, schema: Any, stack: ExitStack) -> tuple[TensorFileWriter, Any] | None:
        """A `TensorFileWriter` of `schema` into a new artifact of the store (aborted with `stack` unless
        committed), or None where outputs are built in memory (no streaming, or no fixed header)."""
        size = TensorFileWriter.file_size(schema) if self._streams() else None
        if size is None:
            return None
        assert isinstance(self.store, ArtifactStore)  # `_streams`
        artifact = self.store.open_writer(size)
        stack.callback(artifact.abort)
        writer = TensorFileWriter(schema, artifact.write)
        stack.callback(writer.close)  # before the abort: no write may reach a closed (or reused) descriptor
        return writer, artifact

    @staticmethod
    def digest(tensors: dict[str, Any]) -> bytes:
        """`tensor_digest` of loaded or stored (`open`) tensors."""
        return stored_digest(tensors) if isinstance(tensors, StoredTensors) else tensor_digest(tensors)

    def save(self, tensors: dict[str, np.ndarray]) -> tuple[ArtifactRef, bytes]:
        """Store `tensors` as safetensors, written and hashed from the arrays' own memory where the
        container allows (`safetensors_parts`; else serialized first). Returns (ref, tensor digest)."""
        return self._store_state(tensors), tensor_digest(tensors)

    def run_timed(self, task: Task) -> tuple[TaskResult, dict[str, float]]:
        """`run`, and the seconds of the task's parts (the host's ``task-done`` line carries them): for a train
        task ``start`` (where its training starts from: `start_params`), ``training`` (the workload's, the
        checkpoints it stores included) and ``store`` (encoding and storing the delta, the residual and the
        trajectory); empty for other tasks and a streamed train task."""
        self.parts = {}
        return self.run(task), self.parts

    def run(self, task: Task) -> TaskResult:
        """Run one task (a `core.tasks` class) and return its kind's result class; raises on failure (the host
        turns that into TaskFailed): KeyError for an artifact the store lacks, ValueError for a workload
        that misbehaves, VerificationError for a stored file of the wrong size, OSError from the store."""
        match task:
            case TrainTask():
                return self._train_task(task)
            case ScreenTask():
                with ExitStack() as stack:
                    return self._screen_task(task, stack)
            case ReduceTask():
                with ExitStack() as stack:
                    return self._reduce(task, stack)
            case EvaluateTask():
                # Mapped for this task only (kept ones are used): loss checks read the head's params block by
                # block (`loss_base`), and a mapping kept until the next head would be a model size of RSS.
                held = self._params
                params = held[1] if held is not None and held[0] == task.params.digest else \
                    self.load_mapped(task.params)
                return EvaluateResult(metrics=self._evaluate(params))
            case AuditTask():
                return self._audit_task(task)
            case AuditPlanTask():
                return self._audit_plan(task)
            case _:
                assert_never(task)

    def _workload(self) -> Workload:
        """The workload tasks train and evaluate with; ValueError for an executor built without one."""
        if self.workload is None:
            raise ValueError("this compute executor has no workload (it reduces and screens only)")
        return self.workload

    def train_seed(self, seed: int) -> int:
        """The seed a train task passes to the workload: `seed` itself, or `private_seed` of it under the
        executor's `seed_key` (a private-data trainer)."""
        return int(seed) if self.seed_key is None else private_seed(self.seed_key, int(seed))

    def _train_task(self, task: TrainTask) -> TrainResult:
        """The ``train`` task: train, encode (error feedback for biased codecs), store the delta. With
        ``segments`` S > 0 (segment audits, spec/protocol.md §6.3) the workload's whole training state after
        each segment is stored as a checkpoint artifact, the residual the encoding starts from too, and both
        are committed in a `Trajectory` artifact: result ``trajectory`` (its ref) and ``committed`` (every
        artifact the trainer must serve: checkpoints 1..S, the residual, the trajectory)."""
        inner_steps, segments = task.inner_steps, task.segments
        if not segments and self._streams_train() and task.start is None:
            with ExitStack() as stack:
                return self._train_streamed(task, stack)
        began = time.perf_counter()
        params = self.start_params(task.params, task.start)
        started = time.perf_counter()
        checkpoints: list[ArtifactRef] = []
        if segments:
            def keep(j: int, state: dict[str, np.ndarray]) -> None:
                checkpoints.append(self._store_state(state, durable=False))
            indices = [i for s in task.shards for i in self.shards[s]]
            delta, metrics = self._workload().train(params, indices, self.train_seed(task.seed),
                                                 inner_steps=inner_steps,
                                                 checkpoints=segments, on_checkpoint=keep,
                                                 **self._global_step(task.window, inner_steps))
            if len(checkpoints) != segments:
                raise ValueError(f"the workload took {len(checkpoints)} checkpoints, not {segments}")
        else:
            delta, metrics = self._train(params, task.shards, self.train_seed(task.seed), inner_steps, task.window)
        trained = time.perf_counter()
        author = task.author
        residual = None
        if segments and self.manifest.codec in ERROR_FEEDBACK_CODECS:
            state = self._residual_of(author, delta)
            residual = self._store_state(state.residual, durable=False)
        # Stored without fsync, off the critical path: the trainer's claim makes the delta and the trajectory
        # durable before it is written (`ClaimRecord.artifacts`, spec/design.md §6, Storage).
        ref, digest = self._store_volatile(self._encode(delta, author))
        train_loss = float(metrics["train_loss"])
        if not segments:
            self.parts = _parts(began, started, trained)
            return TrainResult(delta=ref, delta_digest=digest, train_loss=train_loss)
        trajectory = self.store.put_parts(
            [encode(Trajectory(checkpoints=tuple(checkpoints), residual=residual).to_cbor())], durable=False)
        committed = (*checkpoints, *([residual] if residual is not None else []), trajectory)
        self.parts = _parts(began, started, trained)
        return TrainResult(delta=ref, delta_digest=digest, train_loss=train_loss, trajectory=trajectory,
                           committed=committed)

    def _streams_train(self) -> bool:
        """Whether a train task streams its head and pseudo-gradient (spec/pools.md §6): the workload takes a
        ``sink`` (a sharded trainer pool, ``STREAMS_DELTA``), the delta is stored as trained (codec none) and
        the store streams (`_streams`)."""
        return streams_delta(self.workload) and self.manifest.codec == "none" and self._streams()

    def _train_streamed(self, task: TrainTask, stack: ExitStack) -> TrainResult:
        """The ``train`` task of a sharded pool: the head is read from its file one tensor at a time (`open`)
        and the pseudo-gradient written into a new artifact one tensor at a time, in blocks, as the pool's
        rank 0 gathers it, so this process never holds the whole model (spec/pools.md §6). The artifact is
        committed only when the pool's task returned; a failed task aborts it (`writer`'s stack): an update
        built from some ranks' shards is never stored, let alone announced."""
        workload = self._workload()
        inner_steps = task.inner_steps
        params = self.open(task.params, stack)
        made = self.writer(workload.schema(), stack)
        if made is None:
            raise ValueError("this schema's safetensors bytes are not streamed (several dtypes or odd names)")
        writer, artifact = made

        def sink(name: str, array: np.ndarray) -> None:
            flat, values = writer.tensors[name].reshape(-1), array.reshape(-1)
            for start in range(0, values.size, SINK_BLOCK):
                flat[start:start + SINK_BLOCK][...] = values[start:start + SINK_BLOCK]

        indices = [i for s in task.shards for i in self.shards[s]]
        options = {"inner_steps": inner_steps, **self._global_step(task.window, inner_steps)} \
            if inner_steps > 0 else {}
        _, metrics = workload.train(params, indices, self.train_seed(task.seed), sink=sink, **options)
        digest = writer.finish()
        return TrainResult(delta=artifact.commit(), delta_digest=digest, train_loss=float(metrics["train_loss"]))

    def _store_volatile(self, tensors: dict[str, np.ndarray]) -> tuple[ArtifactRef, bytes]:
        """`save` without fsync, the tensor digest hashed on a second thread while the store hashes the chunks
        and writes them (hashlib releases the GIL): a trainer's delta, which its claim makes durable later."""
        digests: list[bytes] = []
        failed: list[BaseException] = []

        def digest() -> None:
            try:
                digests.append(tensor_digest(tensors))
            except BaseException as exc:  # handed to the caller's thread below
                failed.append(exc)

        thread = threading.Thread(target=digest, name="tensor-digest")
        thread.start()
        try:
            ref = self._store_state(tensors, durable=False)
        finally:
            thread.join()
        if failed:
            raise failed[0]
        return ref, digests[0]

    def _store_state(self, tensors: dict[str, np.ndarray], *, durable: bool = True) -> ArtifactRef:
        """Store tensors (`save` without the tensor digest); ``durable=False`` for a trainer's checkpoints
        and residual copy: a crash before its audit only costs that audit, never what it signed."""
        parts = safetensors_parts(tensors)
        if parts is None:
            return self.store.put(to_safetensors(tensors))
        return self.store.put_parts(parts) if durable else self.store.put_parts(parts, durable=False)

    def _audit_plan(self, task: AuditPlanTask) -> AuditPlanResult:
        """The ``audit-plan`` task of a segment audit (spec/protocol.md §6.3): read the author's stored
        `Trajectory` (hostile input: decoded with a size bound) and name the artifacts segment `task.segment`
        needs (`SegmentPlan`: start None for segment 0, which starts from the base params), or ok False with
        reason ``bad-trajectory`` when it is not a trajectory of `task.segments` checkpoints (with a residual
        exactly when the codec uses error feedback)."""
        segments, j = task.segments, task.segment
        try:
            trajectory = Trajectory.from_cbor(decode(self.store.get(task.trajectory.digest), max_bytes=1 << 24))
        except (DecodeError, VerificationError):
            return AuditPlanResult(ok=False, reason="bad-trajectory")
        if len(trajectory.checkpoints) != segments or \
                (trajectory.residual is not None) != (self.manifest.codec in ERROR_FEEDBACK_CODECS):
            return AuditPlanResult(ok=False, reason="bad-trajectory")
        plan = SegmentPlan(start=trajectory.checkpoints[j - 1] if j > 0 else None, stop=trajectory.checkpoints[j],
                           final=trajectory.checkpoints[-1], residual=trajectory.residual)
        return AuditPlanResult(ok=True, plan=plan)

    def _screen_task(self, task: ScreenTask, stack: ExitStack) -> ScreenResult:
        """The ``screen`` task: decode, screen, check the tensor digest and the norm bound, the loss check,
        audit. A delta in the ``none`` codec is read block by block where the backend streams (`open`), once
        for the statistics, the digest and the update applied of the loss check (`screen_stored`), then
        once more for the opposite side."""
        try:
            encoded = self.open(task.delta, stack) if self.manifest.codec == "none" else self.load(task.delta)
            delta = self._decode(encoded)
        except DecodeError:
            return ScreenResult(ok=False, reason="undecodable", norm=float("nan"))
        loss_check = task.loss_check
        applied = base = None
        if not schema_matches(delta, self.manifest.schema):
            ok, reason, norm = False, "schema", float("nan")
        elif isinstance(encoded, StoredTensors):  # the none codec, streamed: one read for all of it
            base = None if loss_check is None else self.loss_base(loss_check, stack)
            applied = None if base is None else self._scratch_for(base)
            stats, digest = screen_stored(encoded, base=base, applied=applied, threads=self.compute.threads)
            ok, reason, norm = self._verdict(stats)
            if ok and digest != task.delta_digest:
                ok, reason = False, "digest-mismatch"
        else:
            ok, reason, norm = self._verdict(self.compute.stats(delta))
            if ok and self.digest(encoded) != task.delta_digest:
                ok, reason = False, "digest-mismatch"
        max_norm = float(task.max_norm)
        if ok and max_norm > 0.0 and not norm <= max_norm:
            ok, reason = False, "norm-bound"
        detail = ""
        if ok and loss_check is not None:
            ok, reason, detail = self._loss_check(delta, loss_check, applied, base)
        if ok and task.audit is not None:
            ok, reason = self._audit(delta, task.audit)
        return ScreenResult(ok=ok, reason=reason, norm=norm, detail=detail)

    def _loss_check(self, delta: dict[str, Any], check: LossCheck, applied_params: dict[str, np.ndarray] | None = None,
                    base: dict[str, Any] | None = None) -> tuple[bool, str, str]:
        """The loss check (spec/protocol.md §6.1): the workload's loss on a batch of the author's leased
        samples at the base params with the decoded `delta` applied (``applied = base - delta``) and with
        it applied the opposite way (``opposite = base + delta``); forward passes only. (ok, reason
        ``loss``, detail) - ok iff both are finite and ``opposite - applied >= min_drop * (opposite +
        applied)`` with ``applied < opposite``: the update points downhill on its own data. Comparing the
        two sides cancels the second-order term an honest update that overshoots pays on both, which a
        before/after comparison charges it (spec §6.1 gives the measurement).

        The batch is ``check.samples`` of the lease's sample indices (all when fewer), drawn without
        replacement by ``np.random.default_rng(check.seed)`` (the update's `loss_batch_seed`), in lease
        order. A workload without ``loss`` raises AttributeError (a task failure, never a strike).
        `applied_params`: ``base - delta`` already computed into this executor's buffer (`screen_stored`);
        `base`: the params the update is applied to, as `loss_base` gave them (None: `start_params`)."""
        batch = loss_check_batch([i for s in check.shards for i in self.shards[s]], check.samples, check.seed)
        params = self.start_params(check.params, check.start) if base is None else base
        if applied_params is None:
            applied_params = self._applied(params, delta, -1.0)
        workload = self._workload()
        if not has(workload, LossCheckable):
            raise AttributeError(f"the workload {type(workload).__name__} has no loss (the loss check needs it)")
        applied = float(workload.loss(applied_params, batch))
        opposite = float(workload.loss(self._applied(params, delta, 1.0), batch))
        detail = f"loss {applied:.6g} applied, {opposite:.6g} opposite, on {len(batch)} samples"
        ok = loss_check_passes(applied, opposite, float(check.min_drop))
        return ok, "" if ok else "loss", detail

    @staticmethod
    def _verdict(stats: dict[str, Any]) -> tuple[bool, str, float]:
        """(ok, reason, norm) of a delta of the manifest's schema from its screening statistics: ``non-finite``,
        else ok with the global L2 norm (the backends' lane-summed float64 norm, equal on numpy and torch);
        norm NaN when not ok."""
        if not stats["finite"]:
            return False, "non-finite", float("nan")
        return True, "", float(stats["global_norm"])

    def _evaluate(self, params: dict[str, np.ndarray]) -> dict[str, float]:
        """Every metric the workload's ``evaluate`` reports, as a float by its name (``loss`` and ``accuracy``
        for the bundled workloads; heads carry each as ``test_<name>``). ValueError for more than
        `MAX_EVAL_METRICS` metrics, a name that is not a non-empty string, or a value that is not a number."""
        metrics = self._workload().evaluate(params)
        if not 1 <= len(metrics) <= MAX_EVAL_METRICS:
            raise ValueError(f"a workload reports 1 to {MAX_EVAL_METRICS} metrics, got {len(metrics)}")
        out: dict[str, float] = {}
        for name, value in metrics.items():
            if not isinstance(name, str) or not name or isinstance(value, bool):
                raise ValueError(f"metric {name!r}: {value!r} is not a named number")
            out[name] = float(value)
        return out

    def _global_step(self, window: int | None, inner_steps: int) -> dict[str, int]:
        """``{"step": (window - 1) * inner_steps}``, the run's global step when window `window` starts training
        (spec/protocol.md §5.1), for a workload that takes it (`takes_step`: `TorchWorkload`, its LR schedule
        spans windows); ``{}`` for other workloads, FedAvg's local epochs (`inner_steps` 0) or no window."""
        if not takes_step(self.workload) or not window or inner_steps <= 0:
            return {}
        return {"step": (window - 1) * inner_steps}

    def _train(self, params: dict[str, np.ndarray], shards: Sequence[int], seed: int,
               inner_steps: int, window: int | None = None) -> tuple[dict[str, np.ndarray], Mapping[str, Any]]:
        """The workload's training on the leased `shards`, exactly as a trainer must run it.

        `inner_steps` > 0 is the manifest's H: exactly that many optimizer steps (DiLoCo); 0 leaves the
        workload's own local epochs. Shared by ``train`` and the audit, so audits recompute exactly what
        trainers ran.
        """
        indices = [i for s in shards for i in self.shards[s]]
        if inner_steps <= 0:
            return self._workload().train(params, indices, seed)
        return self._workload().train(params, indices, seed, inner_steps=inner_steps,
                                   **self._global_step(window, inner_steps))

    def _residual_of(self, author: PeerId | None, delta: dict[str, np.ndarray]) -> np_codecs.ErrorFeedback:
        """The error-feedback residual `author`'s next encoding starts from (in memory, on disk, or zeros)."""
        state = self.residuals.get(author) or self._load_residual(author)
        if state is None:
            state = self.residuals[author] = np_codecs.zeros_state(delta)
        return state

    def _encode(self, delta: dict[str, np.ndarray], author: PeerId | None) -> dict[str, np.ndarray]:
        """`delta` in the manifest's codec; error feedback (the author's residual) for biased codecs."""
        codec = self.manifest.codec
        if codec == "none":
            return delta
        state = self._residual_of(author, delta) if codec in ERROR_FEEDBACK_CODECS else None
        encoded, new_state = np_codecs.encode(codec, delta, state, fraction=self.manifest.codec_fraction)
        if new_state is not None:
            self.residuals[author] = new_state
            self._save_residual(author, new_state)
        return encoded

    def _decode(self, encoded: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The pseudo-gradient an encoded delta artifact carries (hostile input: DecodeError on anything
        malformed; the manifest's schema bounds every allocation)."""
        codec = self.manifest.codec
        if codec == "none":
            return encoded
        return np_codecs.decode(codec, encoded, schema=self.manifest.schema)

    def _audit(self, delta: dict[str, np.ndarray], audit: Recomputation) -> tuple[bool, str]:
        """Recompute the author's training (core/audit.py) and compare: (ok, reason).

        `delta` is the announced update, decoded. The recomputation goes through the same codec (encode,
        decode; no error feedback: a manifest refuses audits with an error-feedback codec), so an honest
        update reproduces it. Their cosine (`screening_stats`, float64 sums over all tensors) must be at least
        ``audit.min_cosine``; an honest update on the same platform reproduces bit for bit, and on
        another platform stays within floating-point drift of 1.
        """
        expected, _ = self._train(self.start_params(audit.params, audit.start), audit.shards, audit.seed,
                                  audit.inner_steps, audit.window)
        if self.manifest.codec != "none":
            encoded, _ = np_codecs.encode(self.manifest.codec, expected, fraction=self.manifest.codec_fraction)
            expected = self._decode(encoded)
        # The backends' screening statistics: float64 lane sums in reused buffers, equal on numpy and torch.
        stats = self.compute.stats(delta, reference=expected)
        cosine = stats["cosine"]
        if math.isnan(cosine):  # a zero norm on one side: only "both zero" reproduces
            cosine = 1.0 if stats["global_norm"] == 0.0 and self.compute.stats(expected)["global_norm"] == 0.0 else 0.0
        return (True, "") if cosine >= float(audit.min_cosine) else (False, "audit")

    def _applied(self, params: dict[str, Any], delta: dict[str, Any], sign: float) -> dict[str, np.ndarray]:
        """``params + sign * delta`` (`sign` -1: the update applied, +1: the opposite way) in float32, written
        into a buffer this executor reuses for every loss check (a fresh model-size allocation per update is
        what costs here). `delta` and `params` may be read block by block (`open`'s file tensors, `loss_base`'s
        `StartTensor`). The result is valid until the next call."""
        combine = np.subtract if sign < 0 else np.add
        scratch = self._scratch_for(params)
        for name, base in params.items():
            out, d = scratch[name], delta[name]
            if isinstance(d, np.ndarray) and isinstance(base, np.ndarray):
                combine(base, d, out=out, dtype=np.float32)
                continue
            flat_out, flat_base, flat_d = out.reshape(-1), base.reshape(-1), d.reshape(-1)
            for start in range(0, flat_out.size, APPLY_BLOCK):
                stop = min(start + APPLY_BLOCK, flat_out.size)
                combine(flat_base[start:stop], flat_d[start:stop], out=flat_out[start:stop], dtype=np.float32)
        return scratch

    def _scratch_for(self, params: dict[str, Any]) -> dict[str, np.ndarray]:
        """This executor's float32 buffer of `params`' names and shapes, allocated once and reused by every
        loss check (`_applied`, `screen_stored`); valid until the next call."""
        shapes = {n: p.shape for n, p in params.items()}
        if self._scratch is None or {n: t.shape for n, t in self._scratch.items()} != shapes:
            self._scratch = None  # drop the old one before allocating the next
            self._scratch = {n: np.empty(shape, np.float32) for n, shape in shapes.items()}
        return self._scratch

    def _audit_task(self, task: AuditTask) -> AuditResult:
        """The ``audit`` task of a sampled audit (spec/protocol.md §6.2): decode the stored delta and recompute
        it, whole (`_audit`) or, with `task.segment`, one committed segment (`_audit_segment`). Result: ok,
        or reason ``audit``, ``segment``, ``inconsistent``, ``bad-checkpoint``, ``undecodable`` or
        ``schema``. Where the backend streams, an uncompressed delta and the committed checkpoints
        but the segment's start are read block by block (the memory of a validator auditing a large model)."""
        with ExitStack() as stack:
            try:
                encoded = self.open(task.delta, stack) if self.manifest.codec == "none" else self.load(task.delta)
                delta = self._decode(encoded)
            except DecodeError:
                return AuditResult(ok=False, reason="undecodable")
            if not schema_matches(delta, self.manifest.schema):
                return AuditResult(ok=False, reason="schema")
            if task.segment is None:
                ok, reason = self._audit(delta, task.audit)
            else:
                ok, reason = self._audit_segment(encoded, delta, task.audit, task.segment, stack)
            return AuditResult(ok=ok, reason=reason)

    def _checkpoint(self, ref: ArtifactRef, like: dict[str, Any] | None,
                    stack: ExitStack | None) -> dict[str, Any] | None:
        """A committed checkpoint's tensors, streamed (`open`) with `stack`, else loaded whole: the params of
        the manifest's schema (float32, exact shapes) and its training state, of the same names, dtypes and
        shapes as `like` when given; None when it is not such a state."""
        try:
            state = self.open(ref, stack) if stack is not None else self.load(ref)
        except (DecodeError, VerificationError, ValueError, KeyError):
            return None
        params = {n: state[n] for n, _, _ in self.manifest.schema if n in state}
        if len(params) != len(self.manifest.schema) or not schema_matches(params, self.manifest.schema):
            return None
        if like is not None and {n: (t.dtype, tuple(t.shape)) for n, t in state.items()} != \
                {n: (t.dtype, tuple(t.shape)) for n, t in like.items()}:
            return None
        return state

    def _audit_segment(self, encoded: dict[str, Any], delta: dict[str, Any], audit: Recomputation,
                       segment: SegmentAudit, stack: ExitStack) -> tuple[bool, str]:
        """Replay one committed segment and check that the trajectory ends in the announced delta
        (spec/protocol.md §6.3). ``segment.plan``: start (checkpoint ref, None = the base params), stop, final
        (checkpoint refs), residual (ref or None); from_step / to_step (inner-step bounds). (ok, reason):

        - ``bad-checkpoint``: a checkpoint is not a state of this workload's layout;
        - ``inconsistent``: the announced delta is not the manifest's codec of ``base - final params`` (plus
          the committed residual under error feedback), bit for bit;
        - ``segment``: the replay from `start` does not reach `stop` (`_moved_alike`).
        """
        plan = segment.plan
        base = self.start_params(audit.params, audit.start)
        stop = self._checkpoint(plan.stop, None, stack)
        final = stop if plan.final == plan.stop else self._checkpoint(plan.final, stop, stack)
        if stop is None or final is None:
            return False, "bad-checkpoint"
        names = [n for n, _, _ in self.manifest.schema]
        codec = self.manifest.codec
        if codec == "none":
            consistent = all(np.array_equal(np.subtract(b, f, dtype=np.float32), d)
                             for n in names for b, f, d in _blocks(base[n], final[n], delta[n]))
        else:
            expected = {n: np.subtract(base[n], _whole(final[n]), dtype=np.float32) for n in names}
            state = None
            if codec in ERROR_FEEDBACK_CODECS:
                residual = None if plan.residual is None else self._checkpoint(plan.residual, None, None)
                if residual is None or set(residual) != set(expected):
                    return False, "inconsistent"
                state = np_codecs.ErrorFeedback({n: np.array(t, dtype=np.float32) for n, t in residual.items()})
            expected, _ = np_codecs.encode(codec, expected, state, fraction=self.manifest.codec_fraction)
            consistent = set(expected) == set(encoded) and all(np.array_equal(expected[n], encoded[n])
                                                               for n in expected)
            del expected
        if not consistent:
            return False, "inconsistent"
        start = base if plan.start is None else self._checkpoint(plan.start, stop, None)
        if start is None:
            return False, "bad-checkpoint"
        indices = [i for s in audit.shards for i in self.shards[s]]
        workload = self._workload()
        if not has(workload, Resumable):
            raise AttributeError(f"the workload {type(workload).__name__} cannot resume (segment audits need it)")
        replayed = workload.resume(dict(start), indices, audit.seed, inner_steps=audit.inner_steps,
                                        start=segment.from_step, stop=segment.to_step,
                                        **self._global_step(audit.window, audit.inner_steps))
        if set(replayed) != set(stop):
            return False, "segment"
        alike = _moved_alike(start, stop, replayed, names, float(audit.min_cosine))
        return (True, "") if alike else (False, "segment")

    def _reduce(self, task: ReduceTask, stack: ExitStack) -> ReduceResult:
        """Cohort screening, then aggregation and the outer optimizer step (spec/protocol.md §6-7).

        The candidates (canonical order) are screened against each other: the robust centre is their
        coordinate-wise median; a candidate whose L2 norm exceeds the larger of ``norm_ratio`` and the
        cohort's spread to the power ``norm_mads`` times the median norm is an outlier (``norm-outlier``),
        else one whose cosine to the centre is below ``min_cosine`` is (``cosine``): `cohort_outliers`. The
        rest are aggregated with the manifest's rule and the outer optimizer applied: FedAvg (SGD, lr
        `outer_lr`) or DiLoCo (Nesterov momentum `outer_momentum`, state = the parent head's `outer_state`
        artifact or zeros). Result (`ReduceResult`): params, params_digest, outer_state (ArtifactRef or None),
        outer_state_digest, outliers (`Outlier`: candidate index, reason, detail, the numbers) and kept
        (candidate indices reduced).

        Memory (spec/design.md §5): where the backend streams (`open`, `writer`), the params, the optimizer state and
        the deltas (``none`` codec) are read block by block from their files and the new params and state
        are written block by block into new artifacts, hashed on the way, so the task holds about one model
        size (the aggregate) whatever the cohort. Otherwise the inputs are views of their stored bytes,
        dropped once used: about five model sizes.
        """
        read = (lambda ref: self.open(ref, stack)) if self.manifest.codec == "none" else self.load
        deltas = [self._decode(read(ref)) for ref in task.deltas]
        weights = list(task.weights)
        outliers = tuple(Outlier(index=int(i), reason=str(reason), detail=str(rest[0]) if rest else "")
                         for i, reason, *rest in cohort_outliers(self.compute, deltas, float(task.norm_ratio),
                                                                 float(task.min_cosine), int(task.norm_mads)))
        bad = {o.index for o in outliers}
        kept = tuple(i for i in range(len(deltas)) if i not in bad)
        if not kept:
            return ReduceResult(params=task.params, params_digest=self.digest(self.open(task.params, stack)),
                                outliers=outliers, kept=kept)
        centre = self.compute.aggregate(task.rule, [deltas[i] for i in kept], [weights[i] for i in kept])
        del deltas
        params = self.open(task.params, stack)
        optimizer = task.outer_optimizer
        if optimizer not in ("fedavg", "diloco"):
            raise ValueError(f"unknown outer optimizer {optimizer!r}")
        schema = schema_of(centre)
        new_writer = self.writer(schema, stack)
        state_writer = self.writer(schema, stack) if optimizer == "diloco" and new_writer is not None else None
        state = None
        if optimizer == "diloco" and task.outer_state is not None:
            state = self.open(task.outer_state, stack)
        new, new_state = self.compute.outer(
            optimizer, params, centre, state, task.outer_lr,
            task.outer_momentum if optimizer == "diloco" else 0.0,
            out=None if new_writer is None else new_writer[0].tensors,
            out_state=None if state_writer is None else state_writer[0].tensors)
        del params, centre, state
        outer_state: ArtifactRef | None = None
        outer_state_digest: bytes | None = None
        if new_state is not None:
            if state_writer is None:
                outer_state, outer_state_digest = self.save(new_state)
            else:
                outer_state_digest = state_writer[0].finish()
                outer_state = state_writer[1].commit()
            del new_state
        if new_writer is None:
            new_params, params_digest = self.save(new)
        else:
            params_digest = new_writer[0].finish()
            new_params = new_writer[1].commit()
        return ReduceResult(params=new_params, params_digest=params_digest, outer_state=outer_state,
                            outer_state_digest=outer_state_digest, outliers=outliers, kept=kept)


MIN_SCREEN_COHORT = 3
"""Fewer candidates than this are never cohort outliers (spec/protocol.md §6): two have their mean as median."""


def _parts(began: float, started: float, trained: float) -> dict[str, float]:
    """A train task's parts (`ComputeExecutor.run_timed`) from its `time.perf_counter` marks, ending now."""
    return {"start": round(started - began, 4), "training": round(trained - started, 4),
            "store": round(time.perf_counter() - trained, 4)}


def eager_start(params: Mapping[str, Any], state: Mapping[str, Any] | None, prior: Mapping[str, Any],
                scale: float, *, out: dict[str, np.ndarray] | None = None, threads: int = 1) -> dict[str, np.ndarray]:
    """Where an overlapped update with a prior starts (spec/protocol.md §5.2): ``params - scale * state - prior``
    per element in float64, in that order (the state's term left out when `state` is None), rounded once to each
    tensor's dtype. Tensors of `out` of the right shape and dtype are written in place (and returned); the others
    are allocated. Same names, shapes and dtypes in, as the manifest's schema fixes them; the inputs are numpy
    arrays or stored `FileTensor` objects (read a block at a time, each thread into its own buffer). Blocks are shared
    among `threads` threads (`peerloom.backends.numpy.aggregate.workspace`: numpy releases the GIL); each
    element's arithmetic is its own, so the bytes are the same on any count."""
    result: dict[str, np.ndarray] = {}
    # Elements per float64 pass: a model-sized float64 temporary would be twice the model, and each thread keeps
    # two passes' buffers in its workspace for good (16 MiB at this size); large enough that a thread reacquires
    # the GIL rarely (400 times at 100M parameters): beside a busy event loop each numpy call can wait for it.
    block = 1 << 20
    jobs: list[tuple[Any, Any, Any, np.ndarray]] = []
    for name, p in params.items():
        buf = None if out is None else out.get(name)
        if buf is None or buf.shape != p.shape or buf.dtype != p.dtype:
            buf = np.empty(p.shape, dtype=p.dtype)
        jobs.append((p.reshape(-1), prior[name].reshape(-1), None if state is None else state[name].reshape(-1),
                     buf.reshape(-1)))
        result[name] = buf
    spans = [(j, i) for j, (flat_p, *_) in enumerate(jobs) for i in range(0, flat_p.size, block)]
    ws = workspace(threads)

    def part(k: int, space: Any) -> None:
        x, y = space.get("start-x", 0, block), space.get("start-y", 0, block)
        for j, i in spans[k::ws.threads]:
            flat_p, flat_prior, flat_state, flat_out = jobs[j]
            n = min(block, flat_p.size - i)
            start_block(flat_p[i:i + n], None if flat_state is None else flat_state[i:i + n], flat_prior[i:i + n],
                        scale, x[:n], y[:n], flat_out[i:i + n])

    ws.parallel(part, sum(job[0].size for job in jobs))
    return result


def start_block(params: np.ndarray, state: np.ndarray | None, prior: np.ndarray, scale: float, x: np.ndarray,
                y: np.ndarray, out: np.ndarray) -> None:
    """One block of `eager_start` (``params - scale * state - prior``, float64, rounded once) into `out`, with
    float64 scratch `x` and `y` of its length: the one place this arithmetic is written, so a start computed
    whole and one computed block by block (`StartTensor`) are the same bytes."""
    # the casts to float64 happen inside each ufunc (exact), so every step is one float64 operation
    if state is not None:
        np.multiply(state, scale, out=y, dtype=np.float64)
        np.subtract(params, y, out=x, dtype=np.float64)
    else:
        np.copyto(x, params, casting="unsafe")
    np.subtract(x, prior, out=x, dtype=np.float64)
    np.copyto(out, x, casting="unsafe")


class StartTensor:
    """One tensor of an eager start (`eager_start`, spec/protocol.md §5.2) that is never held whole: a flat
    ``[start:stop]`` slice computes that block from the block of each input (numpy arrays or stored
    `FileTensor` views, read then) into a buffer of the slicing thread, valid until its next slice, as a
    `FileTensor` slice is. A validator's loss check reads its base twice this way (the update applied, then
    the opposite way) instead of keeping a model-size start beside its scratch. `shape`: the tensor's;
    `reshape` gives only the flat view (``-1``)."""

    def __init__(self, params: Any, state: Any, prior: Any, scale: float, shape: tuple[int, ...],
                 dtype: np.dtype) -> None:
        self.params, self.state, self.prior = params.reshape(-1), None if state is None else state.reshape(-1), \
            prior.reshape(-1)
        self.scale, self.shape, self.dtype = scale, tuple(shape), np.dtype(dtype)
        self.size = int(np.prod(shape, dtype=np.int64)) if shape else 1
        self._local = threading.local()  # .buffers: this thread's (x, y, out)

    def reshape(self, *shape: Any, **_: Any) -> StartTensor:
        want = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if tuple(want) not in ((-1,), (self.size,)):
            raise ValueError(f"a StartTensor only reshapes to flat, not {want}")
        return self

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a StartTensor is sliced flat and contiguously: t[a:b]")
        start, stop, _ = key.indices(self.size)
        count = max(0, stop - start)
        buffers = getattr(self._local, "buffers", None)
        if buffers is None or buffers[2].size < count:
            buffers = self._local.buffers = (np.empty(count, np.float64), np.empty(count, np.float64),
                                             np.empty(count, self.dtype))
        x, y, out = (b[:count] for b in buffers)
        start_block(self.params[start:stop], None if self.state is None else self.state[start:stop],
                    self.prior[start:stop], self.scale, x, y, out)
        return out

    def __array__(self, *_: Any, **__: Any) -> np.ndarray:
        raise TypeError("a StartTensor is computed block by block; slice it")


def norm_spread(norms: Sequence[float], median_norm: float) -> float:
    """The cohort's spread of norms (spec/protocol.md §6): the median over candidates of ``max(n / m, m / n)``
    (``m`` the median norm, a zero norm against a positive ``m`` counting as infinite), >= 1; of an even
    count the geometric mean of the two middle values. ``log`` of it is the median absolute deviation of the
    log norms, computed with correctly rounded operations only (division, product, square root), so every
    validator gets the same float64."""
    spreads = sorted(max(n, median_norm) / min(n, median_norm) if min(n, median_norm) > 0.0 else
                     (1.0 if n == median_norm else math.inf) for n in norms)
    mid = len(spreads) // 2
    return spreads[mid] if len(spreads) % 2 else math.sqrt(spreads[mid - 1] * spreads[mid])


def cohort_outliers(compute: NumpyCompute, deltas: Sequence[dict[str, Any]], norm_ratio: float,
                    min_cosine: float, norm_mads: int = 0) -> list[list[Any]]:
    """Cohort screening (spec/protocol.md §6) of candidate deltas in canonical order, as the ``reduce`` task
    runs it: ``[[candidate index, reason, detail]]`` in index order, reason ``norm-outlier`` or ``cosine``
    (the engine's ``screen-*`` codes without the prefix) and detail the numbers.

    The robust centre is the candidates' coordinate-wise median (`compute`'s ``median``). A candidate whose
    global L2 norm (float64 lane sums, equal on numpy and torch) exceeds ``factor`` times the median norm
    ``m`` is a ``norm-outlier``, with ``factor = max(norm_ratio, spread ** norm_mads)`` (`norm_spread`; the
    power by repeated multiplication): in log space the bound is the median log norm plus the larger of
    ``log(norm_ratio)`` and ``norm_mads`` median absolute deviations of the log norms, so a cohort whose
    honest norms are spread widely is not cut at a fixed ratio. ``norm_mads`` 0 is the fixed ratio alone.
    Else one whose cosine to the centre is below ``min_cosine`` is a ``cosine`` outlier. ``norm_ratio`` 0 and
    ``min_cosine`` -1 switch the tests off; fewer than `MIN_SCREEN_COHORT` candidates are never outliers. A
    deterministic function of the candidates and the thresholds, invariant under their order, so validators
    re-run it to check a proposal (spec §7)."""
    if len(deltas) < MIN_SCREEN_COHORT or (norm_ratio <= 0.0 and min_cosine <= -1.0):
        return []
    centre = compute.aggregate("median", list(deltas), [1] * len(deltas))
    stats = [compute.stats(d, reference=centre) for d in deltas]
    norms = [s["global_norm"] for s in stats]
    median_norm = median_of(norms)
    factor, why = norm_ratio, f"norm_ratio {norm_ratio:g}"
    if norm_ratio > 0.0 and norm_mads > 0:
        spread = norm_spread(norms, median_norm)
        power = 1.0
        for _ in range(norm_mads):
            power *= spread
        if power > factor:
            factor = power
            why = f"spread {spread:.4g} ** norm_mads {norm_mads} (norm_ratio {norm_ratio:g})"
        else:
            why += f" (spread {spread:.4g} ** norm_mads {norm_mads} = {power:.4g})"
    outliers: list[list[Any]] = []
    for i, s in enumerate(stats):
        norm, threshold = s["global_norm"], factor * median_norm
        if norm_ratio > 0.0 and norm > threshold:
            ratio = norm / median_norm if median_norm > 0.0 else math.inf
            outliers.append([i, "norm-outlier", f"norm {norm:.6g} is {ratio:.4g} x the cohort's median norm "
                                                f"{median_norm:.6g}; threshold {factor:.4g} x = {threshold:.6g} "
                                                f"from {why}"])
        elif min_cosine > -1.0 and s["cosine"] == s["cosine"] and s["cosine"] < min_cosine:
            outliers.append([i, "cosine", f"cosine {s['cosine']:.4g} to the cohort's coordinate-wise median, "
                                          f"below min_cosine {min_cosine:g}"])
    return outliers


PRIVATE_SEED_CONTEXT = b"peerloom/private-seed/v1"


def private_seed(key: bytes, seed: int) -> int:
    """A private-data trainer's train seed (spec/protocol.md §10, spec/privacy.md §1): the first 8 bytes,
    big-endian, of HMAC-SHA256 keyed with `key` (the trainer's identity private seed, 32 bytes) over
    ``b"peerloom/private-seed/v1"`` followed by the public train seed `seed` as 8 bytes big-endian. Only the
    key's holder can compute it, so the noise and batch sampling it draws are secret; a 64-bit int in
    ``[0, 2**64)``. OverflowError for a `seed` outside ``[0, 2**64)``."""
    message = PRIVATE_SEED_CONTEXT + int(seed).to_bytes(8, "big")
    return int.from_bytes(hmac.new(key, message, hashlib.sha256).digest()[:8], "big")


def loss_check_batch(lease: Sequence[int], samples: int, seed: int) -> list[int]:
    """The loss check's batch (spec/protocol.md §6.1): `samples` of the lease's sample indices (all when
    fewer), drawn without replacement by ``np.random.default_rng(seed)`` (the update's `loss_batch_seed`),
    kept in lease order."""
    indices = np.asarray(lease, dtype=np.int64)
    if len(indices) > samples:
        indices = indices[np.sort(np.random.default_rng(seed).choice(len(indices), samples, replace=False))]
    return indices.tolist()


def loss_check_passes(applied: float, opposite: float, min_drop: float) -> bool:
    """The loss check's verdict (spec/protocol.md §6.1) from the batch's loss with the update applied and
    applied the opposite way: both finite, ``applied < opposite`` and ``opposite - applied >= min_drop *
    (opposite + applied)``."""
    return math.isfinite(applied) and math.isfinite(opposite) and applied < opposite and \
        opposite - applied >= min_drop * (opposite + applied)


STEP_SUFFIX = "step"


def _blocks(*tensors: Any) -> Any:
    """Aligned flat blocks of same-sized tensors, numpy arrays or streamed `FileTensor` objects alike: tuples
    of numpy views of at most `APPLY_BLOCK` elements (a streamed block is valid until the next one)."""
    flats = [t.reshape(-1) for t in tensors]
    size = flats[0].size
    for start in range(0, size, APPLY_BLOCK):
        stop = min(start + APPLY_BLOCK, size)
        yield tuple(flat[start:stop] for flat in flats)


def _whole(tensor: Any) -> np.ndarray:
    """A tensor in memory: a numpy array as it is, a streamed `FileTensor` read whole (its own copy)."""
    if isinstance(tensor, np.ndarray):
        return tensor
    return np.array(tensor.reshape(-1)[0:tensor.size], copy=True).reshape(tensor.shape)


def _moved_alike(start: dict[str, Any], committed: dict[str, Any], replayed: dict[str, Any], params: list[str],
                 min_cosine: float) -> bool:
    """Whether a replayed segment moved the params as the committed one did: counters (state names ending
    in ``step``) equal, and the cosine between ``committed - start`` and ``replayed - start`` over the
    `params` at least `min_cosine` (float32 differences, dot products summed in float64); two segments that
    did not move at all agree. The rest of the state (optimizer moments) is not compared: a fabricated one
    makes the next segment's replay miss its committed end instead. `committed` may be streamed."""
    for name, end in committed.items():
        if name.endswith(STEP_SUFFIX) and not np.array_equal(_whole(end), np.asarray(replayed[name])):
            return False
    dot = a2 = b2 = 0.0
    for name in params:
        for origin, end, ours in _blocks(np.asarray(start[name], dtype=np.float32), committed[name],
                                         np.asarray(replayed[name], dtype=np.float32)):
            a = np.subtract(end, origin, dtype=np.float32)
            b = np.subtract(ours, origin, dtype=np.float32)
            dot += float(np.dot(a, b))
            a2 += float(np.dot(a, a))
            b2 += float(np.dot(b, b))
    if a2 == 0.0 or b2 == 0.0:
        return a2 == b2
    return math.isfinite(dot) and dot / math.sqrt(a2 * b2) >= min_cosine

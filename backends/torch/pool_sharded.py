"""One train task on a sharded trainer pool: FSDP2 or a pipeline of stages, so that a model larger than one
device trains as one peer (spec/pools.md §6 "Sharded pools" and §7 "Pipelined pools").

`pool_train_sharded` runs on every rank, in lockstep, inside the group `peerloom.adapters.pool` formed. Both
modes keep a model of their own per process, built once per group from ``workload.model_factory`` on the
``meta`` device (no memory) and materialised only where this rank holds it; the workload's own whole model
is then released (`shed_whole_model`): a sharded pool's ranks never hold the whole model.

- **fsdp** (``torch.distributed.fsdp.fully_shard``): every module that owns parameters is one FSDP unit, then
  the root; rank r holds rows ``[r*c, (r+1)*c)`` of every parameter's dim 0 (``c = ceil(rows / N)``, FSDP2's
  ``Shard(0)``), its gradient and its inner-optimizer state. The ranks split every global batch as the DDP
  pool does (`peerloom.backends.torch.pool.rank_batch`); FSDP2 reduce-scatters the mean gradient.
- **pipeline** (``torch.distributed.pipelining``): the model is an ``nn.Sequential`` cut into N stages at
  named children (the split points; by default balanced by parameter count); rank r holds stage r, its
  gradients and optimizer state. Every global batch goes through the stages whole, in micro-batches, with
  GPipe or 1F1B; the micro-batch losses are scaled by their count (``scale_grads``), so the gradient is the
  batch's mean gradient. Gradient clipping uses the norm over all stages (one all_reduce).

Head params in, pseudo-gradient out, one tensor at a time (never the whole model on one rank): rank 0
reads each head tensor (a numpy array, or a `peerloom.backends.numpy.stored.FileTensor` read from the store)
and scatters its shards (fsdp) or sends it to its stage (pipeline); after training, the closing all_gather
of ``(loss sum, samples)`` checks that every rank finished, then rank 0 gathers each tensor's shards (or
receives it from its stage), subtracts it from the head and hands the float32 delta to ``sink(name, array)``
in name order, or collects a dict. A rank that dies or hangs fails a collective on rank 0, so the task
raises before it returns: an update is never built from some ranks' shards (spec/pools.md §4).
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from peerloom.backends.numpy.tensors import TensorDict
from peerloom.backends.torch.pool import _close, _group_info, lease_batches, rank_batch, restore_optimizer
from peerloom.backends.torch.workload import _move

__all__ = ["PARALLEL_MODES", "SCHEDULES", "pool_train_sharded", "shard_rows", "shed_whole_model", "stage_bounds"]

PARALLEL_MODES = ("ddp", "fsdp", "pipeline")
"""``[pool] parallel``: ``ddp`` replicates the model (spec/pools.md §2), the others shard it (§6, §7)."""
SCHEDULES = ("gpipe", "1f1b")
"""``[pool] schedule`` of a pipelined pool: ``torch.distributed.pipelining.ScheduleGPipe`` or ``Schedule1F1B``."""

Sink = Callable[[str, np.ndarray], None]


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of a dim 0 of `rows` that rank `rank` of `world` holds under FSDP2's
    ``Shard(0)`` (``torch.chunk``: ``c = ceil(rows / world)`` rows each, the last ranks fewer or none)."""
    chunk = -(-rows // world)
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


def stage_bounds(model: nn.Module, stages: int, split_points: Sequence[str] | None = None) -> list[tuple[int, int]]:
    """The ``[start, stop)`` child indices of each of `stages` pipeline stages of an ``nn.Sequential``.

    `split_points`: the names of the children where stages 1..N-1 begin (``stages - 1`` names, in order);
    None splits the children into contiguous runs of about equal parameter counts. ValueError for a model
    that is not an ``nn.Sequential``, fewer children than stages, or split points that are not children in
    increasing order (a stage would be empty)."""
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"a pipelined pool splits an nn.Sequential at its children, not a {type(model).__name__}")
    names = [name for name, _ in model.named_children()]
    if len(names) < stages:
        raise ValueError(f"a model of {len(names)} children cannot make {stages} pipeline stages")
    if split_points is not None:
        if len(split_points) != stages - 1 or any(p not in names for p in split_points):
            raise ValueError(f"split_points must name {stages - 1} of the children {names}, got {list(split_points)}")
        starts = [0, *(names.index(p) for p in split_points)]
        if starts != sorted(set(starts)):
            raise ValueError(f"split_points {list(split_points)} must be increasing children after the first")
    else:  # stage s begins at the first child where the parameters before it reach s/N of the total
        sizes = [sum(p.numel() for p in child.parameters()) for child in model.children()]
        before = np.cumsum([0, *sizes])
        starts = [0]
        for s in range(1, stages):
            at = int(np.searchsorted(before, s * before[-1] / stages))
            starts.append(min(max(at, starts[-1] + 1), len(names) - (stages - s)))  # no stage left empty
    return list(zip(starts, [*starts[1:], len(names)], strict=True))


def shed_whole_model(workload: Any) -> None:
    """Release the workload's own whole model on this rank (its tensors move to the ``meta`` device): a
    sharded pool trains its own sharded model, and a rank that kept the whole one would hold a model size
    for nothing. The workload then only trains through the pool (its ``evaluate`` and ``loss`` need the
    model back: a pool is a trainer's, which runs train tasks only, spec/pools.md §1)."""
    if getattr(workload, "_shed", False):
        return
    workload.model.to("meta")
    workload._state = {}
    workload._staging = {}
    workload._cpu_model = None
    workload._shed = True


class _Built:
    """This rank's part of the model for one group: the module it trains, where each named state tensor
    lives, and (pipeline) its stage."""

    def __init__(self, group: Any, mode: str, module: nn.Module, owner: dict[str, int],
                 shapes: dict[str, tuple[int, ...]], stage: int) -> None:
        self.group, self.mode, self.module = group, mode, module
        self.owner, self.shapes, self.stage = owner, shapes, stage


def _float_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t for n, t in module.state_dict(keep_vars=True).items() if t.is_floating_point()}


def _build(workload: Any, mode: str, group: Any, split_points: Sequence[str] | None) -> _Built:
    """Build this rank's sharded module on the meta device and materialise only its part (see the module doc)."""
    built = getattr(workload, "_pool_built", None)  # this group's, kept across tasks; rebuilt on re-forming
    current = group if group is not None else dist.distributed_c10d._get_default_group()
    if built is not None and built.group is current and built.mode == mode:
        return built
    rank, world = _group_info(group)
    device = workload.device
    with torch.device("meta"):
        model = workload.model_factory()
    state = _float_state(model)
    names = sorted(state)
    if [n for n, _, _ in workload.schema()] != names:
        raise ValueError("the model factory's float state does not match the workload's schema")
    shapes = {n: tuple(state[n].shape) for n in names}
    if mode == "fsdp":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        ranks = dist.get_process_group_ranks(current)
        mesh = DeviceMesh.from_group(current, device.type, mesh=torch.tensor(ranks))
        for sub in model.modules():  # one FSDP unit per module owning parameters: one unsharded at a time
            if sub is not model and any(True for _ in sub.parameters(recurse=False)):
                fully_shard(sub, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device=device)
        module: nn.Module = model
        owner = dict.fromkeys(names, -1)  # -1: every rank holds its rows
        stage = 0
    else:
        bounds = stage_bounds(model, world, split_points)
        children = list(model.named_children())
        start, stop = bounds[rank]
        module = nn.Sequential(OrderedDict(children[start:stop])).to_empty(device=device)
        owner = {}
        for r, (a, b) in enumerate(bounds):
            for child, _ in children[a:b]:
                owner.update((n, r) for n in names if n.startswith(child + "."))
        if set(owner) != set(names):
            raise ValueError("some state is not inside a child of the nn.Sequential: it cannot be staged")
        stage = rank
    for name, value in getattr(workload, "_built_buffers", {}).items():  # e.g. num_batches_tracked
        buffers = dict(module.named_buffers())
        if name in buffers:
            buffers[name].copy_(value)
    shed_whole_model(workload)
    built = _Built(current, mode, module, owner, shapes, stage)
    workload._pool_built = built
    return built


def _head_tensor(params: Mapping[str, Any], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Rank 0's head tensor `name` as a float32 CPU tensor (a FileTensor is read here, this tensor only)."""
    value = params[name]
    if hasattr(value, "blocks"):  # a FileTensor: one read of this tensor into a buffer of its own
        value = next(iter(value.blocks(max(value.size, 1)))) if value.size else np.empty(0, np.float32)
    array = np.asarray(value, dtype=np.float32).reshape(shape)
    return torch.from_numpy(np.ascontiguousarray(array))


def _load_head(built: _Built, params: Mapping[str, Any] | None, rank: int, world: int, device: torch.device,
               group: Any) -> None:
    """Rank 0's head into every rank's part, one tensor at a time in name order."""
    state = _float_state(built.module)
    if rank == 0 and params is None:
        raise ValueError("rank 0 must pass the head's params")
    with torch.no_grad():
        for name in sorted(built.shapes):
            shape = built.shapes[name]
            full = _head_tensor(params, name, shape).to(device) if params is not None and rank == 0 else None
            owner = built.owner[name]
            if owner >= 0:  # pipeline: the stage that holds it
                if owner == 0:
                    if rank == 0:
                        assert full is not None
                        state[name].copy_(full)
                elif rank == 0:
                    assert full is not None
                    dist.send(full, dst=owner, group=group)
                elif rank == owner:
                    dist.recv(state[name], src=0, group=group)
                continue
            target = state[name]
            if not isinstance(target, DTensor):  # a buffer: FSDP replicates it
                if rank == 0:
                    assert full is not None
                    target.copy_(full)
                dist.broadcast(target, src=0, group=group)
                continue
            start, stop = shard_rows(shape[0], world, rank)
            local = target.to_local()
            if tuple(local.shape) != (stop - start, *shape[1:]):
                raise RuntimeError(f"FSDP holds {tuple(local.shape)} of {name!r}, expected rows {start}:{stop}")
            chunk = -(-shape[0] // world)
            parts = None
            if rank == 0:
                assert full is not None
                padded = torch.zeros((chunk * world, *shape[1:]), dtype=torch.float32, device=device)
                padded[: shape[0]] = full
                parts = list(padded.split(chunk))
            mine = torch.empty((chunk, *shape[1:]), dtype=torch.float32, device=device)
            dist.scatter(mine, parts, src=0, group=group)
            local.copy_(mine[: stop - start])


def _gather_delta(built: _Built, params: Mapping[str, Any] | None, rank: int, world: int, device: torch.device,
                  group: Any, sink: Sink) -> None:
    """Every tensor after training to rank 0, one at a time in name order; rank 0 hands ``head - after`` to
    `sink`. Raises (a dead or hung rank) before the last tensor: the caller must then drop what `sink` got."""
    state = _float_state(built.module)
    with torch.no_grad():
        for name in sorted(built.shapes):
            shape = built.shapes[name]
            owner = built.owner[name]
            after: torch.Tensor | None = None
            if owner >= 0:
                if owner == rank:
                    after = state[name].detach()
                    if rank != 0:
                        dist.send(after.contiguous(), dst=0, group=group)
                        after = None
                elif rank == 0:
                    after = torch.empty(shape, dtype=torch.float32, device=device)
                    dist.recv(after, src=owner, group=group)
            elif not isinstance(state[name], DTensor):
                after = state[name].detach() if rank == 0 else None  # a replicated buffer: rank 0's own
            else:
                sharded = state[name]
                assert isinstance(sharded, DTensor)
                start, stop = shard_rows(shape[0], world, rank)
                chunk = -(-shape[0] // world)
                mine = torch.zeros((chunk, *shape[1:]), dtype=torch.float32, device=device)
                mine[: stop - start] = sharded.to_local()
                parts = [torch.empty_like(mine) for _ in range(world)] if rank == 0 else None
                dist.gather(mine, parts, dst=0, group=group)
                if rank == 0:
                    assert parts is not None
                    after = torch.cat(parts)[: shape[0]]
                del mine, parts
            if rank == 0:
                assert after is not None and params is not None
                sink(name, np.subtract(_head_tensor(params, name, shape).numpy(), after.cpu().numpy(),
                                       dtype=np.float32))


def _clip_stages(parameters: list[nn.Parameter], max_norm: float, device: torch.device, group: Any) -> None:
    """``clip_grad_norm_`` over the whole pipeline: the 2-norm of every stage's gradients (one all_reduce of
    the squared norms), then torch's own scaling ``min(1, max_norm / (norm + 1e-6))`` on this stage."""
    grads = [p.grad for p in parameters if p.grad is not None]
    squared = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        squared += torch.linalg.vector_norm(g.detach(), 2.0) ** 2
    dist.all_reduce(squared, group=group)
    coef = torch.clamp(max_norm / (squared.sqrt() + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef)


class _Pipeline:
    """A schedule per micro-batch count over this rank's stage (a stage infers its shapes once)."""

    def __init__(self, built: _Built, world: int, device: torch.device, loss_fn: Any, schedule: str,
                 group: Any) -> None:
        self.built, self.world, self.device, self.loss_fn, self.kind, self.group = (built, world, device, loss_fn,
                                                                                      schedule, group)
        self._made: dict[tuple[int, int], Any] = {}

    def step(self, inputs: Any, targets: Any, microbatches: int) -> float | None:
        """One global batch through the stages in `microbatches` micro-batches; the last stage returns the
        batch's mean loss, the others None."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        key = (len(targets), microbatches)
        if key not in self._made:
            stage = PipelineStage(self.built.module, self.built.stage, self.world, self.device, group=self.group)
            kind = Schedule1F1B if self.kind == "1f1b" else ScheduleGPipe
            self._made[key] = kind(stage, n_microbatches=microbatches, loss_fn=self.loss_fn, scale_grads=True)
        schedule = self._made[key]
        first, last = self.built.stage == 0, self.built.stage == self.world - 1
        losses: list[torch.Tensor] = []
        args = (_move(inputs, self.device),) if first else ()
        target = _move(targets, self.device) if last else None
        schedule.step(*args, target=target, losses=losses if last else None)
        if not last:
            return None
        return float(torch.stack([loss.detach() for loss in losses]).mean())


def pool_train_sharded(workload: Any, params: Mapping[str, Any] | None, indices: Sequence[int], seed: int, *,
                       parallel: str, inner_steps: int | None = None, epochs: int | None = None, step: int = 0,
                       split_points: Sequence[str] | None = None, schedule: str = "gpipe",
                       microbatches: int | None = None, sink: Sink | None = None,
                       group: Any = None) -> tuple[TensorDict | None, dict[str, float | int]]:
    """Train a `TorchWorkload` on one lease across the ranks of `group`, its model sharded (``parallel``:
    ``"fsdp"`` or ``"pipeline"``; spec/pools.md §6-7).

    Every rank calls it with the same `indices` (the lease's sample indices, in the single process's order),
    `seed`, `inner_steps`, `epochs`, global `step` (the LR schedule starts there, spec/protocol.md §5.1) and
    options: `split_points`, `schedule` (one of `SCHEDULES`) and `microbatches` (per global batch, default N;
    a batch of B samples runs in ``gcd(B, microbatches)`` equal micro-batches) for a pipeline. Rank 0 passes
    the head's `params` (name -> float32 array or `FileTensor`, the workload's schema), the others None.

    Returns on rank 0 ``(delta, {"train_loss", "samples"})`` as `TorchWorkload.train` does — or, with `sink`,
    ``(None, metrics)`` after ``sink(name, delta_array)`` was called for every state tensor in name order
    (float32, the tensor's shape) — and ``(None, metrics)`` on other ranks. Raises ValueError (empty lease,
    out-of-range index, a ``train_loader``, bf16 in a pipeline, a model that cannot be staged) and
    torch.distributed's errors (a dead rank, the group's timeout) as they come.
    """
    if parallel not in ("fsdp", "pipeline"):
        raise ValueError(f"parallel must be fsdp or pipeline here, got {parallel!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if workload.train_loader is not None:
        raise ValueError("a trainer pool splits the built-in batching; a workload with its own train_loader "
                         "cannot be split (spec/pools.md)")
    if parallel == "pipeline" and workload.bf16:
        raise ValueError("a pipelined pool trains in float32: bf16 autocast is not carried across stages")
    rank, world = _group_info(group)
    index = torch.as_tensor(np.asarray(indices, dtype=np.int64))
    if index.ndim != 1 or len(index) == 0:
        raise ValueError("indices must be a non-empty sequence of ints")
    if int(index.min()) < 0 or int(index.max()) >= workload.num_train:
        raise ValueError(f"indices must lie in [0, {workload.num_train})")
    if rank == 0 and params is None:
        raise ValueError("rank 0 must pass the head's params")
    device = workload.device
    built = _build(workload, parallel, group, split_points)
    _load_head(built, params, rank, world, device, group)
    module = built.module
    module.train()
    held = list(module.parameters())
    # A stage may hold no parameters (e.g. an activation alone): it only passes activations on.
    optimizer = workload.optimizer_factory(held) if held else None
    kept = workload.keep_optimizer_state and None in workload._saved_schedulers
    scheduler = workload._scheduler(optimizer, 0 if kept else step) if optimizer is not None else None
    if optimizer is not None and workload.keep_optimizer_state:  # each rank saved its own shard's or stage's
        restore_optimizer(workload, optimizer, scheduler)
    pipe = _Pipeline(built, world, device, workload.loss_fn, schedule, group) if parallel == "pipeline" else None
    per_micro = microbatches if microbatches is not None else world
    steps = workload.inner_steps if inner_steps is None else inner_steps
    n_epochs = workload.local_epochs if epochs is None else epochs
    loss_sum, seen = 0.0, 0
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        torch.manual_seed((seed + rank) % 2**63)
        for new_pass, batch in lease_batches(index, workload.batch_size, steps, n_epochs, seed):
            if new_pass:
                loss_sum, seen = 0.0, 0
            module.zero_grad(set_to_none=True)
            if pipe is not None:  # the whole batch through the stages; the last one has the loss
                inputs, targets = workload._train_batch(batch)
                mean = pipe.step(inputs, targets, math.gcd(len(batch), per_micro))
                if workload.clip_grad_norm is not None:
                    _clip_stages(list(module.parameters()), workload.clip_grad_norm, device, group)
                if mean is not None:
                    loss_sum += mean * len(batch)
                    seen += len(batch)
            else:  # fsdp: data parallel over the split batch, FSDP2 reduce-scatters the mean gradient
                mine = rank_batch(batch, rank, world)
                inputs, targets = workload._train_batch(mine)
                with workload._autocast():
                    loss = workload.loss_fn(module(_move(inputs, device)), _move(targets, device))
                loss.backward()
                if workload.clip_grad_norm is not None:
                    nn.utils.clip_grad_norm_(module.parameters(), workload.clip_grad_norm)
                loss_sum += float(loss.detach()) * len(mine)
                seen += len(mine)
            if optimizer is not None:
                optimizer.step()
            if scheduler is not None:
                scheduler.step()
    module.zero_grad(set_to_none=True)  # the gradients' memory back before the gather
    if optimizer is not None and workload.keep_optimizer_state:
        workload._saved_optimizers[None] = copy.deepcopy(optimizer.state_dict())
        if scheduler is not None:
            workload._saved_schedulers[None] = copy.deepcopy(scheduler.state_dict())
    del optimizer
    # Every rank must report (no replicas to compare: each holds its own part, so the checksum is 0).
    total_loss, total_seen = _close(loss_sum, seen, 0.0, device, group)
    metrics: dict[str, float | int] = {"train_loss": total_loss / max(total_seen, 1), "samples": len(index)}
    collected: dict[str, np.ndarray] = {}
    _gather_delta(built, params, rank, world, device, group, sink if sink is not None else collected.__setitem__)
    if rank != 0 or sink is not None:
        return None, metrics
    return collected, metrics

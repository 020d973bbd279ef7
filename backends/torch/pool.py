"""One train task on a trainer pool: the ranks of one torch.distributed process group train one lease
together and rank 0 gets the one pseudo-gradient (spec/pools.md).

`pool_train` runs on every rank, in lockstep, inside a process group that the caller formed
(`peerloom.adapters.pool`):

1. rank 0 loads the head's params into its model and **broadcasts** every state tensor (``state_dict``
   order of `TorchWorkload.schema`) to the group, so every replica starts from the head;
2. the ranks train with ``DistributedDataParallel`` for the inner steps (or local epochs): every global
   mini-batch of the single process (`TorchWorkload.train`'s shuffled order, ``batch_size`` samples) is split
   by `rank_batch` — rank r takes samples r, r+N, r+2N, ... of it, after padding it to a multiple of N by
   wrapping around (DistributedSampler's rule) — and DDP averages the gradients over the ranks;
3. an **all_gather** of ``(loss sum, samples seen, checksum of the params)`` closes the task: every rank
   must report, and every replica must hold the same params, else `PoolDiverged`; rank 0 then returns
   ``delta = params_before - params_after`` and the lease's train loss.

Equivalence (spec/pools.md "Equivalence"): with the per-rank batch ``batch_size / N``, a loss that is a mean
over its batch, no padding (``batch_size`` and the last global batch of every pass divisible by N), no
BatchNorm (per-rank batch statistics) and no random layers (rank r forks the global RNG seeded with
``seed + r``), the pool computes the single process's pseudo-gradient up to float rounding: the gradient
of a global batch is the mean of the ranks' gradients. Gradient clipping sees the averaged gradient, as the
single process does. A workload with its own ``train_loader`` cannot be split this way: ValueError.

`pool_train_generic` is the path for a workload that is not a `TorchWorkload`: it broadcasts the params,
gives rank r the sorted lease indices ``r::N`` (padded the same way) and calls the workload's own
``train`` on every rank; the workload keeps its replicas in step itself with
`peerloom.backends.torch.collectives`, and the closing all_gather refuses deltas that differ.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from peerloom.backends.numpy.tensors import TensorDict
from peerloom.backends.torch.workload import _move
from peerloom.backends.workload import takes_step

__all__ = ["PoolDiverged", "pool_train", "pool_train_generic", "rank_batch", "rank_share"]


class PoolDiverged(RuntimeError):
    """The ranks of a pool ended a train task with different params (or deltas): no update is built."""


def rank_batch(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s part of one global mini-batch (1-D int64 sample indices, in the order trained).

    The batch is padded to a multiple of `world` by repeating it from its start (DistributedSampler's
    rule), then rank r takes ``padded[r::world]``: every rank gets ``ceil(len(batch) / world)`` samples
    and the union over ranks is the batch (plus the padding). ValueError for an empty batch or a rank
    outside ``[0, world)``.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank must lie in [0, {world}), got {rank}")
    n = len(batch)
    if n == 0:
        raise ValueError("an empty batch cannot be split")
    size = -(-n // world) * world
    if size != n:
        batch = batch.repeat(-(-size // n))[:size]
    return batch[rank::world]


def rank_share(indices: Sequence[int], rank: int, world: int) -> list[int]:
    """Rank `rank`'s share of a whole lease (the generic path): the sorted indices, padded like
    `rank_batch`, ``[r::world]``. Deterministic per lease: it depends on the set of indices only."""
    ordered = torch.as_tensor(sorted(int(i) for i in indices), dtype=torch.int64)
    return [int(i) for i in rank_batch(ordered, rank, world)]


def _group_info(group: Any) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _broadcast_params(tensors: dict[str, torch.Tensor], group: Any) -> None:
    """Rank 0's tensors into every rank's, in place, in sorted name order."""
    for name in sorted(tensors):
        dist.broadcast(tensors[name], src=0, group=group)


def _close(loss_sum: float, seen: int, checksum: float, device: torch.device, group: Any) -> tuple[float, int]:
    """The closing all_gather: every rank's ``(loss_sum, seen, checksum)``; PoolDiverged when the checksums
    differ. Returns the group's (loss sum, samples seen)."""
    world = dist.get_world_size(group)
    mine = torch.tensor([loss_sum, float(seen), checksum], dtype=torch.float64, device=device)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    rows = torch.stack(parts).cpu()
    if not bool((rows[:, 2] == rows[0, 2]).all()):
        raise PoolDiverged(f"the ranks' checksums differ: {rows[:, 2].tolist()}")
    return float(rows[:, 0].sum()), int(rows[:, 1].sum())


def _checksum(tensors: Any) -> float:
    """A float64 sum of every value (replicas holding the same bytes give the same sum)."""
    return float(sum(float(t.double().sum()) for t in tensors))


def pool_train(workload: Any, params: TensorDict | None, indices: Sequence[int], seed: int, *,
               inner_steps: int | None = None, epochs: int | None = None, step: int = 0,
               group: Any = None) -> tuple[TensorDict | None, dict[str, float | int]]:
    """Train a `TorchWorkload` on one lease across the ranks of `group` (default: the default group).

    Every rank calls it with the same `indices` (the lease's sample indices, in the order the single
    process would use), `seed`, `inner_steps`, `epochs` and the run's global `step` (the LR schedule starts
    there, as in `TorchWorkload.train`, spec/protocol.md §5.1); rank 0 passes the head's `params` (numpy float32,
    the workload's schema), the others None. Returns on rank 0 ``(delta, {"train_loss", "samples"})`` as
    `TorchWorkload.train` does (train loss: the sample-weighted mean over all ranks of the last pass, padding
    included), on other ranks ``(None, metrics)``. Raises ValueError for an empty lease, out-of-range
    indices, params of the wrong schema or a workload with a ``train_loader``; PoolDiverged when the
    replicas disagree; torch.distributed's errors (a dead rank, the group's timeout) as they come.
    """
    rank, world = _group_info(group)
    if workload.train_loader is not None:
        raise ValueError("a trainer pool splits the built-in batching; a workload with its own train_loader "
                         "cannot be split (spec/pools.md)")
    steps = workload.inner_steps if inner_steps is None else inner_steps
    n_epochs = workload.local_epochs if epochs is None else epochs
    index = torch.as_tensor(np.asarray(indices, dtype=np.int64))
    if index.ndim != 1 or len(index) == 0:
        raise ValueError("indices must be a non-empty sequence of ints")
    if int(index.min()) < 0 or int(index.max()) >= workload.num_train:
        raise ValueError(f"indices must lie in [0, {workload.num_train})")
    if rank == 0:
        if params is None:
            raise ValueError("rank 0 must pass the head's params")
        workload._load(params)
    _broadcast_params(workload._state, group)
    model: nn.Module = workload.model
    model.train()
    device = workload.device
    ddp = DistributedDataParallel(model, device_ids=[device.index or 0] if device.type == "cuda" else None,
                                  process_group=group, init_sync=False)
    optimizer = workload.optimizer_factory(model.parameters())
    kept = workload.keep_optimizer_state and None in workload._saved_schedulers
    scheduler = workload._scheduler(optimizer, 0 if kept else step)  # the schedule at the run's global step
    if workload.keep_optimizer_state:  # every replica saved the same state: its gradients were the same
        restore_optimizer(workload, optimizer, scheduler)
    loss_sum, seen = 0.0, 0
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        torch.manual_seed((seed + rank) % 2**63)
        for new_pass, batch in lease_batches(index, workload.batch_size, steps, n_epochs, seed):
            if new_pass:
                loss_sum, seen = 0.0, 0
            mine = rank_batch(batch, rank, world)
            inputs, targets = workload._train_batch(mine)
            inputs, targets = _move(inputs, device), _move(targets, device)
            optimizer.zero_grad(set_to_none=True)
            with workload._autocast():
                loss = workload.loss_fn(ddp(inputs), targets)
            loss.backward()  # DDP: the gradients are averaged over the ranks here
            if workload.clip_grad_norm is not None:
                nn.utils.clip_grad_norm_(model.parameters(), workload.clip_grad_norm)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            loss_sum += float(loss.detach()) * len(mine)
            seen += len(mine)
    del ddp  # its reducer's autograd hooks go with it: the next task wraps the model afresh
    if workload.keep_optimizer_state:
        workload._saved_optimizers[None] = copy.deepcopy(optimizer.state_dict())
        if scheduler is not None:
            workload._saved_schedulers[None] = copy.deepcopy(scheduler.state_dict())
    total_loss, total_seen = _close(loss_sum, seen, _checksum(workload._state.values()), device, group)
    metrics: dict[str, float | int] = {"train_loss": total_loss / total_seen, "samples": len(index)}
    if rank != 0:
        return None, metrics
    assert params is not None
    delta = {name: np.subtract(params[name], workload._host(name), dtype=np.float32) for name in workload._state}
    return delta, metrics


def restore_optimizer(workload: Any, optimizer: Any, scheduler: Any) -> None:
    """Load the optimizer's and the scheduler's state this process kept from its last task
    (``keep_optimizer_state``), where it kept any."""
    if (saved := workload._saved_optimizers.get(None)) is not None:
        optimizer.load_state_dict(saved)
    if scheduler is not None and (saved := workload._saved_schedulers.get(None)) is not None:
        scheduler.load_state_dict(saved)


def lease_batches(index: torch.Tensor, size: int, steps: int | None, epochs: int,
                  seed: int) -> Iterator[tuple[bool, torch.Tensor]]:
    """The global mini-batches of one task over the lease `index` (int64, [n]), as a single process draws
    them: `steps` batches of `size` (None: `epochs` passes), a fresh permutation from a generator seeded
    with `seed` at the start of every pass. Yields (whether a pass starts, the batch's sample indices)."""
    generator = torch.Generator().manual_seed(seed)
    n = len(index)
    per_pass = -(-n // size)
    order = index
    for k in range(steps if steps is not None else epochs * per_pass):
        pos = k % per_pass
        if pos == 0:
            order = index[torch.randperm(n, generator=generator)]
        yield pos == 0, order[pos * size : (pos + 1) * size]


def pool_train_generic(workload: Any, params: TensorDict | None, indices: Sequence[int], seed: int, *,
                       inner_steps: int | None = None, epochs: int | None = None, step: int = 0,
                       group: Any = None) -> tuple[TensorDict | None, dict[str, float | int]]:
    """Train any workload (``train(params, indices, seed, ...)``, ``schema()``) on one lease across the ranks:
    rank 0's `params` are broadcast (CPU tensors: gloo), rank r trains on `rank_share` of the lease with the
    workload's own ``train``, and the ranks' deltas must agree (the workload synchronises its replicas
    with the collectives, e.g. by all-reducing its gradients), else PoolDiverged. Returns as `pool_train`.
    """
    rank, world = _group_info(group)
    tensors = {}
    for name, dtype, shape in workload.schema():
        if rank == 0:
            if params is None:
                raise ValueError("rank 0 must pass the head's params")
            tensors[name] = torch.from_numpy(np.array(params[name], dtype=dtype, copy=True))
        else:
            tensors[name] = torch.from_numpy(np.empty(tuple(shape), dtype=dtype))
    _broadcast_params(tensors, group)
    received = {name: t.numpy() for name, t in tensors.items()}
    kwargs: dict[str, Any] = {}
    if inner_steps is not None:
        kwargs["inner_steps"] = inner_steps
    if epochs is not None:
        kwargs["epochs"] = epochs
    if step and takes_step(workload):
        kwargs["step"] = step
    delta, metrics = workload.train(received, rank_share(indices, rank, world), seed, **kwargs)
    seen = int(metrics.get("samples", 1))
    loss_sum = float(metrics["train_loss"]) * seen
    total_loss, total_seen = _close(loss_sum, seen, _checksum(torch.from_numpy(np.asarray(a)) for a in delta.values()),
                                    torch.device("cpu"), group)
    out: dict[str, float | int] = {"train_loss": total_loss / max(total_seen, 1), "samples": len(indices)}
    return (delta if rank == 0 else None), out


"""Collective operations for workloads inside a trainer pool: thin wrappers on torch.distributed
(spec/pools.md §5).

A pool (`peerloom.adapters.pool`) runs one process per rank, all in torch.distributed's default process
group (gloo on the CPU, nccl on CUDA). A custom workload uses these to keep its replicas in step, e.g. to
average its gradients::

    from peerloom.workloads import all_reduce, pool_size

    for p in model.parameters():
        all_reduce(p.grad, op="avg")

Outside a pool (no process group initialised) every operation acts on a group of one: `all_reduce` and
`broadcast` return the tensor unchanged and `all_gather` returns ``[tensor]``, so the same workload runs
alone unchanged. Tensors must live where the group's backend can reach them (CPU for gloo, the rank's GPU
for nccl). Errors are torch.distributed's: a dead rank or the group's timeout raises (``DistError`` or
``RuntimeError``), which fails the pool's train task (spec/pools.md "Failure").
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["REDUCE_OPS", "all_gather", "all_reduce", "broadcast", "pool_rank", "pool_size"]

REDUCE_OPS = ("sum", "avg", "max", "min", "product")
"""The `all_reduce` operations; ``avg`` is the sum divided by the group size (gloo has no AVG)."""
_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "product": dist.ReduceOp.PRODUCT}


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def pool_rank() -> int:
    """This process's rank in the pool (0 holds the peer's identity and publishes); 0 outside a pool."""
    return dist.get_rank() if _active() else 0


def pool_size() -> int:
    """The number of ranks in the pool; 1 outside a pool."""
    return dist.get_world_size() if _active() else 1


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce `tensor` element-wise over every rank, in place (``torch.distributed.all_reduce``); every rank
    passes a tensor of the same shape and dtype and gets the result. `op`: one of `REDUCE_OPS` (``avg``
    needs a floating-point tensor). Returns `tensor`. ValueError for another op."""
    if op not in _OPS:
        raise ValueError(f"op must be one of {', '.join(REDUCE_OPS)}, got {op!r}")
    if not _active():
        return tensor
    dist.all_reduce(tensor, op=_OPS[op])
    if op == "avg":
        tensor.div_(dist.get_world_size())
    return tensor


def broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Copy rank `src`'s `tensor` into every rank's, in place (``torch.distributed.broadcast``); every rank
    passes a tensor of the same shape and dtype. Returns `tensor`. ValueError for `src` outside the pool."""
    size = pool_size()
    if not 0 <= src < size:
        raise ValueError(f"src must lie in [0, {size}), got {src}")
    if _active():
        dist.broadcast(tensor, src=src)
    return tensor


def all_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's `tensor` (same shape and dtype on every rank), indexed by rank, on every rank
    (``torch.distributed.all_gather``): a list of `pool_size` new tensors."""
    if not _active():
        return [tensor.clone()]
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor)
    return parts

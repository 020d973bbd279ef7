"""Your own model as a peerloom workload: the public constructors (spec/design.md §5, Workloads).

=================== ====================================================================================
name                what
=================== ====================================================================================
`torch_workload`    a workload from your torch objects: model factory, loss, inner-optimizer factory,
                    train / eval ``Dataset`` s (or DataLoader factories), LR scheduler, gradient clipping,
                    bf16 autocast, device, metrics (`peerloom.backends.torch.workload.torch_workload`)
`TorchWorkload`     the class it returns
`numpy_workload`    the same shape in pure numpy: an MLP trained with Adam on your arrays
                    (`peerloom.backends.numpy.workload.numpy_workload`)
`shards_for`        ``(dataset_len, num_shards, seed) -> shard -> sample indices``, the mapping a factory
                    returns (`peerloom.backends.sharding.shards_for`)
`resolve_device`    ``"cpu" | "cuda" | "cuda:N" | "mps" | "auto"`` -> the device it means here, or
                    `DeviceError` naming an absent one (`peerloom.backends.devices`)
`all_reduce`        collectives for a workload inside a trainer pool (``[pool]`` or torchrun, spec/pools.md):
`broadcast`         thin wrappers on torch.distributed that act on a group of one outside a pool
`all_gather`        (`peerloom.backends.torch.collectives`)
`pool_rank`         this process's rank in its pool (0 outside one)
`pool_size`         the pool's number of ranks (1 outside one)
=================== ====================================================================================

A node trains your workload when its config names a factory, ``workload = "mypkg.train:factory"``, called
as ``factory(seed, num_shards) -> (workload, shards)`` with the manifest's ``workload_seed`` and shard
count (``peerloom/node.py``); every peer of a revision must build the same model and shards::

    from torch import nn
    from peerloom.workloads import shards_for, torch_workload

    def factory(seed, num_shards):
        train, test = my_datasets()                      # torch.utils.data.Dataset s of (input, target)
        workload = torch_workload(model=MyNet, loss=nn.functional.cross_entropy,
                                  optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                                  train_data=train, eval_data=test, batch_size=64)
        return workload, shards_for(len(train), num_shards, seed)

Importing this module imports neither torch nor scikit-learn: `torch_workload` and `TorchWorkload` load
torch on first use, so numpy-only peers can use the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from peerloom.backends.devices import DEVICE_NAMES, DeviceError, resolve_device
from peerloom.backends.numpy.workload import NumpyWorkload, numpy_workload
from peerloom.backends.sharding import shards_for

if TYPE_CHECKING:
    from peerloom.backends.torch.collectives import all_gather, all_reduce, broadcast, pool_rank, pool_size
    from peerloom.backends.torch.workload import TorchWorkload, argmax_accuracy, torch_workload

__all__ = [
    "DEVICE_NAMES",
    "DeviceError",
    "NumpyWorkload",
    "TorchWorkload",
    "all_gather",
    "all_reduce",
    "argmax_accuracy",
    "broadcast",
    "numpy_workload",
    "pool_rank",
    "pool_size",
    "resolve_device",
    "shards_for",
    "torch_workload",
]
_TORCH_NAMES = frozenset({"TorchWorkload", "argmax_accuracy", "torch_workload"})
_COLLECTIVE_NAMES = frozenset({"all_gather", "all_reduce", "broadcast", "pool_rank", "pool_size"})


def __getattr__(name: str) -> Any:
    """The torch constructors, imported on first use (PEP 562), so that importing this module needs no torch."""
    if name in _TORCH_NAMES or name in _COLLECTIVE_NAMES:
        try:
            from peerloom.backends.torch import collectives, workload
        except ImportError as exc:
            raise ImportError(f"peerloom.workloads.{name} needs torch: pip install 'peerloom[torch]' ({exc})") from exc
        value = getattr(workload if name in _TORCH_NAMES else collectives, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'peerloom.workloads' has no attribute {name!r}")

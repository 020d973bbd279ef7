"""Named workloads a manifest can refer to (`Manifest.workload`).

A workload name plus its seed must mean the same model, data split and shard contents on every peer,
because leases name shards by number and sample weights come from the manifest's shard sizes.
"""

from __future__ import annotations

from typing import Any

WORKLOADS = ("digits-mlp",)


def build_workload(name: str, seed: int, num_shards: int, **options: Any) -> tuple[Any, list[list[int]]]:
    """(workload, shard -> train sample indices) for a workload name. ValueError for unknown names."""
    if name == "digits-mlp":
        from .datasets import load_digits_split, shard_indices
        from .torch.models import make_digits_workload

        workload = make_digits_workload(seed=seed, **options)
        num_train = len(load_digits_split(seed)[0])
        return workload, shard_indices(num_train, num_shards, seed)
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")

"""How a revision's shards map to a dataset's sample indices (spec/protocol.md §4: leases name shards by number).

Every peer of a revision must map shard ``s`` to the same sample indices, or its update trains on other
data than its lease says and fails the recomputation audit. `shards_for` is the mapping the bundled
workloads use (`peerloom.backends.datasets.shard_indices` is the same function) and the one a user's
workload factory should return: a pure function of (dataset length, shard count, seed), numpy's PCG64
generator only, so it is the same on every platform and needs neither torch nor scikit-learn.

A private-data trainer (spec/protocol.md §10) maps the same shard numbers to its own samples instead:
`private_shards_for`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def shards_for(dataset_len: int, num_shards: int, seed: int) -> list[list[int]]:
    """Shard ``s`` -> its sample indices: a seeded permutation of ``range(dataset_len)`` cut into `num_shards`
    contiguous, near-equal parts.

    The permutation is ``np.random.default_rng(seed).permutation(dataset_len)`` (PCG64, stable across
    platforms and numpy versions); part sizes differ by at most one, the first ``dataset_len % num_shards``
    parts holding the extra sample (``np.array_split``). Every index appears in exactly one shard, as a
    Python int. Pass the manifest's ``workload_seed`` (a node's factory gets it as its ``seed``) and shard
    count. Raises ValueError unless ``1 <= num_shards <= dataset_len``.

    Example: ``shards_for(10, 3, 0)`` -> three lists of 4, 3 and 3 indices.
    """
    if dataset_len < 0 or num_shards < 1 or num_shards > dataset_len:
        raise ValueError(f"need 1 <= num_shards <= dataset_len, got num_shards={num_shards}, "
                         f"dataset_len={dataset_len}")
    order = np.random.default_rng(seed).permutation(dataset_len)
    return [[int(i) for i in part] for part in np.array_split(order, num_shards)]


def private_shards_for(shard_sizes: Sequence[int], local_len: int, seed: int) -> list[list[int]]:
    """Shard ``s`` -> indices of a private-data trainer's own samples (spec/protocol.md §10): its lease of
    shards S is a sample count, ``sum(shard_sizes[s] for s in S)`` samples of the data only it holds.

    Shard ``s`` takes ``shard_sizes[s]`` consecutive positions of ``np.random.default_rng(seed).permutation(
    local_len)``, read cyclically, starting at ``sum(shard_sizes[:s]) % local_len``; so the shards together
    cover the local data (several times over when the manifest's shards hold more samples than it, some
    samples twice within one shard when one shard alone does), and over windows a trainer's changing leases
    cover all of it. Pass the manifest's shard sizes (`Manifest.shards`) and ``workload_seed``: which of its
    own records a lease names is no secret (the records are), and the map stays the same across restarts.
    Indices are Python ints in ``range(local_len)``. Raises ValueError for an empty local dataset or a
    shard size below 1.

    Example: ``private_shards_for([4, 3, 3], 5, 0)`` -> shards of 4, 3 and 3 indices into ``range(5)``,
    the second starting where the first ended.
    """
    if local_len < 1:
        raise ValueError(f"a private-data trainer needs at least one local sample, got {local_len}")
    if any(size < 1 for size in shard_sizes):
        raise ValueError(f"shard sizes must be positive, got {list(shard_sizes)}")
    order = np.random.default_rng(seed).permutation(local_len)
    out, start = [], 0
    for size in shard_sizes:
        out.append([int(i) for i in order[(start + np.arange(size)) % local_len]])
        start = (start + size) % local_len
    return out

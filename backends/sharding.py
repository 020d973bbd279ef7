"""How a revision's shards map to a dataset's sample indices (spec/protocol.md §4: leases name shards by number).

Every peer of a revision must map shard ``s`` to the same sample indices, or its update trains on other
data than its lease says and fails the recomputation audit. `shards_for` is the mapping the bundled
workloads use (`peerloom.backends.datasets.shard_indices` is the same function) and the one a user's
workload factory should return: a pure function of (dataset length, shard count, seed), numpy's PCG64
generator only, so it is the same on every platform and needs neither torch nor scikit-learn.
"""

from __future__ import annotations

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

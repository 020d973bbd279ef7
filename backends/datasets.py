"""Datasets that ship with the install (spec/design.md §8): scikit-learn's bundled 8x8 digits, no network.

Digits: 1797 grey-scale 8x8 images of the digits 0-9 (the UCI "Optical Recognition of Handwritten
Digits" test set, bundled with scikit-learn as ``sklearn.datasets.load_digits``).
"""

from __future__ import annotations

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from .sharding import shards_for


def load_digits_split(
    seed: int = 0, test_fraction: float = 0.25
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, y_train, x_test, y_test)`` from the bundled digits, split stratified by label.

    x: float32 ``[n, 64]``, pixel values scaled from 0..16 to 0..1; y: int64 ``[n]``, labels 0..9. The
    split is a pure function of (`seed`, `test_fraction`); with the defaults it is 1347 train / 450 test.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    bunch = load_digits()
    x = (np.asarray(bunch.data, dtype=np.float64) / 16.0).astype(np.float32)
    y = np.asarray(bunch.target, dtype=np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y, shuffle=True
    )
    return (
        np.ascontiguousarray(x_train),
        np.ascontiguousarray(y_train),
        np.ascontiguousarray(x_test),
        np.ascontiguousarray(y_test),
    )


def shard_indices(n: int, num_shards: int, seed: int) -> list[list[int]]:
    """A seeded permutation of ``range(n)`` cut into `num_shards` contiguous, near-equal shards: the same
    function as `peerloom.backends.sharding.shards_for` (which documents it; kept under this name for the
    bundled workloads). Raises ValueError unless ``1 <= num_shards <= n``.
    """
    return shards_for(n, num_shards, seed)

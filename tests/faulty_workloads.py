"""Workload factories that go wrong as a user's can (`peerloom up` must say so): set as one node's
``workload`` config key while the others run `tests.node_cluster:numpy_digits`."""

from typing import Any

from tests.node_cluster import numpy_digits


def failing_digits(seed: int, num_shards: int) -> tuple[Any, list[list[int]]]:
    """The digits workload whose training raises, as a user's Dataset that cannot read a sample would."""
    workload, shards = numpy_digits(seed, num_shards)

    def train(*args: Any, **kwargs: Any) -> Any:
        raise OSError("sample 17: cannot read image file")

    workload.train = train  # the instance's, not the class's
    return workload, shards


def wide_digits(seed: int, num_shards: int) -> tuple[Any, list[list[int]]]:
    """The digits MLP with 64 hidden units instead of the manifest's 128: another schema."""
    from peerloom.backends.datasets import load_digits_split, shard_indices
    from peerloom.backends.numpy.workload import make_digits_numpy_workload

    workload = make_digits_numpy_workload(seed=seed, local_epochs=1, hidden=64)
    return workload, shard_indices(len(load_digits_split(seed)[0]), num_shards, seed)

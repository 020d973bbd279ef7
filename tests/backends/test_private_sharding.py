"""A private-data trainer's lease as a sample count of its own data (spec/protocol.md §10):
`private_shards_for`, and `with_train_data` on the bundled workloads."""

from __future__ import annotations

import numpy as np
import pytest

from peerloom.backends.numpy.workload import make_digits_numpy_workload
from peerloom.backends.sharding import private_shards_for


def test_each_shard_takes_its_size_of_a_seeded_permutation_cyclically() -> None:
    sizes = [4, 3, 3, 5]
    shards = private_shards_for(sizes, 7, seed=3)
    assert [len(s) for s in shards] == sizes
    order = np.random.default_rng(3).permutation(7).tolist()
    flat = [i for s in shards for i in s]
    assert flat == [order[j % 7] for j in range(sum(sizes))]  # shard s starts at sum(sizes[:s]) mod 7
    assert all(isinstance(i, int) and 0 <= i < 7 for i in flat)
    assert set(flat) == set(range(7))  # together they cover the local data
    assert private_shards_for(sizes, 7, seed=3) == shards  # deterministic
    assert private_shards_for(sizes, 7, seed=4) != shards


def test_more_local_data_than_the_shards_hold_is_covered_by_other_leases() -> None:
    shards = private_shards_for([10, 10], 100, seed=0)
    assert len(set(shards[0]) | set(shards[1])) == 20 and not set(shards[0]) & set(shards[1])
    one = private_shards_for([250], 100, seed=0)[0]  # one shard longer than the data: every sample, cyclically
    assert len(one) == 250 and set(one) == set(range(100))


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError):
        private_shards_for([3], 0, seed=0)
    with pytest.raises(ValueError):
        private_shards_for([3, 0], 5, seed=0)


def _torch_digits(seed: int):
    pytest.importorskip("torch")
    from peerloom.backends.torch.models import make_digits_workload

    return make_digits_workload(seed)


@pytest.mark.parametrize("factory", [make_digits_numpy_workload, _torch_digits])
def test_with_train_data_trains_on_the_given_samples_only(factory) -> None:
    wl = factory(0)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((50, 64)).astype(np.float32)
    y = rng.integers(0, 10, 50)
    mine = wl.with_train_data(x, y)
    assert mine.num_train == 50 and np.array_equal(mine.train_labels, y)
    assert wl.num_train != 50  # the original keeps its data
    params = wl.initial_params(0)
    delta, metrics = mine.train(params, list(range(50)), 1)
    assert metrics["samples"] == 50 and set(delta) == {n for n, _, _ in wl.schema()}
    with pytest.raises(ValueError):
        mine.train(params, [50], 1)  # indices name rows of the new data
    with pytest.raises(ValueError):
        wl.with_train_data(x[:, :10], y)
    with pytest.raises(ValueError):
        wl.with_train_data(x, y[:10])

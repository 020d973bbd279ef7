"""Byzantine workload wrappers used by demo nodes (backends/behaviours.py)."""

import numpy as np
import pytest

from peerloom.backends.behaviours import ByzantineWorkload, wrap_workload


class LinearWorkload:
    """A stand-in workload whose delta is the mean of its sample indices times the seed (deterministic)."""

    num_train = 64

    def train(self, params, indices, seed):
        value = float(np.mean(indices)) * (1 + seed % 3)
        return {"w": np.full((3, 2), value, dtype=np.float32) - params["w"]}, {"train_loss": 0.5}


def test_honest_behaviour_is_the_workload_itself():
    w = LinearWorkload()
    assert wrap_workload(w, None) is w and wrap_workload(w, "honest") is w


def test_sign_flip_scale_sends_minus_ten_times_the_honest_delta():
    w = LinearWorkload()
    params = {"w": np.ones((3, 2), dtype=np.float32)}
    honest, _ = w.train(params, [1, 2, 3], 4)
    attacked, metrics = ByzantineWorkload(w, "sign-flip-scale").train(params, [1, 2, 3], 4)
    np.testing.assert_array_equal(attacked["w"], -10 * honest["w"])
    assert attacked["w"].dtype == np.float32 and metrics == {"train_loss": 0.5}
    assert ByzantineWorkload(w, "sign-flip-scale").num_train == 64  # everything else is delegated


def test_alie_differs_from_honest_and_replays_by_seed():
    w = LinearWorkload()
    params = {"w": np.zeros((3, 2), dtype=np.float32)}
    indices = list(range(16))
    honest, _ = w.train(params, indices, 1)
    a1, _ = ByzantineWorkload(w, "alie").train(params, indices, 1)
    a2, _ = ByzantineWorkload(w, "alie").train(params, indices, 1)
    np.testing.assert_array_equal(a1["w"], a2["w"])
    assert not np.array_equal(a1["w"], honest["w"])


def test_unknown_behaviour_is_refused():
    with pytest.raises(ValueError, match="unknown behaviour"):
        ByzantineWorkload(LinearWorkload(), "teleport")

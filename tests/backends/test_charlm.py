"""Character-level LM workload on the bundled Python docs (spec/design.md §8): shapes, determinism, learning."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from peerloom.backends.datasets import shard_indices
from peerloom.backends.torch import charlm


@pytest.fixture(scope="module")
def workload() -> charlm.CharLMWorkload:
    w = charlm.make_charlm_workload(context=32, d_model=32, layers=1, heads=2, batch_size=16)
    w.x_eval, w.y_eval = w.x_eval[:128], w.y_eval[:128]  # keep the test fast
    return w


def test_split_is_fixed_and_windows_are_shifted_by_one() -> None:
    x_train, y_train, x_val, y_val = charlm.load_charlm_split(16)
    assert x_train.dtype == np.int64 and x_train.shape[1] == 16 and x_train.shape == y_train.shape
    assert x_val.shape[1] == 16 and len(x_val) > 0
    assert len(x_val) / (len(x_train) + len(x_val)) == pytest.approx(charlm.VALIDATION_FRACTION, abs=0.01)
    assert np.array_equal(x_train[:, 1:], y_train[:, :-1])  # target = input shifted by one character
    assert np.array_equal(x_train[1:, 0], y_train[:-1, -1])  # windows are contiguous
    assert 0 <= x_train.min() and x_train.max() < charlm.VOCAB_SIZE
    again = charlm.load_charlm_split(16)
    assert all(np.array_equal(a, b) for a, b in zip((x_train, y_train, x_val, y_val), again, strict=True))
    text = charlm.corpus_text()
    ids = charlm.encode_text(text[:200])
    assert "".join(charlm.VOCAB[i] if i < len(charlm.VOCAB) else "?" for i in ids) == "".join(
        c if c in charlm.VOCAB else "?" for c in text[:200])


def test_model_shapes_and_causality() -> None:
    torch.manual_seed(0)
    model = charlm.TinyCharTransformer(context=8, d_model=16, layers=1, heads=2).eval()
    ids = torch.randint(0, charlm.VOCAB_SIZE, (3, 8))
    out = model(ids)
    assert out.shape == (3, 8, charlm.VOCAB_SIZE) and out.dtype == torch.float32
    changed = ids.clone()
    changed[:, 5] = (changed[:, 5] + 1) % charlm.VOCAB_SIZE
    out2 = model(changed)
    torch.testing.assert_close(out[:, :5], out2[:, :5])  # no position sees the future
    assert not torch.allclose(out[:, 5:], out2[:, 5:])


def test_train_is_deterministic_and_learns(workload) -> None:
    params = workload.initial_params(3)
    assert all(p.dtype == np.float32 for p in params.values())
    assert tuple(name for name, _, _ in workload.schema()) == tuple(sorted(params))
    shard = shard_indices(workload.num_train, 40, 0)[0]
    before = workload.evaluate(params)
    assert before["loss"] == pytest.approx(math.log(charlm.VOCAB_SIZE), rel=0.1)  # ~uniform at init
    assert before["bits_per_char"] == pytest.approx(before["loss"] / math.log(2))
    delta, metrics = workload.train(params, shard, seed=7)
    delta2, _ = workload.train(params, shard, seed=7)
    assert all(delta[k].tobytes() == delta2[k].tobytes() for k in delta)
    delta3, _ = workload.train(params, shard, seed=8)
    assert any(delta[k].tobytes() != delta3[k].tobytes() for k in delta)  # the seed shuffles batches
    assert metrics["samples"] == len(shard)
    after = workload.evaluate({k: params[k] - delta[k] for k in params})
    assert after["loss"] < before["loss"] - 0.5
    assert after["accuracy"] > before["accuracy"]
    assert 0.0 <= after["accuracy"] <= 1.0


def test_centralized_baseline_reports_bits_per_char() -> None:
    small = charlm.make_charlm_workload(context=16, d_model=16, layers=1, heads=2, batch_size=16)
    small.x_train, small.y_train = small.x_train[:256], small.y_train[:256]  # keep the test fast
    small.x_eval, small.y_eval = small.x_eval[:128], small.y_eval[:128]
    result = charlm.train_centralized(small, epochs=3, seed=0)
    assert set(result) == {"test_accuracy", "test_loss", "test_bits_per_char", "epochs", "wall_s"}
    assert result["test_bits_per_char"] == pytest.approx(result["test_loss"] / math.log(2))
    assert result["test_loss"] < math.log(charlm.VOCAB_SIZE)

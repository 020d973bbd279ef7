"""NumpyWorkload, the noisy quadratic, DiLoCo inner steps and kept optimizer state, the workload registry."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from peerloom.backends.numpy.reduce import outer_sgd_step, weighted_mean
from peerloom.backends.numpy.tensors import schema_of, tensor_digest
from peerloom.backends.numpy.workload import NumpyWorkload, make_digits_numpy_workload
from peerloom.backends.registry import WORKLOADS, build_workload
from peerloom.backends.synthetic import QuadraticWorkload
from peerloom.backends.torch.models import make_digits_workload


@pytest.fixture(scope="module")
def digits() -> NumpyWorkload:
    return make_digits_numpy_workload(0, local_epochs=1)


def fedavg(wl, shards, windows: int, seed0: int = 0) -> dict[str, np.ndarray]:
    params = wl.initial_params(seed0)
    for w in range(windows):
        res = [wl.train(params, s, seed=w * 100 + i) for i, s in enumerate(shards)]
        params = outer_sgd_step(params, weighted_mean([d for d, _ in res], [len(s) for s in shards]), 1.0)
    return params


def test_numpy_workload_shares_the_torch_schema(digits: NumpyWorkload) -> None:
    torch_wl = make_digits_workload(0)
    assert digits.schema() == torch_wl.schema()
    p = digits.initial_params(4)
    assert schema_of(p) == digits.schema()
    assert tensor_digest(p) == tensor_digest(digits.initial_params(4)) != tensor_digest(digits.initial_params(5))
    bound = 1 / math.sqrt(64)
    assert np.abs(p["0.weight"]).max() <= bound and np.abs(p["0.weight"]).max() > 0.9 * bound
    # numpy params run in the torch workload and vice versa (same names and shapes)
    assert 0.0 <= torch_wl.evaluate(p)["accuracy"] <= 1.0
    assert 0.0 <= digits.evaluate(torch_wl.initial_params(0))["accuracy"] <= 1.0


def test_numpy_workload_gradients_match_torch_autograd(digits: NumpyWorkload) -> None:
    # One plain-SGD-like Adam step from zero state moves each weight by ~lr * sign(grad): compare the signs
    # of the first step's delta with torch autograd's gradient on the same batch.
    import torch

    params = digits.initial_params(1)
    idx = list(range(32))
    delta, _ = digits.train(params, idx, seed=0, inner_steps=1)
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    x = torch.tensor(digits.x_train[idx])
    y = torch.tensor(digits.y_train[idx])
    h = torch.relu(x @ tp["0.weight"].T + tp["0.bias"])
    loss = torch.nn.functional.cross_entropy(h @ tp["2.weight"].T + tp["2.bias"], y)
    loss.backward()
    for k, t in tp.items():
        g = t.grad.numpy()
        big = np.abs(g) > 1e-4
        assert np.array_equal(np.sign(delta[k][big]), np.sign(g[big])), k  # delta = before - after = +lr sign(g)
        assert np.allclose(np.abs(delta[k][big]), digits.lr, rtol=1e-2)


def test_numpy_workload_learns_digits_with_fedavg(digits: NumpyWorkload) -> None:
    from peerloom.backends.datasets import shard_indices

    shards = shard_indices(digits.num_train, 4, 0)
    start = digits.evaluate(digits.initial_params(0))["accuracy"]
    params = fedavg(digits, shards, 3)
    assert digits.evaluate(params)["accuracy"] > max(0.85, start + 0.5)


def test_numpy_workload_is_deterministic_and_validates(digits: NumpyWorkload) -> None:
    params = digits.initial_params(2)
    d1, m1 = digits.train(params, range(100), 7)
    d2, m2 = digits.train(params, range(100), 7)
    d3, _ = digits.train(params, range(100), 8)
    assert tensor_digest(d1) == tensor_digest(d2) != tensor_digest(d3)
    assert m1 == m2 and m1["samples"] == 100 and math.isfinite(m1["train_loss"])
    assert tensor_digest(params) == tensor_digest(digits.initial_params(2))
    for bad in ([], [digits.num_train], [-1]):
        with pytest.raises(ValueError):
            digits.train(params, bad, 0)
    with pytest.raises(ValueError, match="schema"):
        digits.train({**params, "0.bias": np.zeros(3, np.float32)}, [0], 0)


@pytest.mark.parametrize("factory", [make_digits_numpy_workload, make_digits_workload])
def test_inner_steps_count_optimizer_steps(factory) -> None:
    wl = factory(0, batch_size=10)
    params = wl.initial_params(0)
    idx = list(range(25))  # 3 batches per pass
    one_pass, _ = wl.train(params, idx, 3, epochs=1)
    three_steps, _ = wl.train(params, idx, 3, inner_steps=3)
    assert tensor_digest(one_pass) == tensor_digest(three_steps)  # H = batches of one pass = one epoch
    seven, _ = wl.train(params, idx, 3, inner_steps=7)
    norm = lambda d: math.sqrt(sum(float((v.astype(np.float64) ** 2).sum()) for v in d.values()))  # noqa: E731
    assert norm(seven) > norm(three_steps)
    configured = factory(0, batch_size=10, inner_steps=7)
    assert tensor_digest(configured.train(params, idx, 3)[0]) == tensor_digest(seven)


@pytest.mark.parametrize("factory", [make_digits_numpy_workload, make_digits_workload])
def test_kept_optimizer_state_survives_windows_per_key(factory) -> None:
    fresh = factory(0, inner_steps=5)
    kept = factory(0, inner_steps=5, keep_optimizer_state=True)
    params = fresh.initial_params(0)
    idx = list(range(64))
    first_fresh, _ = fresh.train(params, idx, 1)
    first_kept, _ = kept.train(params, idx, 1, state_key="a")
    assert tensor_digest(first_fresh) == tensor_digest(first_kept)  # nothing kept yet
    second_fresh, _ = fresh.train(params, idx, 2)
    second_kept, _ = kept.train(params, idx, 2, state_key="a")
    assert tensor_digest(second_fresh) != tensor_digest(second_kept)  # Adam moments carried over
    other_key, _ = kept.train(params, idx, 2, state_key="b")
    assert tensor_digest(other_key) == tensor_digest(second_fresh)  # state is per key
    kept.reset_optimizer_state("a")
    assert tensor_digest(kept.train(params, idx, 2, state_key="a")[0]) == tensor_digest(second_fresh)


@pytest.mark.parametrize("factory", [make_digits_numpy_workload, make_digits_workload])
def test_with_train_labels_copies(factory) -> None:
    wl = factory(0)
    flipped = wl.with_train_labels(9 - wl.train_labels)
    assert np.array_equal(flipped.train_labels, 9 - wl.train_labels)
    assert wl.train_labels.min() == 0 and np.array_equal(wl.train_labels, factory(0).train_labels)
    with pytest.raises(ValueError):
        wl.with_train_labels([1, 2, 3])


def test_quadratic_is_fast_deterministic_and_converges_under_fedavg() -> None:
    wl = QuadraticWorkload(0)
    assert wl.schema() == (("x", "float32", (16,)),)
    params = wl.initial_params(0)
    d1, m1 = wl.train(params, range(64), 5)
    d2, m2 = wl.train(params, range(64), 5)
    d3, _ = wl.train(params, range(64), 6)
    assert tensor_digest(d1) == tensor_digest(d2) != tensor_digest(d3) and m1 == m2
    assert d1["x"].dtype == np.float32 and m1["samples"] == 64
    # the delta points from params toward the lease optimum
    target = wl.lease_target(range(64))
    assert float(np.dot(d1["x"], params["x"] - target)) > 0
    shards = [list(range(64 * i, 64 * (i + 1))) for i in range(16)]
    before = wl.evaluate(params)
    after = wl.evaluate(fedavg(wl, shards, 10))
    assert after["loss"] < 0.05 * before["loss"] and after["accuracy"] > before["accuracy"]
    start = time.perf_counter()
    for k in range(2000):
        wl.train(params, shards[k % 16], k)
    per_call = (time.perf_counter() - start) / 2000
    assert per_call < 1e-3  # tens of microseconds on a quiet core; generous bound for a shared one
    assert tensor_digest(wl.train(params, range(64), 5, inner_steps=5)[0]) == tensor_digest(d1)
    ten, _ = wl.train(params, range(64), 5, epochs=2)
    assert tensor_digest(wl.train(params, range(64), 5, inner_steps=10)[0]) == tensor_digest(ten)
    assert np.linalg.norm(ten["x"]) > np.linalg.norm(d1["x"])  # more steps, further toward the target
    with pytest.raises(ValueError):
        wl.train({"x": np.zeros(3, np.float32)}, [0], 0)
    with pytest.raises(ValueError):
        wl.train(params, [wl.num_train], 0)


def test_registry_builds_every_workload() -> None:
    assert set(WORKLOADS) >= {"digits-mlp", "digits-numpy", "quadratic", "charlm"}
    for name in WORKLOADS:
        wl, shards = build_workload(name, 0, 8)
        assert len(shards) == 8
        covered = [i for s in shards for i in s]
        assert len(set(covered)) == len(covered) and max(covered) < wl.num_train
        params = wl.initial_params(0)
        delta, metrics = wl.train(params, shards[0], 0)
        assert schema_of(delta) == wl.schema() and math.isfinite(metrics["train_loss"])
        assert set(wl.evaluate(params)) >= {"loss", "accuracy"}
    numpy_wl, _ = build_workload("digits-numpy", 0, 4, inner_steps=3)
    assert numpy_wl.inner_steps == 3
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload("nope", 0, 4)

"""TorchWorkload on the bundled digits: deltas, metrics, determinism (spec/design.md §5, §8)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from peerloom.backends.datasets import load_digits_split, shard_indices
from peerloom.backends.numpy.reduce import outer_sgd_step, weighted_mean
from peerloom.backends.numpy.tensors import schema_of, tensor_digest
from peerloom.backends.torch.models import make_digits_workload, mlp
from peerloom.backends.torch.workload import TorchWorkload


@pytest.fixture(scope="module")
def workload() -> TorchWorkload:
    return make_digits_workload(0, local_epochs=1)


@pytest.fixture(scope="module")
def shards(workload: TorchWorkload) -> list[list[int]]:
    return shard_indices(workload.num_train, 4, seed=0)


def test_digits_split_shapes_and_stratification() -> None:
    x_train, y_train, x_test, y_test = load_digits_split(0)
    assert x_train.shape == (1347, 64) and x_test.shape == (450, 64)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int64
    assert 0.0 <= x_train.min() and x_train.max() <= 1.0
    counts = np.bincount(y_test, minlength=10)
    assert counts.min() >= 43 and counts.max() <= 47  # stratified: ~45 of each digit
    again = load_digits_split(0)
    assert all(np.array_equal(a, b) for a, b in zip(again, (x_train, y_train, x_test, y_test), strict=True))
    assert not np.array_equal(load_digits_split(1)[1], y_train)


def test_shard_indices_partition() -> None:
    parts = shard_indices(10, 3, seed=5)
    assert sorted(i for p in parts for i in p) == list(range(10))
    assert [len(p) for p in parts] == [4, 3, 3]
    assert shard_indices(10, 3, seed=5) == parts != shard_indices(10, 3, seed=6)
    for bad in ((3, 0), (3, 4)):
        with pytest.raises(ValueError):
            shard_indices(*bad, seed=0)


def test_initial_params_deterministic_and_rng_untouched(workload: TorchWorkload) -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = workload.initial_params(7)
    assert torch.equal(torch.rand(3), expected_next)  # global RNG state untouched
    b = workload.initial_params(7)
    assert tensor_digest(a) == tensor_digest(b)
    assert tensor_digest(workload.initial_params(8)) != tensor_digest(a)
    assert (
        schema_of(a)
        == workload.schema()
        == (
            ("0.bias", "float32", (128,)),
            ("0.weight", "float32", (128, 64)),
            ("2.bias", "float32", (10,)),
            ("2.weight", "float32", (10, 128)),
        )
    )


def test_train_returns_finite_delta_that_reduces_loss(workload: TorchWorkload, shards) -> None:
    params = workload.initial_params(0)
    shard = shards[0]
    pointers = [t.data_ptr() for t in workload.model.parameters()]
    delta, metrics = workload.train(params, shard, seed=1)
    assert [t.data_ptr() for t in workload.model.parameters()] == pointers  # loaded in place
    assert schema_of(delta) == workload.schema()
    assert all(np.isfinite(d).all() for d in delta.values())
    assert metrics["samples"] == len(shard)
    assert math.isfinite(metrics["train_loss"])
    # Loss on the shard itself, before and after (after = params - delta: DiLoCo sign convention).
    probe = TorchWorkload(
        lambda: mlp(),
        lambda p: torch.optim.SGD(p, lr=0.1),
        torch.nn.functional.cross_entropy,
        (workload.x_train, workload.y_train),
        (workload.x_train[shard], workload.y_train[shard]),
    )
    before = probe.evaluate(params)["loss"]
    after = probe.evaluate({k: params[k] - delta[k] for k in params})["loss"]
    assert after < 0.8 * before
    ev = workload.evaluate(params)
    assert 0.0 <= ev["accuracy"] <= 1.0 and math.isfinite(ev["loss"])


def test_train_is_deterministic_per_seed(workload: TorchWorkload, shards) -> None:
    params = workload.initial_params(3)
    d1, m1 = workload.train(params, shards[1], seed=9)
    d2, m2 = workload.train(params, shards[1], seed=9)
    d3, _ = workload.train(params, shards[1], seed=10)
    assert tensor_digest(d1) == tensor_digest(d2)
    assert m1 == m2
    assert tensor_digest(d3) != tensor_digest(d1)
    # params are inputs only: the caller's arrays are never written
    assert tensor_digest(params) == tensor_digest(workload.initial_params(3))


def test_train_rejects_bad_leases_and_params(workload: TorchWorkload) -> None:
    params = workload.initial_params(0)
    for bad in ([], [workload.num_train], [-1]):
        with pytest.raises(ValueError):
            workload.train(params, bad, seed=0)
    wrong = dict(params)
    wrong["0.bias"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="schema"):
        workload.train(wrong, [0, 1], seed=0)


def test_two_windows_of_fedavg_improve_accuracy(workload: TorchWorkload, shards) -> None:
    params = workload.initial_params(0)
    start = workload.evaluate(params)["accuracy"]
    for window in range(2):
        results = [workload.train(params, s, seed=window * 10 + i) for i, s in enumerate(shards)]
        mean = weighted_mean([d for d, _ in results], [m["samples"] for _, m in results])
        params = outer_sgd_step(params, mean, 1.0)
    assert workload.evaluate(params)["accuracy"] > max(0.6, start + 0.3)


# --- the Workload protocol and its capabilities (peerloom/backends/workload.py) -----------------------------

def test_bundled_workloads_implement_the_protocol_and_state_their_capabilities():
    from pathlib import Path

    from peerloom.backends import workload as api
    from peerloom.backends.behaviours import ByzantineWorkload
    from peerloom.backends.registry import build_workload

    caps = (api.LossCheckable, api.Resumable, api.TakesStep, api.Placeable, api.Private, api.LocalData,
            api.Relabelable)

    def capabilities(w):
        assert api.has(w, api.Workload)
        return {c.__name__ for c in caps if api.has(w, c)} | ({"step"} if api.takes_step(w) else set())

    numpy_wl, _ = build_workload("digits-numpy", 0, 4)
    torch_wl, _ = build_workload("digits-mlp", 0, 4)
    quadratic, _ = build_workload("quadratic", 0, 4)
    assert capabilities(numpy_wl) == {"LossCheckable", "Resumable", "LocalData", "Relabelable"}
    assert capabilities(torch_wl) == {"LossCheckable", "Resumable", "TakesStep", "Placeable", "Private", "LocalData",
                                      "Relabelable", "step"}
    assert capabilities(quadratic) == {"LossCheckable", "Resumable"}
    assert not api.streams_delta(torch_wl) and not api.takes_step(object())
    # a wrapper has what it wraps, but an attacker keeps its own schedule (its class says so)
    attacker = ByzantineWorkload(torch_wl, "lazy")
    assert capabilities(attacker) == capabilities(torch_wl) - {"step"}

    class Opaque:  # forwards nothing: what Python >= 3.12's static protocol lookup makes of any wrapper
        TAKES_STEP = False

        def __init__(self, inner):
            self.inner = inner

    hidden = Opaque(torch_wl)
    assert not isinstance(hidden, api.LossCheckable) and api.has(hidden, api.LossCheckable)
    assert capabilities(hidden) == capabilities(torch_wl) - {"step"}  # its own flag comes first
    assert not api.has(Opaque(object()), api.Workload)
    # nodes, the executor and the simulator check capabilities by type, never by probing names
    root = Path(__file__).resolve().parents[2]
    for path in ("peerloom/node.py", "sim/adversary.py", "adapters/compute.py", "adapters/pool.py",
                 "backends/torch/pool.py"):
        source = (root / path).read_text()
        for name in ("with_privacy", "with_train_data", "to_device", "x_train", "TAKES_STEP", "STREAMS_DELTA"):
            assert f'hasattr(workload, "{name}")' not in source and f'"{name}", False)' not in source, (path, name)

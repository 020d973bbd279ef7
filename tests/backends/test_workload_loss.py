"""Every workload's forward-only ``loss(params, indices)``: a validator's loss check compares it before and after
an update on the trainer's leased samples. It must be the training loss, deterministic, leave no trace (a later
`train` gives the same bytes), fall under an honest update and not under a random one of the same norm."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from peerloom.backends.numpy.workload import NumpyWorkload, _softmax_xent
from peerloom.backends.registry import build_workload
from peerloom.backends.synthetic import QuadraticWorkload


def _applied(params: dict[str, np.ndarray], delta: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``params - delta`` (DiLoCo sign: an honest update lowers the loss), float32."""
    return {k: np.subtract(params[k], delta[k], dtype=np.float32) for k in params}


def _random_like(delta: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A Gaussian direction with the same names, shapes and global L2 norm as `delta`."""
    norm = math.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in delta.values()))
    r = {k: rng.standard_normal(v.shape) for k, v in delta.items()}
    rn = math.sqrt(sum(float(np.sum(v * v)) for v in r.values()))
    return {k: (v * (norm / rn)).astype(np.float32) for k, v in r.items()}


def _digest(tensors: dict[str, np.ndarray]) -> bytes:
    return b"".join(k.encode() + np.ascontiguousarray(tensors[k]).tobytes() for k in sorted(tensors))


def check_update_lowers_loss_and_random_does_not(workload: Any, params: dict[str, np.ndarray],
                                                  indices: list[int], seed: int) -> None:
    delta, _ = workload.train(params, indices, seed)
    before = workload.loss(params, indices)
    after = workload.loss(_applied(params, delta), indices)
    gain = before - after
    assert gain > 0.05 * abs(before)  # honest training lowers the lease's loss clearly
    rng = np.random.default_rng(99)
    randoms = [workload.loss(_applied(params, _random_like(delta, rng)), indices) for _ in range(6)]
    # a random direction of the same norm gains nothing on average, and never comes close to the honest update
    assert np.mean(randoms) > before - 0.1 * gain
    assert min(randoms) > after + 0.5 * gain


def check_errors(workload: Any, params: dict[str, np.ndarray]) -> None:
    n = workload.num_train
    for bad in ([], [n], [-1], [0, n + 5], np.zeros((2, 2), np.int64)):
        with pytest.raises(ValueError):
            workload.loss(params, bad)
    name = sorted(params)[0]
    wrong = [
        {k: v for k, v in params.items() if k != name},  # a tensor missing
        {**params, "extra": np.zeros(1, np.float32)},  # one too many
        {**params, name: params[name].astype(np.float64)},  # wrong dtype
        {**params, name: np.zeros((*params[name].shape, 1), np.float32)},  # wrong shape
    ]
    for bad_params in wrong:
        with pytest.raises(ValueError):
            workload.loss(bad_params, [0, 1])


# ---------------------------------------------------------------------------------------------------- numpy


@pytest.fixture(scope="module")
def numpy_digits() -> tuple[NumpyWorkload, list[list[int]]]:
    return build_workload("digits-numpy", 0, 8)


def test_numpy_loss_by_hand() -> None:
    # softmax regression 2 -> 3 on three rows; logits z = W x + b, loss = mean(logsumexp(z) - z[y])
    x = np.array([[1.0, 0.0], [0.0, 2.0], [1.0, -1.0]], np.float32)
    y = np.array([0, 2, 1])
    w = NumpyWorkload((x, y), (x, y), sizes=(2, 3))
    params = {"0.weight": np.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]], np.float32),
              "0.bias": np.array([0.0, 0.1, -0.2], np.float32)}
    logits = [[1.0, 0.1, 0.3], [0.0, 2.1, 0.8], [1.0, -0.9, -0.2]]
    per_row = [math.log(sum(math.exp(v) for v in z)) - z[t] for z, t in zip(logits, y.tolist(), strict=True)]
    assert w.loss(params, [0, 1, 2]) == pytest.approx(sum(per_row) / 3, rel=1e-6)
    assert w.loss(params, [1]) == pytest.approx(per_row[1], rel=1e-6)
    # duplicates count once per occurrence (sample weighting), order does not matter beyond rounding
    assert w.loss(params, [2, 0, 0]) == pytest.approx((per_row[2] + 2 * per_row[0]) / 3, rel=1e-6)


def test_numpy_loss_is_the_training_cross_entropy(numpy_digits: tuple[NumpyWorkload, list[list[int]]]) -> None:
    workload, shards = numpy_digits
    params = workload.initial_params(3)
    idx = shards[2]
    rows = np.asarray(idx)
    expected, _ = _softmax_xent(workload._forward(params, workload.x_train[rows])[-1], workload.y_train[rows], False)
    assert workload.loss(params, idx) == expected  # one chunk: the very same arithmetic
    # more rows than one chunk (1024): the sample-weighted mean over chunks is the mean over all rows
    everything = list(range(workload.num_train)) * 2
    assert len(everything) > 2 * 1024
    logits = workload._forward(params, workload.x_train)[-1].astype(np.float64)
    z = logits - logits.max(axis=1, keepdims=True)
    per_row = np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(z)), workload.y_train]
    assert workload.loss(params, everything) == pytest.approx(float(per_row.mean()), rel=1e-5)


def test_numpy_loss_deterministic_and_leaves_no_trace(numpy_digits: tuple[NumpyWorkload, list[list[int]]]) -> None:
    workload, shards = numpy_digits
    params = workload.initial_params(1)
    idx = shards[0]
    frozen = {k: v.copy() for k, v in params.items()}
    delta_plain, metrics_plain = workload.train(params, idx, 5)
    first = workload.loss(params, idx)
    state = [{k: v.copy() for k, v in d.items()} for d in (workload._w, workload._m, workload._v)]
    assert workload.loss(_applied(params, delta_plain), shards[1]) != first
    assert workload.loss(params, idx) == first
    for kept, now in zip(state, (workload._w, workload._m, workload._v), strict=True):  # weights, Adam moments
        assert all(np.array_equal(now[k], v) for k, v in kept.items())
    assert _digest(params) == _digest(frozen)
    delta_after, metrics_after = workload.train(params, idx, 5)
    assert _digest(delta_after) == _digest(delta_plain) and metrics_after == metrics_plain


@pytest.mark.parametrize("name", ["digits-numpy", "digits-mlp"])
def test_loss_leaves_kept_optimizer_state_alone(name: str) -> None:
    """Evaluating the loss between two trainings that keep their optimizer state changes nothing they compute."""
    if name == "digits-mlp":
        pytest.importorskip("torch")

    def run(with_loss: bool) -> bytes:
        workload, shards = build_workload(name, 0, 8, keep_optimizer_state=True, local_epochs=1)
        params = workload.initial_params(0)
        delta, _ = workload.train(params, shards[0], 1, state_key="t")
        params = _applied(params, delta)
        if with_loss:
            workload.loss(params, shards[0])
            workload.loss(workload.initial_params(9), shards[3])
        delta, _ = workload.train(params, shards[0], 2, state_key="t")
        return _digest(delta)

    assert run(True) == run(False)


def test_numpy_honest_update_lowers_loss(numpy_digits: tuple[NumpyWorkload, list[list[int]]]) -> None:
    workload, shards = numpy_digits
    params = workload.initial_params(0)
    check_update_lowers_loss_and_random_does_not(workload, params, shards[0], seed=1)
    trained = _applied(params, workload.train(params, shards[0], 1)[0])  # a trained starting point too
    check_update_lowers_loss_and_random_does_not(workload, trained, shards[1], seed=2)


def test_numpy_loss_errors(numpy_digits: tuple[NumpyWorkload, list[list[int]]]) -> None:
    workload, _ = numpy_digits
    check_errors(workload, workload.initial_params(0))


# ---------------------------------------------------------------------------------------------------- quadratic


def test_quadratic_loss() -> None:
    workload, shards = build_workload("quadratic", 0, 16, num_train=4096)
    params = workload.initial_params(0)
    idx = shards[3]
    _, metrics = workload.train(params, idx, 7)
    assert workload.loss(params, idx) == metrics["train_loss"]  # train reports the same objective
    c = workload.lease_target(idx).astype(np.float64)
    x = params["x"].astype(np.float64)
    assert workload.loss(params, idx) == pytest.approx(0.5 * float(np.sum(workload.a * (x - c) ** 2)), rel=1e-5)
    assert workload.loss(params, idx) == workload.loss(params, list(idx))  # deterministic
    check_update_lowers_loss_and_random_does_not(workload, params, idx, seed=7)
    check_errors(workload, params)
    with pytest.raises(ValueError):
        workload.loss({"x": params["x"].tolist()}, idx)  # not an array of float32
    assert isinstance(QuadraticWorkload(1, dim=4).loss({"x": np.zeros(4, np.float32)}, [0]), float)


# ---------------------------------------------------------------------------------------------------- wrappers


def test_wrappers_delegate_loss(numpy_digits: tuple[NumpyWorkload, list[list[int]]]) -> None:
    from peerloom.adapters.pool import PoolWorkload
    from peerloom.backends.behaviours import ByzantineWorkload

    workload, shards = numpy_digits
    params = workload.initial_params(0)
    expected = workload.loss(params, shards[0])
    # the ignore: no pool, which loss() never touches
    assert PoolWorkload(workload, pool=None).loss(params, shards[0]) == expected  # type: ignore[arg-type]
    assert ByzantineWorkload(workload, "sign-flip-scale").loss(params, shards[0]) == expected


def test_bench_flat_workload_loss() -> None:
    from bench.window import FlatWorkload

    workload = FlatWorkload(64, 4)
    params = workload.initial_params(0)
    delta, _ = workload.train(params, [2], 0)
    assert workload.loss(_applied(params, delta), [2]) < workload.loss(params, [2]) == workload.loss(params, [2])
    check_errors(workload, params)


# ---------------------------------------------------------------------------------------------------- torch


@pytest.fixture(scope="module")
def torch_digits() -> tuple[Any, list[list[int]]]:
    pytest.importorskip("torch")
    return build_workload("digits-mlp", 0, 8)


def test_torch_loss_is_the_training_loss(torch_digits: tuple[Any, list[list[int]]],
                                         numpy_digits: tuple[NumpyWorkload, list[list[int]]]) -> None:
    import torch

    workload, shards = torch_digits
    params = workload.initial_params(0)
    idx = shards[4]
    model = workload.model_factory().eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()})
    rows = torch.as_tensor(idx)
    with torch.no_grad():
        expected = float(workload.loss_fn(model(workload.x_train[rows]), workload.y_train[rows]))
    assert workload.loss(params, idx) == pytest.approx(expected, rel=1e-6)
    # the numpy twin has the same schema, data split and cross-entropy: the same loss up to float32 rounding
    twin, twin_shards = numpy_digits
    assert twin_shards == shards
    assert workload.loss(params, idx) == pytest.approx(twin.loss(params, idx), rel=1e-5)
    assert workload.loss(params, list(range(workload.num_train))) == pytest.approx(
        twin.loss(params, list(range(twin.num_train))), rel=1e-5)


def test_torch_loss_deterministic_and_leaves_no_trace(torch_digits: tuple[Any, list[list[int]]]) -> None:
    import torch

    workload, shards = torch_digits
    params = workload.initial_params(1)
    idx = shards[0]
    delta_plain, metrics_plain = workload.train(params, idx, 5)
    working = workload.params()
    for training in (True, False):
        workload.model.train(training)
        torch.manual_seed(123)
        expected_next = torch.rand(3)
        torch.manual_seed(123)
        first = workload.loss(params, idx)
        assert torch.equal(torch.rand(3), expected_next)  # global RNG untouched
        assert workload.model.training is training  # mode put back
        assert workload.loss(params, idx) == first
        assert _digest(workload.params()) == _digest(working)  # the model's weights restored
    delta_after, metrics_after = workload.train(params, idx, 5)
    assert _digest(delta_after) == _digest(delta_plain) and metrics_after == metrics_plain


def test_torch_honest_update_lowers_loss(torch_digits: tuple[Any, list[list[int]]]) -> None:
    workload, shards = torch_digits
    params = workload.initial_params(0)
    check_update_lowers_loss_and_random_does_not(workload, params, shards[0], seed=1)
    trained = _applied(params, workload.train(params, shards[0], 1)[0])
    check_update_lowers_loss_and_random_does_not(workload, trained, shards[1], seed=2)


def test_torch_loss_errors(torch_digits: tuple[Any, list[list[int]]]) -> None:
    workload, _ = torch_digits
    check_errors(workload, workload.initial_params(0))


def _user_workload(**options: Any) -> Any:
    """A user's model with dropout and BatchNorm on random 8-feature data, 3 classes."""
    torch = pytest.importorskip("torch")
    from torch import nn

    from peerloom.workloads import torch_workload

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(120, 8, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()

    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))

    return torch_workload(model=model, loss=nn.functional.cross_entropy, train_data=(x, y), eval_data=(x, y),
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=10, **options)


def test_torch_loss_eval_mode_batchnorm_dropout() -> None:
    import torch

    workload = _user_workload()
    params = workload.initial_params(0)
    params["1.running_mean"] = np.full(16, 0.3, np.float32)  # eval mode normalizes with the running stats
    params["1.running_var"] = np.full(16, 2.0, np.float32)
    idx = list(range(0, 120, 3))
    model = workload.model_factory().eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()}, strict=False)
    with torch.no_grad():
        expected = float(torch.nn.functional.cross_entropy(model(workload.x_train[idx]), workload.y_train[idx]))
    assert workload.loss(params, idx) == pytest.approx(expected, rel=1e-6)  # no dropout, running stats
    assert workload.loss(params, idx) == workload.loss(params, idx)
    tracked = int(workload.model[1].num_batches_tracked)
    before = workload.params()
    workload.loss(params, idx)
    assert int(workload.model[1].num_batches_tracked) == tracked  # BatchNorm statistics not updated
    assert _digest(workload.params()) == _digest(before)


def test_torch_loss_with_a_train_loader_and_with_bf16() -> None:
    import torch
    from torch.utils.data import DataLoader

    plain = _user_workload()
    params = plain.initial_params(0)
    idx = list(range(3, 120, 2))
    expected = plain.loss(params, idx)

    def loader(subset: Any, generator: torch.Generator) -> DataLoader:
        return DataLoader(subset, batch_size=7, shuffle=True, generator=generator)

    with_loader = _user_workload(train_loader=loader)
    assert with_loader.loss(params, idx) == pytest.approx(expected, rel=1e-5)  # the same samples, reshuffled
    assert with_loader.loss(params, idx) == with_loader.loss(params, idx)
    empty = _user_workload(train_loader=lambda subset, generator: [])
    with pytest.raises(ValueError, match="no batch"):
        empty.loss(params, idx)
    bf16 = _user_workload(bf16=True)
    assert bf16.loss(params, idx) == pytest.approx(expected, rel=5e-2)  # the training loss under bf16 autocast
    assert bf16.loss(params, idx) == bf16.loss(params, idx)


def test_charlm_inherits_torch_loss() -> None:
    torch = pytest.importorskip("torch")
    from peerloom.backends.torch import charlm

    workload = charlm.make_charlm_workload(context=16, d_model=16, layers=1, heads=2, batch_size=8)
    params = workload.initial_params(0)
    idx = list(range(40, 72))
    model = workload.model_factory().eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()})
    with torch.no_grad():  # nats per character over all the windows' characters
        expected = float(charlm.sequence_cross_entropy(model(workload.x_train[idx]), workload.y_train[idx]))
    assert workload.loss(params, idx) == pytest.approx(expected, rel=1e-5)
    delta, _ = workload.train(params, idx, 0, epochs=2)
    assert workload.loss(_applied(params, delta), idx) < workload.loss(params, idx) - 0.1

"""Checkpointed training and segment replays (segment audits): `train(..., checkpoints=S, on_checkpoint=cb)`
reports the whole training state after steps ``(j * H) // S``, and `resume(state_j, start=b_j, stop=b_{j+1})`
rebuilds state ``j + 1`` bit for bit, for the numpy, torch (built-in batching, a user's SGD-momentum / StepLR /
dropout / clipping model, bf16, train_loader with and without a generator), char-LM and quadratic workloads."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from peerloom.backends.numpy.workload import NumpyWorkload, make_digits_numpy_workload
from peerloom.backends.synthetic import QuadraticWorkload

PREFIX = "train_state."


def bounds(h: int, s: int) -> list[int]:
    return [(j * h) // s for j in range(s + 1)]


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    """Same names, dtypes, shapes and bytes."""
    return set(a) == set(b) and all(
        a[n].dtype == b[n].dtype and a[n].shape == b[n].shape and a[n].tobytes() == b[n].tobytes() for n in a)


def checkpointed(workload: Any, params: dict, lease: list[int], seed: int, h: int, s: int,
                 **options: Any) -> tuple[dict, dict, dict[int, dict]]:
    states: dict[int, dict] = {}

    def keep(j: int, state: dict) -> None:
        assert j not in states
        states[j] = {n: np.array(a, copy=True) for n, a in state.items()}

    delta, metrics = workload.train(params, lease, seed, inner_steps=h, checkpoints=s, on_checkpoint=keep,
                                    **options)
    assert sorted(states) == list(range(1, s + 1))
    return delta, metrics, states


def check_segments(workload: Any, params: dict, lease: list[int], seed: int, h: int, s: int,
                   tamper: str | None = None) -> dict[int, dict]:
    """(i) same delta as plain training, (ii) every segment replays bit for bit, (iii) the last state's params
    give the delta, layout checks, and (v) a tampered start state replays to another end state."""
    plain, plain_metrics = workload.train(params, lease, seed, inner_steps=h)
    delta, metrics, states = checkpointed(workload, params, lease, seed, h, s)
    assert same(delta, plain) and metrics == plain_metrics
    b = bounds(h, s)
    previous = params
    for j in range(1, s + 1):
        state = states[j]
        assert set(state) == set(states[s])  # one layout
        for name, _, _ in workload.schema():
            assert name in state
        for name, array in state.items():
            assert name in params or name.startswith(PREFIX), name
            assert array.dtype == np.float32 and array.flags.c_contiguous, name
            assert array.dtype.byteorder in "<=", name
        replay = workload.resume(previous, lease, seed, inner_steps=h, start=b[j - 1], stop=b[j])
        assert same(replay, state), f"segment {j} ({b[j - 1]}..{b[j]}) does not replay"
        previous = state
    for name in params:
        assert np.subtract(params[name], states[s][name], dtype=np.float32).tobytes() == delta[name].tobytes()
    if s >= 2:  # several segments at once, and the input state is left alone
        before = {n: a.copy() for n, a in states[1].items()}
        assert same(workload.resume(states[1], lease, seed, inner_steps=h, start=b[1], stop=h), states[s])
        assert same(states[1], before)
        name = tamper or workload.schema()[0][0]
        bad = dict(states[1])
        bad[name] = (states[1][name] * np.float32(1.5)).astype(np.float32)
        assert not same(workload.resume(bad, lease, seed, inner_steps=h, start=b[1], stop=b[2]), states[2])
    return states


def check_refusals(workload: Any, params: dict, lease: list[int], h: int, states: dict[int, dict],
                   kept: Callable[[], Any] | None) -> None:
    """(iv) checkpoints that cannot be taken, and replays of bad bounds or layouts."""
    with pytest.raises(ValueError, match="checkpoints"):
        workload.train(params, lease, 1, inner_steps=h, checkpoints=h + 1, on_checkpoint=lambda j, s: None)
    if kept is not None:
        with pytest.raises(ValueError, match="checkpoints"):
            kept().train(params, lease, 1, inner_steps=h, checkpoints=2, on_checkpoint=lambda j, s: None)
    for start, stop in ((-1, 2), (2, 2), (3, 2), (0, h + 1)):
        with pytest.raises(ValueError):
            workload.resume(params, lease, 1, inner_steps=h, start=start, stop=stop)
    full = states[1]
    extra = [n for n in full if n.startswith(PREFIX)]
    start = bounds(h, len(states))[1]
    if extra:
        with pytest.raises(ValueError):  # params alone only at step 0
            workload.resume(params, lease, 1, inner_steps=h, start=1, stop=2)
        for name in extra:
            partial = {n: a for n, a in full.items() if n != name}
            with pytest.raises(ValueError):
                workload.resume(partial, lease, 1, inner_steps=h, start=start, stop=h)
        with pytest.raises(ValueError):
            workload.resume({**full, PREFIX + "bogus": np.zeros(1, np.float32)}, lease, 1, inner_steps=h,
                            start=start, stop=h)
    with pytest.raises(ValueError):
        workload.resume({n: a for n, a in full.items() if n != workload.schema()[0][0]}, lease, 1, inner_steps=h,
                        start=start, stop=h)


# ---------------------------------------------------------------- numpy and quadratic


@pytest.fixture(scope="module")
def digits_numpy() -> NumpyWorkload:
    return make_digits_numpy_workload(0, hidden=32)


def test_numpy_segments_replay(digits_numpy: NumpyWorkload) -> None:
    params = digits_numpy.initial_params(3)
    lease = list(range(0, 200, 2))  # 4 batches a pass: 12 steps cross passes
    states = check_segments(digits_numpy, params, lease, 5, 12, 4)
    check_refusals(digits_numpy, params, lease, 12, states,
                   lambda: make_digits_numpy_workload(0, hidden=32, keep_optimizer_state=True))
    with pytest.raises(ValueError, match="checkpoints"):  # no inner steps: epochs
        digits_numpy.train(params, lease, 1, checkpoints=2, on_checkpoint=lambda j, s: None)


def test_quadratic_segments_replay() -> None:
    workload = QuadraticWorkload(0, dim=16, local_steps=7, num_train=1000)
    params = workload.initial_params(1)
    lease = list(range(64))
    states = check_segments(workload, params, lease, 9, 12, 4)
    assert all(set(s) == {"x"} for s in states.values())  # plain SGD: the params are the whole state
    # H defaults to the workload's own step count (local_steps * epochs).
    # the ignore: None asks for the default H
    delta, _, own = checkpointed(workload, params, lease, 9, None, 3, epochs=2)  # type: ignore[arg-type]
    assert same(delta, workload.train(params, lease, 9, epochs=2)[0])
    assert same(workload.resume(own[1], lease, 9, inner_steps=14, start=4, stop=14), own[3])
    check_refusals(workload, params, lease, 12, states, None)
    with pytest.raises(ValueError):
        workload.resume({"x": params["x"].astype(np.float64)}, lease, 9, inner_steps=12, start=0, stop=3)


# ---------------------------------------------------------------- torch

torch = pytest.importorskip("torch")
nn = torch.nn

from torch.utils.data import DataLoader  # noqa: E402

from peerloom.backends.registry import build_workload  # noqa: E402
from peerloom.workloads import torch_workload  # noqa: E402
from tests.backends.test_user_workload import TinyCNN, synthetic  # noqa: E402


def user_cnn(**options: Any) -> Any:
    """The user's model of test_user_workload with SGD + momentum, StepLR, dropout and clipping."""
    settings: dict[str, Any] = dict(
        model=TinyCNN, loss=nn.functional.cross_entropy,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.5),
        train_data=synthetic(96, 0), eval_data=synthetic(16, 1), batch_size=10, clip_grad_norm=1.0,
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5))
    return torch_workload(**{**settings, **options})


def test_torch_digits_segments_replay() -> None:
    workload, shards = build_workload("digits-mlp", 0, 8)
    params = workload.initial_params(0)
    lease = shards[0][:100]  # 4 batches of 32 a pass: 12 steps cross reshuffles
    states = check_segments(workload, params, lease, 7, 12, 4)
    names = set(states[4])
    assert {PREFIX + "meta", PREFIX + "step", PREFIX + "rng.cpu", PREFIX + "optimizer.0.weight.exp_avg",
            PREFIX + "optimizer.0.weight.exp_avg_sq", PREFIX + "optimizer.0.weight.step"} <= names
    assert states[2][PREFIX + "step"].tolist() == states[2][PREFIX + "optimizer.0.bias.step"].tolist() == [6.0]
    check_refusals(workload, params, lease, 12, states,
                   lambda: build_workload("digits-mlp", 0, 8, keep_optimizer_state=True)[0])
    with pytest.raises(ValueError, match="checkpoints"):  # no inner steps: epochs
        workload.train(params, lease, 1, checkpoints=2, on_checkpoint=lambda j, s: None)
    with pytest.raises(ValueError, match="step"):  # a state after step 3 is not one after step 2
        workload.resume(states[1], lease, 7, inner_steps=12, start=2, stop=6)
    # Tampered optimizer state: another end state; a tampered meta: refused.
    bad = dict(states[1])
    bad[PREFIX + "optimizer.0.weight.exp_avg"] = states[1][PREFIX + "optimizer.0.weight.exp_avg"] * np.float32(2)
    assert not same(workload.resume(bad, lease, 7, inner_steps=12, start=3, stop=6), states[2])
    bad = dict(states[1])
    bad[PREFIX + "meta"] = np.concatenate([states[1][PREFIX + "meta"][:-1], np.float32([300.0])])
    with pytest.raises(ValueError, match="meta"):
        workload.resume(bad, lease, 7, inner_steps=12, start=3, stop=6)


def test_torch_user_model_with_momentum_scheduler_dropout_and_clipping() -> None:
    workload = user_cnn()
    params = workload.initial_params(2)
    lease = list(range(0, 96, 2))  # 5 batches a pass
    states = check_segments(workload, params, lease, 4, 13, 4)  # uneven segments: 3, 3, 3, 4 steps
    assert PREFIX + "optimizer.conv.weight.momentum_buffer" in states[1]
    assert PREFIX + "pass_start" not in states[1]
    # The dropout masks come from the checkpoint's RNG state: another one gives another end state.
    bad = dict(states[1])
    bad[PREFIX + "rng.cpu"] = states[2][PREFIX + "rng.cpu"]
    assert not same(workload.resume(bad, lease, 4, inner_steps=13, start=3, stop=6), states[2])
    # The learning rate schedule is rebuilt from the step count: a one-segment replay equals the whole run.
    assert same(workload.resume(params, lease, 4, inner_steps=13, start=0, stop=13), states[4])
    check_refusals(workload, params, lease, 13, states, lambda: user_cnn(keep_optimizer_state=True))


def test_torch_adam_bf16_and_plain_sgd() -> None:
    for optimizer in (lambda p: torch.optim.Adam(p, lr=1e-2), lambda p: torch.optim.SGD(p, lr=0.1)):
        workload = user_cnn(optimizer=optimizer, bf16=True, scheduler=None)
        params = workload.initial_params(0)
        check_segments(workload, params, list(range(40)), 3, 8, 3)


class BatchNormNet(nn.Module):
    """BatchNorm with a cumulative average (momentum None): its running statistics read num_batches_tracked."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(64, 16)
        self.norm = nn.BatchNorm1d(16, momentum=None)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.inner(x))))


class CountingSGD(torch.optim.Optimizer):
    """A user's optimizer keeping Python scalars, None and an int64 tensor in its per-parameter state."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["n"] = state.get("n", 0) + 1
                    state["scale"] = 1.0 / (1.0 + 0.1 * state["n"])
                    state["unused"] = None
                    state["count"] = torch.tensor([state["n"]], dtype=torch.int64)
                    p.add_(p.grad, alpha=-group["lr"] * state["scale"])


def test_torch_batchnorm_counter_and_a_custom_optimizers_state() -> None:
    import json

    x, y = np.random.default_rng(0).standard_normal((60, 64)).astype(np.float32), np.arange(60) % 10
    for optimizer in (CountingSGD, lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True)):
        workload = torch_workload(model=BatchNormNet, loss=nn.functional.cross_entropy, optimizer=optimizer,
                                  train_data=(x, y), eval_data=(x[:8], y[:8]), batch_size=16,
                                  scheduler=lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, 0.9))
        params = workload.initial_params(0)
        states = check_segments(workload, params, list(range(50)), 3, 9, 3)
        meta = json.loads(states[2][PREFIX + "meta"].astype(np.uint8).tobytes())
        assert meta["buffers"]["norm.num_batches_tracked"]["hex"] == (6).to_bytes(8, "little").hex()
        if optimizer is CountingSGD:
            entry = meta["optimizer"]["head.weight"]
            assert entry["n"] == {"value": 6} and entry["unused"] == {"value": None}
            assert entry["count"]["dtype"] == "int64"


@pytest.mark.parametrize("with_generator", [True, False])
def test_torch_train_loader_segments_replay(with_generator: bool) -> None:
    def loader(subset: Any, generator: Any) -> DataLoader:
        return DataLoader(subset, batch_size=8, shuffle=True, generator=generator if with_generator else None)

    workload = user_cnn(train_loader=loader)
    params = workload.initial_params(1)
    lease = list(range(20))  # 3 batches a pass: segments start mid-pass and at a pass's end
    states = check_segments(workload, params, lease, 6, 10, 5)
    assert [int(states[j][PREFIX + "pass_start"][0]) for j in range(1, 6)] == [0, 3, 3, 6, 9]
    check_refusals(workload, params, lease, 10, states, None)
    bad = dict(states[2])
    bad[PREFIX + "pass_start"] = np.float32([0.0])
    with pytest.raises(ValueError, match="pass_start"):
        workload.resume(bad, lease, 6, inner_steps=10, start=4, stop=6)
    if not with_generator:  # the pass's order is drawn from the global RNG when the pass starts
        bad[PREFIX + "pass_start"] = states[2][PREFIX + "pass_start"]
        bad[PREFIX + "rng.pass_cpu"] = states[1][PREFIX + "rng.cpu"]
        assert not same(workload.resume(bad, lease, 6, inner_steps=10, start=4, stop=6), states[3])


def test_charlm_segments_replay() -> None:
    from peerloom.backends.torch import charlm

    workload = charlm.make_charlm_workload(context=16, d_model=16, layers=1, heads=2, batch_size=8)
    params = workload.initial_params(0)
    lease = list(range(24))
    states = check_segments(workload, params, lease, 2, 6, 3, tamper="head.weight")
    assert PREFIX + "optimizer.head.weight.exp_avg" in states[3]


def test_checkpoint_callback_cannot_disturb_training() -> None:
    workload = user_cnn()
    params = workload.initial_params(0)
    lease = list(range(40))
    plain = workload.train(params, lease, 8, inner_steps=6)[0]

    def noisy(j: int, state: dict) -> None:
        torch.rand(100)  # draws from the global RNG between steps
        for array in state.values():
            array[...] = 0.0  # the arrays are the callee's own

    delta = workload.train(params, lease, 8, inner_steps=6, checkpoints=3, on_checkpoint=noisy)[0]
    assert same(delta, plain)
    rng = torch.get_rng_state()
    workload.resume(params, lease, 8, inner_steps=6, start=0, stop=2)
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's RNG is left alone

"""An LR schedule spans windows (spec/protocol.md §5): a node passes the run's global step, ``(window - 1) *
inner_steps``, to `TorchWorkload.train` and `resume`, so the learning rate at window k is a central run's at
step ``(k - 1) * H``, and audits replay the same schedule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from peerloom.backends.numpy.tensors import tensor_digest
from peerloom.workloads import torch_workload

H = 5


def data(n: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


SCHEDULES = {
    "linear": lambda opt: torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=12),
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5),
}


def make(schedule, seen: list[float] | None = None):
    def optimizer(params):
        opt = torch.optim.SGD(params, lr=0.2, momentum=0.9)
        if seen is not None:
            opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(o.param_groups[0]["lr"]))
        return opt

    return torch_workload(model=lambda: nn.Linear(6, 3), loss=nn.functional.cross_entropy, optimizer=optimizer,
                          train_data=data(), eval_data=data(8), batch_size=8, inner_steps=H, scheduler=schedule)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_lr_at_window_k_is_the_central_runs_at_step_k_times_h(name):
    windows = 4
    seen: list[float] = []
    workload = make(SCHEDULES[name], seen)
    params = workload.initial_params(0)
    for window in range(1, windows + 1):
        workload.train(params, list(range(40)), window, step=(window - 1) * H)
    central = torch.optim.SGD(nn.Linear(6, 3).parameters(), lr=0.2, momentum=0.9)
    scheduler = SCHEDULES[name](central)
    expected = []
    for _ in range(windows * H):
        expected.append(central.param_groups[0]["lr"])
        central.step()
        scheduler.step()
    assert seen == expected  # exactly: the same float operations in the same order
    assert len(set(seen)) > 2  # the schedule moved across windows, not restarted per window


def test_a_fast_forward_from_the_remembered_position_equals_one_from_step_0():
    params = make(SCHEDULES["step"]).initial_params(0)
    lease = list(range(40))
    fresh = make(SCHEDULES["step"]).train(params, lease, 7, step=23)[0]
    warmed = make(SCHEDULES["step"])
    warmed.train(params, lease, 7, step=9)  # remembers the schedule at step 9, goes on from there
    assert tensor_digest(warmed.train(params, lease, 7, step=23)[0]) == tensor_digest(fresh)
    assert tensor_digest(warmed.train(params, lease, 7, step=4)[0]) == \
        tensor_digest(make(SCHEDULES["step"]).train(params, lease, 7, step=4)[0])  # behind it: from step 0
    assert tensor_digest(fresh) != tensor_digest(make(SCHEDULES["step"]).train(params, lease, 7)[0])
    with pytest.raises(ValueError, match="step"):
        warmed.train(params, lease, 7, step=-1)


def test_a_segment_replay_at_a_global_step_reproduces_the_checkpoint():
    workload = make(SCHEDULES["linear"])
    params = workload.initial_params(0)
    lease = list(range(40))
    states: dict[int, dict[str, np.ndarray]] = {}
    workload.train(params, lease, 3, checkpoints=H, on_checkpoint=lambda j, s: states.__setitem__(j, s), step=2 * H)
    replayed = make(SCHEDULES["linear"]).resume(states[2], lease, 3, inner_steps=H, start=2, stop=3, step=2 * H)
    assert tensor_digest(replayed) == tensor_digest(states[3])
    other = make(SCHEDULES["linear"]).resume(states[2], lease, 3, inner_steps=H, start=2, stop=3)
    assert tensor_digest(other) != tensor_digest(states[3])  # window 1's schedule is not window 3's


def test_a_node_passes_the_global_step_to_workloads_that_take_it():
    from peerloom.adapters.compute import ComputeExecutor

    executor = ComputeExecutor.__new__(ComputeExecutor)
    executor.workload = make(None)
    assert executor._global_step(3, H) == {"step": 2 * H}
    assert executor._global_step(3, 0) == {} and executor._global_step(None, H) == {}
    executor.workload = object()  # a workload without TAKES_STEP gets the arguments it always got
    assert executor._global_step(3, H) == {}

"""`peerloom.join`'s hand-over between the node's compute thread and the user's loop (spec/protocol.md §5.1),
without a fleet: a loop that follows `Window.batches` and `Window.optimizer` computes, bit for bit, the update
and the committed training states the manifest's workload computes (what validators replay); a loop that
does not is refused before anything is published; a revision without audits takes any loop; a loop that
leaves a window fails that window's task. The whole path across a fleet is examples/own_loop.py."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from peerloom.backends.numpy.tensors import tensor_digest
from peerloom.loop import LoopMismatch, LoopStopped, Peer, _LoopWorkload
from peerloom.workloads import torch_workload

H, S, CLIP = 6, 3, 0.5


def make():
    g = torch.Generator().manual_seed(0)
    data = torch.randn(48, 5, generator=g), torch.randint(0, 3, (48,), generator=g)
    return torch_workload(
        model=lambda: nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 3)),
        loss=nn.functional.cross_entropy, optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5), clip_grad_norm=CLIP,
        train_data=data, eval_data=data, batch_size=8, inner_steps=H)


def peer_of(workload, *, auditable: bool = True, check: str = "first") -> Peer:
    """A `Peer` whose node is this test: its compute thread is `train_in_thread`."""
    peer = Peer.__new__(Peer)
    peer._workload, peer._loop = workload, _LoopWorkload(workload)
    peer.auditable, peer.min_cosine, peer.check, peer._checked = auditable, 0.99, check, False
    peer._window, peer._error, peer._thread = None, None, threading.current_thread()
    return peer


def train_in_thread(peer: Peer, params, *, step: int, checkpoints: int = S) -> tuple[threading.Thread, dict]:
    """The node's ``train`` task on another thread, as its compute slot runs it; `out` gets its result."""
    out: dict[str, Any] = {"states": []}

    def task() -> None:
        try:
            out["result"] = peer._loop.train(params, list(range(48)), 11, inner_steps=H, checkpoints=checkpoints,
                                             on_checkpoint=lambda j, s: out["states"].append(s), step=step)
        except Exception as exc:  # the test looks at it
            out["error"] = exc

    thread = threading.Thread(target=task)
    thread.start()
    return thread, out


def users_loop(peer: Peer, window, *, clip: float = CLIP) -> None:
    model = peer.model
    optimizer, scheduler = window.optimizer()
    for inputs, targets in window.batches():
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        scheduler.step()
        window.record(loss, len(targets))


def test_the_users_loop_computes_what_validators_replay_bit_for_bit():
    workload = make()
    params = workload.initial_params(0)
    peer = peer_of(workload, check="every")
    thread, out = train_in_thread(peer, params, step=2 * H)
    for window in peer.windows(limit=1):
        assert (window.number, window.step, window.inner_steps, window.seed) == (3, 2 * H, H, 11)
        assert all(np.array_equal(workload.params()[n], params[n]) for n in params)  # the head is loaded
        users_loop(peer, window)
    thread.join()
    delta, metrics = out["result"]
    reference: list[dict[str, np.ndarray]] = []
    expected, _ = make().train(params, list(range(48)), 11, inner_steps=H, checkpoints=S,
                               on_checkpoint=lambda j, s: reference.append(s), step=2 * H)
    assert tensor_digest(delta) == tensor_digest(expected)
    assert [tensor_digest(s) for s in out["states"]] == [tensor_digest(s) for s in reference]
    assert metrics["samples"] == 48 and np.isfinite(metrics["train_loss"])
    assert peer._checked


@pytest.mark.parametrize("fault", ["no-clipping", "stops-early"])
def test_a_loop_that_differs_from_the_workload_is_refused_before_publishing(fault):
    workload = make()
    peer = peer_of(workload)
    thread, out = train_in_thread(peer, workload.initial_params(0), step=0)
    with pytest.raises(LoopMismatch):
        for window in peer.windows(limit=1):
            if fault == "no-clipping":
                users_loop(peer, window, clip=1e9)
            else:
                optimizer, _ = window.optimizer()
                for _, (inputs, targets) in zip(range(H - 1), window.batches(), strict=False):
                    optimizer.zero_grad()
                    nn.functional.cross_entropy(peer.model(inputs), targets).backward()
                    optimizer.step()
    thread.join()
    assert isinstance(out["error"], LoopStopped) and "result" not in out


def test_without_audits_any_loop_is_taken():
    workload = make()
    params = workload.initial_params(0)
    peer = peer_of(workload, auditable=False)
    thread, out = train_in_thread(peer, params, step=0, checkpoints=0)
    for window in peer.windows(limit=1):
        optimizer = torch.optim.Adam(peer.model.parameters(), lr=0.01)
        for _ in range(2):  # two passes, another optimizer: free, and unaudited
            for inputs, targets in window.batches() if _ == 0 else []:
                optimizer.zero_grad()
                nn.functional.cross_entropy(peer.model(inputs), targets).backward()
                optimizer.step()
    thread.join()
    delta, metrics = out["result"]
    assert any(d.any() for d in delta.values()) and np.isfinite(metrics["train_loss"])


def test_leaving_the_loop_fails_the_windows_task():
    workload = make()
    peer = peer_of(workload)
    thread, out = train_in_thread(peer, workload.initial_params(0), step=0)
    for _window in peer.windows():
        break
    thread.join(timeout=30)
    assert not thread.is_alive() and isinstance(out["error"], LoopStopped)

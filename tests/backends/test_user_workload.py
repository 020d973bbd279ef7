"""A user's own torch model, loss, optimizer and datasets as a workload (`peerloom.torch_workload`):
determinism from the training seed, the hooks (scheduler, clipping, bf16, metrics, loaders), shards, the
node's ``workload = "module:factory"`` path, and two audited windows through the in-process cluster."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from peerloom.adapters.compute import ComputeExecutor
from peerloom.backends.datasets import shard_indices
from peerloom.backends.numpy.tensors import schema_of, tensor_digest
from peerloom.core.leases import leases_of
from peerloom.node import build_node_workload, load_config
from peerloom.workloads import NumpyWorkload, TorchWorkload, numpy_workload, shards_for, torch_workload
from tests.engine_cluster import N_SHARDS, SEED, build, head_window
from tests.helpers import node_config

CLASSES = 4


class TinyCNN(nn.Module):
    """A user's model: conv -> ReLU -> pool -> dropout -> linear, on 1x8x8 images, 4 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(4 * 4 * 4, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.max_pool2d(torch.relu(self.conv(x)), 2)
        return self.head(self.drop(h.flatten(1)))


def synthetic(n: int, seed: int) -> TensorDataset:
    """Images whose class is the quadrant holding a bright 3x3 blob, plus noise: float32 [n, 1, 8, 8], int64 [n]."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    x = 0.3 * torch.randn(n, 1, 8, 8, generator=g)
    for i, label in enumerate(y.tolist()):
        r, c = divmod(label, 2)
        x[i, 0, 4 * r : 4 * r + 3, 4 * c : 4 * c + 3] += 1.0
    return TensorDataset(x, y)


class Items(Dataset):
    """A plain map-style dataset (not a TensorDataset): items are (image, label) pairs."""

    def __init__(self, base: TensorDataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x, y = self.base[i]
        return x, int(y)


def error_rate(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    return float((outputs.argmax(-1) != targets).float().mean())


def make(train=None, eval_data=None, **options) -> TorchWorkload:
    return torch_workload(model=TinyCNN, loss=nn.functional.cross_entropy,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                          train_data=synthetic(96, 0) if train is None else train,
                          eval_data=synthetic(32, 1) if eval_data is None else eval_data, batch_size=16, **options)


def cnn_factory(seed: int, num_shards: int):
    """What a user writes in their module and names with ``workload = "mymodule:cnn_factory"``."""
    train = synthetic(160, seed)
    workload = torch_workload(
        model=TinyCNN, loss=nn.functional.cross_entropy,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.5), train_data=train,
        eval_data=synthetic(64, seed + 1), batch_size=10, inner_steps=4, clip_grad_norm=5.0,
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
        metrics={"loss": nn.functional.cross_entropy, "error": error_rate})
    return workload, shards_for(len(train), num_shards, seed)


def test_shards_for_partitions_deterministically_and_is_the_bundled_mapping():
    parts = shards_for(10, 3, 5)
    assert sorted(i for p in parts for i in p) == list(range(10)) and [len(p) for p in parts] == [4, 3, 3]
    assert parts == shards_for(10, 3, 5) == shard_indices(10, 3, 5) != shards_for(10, 3, 6)
    assert all(type(i) is int for p in parts for i in p)
    for bad in ((3, 0), (3, 4), (0, 1)):
        with pytest.raises(ValueError, match="num_shards"):
            shards_for(*bad, seed=0)


def test_public_module_imports_without_torch():
    code = ("import sys, peerloom, peerloom.workloads as w; assert 'torch' not in sys.modules, 'torch imported'; "
            "assert callable(w.shards_for) and callable(w.numpy_workload); w.torch_workload; "
            "assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_training_is_a_function_of_params_lease_and_seed():
    workload = make(bf16=False)
    params = workload.initial_params(7)
    assert tensor_digest(params) == tensor_digest(make().initial_params(7)) != tensor_digest(workload.initial_params(8))
    assert schema_of(params) == workload.schema()
    lease = list(range(0, 96, 3))
    d1, m1 = workload.train(params, lease, 11, inner_steps=5)
    d2, m2 = workload.train(params, lease, 11, inner_steps=5)
    d3, _ = workload.train(params, lease, 12, inner_steps=5)  # other shuffles and dropout masks
    assert tensor_digest(d1) == tensor_digest(d2) and m1 == m2 and m1["samples"] == len(lease)
    assert tensor_digest(d3) != tensor_digest(d1)
    assert all(d.dtype == np.float32 for d in d1.values())
    # A second, separately built workload (another peer) reproduces the bytes: what audits rely on.
    assert tensor_digest(make().train(params, lease, 11, inner_steps=5)[0]) == tensor_digest(d1)


def test_a_plain_dataset_batches_like_its_tensors():
    base = synthetic(96, 0)
    tensors, items = make(base), make(Items(base), Items(synthetic(32, 1)))
    params = tensors.initial_params(0)
    lease = list(range(40))
    assert tensor_digest(items.train(params, lease, 3, inner_steps=4)[0]) == \
        tensor_digest(tensors.train(params, lease, 3, inner_steps=4)[0])
    assert items.evaluate(params) == tensors.evaluate(params)
    assert items.num_train == 96
    with pytest.raises(TypeError, match="train_labels"):
        _ = items.train_labels


def test_hooks_scheduler_clipping_bf16_and_kept_scheduler_state():
    params = make().initial_params(0)
    lease = list(range(48))
    plain = make().train(params, lease, 1, inner_steps=6)[0]
    # A scheduler that sets the learning rate to 0: no step moves the params.
    frozen = make(scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0))
    assert all(not d.any() for d in frozen.train(params, lease, 1, inner_steps=6)[0].values())
    # Clipping: plain SGD moves at most lr * max_norm per step.
    clipped = make(clip_grad_norm=0.01).train(params, lease, 1, inner_steps=6)[0]
    norm = float(np.sqrt(sum(float((d.astype(np.float64) ** 2).sum()) for d in clipped.values())))
    assert 0 < norm <= 6 * 0.1 * 0.01 * (1 + 1e-5) < float(np.sqrt(sum(float((d ** 2).sum()) for d in plain.values())))
    # bf16 autocast changes the arithmetic, deterministically; the delta stays float32.
    half = make(bf16=True)
    b1, b2 = half.train(params, lease, 1, inner_steps=6)[0], half.train(params, lease, 1, inner_steps=6)[0]
    assert tensor_digest(b1) == tensor_digest(b2) != tensor_digest(plain)
    assert all(d.dtype == np.float32 and np.isfinite(d).all() for d in b1.values())
    # Evaluation stays float32 (validators on any hardware agree on head metrics) unless asked otherwise.
    assert half.evaluate(params) == make().evaluate(params)
    assert make(bf16=True, eval_on_device=True).evaluate(params)["loss"] != make().evaluate(params)["loss"]
    # keep_optimizer_state keeps the scheduler's position too: lr 0.1 for 3 steps, then 0.
    steps = make(keep_optimizer_state=True, scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: 1.0 if step < 3 else 0.0))
    first = steps.train(params, lease, 1, inner_steps=3, state_key="a")[0]
    assert any(d.any() for d in first.values())
    assert all(not d.any() for d in steps.train(params, lease, 1, inner_steps=3, state_key="a")[0].values())
    assert any(d.any() for d in steps.train(params, lease, 1, inner_steps=3, state_key="b")[0].values())


def test_metrics_of_the_users_choosing():
    workload = make(metrics={"loss": nn.functional.cross_entropy, "error": error_rate})
    params = workload.initial_params(0)
    default = make().evaluate(params)
    chosen = workload.evaluate(params)
    assert set(default) == {"loss", "accuracy"} and set(chosen) == {"loss", "error"}
    assert chosen["error"] == pytest.approx(1.0 - default["accuracy"])
    assert chosen["loss"] == pytest.approx(default["loss"], rel=1e-6)
    with pytest.raises(ValueError, match="metrics"):
        make(metrics={})


def test_dataloader_factories_draw_from_the_training_seed():
    batches = []

    def loader(subset, generator):
        batches.append(len(subset))
        return DataLoader(subset, batch_size=8, shuffle=True, generator=generator)

    workload = make(train_loader=loader, eval_loader=lambda ds: DataLoader(ds, batch_size=5))
    params = workload.initial_params(0)
    lease = list(range(20))  # 3 batches a pass: 10 steps cross three reshuffles
    d1 = workload.train(params, lease, 4, inner_steps=10)[0]
    assert batches == [20]
    assert tensor_digest(workload.train(params, lease, 4, inner_steps=10)[0]) == tensor_digest(d1)
    assert tensor_digest(workload.train(params, lease, 5, inner_steps=10)[0]) != tensor_digest(d1)
    assert workload.evaluate(params) == pytest.approx(make().evaluate(params))


def test_numpy_workload_has_the_same_shape():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((60, 5)).astype(np.float32), rng.integers(0, 3, 60)
    workload = numpy_workload(sizes=(5, 8, 3), train_data=(x, y), eval_data=list(zip(x[:20], y[:20], strict=True)),
                              inner_steps=3, metrics={"error": lambda logits, labels: float(
                                  np.mean(logits.argmax(1) != labels))})
    assert isinstance(workload, NumpyWorkload) and workload.num_train == 60
    params = workload.initial_params(1)
    delta, _ = workload.train(params, shards_for(60, 3, 0)[0], 2)
    assert tensor_digest(delta) == tensor_digest(workload.train(params, shards_for(60, 3, 0)[0], 2)[0])
    assert set(workload.evaluate(params)) == {"error"}


def test_user_cnn_trains_two_audited_windows_through_the_node_factory_path(tmp_path, monkeypatch):
    """The factory goes through the node's config path (``workload = "module:function"``); each node gets its
    own instance, as separate processes would; validator and reducer re-run every update (audit) and accept
    the honest ones."""
    config = load_config(node_config(tmp_path, 'workload = "tests.backends.test_user_workload:cnn_factory"\n'))
    workload, shards = build_node_workload(config, "digits-mlp", SEED, N_SHARDS)
    assert isinstance(workload, TorchWorkload) and shards == shards_for(160, N_SHARDS, SEED)
    audits = []
    original = ComputeExecutor._audit

    def counted(self, delta, audit):
        result = original(self, delta, audit)
        audits.append(result)
        return result

    monkeypatch.setattr(ComputeExecutor, "_audit", counted)
    cluster = build(tmp_path / "c", (workload, shards), trainers=2, audit=True, audit_min_cosine=0.999999)
    for node in cluster.nodes.values():  # one workload per peer, built by the factory like every node does
        node.executor.workload = build_node_workload(config, "digits-mlp", SEED, N_SHARDS)[0]
    assert cluster.run_until(lambda c: all(head_window(c, n) >= 2 for n in c.nodes), max_time=60.0)
    v = cluster.nodes["validator"]
    heads = [h for _, h, _ in v.heads][:2]
    previous = cluster.revision.genesis()
    for head in heads:
        assert not head.skipped and len(head.cohort) == len(leases_of(previous, cluster.revision.manifest))
        assert set(head.metrics) == {"test_loss", "test_error", "train_loss"}  # the user's metrics, named
        previous = head
    assert "screen-audit" not in v.engine.rejected_by_reason
    assert len(audits) >= 2 * sum(len(h.cohort) for h in heads) and all(ok for ok, _ in audits)
    start = workload.evaluate(workload.initial_params(SEED))
    assert heads[1].metrics["test_loss"] < heads[0].metrics["test_loss"] < start["loss"]  # it learns

"""Node config keys ``compute`` (numpy or torch for screening and reduction) and ``device`` (where a torch
workload trains): the two compute backends certify the same heads, byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from peerloom.adapters.compute import ComputeExecutor, TorchCompute
from peerloom.adapters.storage import ArtifactStore
from peerloom.backends._robust import RULES
from peerloom.backends.numpy.tensors import tensor_digest
from peerloom.backends.registry import build_workload
from peerloom.core.tasks import ReduceTask, ScreenTask
from peerloom.node import ConfigError, build_runtime, load_config, place_workload
from peerloom.workloads import DeviceError, resolve_device, shards_for, torch_workload
from tests.engine_cluster import N_SHARDS, SEED, build, build_until, head_window
from tests.helpers import make_revision, node_config


@pytest.fixture(scope="module")
def digits():
    return build_workload("digits-mlp", SEED, N_SHARDS)


def test_compute_torch_and_numpy_certify_the_same_heads(tmp_path, digits, monkeypatch):
    """The same manifest, identities and seeds, once with every validator and reducer on numpy and once on
    torch: head ids equal window by window (DiLoCo momentum, centered clipping, cohort screening)."""
    calls = []
    original = TorchCompute.aggregate
    monkeypatch.setattr(TorchCompute, "aggregate", lambda self, *a: calls.append(a[0]) or original(self, *a))
    fields = dict(trainers=3, rule="centered_clip", outer_optimizer="diloco", outer_lr=0.7, outer_momentum=0.9,
                  norm_ratio=3.0, min_cosine=-0.5, validators=2, quorum=2)
    ids = {}
    for compute in ("numpy", "torch"):
        cluster = build(tmp_path / compute, digits, compute=compute, **fields)
        assert cluster.run_until(lambda c: all(head_window(c, n) >= 3 for n in ("validator", "v1")), max_time=90.0)
        heads = [h for _, h, _ in cluster.nodes["validator"].heads][:3]
        assert all(not h.skipped and h.outer_state is not None for h in heads)
        assert cluster.nodes["validator"].engine.stats["proposals_confirmed"] >= 1
        ids[compute] = [(h.window, h.id) for h in heads]
        assert {x.executor.compute.name for n, x in cluster.nodes.items() if n[0] in "vr"} == {compute}
    assert ids["numpy"] == ids["torch"]
    assert "centered_clip" in calls and "median" in calls  # the torch run aggregated and screened with torch


def test_a_fleet_may_mix_compute_backends(tmp_path, digits):
    """A torch validator confirms a numpy reducer's proposals (and the reverse would fail on any byte)."""
    cluster = build_until(2, tmp_path, digits, trainers=2, rule="median", compute=["torch", "numpy"])
    engine = cluster.nodes["validator"].engine
    assert engine.stats["proposals_confirmed"] >= 1
    assert engine.rejected_by_reason.get("proposal-mismatch", 0) == 0


def test_executor_backends_agree_on_every_rule(tmp_path):
    rng = np.random.default_rng(0)
    params = {"a": rng.standard_normal(40).astype(np.float32), "b": rng.standard_normal((3, 5)).astype(np.float32)}
    schema = tuple((k, "float32", v.shape) for k, v in sorted(params.items()))
    revision = make_revision(schema=schema)
    store = ArtifactStore(tmp_path, chunk_size=1 << 16)
    ex = {c: ComputeExecutor(store, revision.manifest, None, [], compute=c) for c in ("numpy", "torch")}
    deltas = [{k: (rng.standard_normal(v.shape) * (1 + 4 * (i == 5))).astype(np.float32) for k, v in params.items()}
              for i in range(6)]
    refs = [ex["numpy"].save(d)[0] for d in deltas]
    base = {"params": ex["numpy"].save(params)[0], "deltas": tuple(refs), "weights": (3, 1, 2, 2, 1, 4),
            "outer_lr": 0.7, "norm_ratio": 2.0, "min_cosine": -0.2}
    for rule in RULES:
        for optimizer in ("fedavg", "diloco"):
            task = ReduceTask(**base, rule=rule, outer_optimizer=optimizer)
            a, b = ex["numpy"].run(task), ex["torch"].run(task)
            assert a == b, (rule, optimizer)
    # a cohort outlier carries its numbers: the norm, the cohort's median, the ratio and the threshold
    outliers = ex["numpy"].run(ReduceTask(**base, rule="mean", outer_optimizer="fedavg")).outliers
    assert [(o.index, o.reason) for o in outliers] == [(5, "norm-outlier")]
    assert "x the cohort's median norm" in outliers[0].detail and "threshold 2 x =" in outliers[0].detail
    for ref, delta in zip(refs, deltas, strict=True):
        screen = ScreenTask(delta=ref, delta_digest=tensor_digest(delta))
        assert ex["numpy"].run(screen) == ex["torch"].run(screen)
    with pytest.raises(ValueError, match="compute must be one of numpy, torch"):
        ComputeExecutor(store, revision.manifest, None, [], compute="jax")


def test_an_absent_device_is_named():
    for name in ("cuda", "cuda:0", "mps"):
        present = torch.cuda.is_available() if name.startswith("cuda") else torch.backends.mps.is_available()
        if present:
            assert resolve_device(name) == name
        else:
            with pytest.raises(DeviceError, match=f"device '{name}' is not available on this machine"):
                resolve_device(name)
    expected = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert resolve_device("auto") == expected and resolve_device("cpu") == "cpu"


def test_device_places_torch_workloads_and_refuses_gpus_for_numpy(monkeypatch, digits):
    numpy_wl, _ = build_workload("digits-numpy", SEED, N_SHARDS)
    assert place_workload(numpy_wl, "auto") is numpy_wl and place_workload(numpy_wl, "cpu") is numpy_wl
    monkeypatch.setattr("peerloom.node.resolve_device", lambda name: "cuda:0")
    with pytest.raises(ConfigError, match="device 'cuda:0': the workload NumpyWorkload runs on the CPU only"):
        place_workload(numpy_wl, "cuda:0")
    monkeypatch.undo()
    moved = []
    monkeypatch.setattr(type(digits[0]), "to_device", lambda self, d: moved.append(d) or self)
    place_workload(digits[0], "auto")
    assert moved == [resolve_device("auto")]


def test_node_runtime_takes_the_compute_and_device_keys(tmp_path):
    params = build_workload("digits-mlp", 0, 2)[0].initial_params(0)  # a node refuses a model the manifest lacks
    revision = make_revision(schema=tuple((name, "float32", tensor.shape) for name, tensor in params.items()))
    (tmp_path / "m").write_bytes(revision.envelope.to_bytes())
    config = node_config(tmp_path, 'compute = "torch"\ndevice = "auto"\ncompute_threads = 3\n')
    runtime = build_runtime(load_config(config))
    try:
        assert runtime.executor.compute.name == "torch" and runtime.executor.compute.threads == 3
        assert runtime.executor.workload.device.type == resolve_device("auto")
    finally:
        runtime.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: torch.cuda.is_available() is False "
                                                           "on this machine")
def test_cuda_training_reproduces_and_returns_cpu_float32():
    x = torch.randn(64, 10, generator=torch.Generator().manual_seed(0))
    data = (x, (x[:, 0] > 0).long())

    def make(device):
        return torch_workload(model=lambda: torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(),
                                                                torch.nn.Linear(16, 2)),
                              loss=torch.nn.functional.cross_entropy, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                              train_data=data, eval_data=data, batch_size=8, device=device)

    gpu, cpu = make("cuda"), make("cpu")
    assert gpu.device.type == "cuda" and next(gpu.model.parameters()).is_cuda
    params = cpu.initial_params(0)
    assert tensor_digest(gpu.initial_params(0)) == tensor_digest(params)  # built on the CPU everywhere
    lease = shards_for(64, 2, 0)[0]
    d1, d2 = gpu.train(params, lease, 5, inner_steps=6)[0], gpu.train(params, lease, 5, inner_steps=6)[0]
    assert all(isinstance(d, np.ndarray) and d.dtype == np.float32 for d in d1.values())
    assert tensor_digest(d1) == tensor_digest(d2)
    ref = cpu.train(params, lease, 5, inner_steps=6)[0]
    dot = sum(float(np.dot(d1[k].ravel().astype(np.float64), ref[k].ravel())) for k in ref)
    norms = [np.sqrt(sum(float((d[k].astype(np.float64) ** 2).sum()) for k in ref)) for d in (d1, ref)]
    assert dot / (norms[0] * norms[1]) > 0.999  # what an audit on another device compares
    assert gpu.evaluate(params) == cpu.evaluate(params)  # a CPU float32 copy: validators agree on metrics
    on_gpu = make("cuda")
    on_gpu.eval_on_device = True
    assert on_gpu.evaluate(params) == pytest.approx(cpu.evaluate(params), abs=1e-3)

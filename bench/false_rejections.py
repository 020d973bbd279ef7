"""Honest false rejections of the default screening (spec/protocol.md §6 cohort screening, §6.1 loss check).

Every trainer is honest, so every rejection is a false one. An in-process loop of the engine's default
manifest (`core.objects.Manifest`'s defaults: DiLoCo outer step, Nesterov lr 0.7 momentum 0.9, the
``centered_clip`` rule, `peerloom init`'s defaults) runs `--windows` windows with `--trainers` trainers, one
seeded shard each. Every window each trainer trains from the head's params on its shard as a node's
executor calls the workload (``inner_steps`` H and, for a workload whose LR schedule spans windows, the run's
global step ``(window - 1) * H``, spec §5.1); the window's updates are screened by the executor's own
`peerloom.adapters.compute.cohort_outliers` at the manifest's default thresholds, as the ``reduce`` task
runs it, and the kept updates are reduced. Separately, every update gets the loss check (§6.1: the
executor's ``loss_check_batch`` on 64 of its leased samples and ``loss_check_passes`` at ``loss_min_drop``
0), which a deployment enables with ``loss_check_samples``; its verdicts are reported apart and do not
change the trajectory (the default manifest has it off).

Workloads (``--workloads``), chosen for what drives the spread of honest update norms:

- ``digits``, ``mnist1d``: the bundled numpy MLPs at their own training settings (Adam 5e-3, batch 32, one
  local epoch per window: the manifest's ``inner_steps`` 0);
- ``digits-h16``, ``mnist1d-h16``: the same with DiLoCo's H = 16 inner steps;
- ``breast-cancer``: a torch MLP 30-32-2 on scikit-learn's breast-cancer data (569 samples, 30 features
  left unnormalised: their scales span 1e-3 to 4e3; an 80/20 split), SGD lr 1e-3 with momentum 0.9, a
  `LinearLR` warm-up from 0.1 over the first 160 steps, gradient clipping at norm 1, batch 16, H = 16: the
  setting of the user report that started this measurement. Without scikit-learn, a generated set of the
  same shape (features of log-uniform scales, 2 classes) stands in.

Prints progress to stderr and one JSON object on its last line: ``{"rule": the screening parameters,
"windows", "results": [{"workload", "trainers", "updates", "screened" (cohort screening's false rejections),
"screen_rate", "loss_rejected", "loss_rate", "norm_spread" (quantiles over windows of the largest honest
norm over the cohort's median norm), "accuracy" (final test accuracy)}], "wall_s"}``. ``--quick``: digits and
breast-cancer, 4 trainers, 6 windows.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from typing import Any

import attrs
import numpy as np

from peerloom.adapters.compute import NumpyCompute, cohort_outliers, loss_check_batch, loss_check_passes
from peerloom.backends.datasets import shard_indices
from peerloom.backends.numpy.aggregate import aggregate, outer_step
from peerloom.backends.registry import build_workload
from peerloom.backends.workload import takes_step
from peerloom.core.audit import loss_batch_seed
from peerloom.core.objects import Manifest

DEFAULTS = {name: field.default for name, field in attrs.fields_dict(Manifest).items()}
SCREENING = {"norm_ratio": float(DEFAULTS["norm_ratio"]), "min_cosine": float(DEFAULTS["min_cosine"]),
             "norm_mads": int(DEFAULTS["norm_mads"])}
RULE = "centered_clip"  # `peerloom init`'s default aggregation rule
OUTER = {"name": "diloco", "lr": 0.7, "momentum": 0.9}  # `peerloom init`'s default outer optimizer
LOSS_SAMPLES = 64  # `loss_check_samples` of a deployment that enables the loss check
LOSS_MIN_DROP = float(DEFAULTS["loss_min_drop"])
WORKLOADS = ("digits", "mnist1d", "digits-h16", "mnist1d-h16", "breast-cancer")
TRAINERS = (4, 8)
H = 16


def breast_cancer_data(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, y_train, x_test, y_test)``: float32 ``[n, 30]`` unnormalised features, int64 labels 0/1, a
    seeded stratified 80/20 split of scikit-learn's breast-cancer data (569 samples); without scikit-learn a
    generated set of the same shape whose feature scales are log-uniform over 1e-3..4e3."""
    try:
        from sklearn.datasets import load_breast_cancer
        from sklearn.model_selection import train_test_split
    except ImportError:
        rng = np.random.default_rng(seed)
        y = rng.integers(0, 2, 569)
        scales = 10.0 ** rng.uniform(-3, 3.6, 30)
        x = (np.abs(rng.normal(1.0 + 0.4 * y[:, None], 0.3, (569, 30))) * scales).astype(np.float32)
        cut = int(0.8 * 569)
        return x[:cut], y[:cut].astype(np.int64), x[cut:], y[cut:].astype(np.int64)
    bunch = load_breast_cancer()
    x_train, x_test, y_train, y_test = train_test_split(
        bunch.data.astype(np.float32), bunch.target.astype(np.int64), test_size=0.2, random_state=seed,
        stratify=bunch.target)
    return x_train, y_train, x_test, y_test


def make_workload(name: str, seed: int, trainers: int) -> tuple[Any, list[list[int]], int]:
    """(workload, one shard of train indices per trainer, the manifest's ``inner_steps``)."""
    if name == "breast-cancer":
        import torch
        from torch import nn

        from peerloom.backends.torch.models import mlp
        from peerloom.backends.torch.workload import TorchWorkload

        torch.set_num_threads(1)
        x_train, y_train, x_test, y_test = breast_cancer_data(seed)
        workload = TorchWorkload(
            lambda: mlp((30, 32, 2)), lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9),
            nn.functional.cross_entropy, (x_train, y_train), (x_test, y_test), batch_size=16, inner_steps=H,
            scheduler_factory=lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=10 * H),
            clip_grad_norm=1.0)
        return workload, shard_indices(workload.num_train, trainers, seed), H
    base, _, steps = name.partition("-h")
    inner = int(steps) if steps else 0
    options = {"inner_steps": inner} if inner else {}
    workload, shards = build_workload(f"{base}-numpy", seed, trainers, **options)
    return workload, shards, inner


def _stand_in_id(*parts: Any) -> bytes:
    """Stand-in for an update's id (the hash of its signed announcement): fixes its loss-check batch."""
    return hashlib.sha256("/".join(["false-rejections-bench", *map(str, parts)]).encode()).digest()


def _norm(delta: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.dot(t.ravel().astype(np.float64), t.ravel().astype(np.float64)))
                             for t in delta.values())))


def run(name: str, trainers: int, windows: int, seed: int) -> dict[str, Any]:
    """One workload and trainer count: the measurements of the module docstring."""
    workload, shards, inner = make_workload(name, seed, trainers)
    compute = NumpyCompute()
    params = workload.initial_params(seed)
    state = None
    step_taken = takes_step(workload) and inner > 0
    screened = loss_rejected = updates = 0
    spread: list[float] = []
    for w in range(1, windows + 1):
        deltas = []
        for i in range(trainers):
            options: dict[str, Any] = {"inner_steps": inner} if inner else {}
            if step_taken:
                options["step"] = (w - 1) * inner
            deltas.append(workload.train(params, shards[i], seed * 100_003 + w * 101 + i, **options)[0])
        updates += trainers
        for i, delta in enumerate(deltas):
            batch = loss_check_batch(shards[i], LOSS_SAMPLES, loss_batch_seed(_stand_in_id(name, seed, w, i)))
            applied = {n: np.subtract(params[n], delta[n], dtype=np.float32) for n in params}
            opposite = {n: np.add(params[n], delta[n], dtype=np.float32) for n in params}
            loss_rejected += not loss_check_passes(float(workload.loss(applied, batch)),
                                                   float(workload.loss(opposite, batch)), LOSS_MIN_DROP)
        norms = sorted(_norm(d) for d in deltas)
        spread.append(norms[-1] / float(np.median(norms)) if np.median(norms) > 0 else float("inf"))
        outliers = cohort_outliers(compute, deltas, **SCREENING)
        for i, reason, detail in outliers:
            print(f"  {name} x{trainers} window {w}: trainer {i} {reason}: {detail}", file=sys.stderr)
        screened += len(outliers)
        bad = {i for i, *_ in outliers}
        kept = [d for i, d in enumerate(deltas) if i not in bad]
        if kept:
            weights = [len(shards[i]) for i in range(trainers) if i not in bad]
            params, state = outer_step(OUTER["name"], params, aggregate(RULE, kept, weights), state,
                                       lr=OUTER["lr"], momentum=OUTER["momentum"])
    accuracy = float(workload.evaluate(params)["accuracy"])
    print(f"{name} x{trainers}: {screened}/{updates} screened, {loss_rejected} loss-rejected, "
          f"accuracy {accuracy:.3f}", file=sys.stderr, flush=True)
    return {"workload": name, "trainers": trainers, "updates": updates, "screened": screened,
            "screen_rate": screened / updates, "loss_rejected": loss_rejected, "loss_rate": loss_rejected / updates,
            "norm_spread": dict(zip(("median", "q90", "max"),
                                    np.quantile(spread, [0.5, 0.9, 1.0]).round(3).tolist(), strict=True)),
            "accuracy": accuracy}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--trainers", default=",".join(map(str, TRAINERS)))
    parser.add_argument("--windows", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="digits and breast-cancer, 4 trainers, 6 windows")
    args = parser.parse_args(argv)
    names, counts, windows = args.workloads.split(","), [int(t) for t in args.trainers.split(",")], args.windows
    if args.quick:
        names, counts, windows = ["digits", "breast-cancer"], [4], 6
    for name in names:
        if name not in WORKLOADS:
            parser.error(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    start = time.perf_counter()
    results = [run(name, n, windows, args.seed) for name in names for n in counts]
    report = {"rule": SCREENING, "aggregation": RULE, "outer": OUTER, "loss_check_samples": LOSS_SAMPLES,
              "loss_min_drop": LOSS_MIN_DROP, "windows": windows, "seed": args.seed, "results": results,
              "wall_s": round(time.perf_counter() - start, 1)}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()

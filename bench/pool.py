"""Trainer pool scaling: the same lease trained by one process and by pools of N ranks (issue 19;
spec/pools.md).

Workload: a seeded MLP (64 -> hidden -> hidden -> 10 classes, tanh) on seeded synthetic data, SGD with
momentum; one task is `--steps` inner steps over a lease of `--lease` samples in global batches of `--batch`
(a pool splits every global batch over its ranks, spec/pools.md §2, so it does the single process's work).
Baseline, measured in the same run: one process training the same lease with `TorchWorkload.train` on the
same device kind. Pools: N gloo ranks on the CPU (`--ranks`, each rank one torch thread), and with
`--backend nccl` one rank per GPU. Each figure is the median of `--repeats` timed tasks after one warm-up.

Per configuration: ``seconds`` per task (training only: no network), ``windows_per_min`` (60 / seconds),
``samples_per_s_per_rank``, ``speedup`` (single seconds / pool seconds), ``efficiency`` (speedup / N) and
``max_abs_diff`` (largest |pool delta - single delta|: the equivalence of spec/pools.md §3). Prints one JSON
object on its last line: ``{"device", "cpus", "single": {...}, "pools": [{...}], ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from peerloom.adapters.pool import RankEnv, TrainerPool, run_worker
from peerloom.workloads import torch_workload

FEATURES, CLASSES = 64, 10


def build(args: argparse.Namespace, device: str) -> object:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.lease, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(dim=1)
    hidden = args.hidden

    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                             nn.Linear(hidden, CLASSES))

    workload = torch_workload(model=model, loss=nn.functional.cross_entropy,
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                              train_data=TensorDataset(x, y), eval_data=TensorDataset(x[:64], y[:64]),
                              batch_size=args.batch, inner_steps=args.steps)
    return workload.to_device(device)


def timed(fn, repeats: int) -> tuple[float, object]:
    out = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def figures(seconds: float, ranks: int, args: argparse.Namespace) -> dict:
    return {"seconds": round(seconds, 5), "windows_per_min": round(60.0 / seconds, 2),
            "samples_per_s_per_rank": round(args.steps * args.batch / seconds / ranks, 1)}


def worker(args: argparse.Namespace) -> int:
    env = RankEnv.from_environ()
    assert env is not None
    torch.set_num_threads(args.threads)
    device = f"cuda:{env.local_rank}" if args.backend == "nccl" else "cpu"
    return run_worker(build(args, device), env, timeout_s=args.timeout_s, backend=args.backend)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes (for tests)")
    parser.add_argument("--ranks", default=None,
                        help="comma-separated pool sizes (default: 2 for gloo, one rank per GPU for nccl)")
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--lease", type=int, default=4096, help="samples in the lease")
    parser.add_argument("--batch", type=int, default=256, help="global mini-batch (samples)")
    parser.add_argument("--steps", type=int, default=40, help="inner steps per task")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (CPU)")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.lease, args.batch, args.steps, args.repeats = 32, 256, 32, 4, 1
    if args.worker:
        sys.exit(worker(args))
    torch.set_num_threads(args.threads)
    device = "cuda:0" if args.backend == "nccl" else "cpu"
    default = str(torch.cuda.device_count()) if args.backend == "nccl" else "2"
    sizes = [int(n) for n in (args.ranks or default).split(",")]
    single = build(args, device)
    params = single.initial_params(0)
    lease = list(range(args.lease))
    single_s, (expected, _) = timed(lambda: single.train(params, lease, 1), args.repeats)
    report: dict = {"device": torch.cuda.get_device_name(0) if args.backend == "nccl" else "cpu",
                    "cpus": os.cpu_count(), "backend": args.backend, "threads_per_rank": args.threads,
                    "lease": args.lease, "batch": args.batch, "steps": args.steps, "hidden": args.hidden,
                    "single": figures(single_s, 1, args), "pools": []}
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--worker"]
    for ranks in sizes:
        pool = TrainerPool(build(args, device), ranks=ranks, timeout_s=args.timeout_s, backend=args.backend,
                           argv=[sys.executable, os.path.abspath(__file__), "--worker", *forwarded])
        try:
            pool.start()
            pool_s, (delta, _) = timed(lambda: pool.train(params, lease, 1), args.repeats)  # noqa: B023
        finally:
            pool.close()
        speedup = single_s / pool_s
        diff = max(float(np.abs(delta[n] - expected[n]).max()) for n in expected)
        report["pools"].append({"ranks": ranks, **figures(pool_s, ranks, args), "speedup": round(speedup, 3),
                                "efficiency": round(speedup / ranks, 3), "max_abs_diff": diff})
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()

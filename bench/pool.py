"""Trainer pool scaling: the same lease trained by one process and by pools of N ranks (spec/pools.md;
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

``--memory``: the peak memory of every rank against the model size, for ``[pool] parallel`` = ddp, fsdp and
pipeline with 2 and 4 ranks (spec/pools.md §6-7). Workload: an MLP 64 -> h -> (h -> h) x L -> 10 (tanh, float32,
`--mem-hidden`, `--mem-layers`), Adam, `--mem-steps` inner steps of 8-sample batches. Rank 0 runs in a process
of its own, as a node does: for a sharded pool it reads the head from a safetensors file tensor by tensor and
writes the pseudo-gradient into one block by block (spec/pools.md §6); ddp loads the head and returns the delta
whole. Each rank resets its peak (Linux ``/proc/self/clear_refs``) before a task and reports ``VmHWM`` after
it (CUDA: ``torch.cuda.max_memory_allocated``); the second task is measured (the first builds the sharded model
and releases the whole one). Figures: ``peak_x_model`` (the largest rank's peak / model bytes), per rank, and
``above_base_x_model`` (the same above ``base_mb``: an idle process that imported torch and the pool, formed a
gloo group of one and built the data, but holds no model). Every rank runs with ``MALLOC_MMAP_THRESHOLD_``
fixed (see `memory`). ``fsdp4_over_ddp`` is fsdp's largest per-rank peak with 4 ranks over ddp's with 4 ranks. With
``--budget X`` the ranks also run under ``RLIMIT_DATA`` = their data size at start + X model sizes (CPU; under
ddp rank 0 is measured, not limited): the report says which modes trained and how the others failed
(``PoolError``, no update).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

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


def build_memory(args: argparse.Namespace, device: str) -> object:
    """The memory bench's workload: an MLP of `--mem-layers` h x h layers, Adam, batches of 8."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(dim=1)
    hidden, layers = args.mem_hidden, args.mem_layers

    def model() -> nn.Module:
        inner = [m for _ in range(layers) for m in (nn.Linear(hidden, hidden), nn.Tanh())]
        return nn.Sequential(nn.Linear(FEATURES, hidden), nn.Tanh(), *inner, nn.Linear(hidden, CLASSES))

    workload = torch_workload(model=model, loss=nn.functional.cross_entropy,
                              optimizer=lambda p: torch.optim.Adam(p, lr=1e-4),
                              train_data=TensorDataset(x, y), eval_data=TensorDataset(x[:8], y[:8]),
                              batch_size=8, inner_steps=args.mem_steps)
    return workload.to_device(device)


def _status(key: str) -> int:
    """A ``/proc/self/status`` figure in bytes (``VmHWM``, ``VmRSS``, ``VmData``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak(device: str) -> None:
    if device.startswith("cuda"):  # the GPU's peak is what counts; a sandboxed kernel may lack clear_refs
        torch.cuda.reset_peak_memory_stats()
        return
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _peak(device: str) -> int:
    return torch.cuda.max_memory_allocated() if device.startswith("cuda") else _status("VmHWM")


def _limit(budget: float | None, model_bytes: int) -> None:
    """Cap this process's data (``RLIMIT_DATA``) at its data size now plus `budget` model sizes."""
    if budget:
        import resource

        cap = _status("VmData") + int(budget * model_bytes)
        resource.setrlimit(resource.RLIMIT_DATA, (cap, resource.getrlimit(resource.RLIMIT_DATA)[1]))


def _model_bytes(workload: Any) -> int:
    return sum(int(np.prod(shape)) * 4 for _, _, shape in workload.schema())


def _measured(fn, device: str, report: str | None, rank: int):
    """Run one task, measuring this rank's peak; the worker ranks write theirs to `report` (a JSON file)."""
    def run(*args, **kwargs):
        _reset_peak(device)
        start = _status("VmRSS")
        try:
            out = fn(*args, **kwargs)
        except Exception as exc:  # the cause, for rank 0's report (the rank then exits, failing the task)
            if report is not None:
                with open(f"{report}.{rank}", "w") as f:
                    json.dump({"rank": rank, "error": repr(exc)[:300]}, f)
            raise
        if report is not None:
            with open(f"{report}.{rank}", "w") as f:
                json.dump({"rank": rank, "peak": _peak(device), "start": start}, f)
        return out
    return run


def memory_worker(args: argparse.Namespace) -> int:
    """A worker rank of the memory bench: its model, its budget, its peak after every task."""
    from peerloom.backends.torch import pool as ddp_module
    from peerloom.backends.torch import pool_sharded

    env = RankEnv.from_environ()
    assert env is not None
    torch.set_num_threads(args.threads)
    device = f"cuda:{env.local_rank}" if args.backend == "nccl" else "cpu"
    if device != "cpu":
        torch.cuda.set_device(device)
    _limit(args.budget, args.model_bytes)  # before the workload: building it must fit the budget too
    workload = build_memory(args, device)
    ddp_module.pool_train = _measured(ddp_module.pool_train, device, args.report, env.rank)
    pool_sharded.pool_train_sharded = _measured(pool_sharded.pool_train_sharded, device, args.report, env.rank)
    return run_worker(workload, env, timeout_s=args.timeout_s, backend=args.backend)


def memory_rank0(args: argparse.Namespace) -> dict:
    """Rank 0 of one memory configuration (its own process): two tasks, the second measured."""
    import tempfile
    from pathlib import Path

    from peerloom.adapters.pool import PoolError
    from peerloom.backends.numpy.stored import TensorFileWriter, open_stored
    from peerloom.backends.numpy.tensors import safetensors_views, to_safetensors

    torch.set_num_threads(args.threads)
    device = "cuda:0" if args.backend == "nccl" else "cpu"
    folder = Path(tempfile.mkdtemp(prefix="pool-memory-"))
    head = folder / "head.safetensors"
    scaffold = build_memory(args, "cpu")  # writes the head, as a node finds it in its store, then goes
    model_bytes = _model_bytes(scaffold)
    head.write_bytes(to_safetensors(scaffold.initial_params(0)))
    del scaffold
    # Under ddp rank 0 runs without the budget (its peak is measured all the same): a rank 0 held at its limit
    # once aborted while re-forming the pool after ddp's ranks failed (gloo's threads could not start).
    # Sharded modes hold rank 0 to it like every other rank.
    if args.parallel != "ddp":
        _limit(args.budget, model_bytes)
    workload = build_memory(args, device)
    report = str(folder / "peak")
    forwarded = [a for a in sys.argv[1:] if a != "--memory-rank0"] + ["--model-bytes", str(model_bytes)]
    pool = TrainerPool(workload, ranks=args.mem_ranks, timeout_s=args.timeout_s, backend=args.backend,
                       parallel=args.parallel,
                       argv=[sys.executable, os.path.abspath(__file__), "--worker", "--report", report, *forwarded])
    lease = list(range(16))
    out: dict = {"parallel": args.parallel, "ranks": args.mem_ranks, "model_mb": round(model_bytes / 2**20, 1)}

    def task() -> None:
        with open(folder / "delta.safetensors", "wb") as f:
            writer = TensorFileWriter(workload.schema(), f.write)

            def sink(name: str, array: np.ndarray) -> None:
                flat = writer.tensors[name].reshape(-1)
                for start in range(0, array.size, 1 << 20):
                    flat[start:start + (1 << 20)][...] = array.reshape(-1)[start:start + (1 << 20)]

            if args.parallel == "ddp":  # the whole head in (as the node's load_params), the whole delta out
                delta, _ = pool.train(dict(safetensors_views(head.read_bytes())), lease, 1)
                for name in sorted(delta):
                    sink(name, delta[name])
                del delta
            else:
                with open_stored(head) as stored:
                    pool.train(stored, lease, 1, sink=sink)
            writer.finish()

    try:
        pool.start()
        task()
        _reset_peak(device)
        start = _status("VmRSS")
        started = time.perf_counter()
        task()
        out["seconds"] = round(time.perf_counter() - started, 2)
        peaks, starts = [_peak(device)], [start]
        for rank in range(1, args.mem_ranks):
            with open(f"{report}.{rank}") as f:
                got = json.load(f)
                peaks.append(got["peak"])
                starts.append(got["start"])
        out["start_mb"] = [round(p / 2**20, 1) for p in starts]  # each rank's RSS as the task began
        out.update(trained=True, peak_mb=[round(p / 2**20, 1) for p in peaks],
                   peak_x_model=round(max(peaks) / model_bytes, 3),
                   per_rank_x_model=[round(p / model_bytes, 3) for p in peaks])
    except (PoolError, MemoryError, RuntimeError) as exc:
        out.update(trained=False, error=repr(exc)[:400])
        for rank in range(1, args.mem_ranks):
            try:
                with open(f"{report}.{rank}") as f:
                    got = json.load(f)
            except (OSError, ValueError):
                continue
            if "error" in got:
                out.setdefault("rank_errors", {})[rank] = got["error"]
    finally:
        pool.close()
    return out


def memory_base(args: argparse.Namespace) -> int:
    """The resident bytes of an idle rank, measured in a process of its own: torch and the pool imported, a
    gloo group formed (of one), the bench's data built, no model. 0 on CUDA (torch.cuda counts the model's
    allocations only)."""
    import subprocess

    if args.backend == "nccl":
        return 0
    code = ("import sys, torch, torch.distributed as dist; sys.path.insert(0, sys.argv[1]); import pool as b; "
            "import peerloom.adapters.pool; torch.set_num_threads(1); "
            "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1); "
            "torch.randn(64, b.FEATURES); print(b._status('VmRSS'))")
    done = subprocess.run([sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__))],
                          capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1])


def memory(args: argparse.Namespace, forwarded: list[str]) -> dict:
    """Every (parallel, ranks) configuration in a rank 0 process of its own; one JSON report."""
    import subprocess

    # glibc's malloc raises its mmap threshold as large blocks are freed, after which shard-sized blocks
    # come from its heap and stay in the RSS once freed (fsdp's ranks then showed ~4 model sizes kept
    # between tasks); a fixed threshold gives every large tensor back when freed. Every rank, every mode.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    base = memory_base(args)
    if args.backend == "nccl":  # nccl puts one rank on each GPU
        gpus = torch.cuda.device_count()
        args.mem_ranks_list = [n for n in args.mem_ranks_list if n <= gpus] or [gpus]
    rows = []
    configs = [(p, n) for p in ("ddp", "fsdp", "pipeline") for n in args.mem_ranks_list]
    for parallel, ranks in configs:
        if parallel == "pipeline" and ranks < 2:
            continue  # one stage is no pipeline
        cmd = [sys.executable, os.path.abspath(__file__), *forwarded, "--memory-rank0", "--parallel", parallel,
               "--mem-ranks", str(ranks)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s * 10)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        row = json.loads(lines[-1]) if lines else {"parallel": parallel, "ranks": ranks, "trained": False,
                                                   "error": done.stderr[-400:]}
        if row.get("trained") and base:
            model = row["model_mb"] * 2**20
            row["above_base_x_model"] = round((max(row["peak_mb"]) * 2**20 - base) / model, 3)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    report: dict = {"mode": "memory", "device": torch.cuda.get_device_name(0) if args.backend == "nccl" else "cpu",
                    "backend": args.backend, "mem_hidden": args.mem_hidden, "mem_layers": args.mem_layers,
                    "budget_x_model": args.budget, "base_mb": round(base / 2**20, 1), "rows": rows}
    peak = {(r["parallel"], r["ranks"]): r for r in rows if r.get("trained")}
    if ("fsdp", 4) in peak and ("ddp", 4) in peak:
        report["fsdp4_over_ddp"] = round(max(peak["fsdp", 4]["peak_mb"]) / max(peak["ddp", 4]["peak_mb"]), 3)
        if base:
            report["fsdp4_over_ddp_above_base"] = round(
                peak["fsdp", 4]["above_base_x_model"] / peak["ddp", 4]["above_base_x_model"], 3)
    return report


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
    if args.memory:
        return memory_worker(args)
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
    parser.add_argument("--memory", action="store_true", help="per-rank peak memory / model size, by mode")
    parser.add_argument("--mem-hidden", type=int, default=2048, help="memory bench: hidden width")
    parser.add_argument("--mem-layers", type=int, default=24, help="memory bench: h x h layers")
    parser.add_argument("--mem-steps", type=int, default=2, help="memory bench: inner steps per task")
    parser.add_argument("--mem-ranks-list", type=lambda s: [int(n) for n in s.split(",")], default=[2, 4],
                        help="memory bench: pool sizes (comma-separated)")
    parser.add_argument("--budget", type=float, default=None,
                        help="memory bench: RLIMIT_DATA per rank, in model sizes above its start (CPU)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--memory-rank0", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--parallel", default="ddp", help=argparse.SUPPRESS)
    parser.add_argument("--mem-ranks", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--report", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.lease, args.batch, args.steps, args.repeats = 32, 256, 32, 4, 1
        args.mem_hidden, args.mem_layers = 256, 2
    if args.worker:
        sys.exit(worker(args))
    if args.memory_rank0:
        print(json.dumps(memory_rank0(args)), flush=True)
        return {}
    if args.memory:
        report = memory(args, [a for a in (argv if argv is not None else sys.argv[1:])])
        print(json.dumps(report))
        return report
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

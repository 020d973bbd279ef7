"""Aggregation rules at scale: 16 updates x 4M float32, numpy and torch backends (spec/design.md §5).

Baseline, measured in the same run: the plain numpy mean of the cohort,
``np.mean(np.stack([d[name] for d in deltas]), axis=0)`` per tensor. Each figure is the median of
`--repeats` timed calls after one warm-up call (buffers are reused across calls, as in the engine).
Prints one JSON object on its last line:
``{"baseline_s": float, "results": [{"backend", "rule", "seconds", "ratio"}], ...}``.
Targets (ratio to the baseline): mean <= 1.5, trimmed_mean <= 35, krum/multi_krum <= 3,
centered_clip (3 iterations) <= 6, median <= 80, for both backends.

``--reduce`` measures instead a node's whole ``reduce`` task (`peerloom.adapters.compute.ComputeExecutor`, numpy,
streamed from and to an artifact store in a temporary directory): cohort screening, `--rule` (default
centered_clip) over `--members` stored updates of `--size` float32, and the DiLoCo step with its state, on
each of `--threads-list` kernel threads (default 1,2), the counts taking turns within each repeat. The
baseline is one thread in the same run; each figure is the median over `--repeats` after one warm-up each.
Checks that every thread count wrote the same params and state. Prints one JSON object on its last line:
``{"load": [before, after], "results": [{"threads", "seconds", "speedup"}], ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from peerloom.backends.numpy.aggregate import aggregate as np_aggregate
from peerloom.backends.torch.aggregate import aggregate as torch_aggregate

RULES = ("mean", "median", "trimmed_mean", "krum", "multi_krum", "centered_clip")
TARGETS = {"mean": 1.5, "median": 80.0, "trimmed_mean": 35.0, "krum": 3.0, "multi_krum": 3.0, "centered_clip": 6.0}


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def reduce_bench(args: argparse.Namespace) -> dict:
    """The executor's streamed DiLoCo reduce on 1 and N kernel threads (module docstring, ``--reduce``)."""
    import sys

    import attrs

    from peerloom.adapters.compute import ComputeExecutor
    from peerloom.adapters.storage import ArtifactStore
    from peerloom.core.tasks import ReduceTask

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' manifest helper, from a checkout
    from tests.helpers import make_revision

    counts = [int(t) for t in args.threads_list.split(",")]
    schema = (("w", "float32", (args.size,)),)
    manifest = attrs.evolve(make_revision(schema=schema).manifest, aggregation=args.rule, outer_optimizer="diloco")
    before = loadavg()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        store = ArtifactStore(Path(tmp), chunk_size=1 << 20)
        ex = {t: ComputeExecutor(store, manifest, None, [], compute_threads=t) for t in counts}
        rng = np.random.default_rng(args.seed)

        def saved() -> Any:
            return ex[counts[0]].save({"w": rng.standard_normal(args.size, dtype=np.float32)})[0]

        params, state = saved(), saved()
        deltas = [saved() for _ in range(args.members)]
        task = ReduceTask(params=params, deltas=tuple(deltas), weights=(1,) * args.members, rule=args.rule,
                          outer_optimizer="diloco", outer_lr=0.7, outer_momentum=0.9, outer_state=state,
                          norm_ratio=3.0, min_cosine=-1.0)
        outputs = {t: ex[t].run(task) for t in counts}  # warm-up, and the bytes to compare
        same = all(outputs[t] == outputs[counts[0]] for t in counts)
        times: dict[int, list[float]] = {t: [] for t in counts}
        for _ in range(args.repeats):
            for t in counts:
                start = time.perf_counter()
                ex[t].run(task)
                times[t].append(time.perf_counter() - start)
    medians = {t: statistics.median(v) for t, v in times.items()}
    results = [{"threads": t, "seconds": medians[t], "all": times[t], "speedup": medians[counts[0]] / medians[t]}
               for t in counts]
    for r in results:
        print(f"reduce {args.rule} {args.members} x {args.size:,} threads={r['threads']}: {r['seconds']:.3f} s "
              f"({r['speedup']:.2f}x one thread)", flush=True)
    report = {"mode": "reduce", "size": args.size, "members": args.members, "rule": args.rule,
              "repeats": args.repeats, "cpus": os.cpu_count(), "same_bytes": same, "load": [before, loadavg()],
              "results": results}
    print(json.dumps(report))
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes (for tests)")
    parser.add_argument("--members", type=int, default=None, help="updates (default 16; --reduce: 2)")
    parser.add_argument("--size", type=int, default=4_000_000, help="float32 coordinates per update")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--reduce", action="store_true", help="the executor's streamed reduce on 1 vs N threads")
    parser.add_argument("--threads-list", default="1,2", help="--reduce: kernel thread counts, comma-separated")
    parser.add_argument("--rule", default="centered_clip", help="--reduce: the aggregation rule")
    parser.add_argument("--dir", default=None, help="--reduce: where the temporary store goes (default: TMPDIR)")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.repeats = 50_000, 2
    if args.members is None:
        args.members = 2 if args.reduce else 16
    if args.reduce:
        return reduce_bench(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    deltas = [{"w": rng.standard_normal(args.size, dtype=np.float32)} for _ in range(args.members)]
    tdeltas = [{k: torch.from_numpy(v) for k, v in d.items()} for d in deltas]
    weights = [int(w) for w in rng.integers(100, 200, args.members)]

    def baseline() -> dict:
        return {name: np.mean(np.stack([d[name] for d in deltas]), axis=0) for name in deltas[0]}

    base = timed(baseline, args.repeats)
    results = []
    for backend, fn, cohort in (("numpy", np_aggregate, deltas), ("torch", torch_aggregate, tdeltas)):
        for rule in RULES:
            seconds = timed(lambda fn=fn, rule=rule, cohort=cohort: fn(rule, cohort, weights), args.repeats)
            results.append({"backend": backend, "rule": rule, "seconds": seconds, "ratio": seconds / base})
            print(f"{backend:6s} {rule:14s} {seconds * 1e3:9.1f} ms  {seconds / base:6.2f}x "
                  f"(target <= {TARGETS[rule]}x)", flush=True)
    report = {
        "baseline_s": base,
        "results": results,
        "members": args.members,
        "size": args.size,
        "targets": TARGETS,
        "torch_threads": torch.get_num_threads(),
        "met": all(r["ratio"] <= TARGETS[r["rule"]] for r in results),
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()

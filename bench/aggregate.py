"""Aggregation rules at scale: 16 updates x 4M float32, numpy and torch backends (issue 5).

Baseline, measured in the same run: the plain numpy mean of the cohort,
``np.mean(np.stack([d[name] for d in deltas]), axis=0)`` per tensor. Each figure is the median of
`--repeats` timed calls after one warm-up call (buffers are reused across calls, as in the engine).
Prints one JSON object on its last line:
``{"baseline_s": float, "results": [{"backend", "rule", "seconds", "ratio"}], ...}``.
Targets (ratio to the baseline): mean <= 1.5, trimmed_mean <= 35, krum/multi_krum <= 3,
centered_clip (3 iterations) <= 6, median <= 80, for both backends.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes (for tests)")
    parser.add_argument("--members", type=int, default=16)
    parser.add_argument("--size", type=int, default=4_000_000, help="float32 coordinates per update")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.repeats = 50_000, 2
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

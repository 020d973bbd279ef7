"""Simulator scale benchmark (spec/simulator.md §9): N simulated trainers, 7 validators, 2 reducers, W windows of the
synthetic objective, real engines on the virtual clock, no trace.

Prints one progress line per certified window, then one JSON object on the last line::

    {"trainers", "windows", "wall_s", "events", "events_per_s", "peak_rss_bytes", "shards"}

(`windows` = windows certified; `shards` = shards leased per window, so how many trainers train in each;
`"error"` is added when the run could not be built or fell short.)
Target: 10,000 trainers, 10 windows in under 10 minutes on a 2-core machine. `--quick`: 30 trainers,
2 windows. Peak RSS is the process's (ru_maxrss), so it includes the interpreter and numpy.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

DEFAULT_MAX_SHARDS = 1000


def scenario(trainers: int, windows: int, shards: int | None) -> dict:
    shards = shards or min(trainers, DEFAULT_MAX_SHARDS)
    return {
        "name": f"sim-scale-{trainers}",
        "duration_s": 60.0 * windows + 120.0,
        "stop_window": windows,
        "workload": {"name": "synthetic", "dim": 16},
        "roles": {"validators": 7, "reducers": 2, "trainers": trainers},
        "manifest": {"window_s": 30.0, "min_updates": max(1, min(10, shards // 2)), "shards": shards},
        "compute": {"train": 2.0, "screen": 0.0005, "reduce": 0.05, "evaluate": 0.01, "jitter": 0.3},
        "network": {"default": {"latency": {"dist": "lognormal", "median_s": 0.03, "sigma": 0.5},
                                "bandwidth_bps": 12_500_000}},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainers", type=int, default=10_000)
    parser.add_argument("--windows", type=int, default=10)
    parser.add_argument("--shards", type=int, default=None,
                        help=f"shards leased per window (default: one per trainer, at most {DEFAULT_MAX_SHARDS}: "
                             "beyond that each window trains a capacity-weighted random sample of the trainers)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="30 trainers, 2 windows")
    args = parser.parse_args()
    if args.quick:
        args.trainers, args.windows = 30, 2

    from peerloom.sim.scenario import run_scenario

    report: dict = {"trainers": args.trainers, "windows": 0, "wall_s": 0.0, "events": 0, "events_per_s": 0.0,
                    "peak_rss_bytes": 0}
    shards = args.shards or min(args.trainers, DEFAULT_MAX_SHARDS)
    t0, cpu0 = time.perf_counter(), time.process_time()
    def progress(window: int, virtual_s: float) -> None:  # live, so a long run shows it is moving
        print(f"window {window} certified at virtual {virtual_s:.1f} s ({time.perf_counter() - t0:.1f} s wall)",
              file=sys.stderr, flush=True)

    try:
        result = run_scenario(scenario(args.trainers, args.windows, shards), seed=args.seed, trace=False,
                              on_window=progress)
    except Exception as exc:  # report what stopped the run (e.g. a core size limit) in the JSON line
        report["error"] = f"{type(exc).__name__}: {exc}"[:300]
    else:
        wall = time.perf_counter() - t0
        # CPU seconds next to wall: on a shared machine wall time mostly measures the neighbours
        print(f"cpu_s {time.process_time() - cpu0:.2f} wall_s {wall:.2f}", file=sys.stderr)
        report.update(windows=result.summary["windows"]["certified"], wall_s=round(wall, 2),
                      events=result.sim.events, events_per_s=round(result.sim.events / wall, 1))
        if not result.ok:
            report["error"] = "invariant violated: " + json.dumps(
                {k: v["detail"] for k, v in result.summary["invariants"].items() if not v["ok"]})
    report["wall_s"] = report["wall_s"] or round(time.perf_counter() - t0, 2)
    report["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report["shards"] = shards
    print(json.dumps(report))


if __name__ == "__main__":
    main()

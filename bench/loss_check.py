"""Loss check false rejections and catches (spec/protocol.md §6.1): before/after against the symmetric test.

An in-process DiLoCo loop (numpy MLP on digits or mnist1d, 12 trainers on seeded shards, H fresh Adam
steps per window, outer SGD lr 0.7 on the mean) runs `--windows` windows. From window `--from-window` on,
for every honest update and for a random vector of the same global norm, on the 64-sample batch a
validator would draw from the trainer's lease, it records:

- ``before_after``: the honest update is rejected iff ``L(base - delta) >= L(base)``;
- ``symmetric``: the statistic ``(L(base + delta) - L(base - delta)) / (L(base + delta) + L(base - delta))``;
  the update is rejected iff it is below ``loss_min_drop`` (0 by default: below 0, pointing uphill).

Prints progress to stderr and one JSON object on the last line: per workload, the honest false-rejection
rate and the noise catch rate of each test, and the symmetric statistic's quantiles for both; and, per
``loss_min_drop`` threshold, the honest rejection and noise pass rates. ``--quick``: 6 windows, digits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from peerloom.backends.registry import build_workload

TRAINERS = 12
BATCH = 64
THRESHOLDS = (0.0, 0.01, 0.02, 0.05, 0.1)


def _applied(params: dict[str, np.ndarray], delta: dict[str, np.ndarray], sign: float) -> dict[str, np.ndarray]:
    return {k: (params[k] + np.float32(sign) * delta[k]).astype(np.float32) for k in params}


def _norm(tensors: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.dot(v.ravel(), v.ravel())) for v in tensors.values())))


def study(workload_name: str, *, windows: int, from_window: int, inner_steps: int, seed: int) -> dict:
    """The measurements of one workload (module docstring)."""
    workload, shards = build_workload(workload_name, seed, TRAINERS, inner_steps=inner_steps)
    params = workload.initial_params(seed)
    rng = np.random.default_rng(seed)
    honest_stat, noise_stat, before_after_rejects, before_after_noise_passes = [], [], 0, 0
    for window in range(windows):
        deltas = []
        for s in range(TRAINERS):
            delta, _ = workload.train(params, shards[s], 1000 * window + s, inner_steps=inner_steps)
            deltas.append(delta)
            if window < from_window:
                continue
            lease = shards[s]
            pick = np.sort(np.random.default_rng([seed, window, s]).choice(len(lease), min(BATCH, len(lease)),
                                                                            replace=False))
            batch = [lease[i] for i in pick]
            before = workload.loss(params, batch)
            applied = workload.loss(_applied(params, delta, -1.0), batch)
            opposite = workload.loss(_applied(params, delta, 1.0), batch)
            before_after_rejects += applied >= before
            honest_stat.append((opposite - applied) / (opposite + applied))
            noise = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in delta.items()}
            scale = np.float32(_norm(delta) / _norm(noise))
            noise = {k: v * scale for k, v in noise.items()}
            n_applied = workload.loss(_applied(params, noise, -1.0), batch)
            n_opposite = workload.loss(_applied(params, noise, 1.0), batch)
            before_after_noise_passes += n_applied < before
            noise_stat.append((n_opposite - n_applied) / (n_opposite + n_applied))
        mean = {k: np.mean([d[k] for d in deltas], axis=0) for k in params}
        params = _applied(params, mean, -0.7)
        print(f"  {workload_name} window {window + 1}/{windows}: {workload.evaluate(params)}", file=sys.stderr)
    honest, noise = np.array(honest_stat), np.array(noise_stat)
    n = len(honest)
    return {
        "updates": n,
        "before_after": {"honest_rejected": before_after_rejects / n,
                         "noise_caught": 1 - before_after_noise_passes / n},
        "symmetric": {"honest_rejected": float((honest < 0).mean()), "noise_caught": float((noise < 0).mean())},
        "honest_quantiles": dict(zip(("min", "q01", "q05", "median"),
                                     np.quantile(honest, [0, .01, .05, .5]).round(4).tolist(), strict=True)),
        "noise_quantiles": dict(zip(("median", "q95", "q99", "max"),
                                    np.quantile(noise, [.5, .95, .99, 1]).round(4).tolist(), strict=True)),
        "thresholds": [{"loss_min_drop": t, "honest_rejected": float((honest < t).mean()),
                        "noise_passed": float((noise >= t).mean())} for t in THRESHOLDS],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="digits-numpy,mnist1d-numpy")
    parser.add_argument("--windows", type=int, default=30)
    parser.add_argument("--from-window", type=int, default=5, help="measure from this window on (the model fits)")
    parser.add_argument("--inner-steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="digits, 6 windows from window 2")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    names = ["digits-numpy"] if args.quick else args.workloads.split(",")
    windows, from_window = (6, 2) if args.quick else (args.windows, args.from_window)
    results = {name: study(name, windows=windows, from_window=from_window, inner_steps=args.inner_steps,
                           seed=args.seed) for name in names}
    out = {"trainers": TRAINERS, "batch": BATCH, "inner_steps": args.inner_steps, "windows": windows,
           "from_window": from_window, "results": results, "wall_s": round(time.perf_counter() - started, 1)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()

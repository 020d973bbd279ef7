"""DP-SGD and learning (spec/protocol.md §10): accuracy and throughput of the same fleet with and without
differential privacy.

The fleet is bench/overlap.py's in-process loop (`overlap.run`, manifest ``overlap = 0``): ``--trainers`` K
trainers, ``2 K`` shards, leases dealt per window from a seeded slot order, each trainer's
``workload.train(head, its leased samples, seed, inner_steps=H, step=(w - 1) H)``, the executor's
`NumpyCompute.aggregate` (``centered_clip``) and ``.outer`` (DiLoCo, lr 0.7, momentum 0.9: `peerloom init`'s
defaults), ``evaluate`` on the head after every window. Every row uses the same workload (``mnist1d-mlp``),
trainers, windows, H, outer optimizer, leases and training seeds; only the trainers' ``train`` differs:

- ``no DP``: the plain workload (Adam at its default lr, batches of 32): the baseline;
- ``clip only``: DP-SGD with sigma = 0 (Poisson sampling at rate q, per-sample clipping to C, no noise:
  infinite epsilon), to separate clipping's cost from the noise's;
- ``epsilon = e`` for e in ``--epsilons``: DP-SGD (`TorchWorkload.with_privacy(DP(...))`, Opacus) with the
  smallest sigma whose ``windows * H`` steps at rate q spend at most e at ``delta`` (`noise_multiplier_for`).

Accounting. Every window leases every shard to exactly one trainer, so each training sample takes part in
exactly one trainer's H DP-SGD steps per window, in each of them with probability q: over the run it meets
``windows * H`` steps of the subsampled Gaussian mechanism, which is what `epsilon` (Opacus's RDP
accountant) charges, for every trainer's lease and so for every sample of the data set (the aggregation and
the outer step only post-process the trainers' noised updates). Each row prints the epsilon it spent,
recomputed with `peerloom.privacy.epsilon` from the steps the trainers reported (``privacy_steps``).

DP rows train at every inner Adam lr of ``--dp-lrs`` (the workload's default and a larger one: DP-SGD's
noisy, clipped gradients usually want a larger step), at Poisson rate ``--sample-rate`` q (expected batch
q x lease size) and clipping norm ``--clip`` C.

Throughput: training samples per second of the trainers' ``train`` calls (every sample a forward and
backward pass saw, counted at the loss, over the calls' wall time), and its ratio to ``no DP``.

Target: at epsilon = 8 the final test accuracy (median over ``--seeds``) at most 5 points below no
DP's; judged on the best of ``--dp-lrs``, and the miss is reported in points otherwise.

Prints progress to stderr and one JSON object on its last line: ``{"workload", "trainers", "shards",
"windows", "inner_steps", "rule", "outer", "delta", "max_grad_norm", "sample_rate", "lease_samples",
"seeds", "rows": [{"name", "epsilon_target", "inner_lr", "sigma", "q", "steps", "epsilon_spent", "runs":
[{"seed", "final", "best", "curve", "train_s", "samples", "samples_per_s"}], "median": {"final",
"gap_points", "samples_per_s", "throughput_ratio"}}], "target", "wall_s"}``. ``--plot PATH`` draws final
accuracy against epsilon (no DP as a line) and throughput per row (PNG).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from overlap import OUTER, RULE, TRAINERS, run, summarize  # bench/overlap.py, beside this script

from peerloom.backends.mnist1d import make_mnist1d_workload
from peerloom.backends.registry import build_workload
from peerloom.privacy import DP, epsilon, noise_multiplier_for

WORKLOAD = "mnist1d-mlp"
DEFAULT_LR = float(inspect.signature(make_mnist1d_workload).parameters["lr"].default)  # its Adam lr (5e-3)
TARGET_EPSILON, MAX_GAP = 8.0, 5.0  # within 5 points of no DP at epsilon = 8


class CountingLoss:
    """The workload's loss, counting the samples of every call made with gradients on (training, not
    ``evaluate``, which runs under ``torch.no_grad``)."""

    def __init__(self, loss: Any) -> None:
        self.loss, self.samples = loss, 0

    def __call__(self, outputs: Any, targets: Any) -> Any:
        if torch.is_grad_enabled():
            self.samples += len(targets)
        return self.loss(outputs, targets)


def fleet(seed: int, dp: DP | None, lr: float, args: argparse.Namespace) -> dict[str, Any]:
    """One run of the fleet: the final test accuracy, its curve and the ``train`` calls' throughput."""
    workload, shards = build_workload(WORKLOAD, seed, 2 * args.trainers, lr=lr, num_threads=args.threads)
    workload.with_privacy(dp)
    counter = CountingLoss(workload.loss_fn)
    workload.loss_fn = counter
    seconds, steps = [0.0], [0]

    def on_train(elapsed: float, metrics: dict[str, Any]) -> None:
        seconds[0] += elapsed
        steps[0] += int(metrics.get("privacy_steps", 0))

    label = "no DP" if dp is None else f"sigma {dp.noise_multiplier:.3g} lr {lr:g}"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        curve = run(workload, shards, overlap=0, windows=args.windows, trainers=args.trainers, seed=seed,
                    inner_steps=args.inner_steps, rule=RULE, outer=OUTER, label=f"seed {seed} {label}",
                    on_train=on_train)
    out = {"seed": seed, **summarize("accuracy", curve), "train_s": round(seconds[0], 3),
           "samples": counter.samples, "samples_per_s": round(counter.samples / seconds[0], 1)}
    if dp is not None:
        out["privacy_steps_per_trainer"] = steps[0] / args.trainers
    return out


def warm_up(args: argparse.Namespace, q: float) -> None:
    """One untimed plain and one DP-SGD ``train`` call, so that no row's throughput pays torch's and Opacus's
    first-call costs (imports, allocator, kernels)."""
    workload, shards = build_workload(WORKLOAD, 0, 2 * args.trainers, num_threads=args.threads)
    params = workload.initial_params(0)
    for dp in (None, DP(noise_multiplier=1.0, max_grad_norm=args.clip, delta=args.delta, sample_rate=q)):
        workload.with_privacy(dp)
        workload.train(params, shards[0], 0, inner_steps=4)


def spent(sigma: float, q: float, steps: int, delta: float) -> float:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        return epsilon(noise_multiplier=sigma, sample_rate=q, steps=steps, delta=delta) if sigma > 0 else math.inf


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--inner-steps", type=int, default=32, help="the manifest's inner_steps H (> 0 with privacy)")
    parser.add_argument("--trainers", type=int, default=TRAINERS)
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (data, shards, init, training)")
    parser.add_argument("--epsilons", default="8,3,1", help="comma-separated finite budgets per run")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--clip", type=float, default=1.0, help="DP-SGD's per-sample clipping norm C")
    parser.add_argument("--sample-rate", type=float, default=None,
                        help="Poisson rate q (default: the workload's batch of 32 over a lease, 32 / lease size)")
    parser.add_argument("--dp-lrs", default=f"{DEFAULT_LR:g},2e-2", help="inner Adam lrs of the DP rows")
    parser.add_argument("--no-clip-only", action="store_true", help="skip the clip-only (sigma = 0) rows")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--plot", default=None, help="write accuracy against epsilon and throughput as a PNG here")
    args = parser.parse_args(argv)
    if args.windows < 1 or args.inner_steps < 1:
        parser.error("--windows and --inner-steps must be >= 1 (a privacy manifest needs inner_steps > 0)")
    seeds = [int(s) for s in args.seeds.split(",")]
    budgets = [float(e) for e in args.epsilons.split(",")]
    lrs = [float(v) for v in args.dp_lrs.split(",")]
    start = time.perf_counter()
    _, shards = build_workload(WORKLOAD, seeds[0], 2 * args.trainers)
    lease = 2 * len(shards[0])  # 2 shards per trainer per window (4000 samples, 2K shards: equal)
    q = args.sample_rate or min(1.0, 32 / lease)
    steps = args.windows * args.inner_steps
    rows: list[dict[str, Any]] = []
    warm_up(args, q)

    def add(name: str, target: float | None, sigma: float | None, lr: float) -> None:
        dp = None if sigma is None else DP(noise_multiplier=sigma, max_grad_norm=args.clip, delta=args.delta,
                                            sample_rate=q)
        row: dict[str, Any] = {"name": name, "epsilon_target": target, "inner_lr": lr, "sigma": sigma,
                               "q": None if dp is None else q, "steps": steps}
        if dp is not None:
            row["epsilon_spent"] = spent(sigma, q, steps, args.delta)  # type: ignore[arg-type]
        row["runs"] = [fleet(seed, dp, lr, args) for seed in seeds]
        if dp is not None:
            taken = {r["privacy_steps_per_trainer"] for r in row["runs"]}
            assert taken == {steps}, f"trainers took {taken} DP-SGD steps each, expected {steps}"
        row["median"] = {"final": statistics.median(r["final"] for r in row["runs"]),
                         "samples_per_s": statistics.median(r["samples_per_s"] for r in row["runs"])}
        base = rows[0]["median"] if rows else row["median"]
        row["median"]["gap_points"] = round(100 * (row["median"]["final"] - base["final"]), 2)
        row["median"]["throughput_ratio"] = round(row["median"]["samples_per_s"] / base["samples_per_s"], 3)
        eps = row.get("epsilon_spent")
        print(f"{name} (lr {lr:g}): sigma {sigma}, q {q if dp else '-'}, steps {steps}, epsilon spent "
              f"{'-' if eps is None else f'{eps:.3f}'}; accuracy {100 * row['median']['final']:.2f}% "
              f"({row['median']['gap_points']:+.2f} points), {row['median']['samples_per_s']:.0f} samples/s "
              f"(x{row['median']['throughput_ratio']})", file=sys.stderr, flush=True)
        rows.append(row)

    add("no DP", None, None, DEFAULT_LR)
    for lr in lrs:
        if not args.no_clip_only:
            add("clip only", math.inf, 0.0, lr)
        for e in budgets:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
                sigma = noise_multiplier_for(epsilon=e, delta=args.delta, sample_rate=q, steps=steps)
            add(f"epsilon {e:g}", e, sigma, lr)
    at_target = [r for r in rows if r["epsilon_target"] == TARGET_EPSILON]
    target: dict[str, Any] = {"epsilon": TARGET_EPSILON, "max_gap_points": MAX_GAP}
    if at_target:
        best = max(at_target, key=lambda r: r["median"]["gap_points"])
        gap = best["median"]["gap_points"]
        target.update({"inner_lr": best["inner_lr"], "gap_points": gap, "met": gap >= -MAX_GAP,
                       "miss_points": round(max(0.0, -gap - MAX_GAP), 2)})
        verdict = "met" if target["met"] else f"missed by {target['miss_points']} points"
        print(f"target: epsilon {TARGET_EPSILON:g} within {MAX_GAP:g} points of no DP: best gap {gap:+.2f} points "
              f"(lr {best['inner_lr']:g}): {verdict}", file=sys.stderr, flush=True)
    report = {"workload": WORKLOAD, "trainers": args.trainers, "shards": 2 * args.trainers, "windows": args.windows,
              "inner_steps": args.inner_steps, "rule": RULE, "outer": OUTER, "delta": args.delta,
              "max_grad_norm": args.clip, "sample_rate": q, "lease_samples": lease, "seeds": seeds, "rows": rows,
              "target": target, "wall_s": round(time.perf_counter() - start, 1)}
    if args.plot:
        plot(report, args.plot)
    print(json.dumps(finite_json(report)))
    return report


def finite_json(value: Any) -> Any:
    """`value` with every infinite float as the string "inf" (strict JSON has no Infinity)."""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_json(v) for v in value]
    return value


def plot(report: dict[str, Any], path: str) -> None:
    """Left: median final test accuracy against epsilon, one line per inner lr (clip only at the right edge,
    "inf"), no DP as a horizontal line and the target band; right: throughput per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    base = rows[0]
    finite = sorted({r["epsilon_target"] for r in rows[1:] if r["epsilon_target"] not in (None, math.inf)})
    edge = (max(finite) if finite else 1.0) * 2.5  # where "inf" (clip only) is drawn
    fig, (left, right) = plt.subplots(1, 2, figsize=(11.5, 4.2))
    no_dp = 100 * base["median"]["final"]
    left.axhline(no_dp, color="black", label=f"no DP: {no_dp:.1f}%")
    left.axhspan(no_dp - MAX_GAP, no_dp, color="tab:green", alpha=0.12, label=f"within {MAX_GAP:g} points")
    for colour, lr in zip(("tab:blue", "tab:orange", "tab:purple", "tab:red"),
                          sorted({r["inner_lr"] for r in rows[1:]}), strict=False):
        mine = sorted((r for r in rows[1:] if r["inner_lr"] == lr), key=lambda r: r["epsilon_target"])
        x = [edge if r["epsilon_target"] == math.inf else r["epsilon_target"] for r in mine]
        y = [100 * r["median"]["final"] for r in mine]
        lo = [100 * min(s["final"] for s in r["runs"]) for r in mine]
        hi = [100 * max(s["final"] for s in r["runs"]) for r in mine]
        spread = [[a - b for a, b in zip(y, lo, strict=True)], [b - a for a, b in zip(y, hi, strict=True)]]
        left.errorbar(x, y, yerr=spread, marker="o", capsize=3, color=colour, label=f"DP-SGD, inner lr {lr:g}")
    left.set_xscale("log")
    left.set_xticks([*finite, edge], [*(f"{t:g}" for t in finite), "inf\n(clip only)"])
    left.minorticks_off()
    left.set_xlabel(f"epsilon (delta = {report['delta']:g}, whole run)")
    left.set_ylabel("final test accuracy (%), median over seeds")
    left.set_title(f"{report['workload']}: {report['trainers']} trainers, {report['windows']} windows x H = "
                   f"{report['inner_steps']}, q = {report['sample_rate']:g}, C = {report['max_grad_norm']:g}, "
                   f"{len(report['seeds'])} seeds", fontsize=9)
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    labels = [r["name"] if r["sigma"] is None else f"{r['name']}\nlr {r['inner_lr']:g}" for r in rows]
    values = [r["median"]["samples_per_s"] for r in rows]
    right.bar(range(len(rows)), values, color=["black"] + ["tab:blue"] * (len(rows) - 1))
    for k, r in enumerate(rows):
        right.text(k, values[k], f"x{r['median']['throughput_ratio']:.2f}", ha="center", va="bottom", fontsize=7)
    right.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
    right.set_ylabel("training samples / s of train calls (median)")
    right.set_title("throughput (ratio to no DP)", fontsize=9)
    right.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()

"""Overlapped windows and learning: the same fleet trained with manifest ``overlap = 0`` and ``overlap = 1``.

With ``overlap = 1`` a trainer starts window w+1 as soon as it has published window w, from the latest
certified head it holds, so in steady state its update for window w is trained from the head of window w-2
(its *base*) while the validators' reduction applies it to the head of window w-1: the outer optimizer takes
each pseudo-gradient one window late, as in "eager updates" (Kale et al. 2025, arXiv 2502.12996) and
Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512). Window 1 trains from genesis in both modes, and so
does window 2 under ``overlap = 1`` (the base of window w is the head of window ``max(0, w - 1 - overlap)``).

An in-process loop (no node processes), the same in both modes but for the base:

- the workload from the registry (`peerloom.backends.registry.build_workload`: ``mnist1d-numpy``,
  ``mnist1d-mlp`` or ``charlm``), cut into ``2 * trainers`` shards (`peerloom init`'s default);
- leases: as `peerloom.core.leases` deals them to trainers of capacity 1 (shard s to the trainer of slot
  ``s mod trainers``), with the slot order a seeded random permutation per window: ``default_rng([seed,
  window])`` stands in for the head the protocol draws it from (head w-1-overlap). Both modes draw the same
  leases and the same training seeds (``seed * 100_003 + window * 101 + trainer``), so the runs differ only by
  the base each update is trained from;
- each trainer: ``workload.train(start, its leased samples, seed)`` (start: the base, or the eager start)
  as the executor calls it (with the
  manifest's ``inner_steps`` H and the global step ``(window - 1) * H`` when H > 0; H = 0, the manifest's
  default, leaves the workload's own local epochs); pseudo-gradient = start params - trained params;
- the validators' reduction: `peerloom.adapters.compute.NumpyCompute` (the executor's ``reduce`` task calls its
  ``aggregate`` and ``outer``): the cohort (trainer order, weights = leased sample counts) aggregated by the
  rule, then the outer optimizer steps the *current* head (window w-1) with the parent head's momentum;
- defaults of `peerloom init` (`peerloom.experiment.Experiment`): ``centered_clip``, DiLoCo (SGD with
  Nesterov momentum, PyTorch's formulation; Douillard et al. 2023, arXiv 2311.08105) at outer lr 0.7 and
  momentum 0.9 (`peerloom.core.objects.DILOCO_MOMENTUM`), ``inner_steps`` 0; no screening (honest fleet).

After every window the head is evaluated (`workload.evaluate`, the test split). Targets, on the final head:
mnist1d's test accuracy with ``overlap = 1`` at most 1 point below ``overlap = 0``'s; charlm's test loss at
most 3% above. With several ``--seeds`` each quantity is reported per seed and as the median over seeds
(the differences: the median of the per-seed differences); the target is judged on the median.

Prints progress to stderr and one JSON object on its last line: ``{"trainers", "shards", "rule", "outer",
"outer_overlap1", "seeds", "results": [{"workload", "metric", "windows", "inner_steps", "target", "runs": [{"seed",
"overlap0": {"final", "best", "curve"}, "overlap1": {...}, "difference": {"final", "best"}}], "median":
{...}, "met"}], "wall_s"}``. ``--plot PATH`` draws both curves per workload (PNG).
With ``--start eager`` (the default: what the protocol does, spec/protocol.md §5.2) an update one window
ahead starts from its base moved by the part of the next outer step every cohort shares and by its trainer's
own pseudo-gradient of the window before (`peerloom.adapters.compute.eager_start`, the executor's own
function); ``--start base`` trains it from the base itself (the plain delayed step, which oscillates at the
DiLoCo defaults).
``--overlap1-outer LR,MOMENTUM`` runs ``overlap = 1`` with another outer lr and momentum, against ``overlap =
0`` at the defaults in the same run (the smaller step that delayed updates need; Kale et al. 2025).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from peerloom.adapters.compute import NumpyCompute, eager_start
from peerloom.backends.registry import build_workload
from peerloom.backends.workload import takes_step
from peerloom.core.objects import DILOCO_MOMENTUM
from peerloom.experiment import Experiment

_INIT = {name: field.default for name, field in attrs.fields_dict(Experiment).items()}
RULE = str(_INIT["aggregation"])  # centered_clip
OUTER = {"name": str(_INIT["outer_optimizer"]), "lr": float(_INIT["outer_lr"]), "momentum": DILOCO_MOMENTUM}
INNER_STEPS = int(_INIT["inner_steps"])  # 0: the workload's own local epochs
TRAINERS = 4
WORKLOADS = ("mnist1d-numpy", "mnist1d-mlp", "charlm")
WINDOWS = {"mnist1d-numpy": 40, "mnist1d-mlp": 40, "charlm": 5}
# metric -> (evaluate key, better, tolerance): accuracy in points (absolute), loss in percent (relative)
TARGETS = {"accuracy": {"better": "higher", "max_loss": 1.0, "unit": "points"},
           "loss": {"better": "lower", "max_loss": 3.0, "unit": "percent"}}


def metric_of(name: str) -> str:
    """The metric a workload is judged on: test loss for the language model, test accuracy otherwise."""
    return "loss" if name == "charlm" else "accuracy"


def leases(seed: int, window: int, trainers: int, num_shards: int) -> list[list[int]]:
    """Each trainer's leased shards in `window` (ascending): a seeded slot order per window, shard s to the
    trainer of slot ``s mod trainers`` (`peerloom.core.leases.assign_shards` with capacity 1)."""
    slots = np.random.default_rng([seed, window]).permutation(trainers)
    out: list[list[int]] = [[] for _ in range(trainers)]
    for s in range(num_shards):
        out[int(slots[s % trainers])].append(s)
    return out


def run(workload: Any, shards: list[list[int]], *, overlap: int, windows: int, trainers: int, seed: int,
        inner_steps: int, rule: str, outer: dict[str, Any], label: str = "", eager: bool = True,
        on_train: Callable[[float, dict[str, Any]], None] | None = None) -> list[dict[str, float]]:
    """Train `windows` windows with manifest ``overlap`` = `overlap` (0 or 1); returns the test metrics of the
    head after each window, genesis first (``windows + 1`` dicts of ``workload.evaluate``). `on_train`, if
    given, is called after every ``workload.train`` with its wall seconds and its metrics (bench/privacy.py's
    throughput)."""
    compute = NumpyCompute()
    step_taken = takes_step(workload) and inner_steps > 0
    heads = [workload.initial_params(seed)]  # heads[k] = head of window k (0 = genesis); the last 2 kept
    first = 0  # window number of heads[0]
    state = None  # the outer optimizer's momentum, carried by each head
    states: list[Any] = [None]  # states[k]: the momentum of heads[k]
    previous: dict[int, dict[str, np.ndarray]] = {}  # trainer -> its pseudo-gradient of the window before
    scale = outer["lr"] * outer["momentum"] ** 2
    curve = [workload.evaluate(heads[0])]
    for w in range(1, windows + 1):
        lag = w - 1 - max(0, w - 1 - overlap)
        base = heads[max(0, w - 1 - overlap) - first]
        base_state = states[max(0, w - 1 - overlap) - first]
        deltas, weights, mine = [], [], {}
        for i, lease in enumerate(leases(seed, w, trainers, len(shards))):
            indices = [k for s in lease for k in shards[s]]
            start = base
            if eager and lag == 1 and i in previous:  # the protocol's eager start (spec/protocol.md §5.2)
                start = eager_start(base, base_state, previous[i], scale)
            options: dict[str, Any] = {"inner_steps": inner_steps} if inner_steps else {}
            if step_taken:
                options["step"] = (w - 1) * inner_steps
            began = time.perf_counter()
            delta, metrics = workload.train(start, indices, seed * 100_003 + w * 101 + i, **options)
            if on_train is not None:
                on_train(time.perf_counter() - began, metrics)
            deltas.append(delta)
            mine[i] = delta
            weights.append(len(indices))
        previous = mine
        centre = compute.aggregate(rule, deltas, weights)
        params, state = compute.outer(outer["name"], heads[-1], centre, state, outer["lr"], outer["momentum"])
        heads.append(params)
        states.append(state)
        if len(heads) > 2:
            heads.pop(0)
            states.pop(0)
            first += 1
        curve.append(workload.evaluate(params))
        print(f"  {label} overlap {overlap} window {w}: " + ", ".join(f"{k} {v:.4f}" for k, v in curve[-1].items()
                                                                      if k in ("loss", "accuracy")),
              file=sys.stderr, flush=True)
    return curve


def difference(metric: str, zero: float, one: float) -> float:
    """Overlap 1 against overlap 0: accuracy points (``100 * (one - zero)``) or the loss's relative change in
    percent (``100 * (one - zero) / zero``); positive = overlap 1 higher."""
    return round(100.0 * (one - zero) if metric == "accuracy" else 100.0 * (one - zero) / zero, 3)


def met(metric: str, diff: float) -> bool:
    """The target: overlap 1 no worse than ``TARGETS[metric]["max_loss"]`` (points of accuracy, % of loss)."""
    return diff >= -TARGETS[metric]["max_loss"] if metric == "accuracy" else diff <= TARGETS[metric]["max_loss"]


def summarize(metric: str, curve: list[dict[str, float]]) -> dict[str, Any]:
    values = [float(m[metric]) for m in curve]
    best = max(values[1:]) if metric == "accuracy" else min(values[1:])
    return {"final": values[-1], "best": best, "curve": [round(v, 5) for v in values]}


def bench_workload(name: str, seeds: list[int], windows: int, trainers: int, inner_steps: int, rule: str,
                   outer: dict[str, Any], threads: int, outer1: dict[str, Any] | None = None,
                   eager: bool = True) -> dict[str, Any]:
    """Both modes for every seed on workload `name`: the ``results`` entry of the module docstring.
    `outer1`: the outer optimizer of the ``overlap = 1`` runs, if not `outer`; `eager`: the protocol's eager
    start (else every update starts from its base)."""
    metric = metric_of(name)
    runs = []
    for seed in seeds:
        options: dict[str, Any] = {"num_threads": threads} if name != "mnist1d-numpy" else {}
        workload, shards = build_workload(name, seed, 2 * trainers, **options)
        row: dict[str, Any] = {"seed": seed}
        for overlap in (0, 1):
            curve = run(workload, shards, overlap=overlap, windows=windows, trainers=trainers, seed=seed,
                        inner_steps=inner_steps, rule=rule, outer=outer1 if overlap and outer1 else outer,
                        label=f"{name} seed {seed}", eager=eager)
            row[f"overlap{overlap}"] = summarize(metric, curve)
        row["difference"] = {k: difference(metric, row["overlap0"][k], row["overlap1"][k]) for k in ("final", "best")}
        print(f"{name} seed {seed}: {metric} final {row['overlap0']['final']:.4f} -> {row['overlap1']['final']:.4f} "
              f"({row['difference']['final']:+.2f} {TARGETS[metric]['unit']})", file=sys.stderr, flush=True)
        runs.append(row)
    median = {f"overlap{o}_{k}": statistics.median(r[f"overlap{o}"][k] for r in runs)
              for o in (0, 1) for k in ("final", "best")}
    median.update({f"difference_{k}": statistics.median(r["difference"][k] for r in runs) for k in ("final", "best")})
    return {"workload": name, "metric": metric, "windows": windows, "inner_steps": inner_steps,
            "target": {"metric": f"test_{metric}", **TARGETS[metric]}, "runs": runs, "median": median,
            "met": met(metric, median["difference_final"])}


def plot(results: list[dict[str, Any]], path: str, outer1: dict[str, Any] | None = None) -> None:
    """One panel per workload: the test metric after each window, overlap 0 and 1 (median over seeds, the
    seeds' range shaded); `outer1`: the overlap 1 runs' outer optimizer, named in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tuned = f" (outer lr {outer1['lr']}, momentum {outer1['momentum']})" if outer1 else ""
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.0), squeeze=False)
    for ax, res in zip(axes[0], results, strict=True):
        for overlap, colour in ((0, "tab:blue"), (1, "tab:orange")):
            curves = np.array([r[f"overlap{overlap}"]["curve"] for r in res["runs"]])
            scale = 100.0 if res["metric"] == "accuracy" else 1.0
            x = np.arange(curves.shape[1])
            final = scale * res["median"][f"overlap{overlap}_final"]
            ax.plot(x, scale * np.median(curves, axis=0), color=colour,
                    label=f"overlap {overlap}{tuned if overlap else ''}: final {final:.2f}")
            if len(curves) > 1:
                ax.fill_between(x, scale * curves.min(axis=0), scale * curves.max(axis=0), color=colour, alpha=0.2)
        unit = "test accuracy (%)" if res["metric"] == "accuracy" else "test loss (nats/char)"
        diff = res["median"]["difference_final"]
        ax.set_title(f"{res['workload']}, {len(res['runs'])} seed(s): {diff:+.2f} {res['target']['unit']}"
                     f" ({'met' if res['met'] else 'not met'})", fontsize=10)
        ax.set_xlabel("window")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="mnist1d-numpy", help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--windows", type=int, default=None,
                        help="windows per run (default: " + ", ".join(f"{k} {v}" for k, v in WINDOWS.items()) + ")")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (workload, shards, init, training)")
    parser.add_argument("--trainers", type=int, default=TRAINERS)
    parser.add_argument("--inner-steps", type=int, default=INNER_STEPS,
                        help="the manifest's inner_steps H (0: the workload's own local epochs)")
    parser.add_argument("--outer-lr", type=float, default=OUTER["lr"])
    parser.add_argument("--momentum", type=float, default=OUTER["momentum"], help="outer (Nesterov) momentum")
    parser.add_argument("--overlap1-outer", default=None, metavar="LR,MOMENTUM",
                        help="run overlap 1 at this outer lr and momentum instead, against overlap 0 at --outer-lr "
                             "and --momentum (a retuned outer optimizer for delayed updates)")
    parser.add_argument("--start", default="eager", choices=("eager", "base"),
                        help="where an overlapped update starts: the protocol's eager start (default) or its base")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of a torch workload")
    parser.add_argument("--plot", default=None, help="write the curves as a PNG here")
    args = parser.parse_args(argv)
    names = args.workloads.split(",")
    for name in names:
        if name not in WORKLOADS:
            parser.error(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    if args.windows is not None and args.windows < 1:
        parser.error("--windows must be >= 1")
    seeds = [int(s) for s in args.seeds.split(",")]
    outer = {**OUTER, "lr": args.outer_lr, "momentum": args.momentum}
    outer1 = None
    if args.overlap1_outer:
        lr, momentum = (float(v) for v in args.overlap1_outer.split(","))
        outer1 = {**OUTER, "lr": lr, "momentum": momentum}
    start = time.perf_counter()
    results = [bench_workload(name, seeds, args.windows or WINDOWS[name], args.trainers, args.inner_steps, RULE,
                              outer, args.threads, outer1, args.start == "eager") for name in names]
    report = {"trainers": args.trainers, "shards": 2 * args.trainers, "rule": RULE, "outer": outer, "start": args.start,
              "outer_overlap1": outer1 or outer,
              "seeds": seeds, "results": results, "wall_s": round(time.perf_counter() - start, 1)}
    if args.plot:
        plot(results, args.plot, outer1)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()

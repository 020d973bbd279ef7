"""Robustness table: final digits accuracy for every (attack, aggregation rule) cell (issue 5).

Setup: the bundled digits split, 10 trainers on seeded near-equal shards, 2 of them Byzantine (20%); an
in-process FedAvg loop (not the networked engine): every window each honest trainer runs
`NumpyWorkload.train` (MLP 64-128-10, Adam 5e-3, batch 32, `--epochs` local epochs) on its shard, the two
attackers send `peerloom.backends.attacks.craft_update`, the cohort (canonical order, weights = shard
sizes) is aggregated with the rule and the outer step is SGD with lr 1 (FedAvg). Attackers are
omniscient, as in the ALIE and IPM papers: their `references` are this window's honest deltas, and both
send the same crafted update. Label-flip attackers train honestly on flipped labels.

Attacks (columns): ``none``, ``sign-flip``, ``sign-flip-scale`` (x10), ``scaling`` (x10),
``gaussian-noise`` (sigma 1, absolute), ``alie`` (z_max for n=10, f=2 and, as ``alie-z1``, z=1),
``ipm-0.1``, ``ipm-100``, ``label-flip``. Rules (rows): mean, median, trimmed_mean (trim 0.2),
multi_krum (f=2), centered_clip (defaults: 3 iterations, tau = median distance, from zero) — all with the
parameters the engine uses when it calls ``aggregate(rule, deltas, weights)`` unless stated.

``clean_accuracy`` is the mean rule with no attacker. The reported ``default_rule`` is the first rule, in
the order of ``PREFERENCE``, whose accuracy is >= 90% of ``clean_accuracy`` in every attack column
(``null`` if none is). Prints one JSON object on its last line:
``{"clean_accuracy", "default_rule", "cells": [{"attack", "rule", "accuracy"}], ...}``; ``--plot PATH``
draws the table as a heatmap PNG.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from peerloom.backends.attacks import alie_z, craft_update, label_flipped
from peerloom.backends.datasets import shard_indices
from peerloom.backends.mnist1d import make_mnist1d_numpy_workload
from peerloom.backends.numpy.aggregate import aggregate, outer_step
from peerloom.backends.numpy.workload import make_digits_numpy_workload

TRAINERS = 10
BYZANTINE = 2
RULES: dict[str, dict[str, Any]] = {
    "mean": {},
    "median": {},
    "trimmed_mean": {"trim_fraction": 0.2},
    "multi_krum": {"f": BYZANTINE},
    "centered_clip": {},
}
PREFERENCE = ("centered_clip", "trimmed_mean", "multi_krum", "median")
# column -> (attack name in backends.attacks, its parameters); "none" = every trainer honest
ATTACKS: dict[str, tuple[str, dict[str, Any]] | None] = {
    "none": None,
    "sign-flip": ("sign-flip", {}),
    "sign-flip-scale": ("sign-flip-scale", {"scale": 10.0}),
    "scaling": ("scaling", {"scale": 10.0}),
    "gaussian-noise": ("gaussian-noise", {"sigma": 1.0}),
    "alie": ("alie", {"num_workers": TRAINERS, "num_byzantine": BYZANTINE}),
    "alie-z1": ("alie", {"z": 1.0}),
    "ipm-0.1": ("ipm", {"epsilon": 0.1}),
    "ipm-100": ("ipm", {"epsilon": 100.0}),
    "label-flip": ("label-flip", {}),
}
QUICK_ATTACKS = ("none", "sign-flip", "scaling", "alie", "ipm-100")


def run_cell(workload: Any, flipped: Any, shards: list[list[int]], attack: tuple[str, dict[str, Any]] | None,
             rule: str, windows: int, seed: int, outer: str = "fedavg", byzantine_count: int = BYZANTINE) -> float:
    """Final test accuracy of one (attack, rule) cell after `windows` windows (outer optimizer `outer`:
    ``fedavg`` = SGD lr 1, ``diloco`` = Nesterov lr 0.7 momentum 0.9)."""
    params = workload.initial_params(seed)
    state = None
    weights = [len(s) for s in shards]
    byzantine = set() if attack is None else set(range(byzantine_count))  # the first shards, a fixed choice
    rng = np.random.default_rng(seed + 1)
    for w in range(windows):
        honest_deltas: dict[int, dict[str, np.ndarray]] = {}
        for i, shard in enumerate(shards):
            trainer = flipped if (i in byzantine and attack is not None and attack[0] == "label-flip") else workload
            honest_deltas[i] = trainer.train(params, shard, seed * 100_003 + w * 101 + i)[0]
        cohort = []
        refs = [honest_deltas[i] for i in range(len(shards)) if i not in byzantine]
        crafted = None
        for i in range(len(shards)):
            if i not in byzantine:
                cohort.append(honest_deltas[i])
                continue
            name, kw = attack  # type: ignore[misc]
            if name in ("alie", "ipm"):  # colluding attackers send one crafted update
                if crafted is None:
                    crafted = craft_update(name, honest_deltas[i], refs, rng, **kw)
                cohort.append(crafted)
            else:
                cohort.append(craft_update(name, honest_deltas[i], refs, rng, **kw))
        centre = aggregate(rule, cohort, weights, **RULES[rule])
        params, state = outer_step(outer, params, centre, state)
        if not all(np.isfinite(t).all() for t in params.values()):
            return float(np.mean(workload.y_train == 0))  # diverged: report chance-level, not NaN
    return float(workload.evaluate(params)["accuracy"])


def columns(trainers: int, byzantine: int) -> dict[str, tuple[str, dict[str, Any]] | None]:
    """`ATTACKS` with ALIE's z_max and Krum's f for this cohort."""
    out = dict(ATTACKS)
    out["alie"] = ("alie", {"num_workers": trainers, "num_byzantine": byzantine})
    return out


def choose_default(cells: list[dict[str, Any]], clean: float) -> str | None:
    by = {(c["attack"], c["rule"]): c["accuracy"] for c in cells}
    attacks = sorted({c["attack"] for c in cells})
    for rule in PREFERENCE:
        if all((a, rule) in by and by[(a, rule)] >= 0.9 * clean for a in attacks):
            return rule
    return None


def plot(cells: list[dict[str, Any]], clean: float, default: str | None, path: str, trainers: int = TRAINERS,
         byzantine: int = BYZANTINE, workload: str = "digits") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attacks = list(dict.fromkeys(c["attack"] for c in cells))
    rules = list(dict.fromkeys(c["rule"] for c in cells))
    by = {(c["attack"], c["rule"]): c["accuracy"] for c in cells}
    grid = np.array([[by[(a, r)] for a in attacks] for r in rules])
    fig, ax = plt.subplots(figsize=(1.1 * len(attacks) + 2, 0.6 * len(rules) + 1.8))
    im = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(attacks)), attacks, rotation=35, ha="right")
    ax.set_yticks(range(len(rules)), [f"{r} (default)" if r == default else r for r in rules])
    for y in range(len(rules)):
        for x in range(len(attacks)):
            v = grid[y, x]
            ax.text(x, y, f"{100 * v:.0f}", ha="center", va="center", color="white" if v < 0.6 else "black",
                    fontweight="bold" if v < 0.9 * clean else "normal")
    ax.set_title(f"{workload} test accuracy (%), {trainers} trainers, {byzantine} Byzantine; clean {100 * clean:.1f}%")
    fig.colorbar(im, ax=ax, fraction=0.03)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer windows and attacks (smoke test)")
    parser.add_argument("--windows", type=int, default=15)
    parser.add_argument("--epochs", type=int, default=2, help="local epochs per window")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rules", default=",".join(RULES))
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument("--trainers", type=int, default=TRAINERS)
    parser.add_argument("--byzantine", type=int, default=BYZANTINE)
    parser.add_argument("--outer", choices=("fedavg", "diloco"), default="fedavg", help="outer optimizer")
    parser.add_argument("--workload", choices=("digits", "mnist1d"), default="digits",
                        help="digits (64-128-10 MLP) or mnist1d (harder: 40-100-10 MLP, backends/mnist1d.py)")
    parser.add_argument("--plot", default=None, help="write the heatmap PNG here")
    args = parser.parse_args(argv)
    attacks = args.attacks.split(",")
    rules = args.rules.split(",")
    if args.quick:
        args.windows, args.epochs = 4, 1
        if args.attacks == ",".join(ATTACKS):
            attacks = list(QUICK_ATTACKS)
    for name in attacks:
        if name not in ATTACKS:
            parser.error(f"unknown attack column {name!r}; known: {', '.join(ATTACKS)}")
    for name in rules:
        if name not in RULES:
            parser.error(f"unknown rule {name!r}; known: {', '.join(RULES)}")
    if args.workload == "mnist1d":
        workload = make_mnist1d_numpy_workload(args.seed, local_epochs=args.epochs)
    else:
        workload = make_digits_numpy_workload(args.seed, local_epochs=args.epochs)
    flipped = label_flipped(workload, 10)
    shards = shard_indices(workload.num_train, args.trainers, args.seed)
    table = columns(args.trainers, args.byzantine)
    RULES["multi_krum"] = {"f": args.byzantine}
    start = time.perf_counter()
    clean = run_cell(workload, flipped, shards, None, "mean", args.windows, args.seed, args.outer)
    extra = (args.seed, args.outer, args.byzantine)
    cells = []
    for attack in attacks:
        for rule in rules:
            acc = clean if (attack == "none" and rule == "mean") else run_cell(
                workload, flipped, shards, table[attack], rule, args.windows, *extra)
            cells.append({"attack": attack, "rule": rule, "accuracy": acc})
            print(f"{attack:>16} {rule:>14} {100 * acc:6.1f}%", file=sys.stderr, flush=True)
    default = choose_default(cells, clean)
    report = {
        "clean_accuracy": clean,
        "default_rule": default,
        "cells": cells,
        "rule_params": {r: RULES[r] for r in rules},
        "attack_params": {a: (None if table[a] is None else {"attack": table[a][0], **table[a][1]})  # type: ignore[index]
                          for a in attacks},
        "alie_z_max": alie_z(args.trainers, args.byzantine),
        "trainers": args.trainers,
        "byzantine": args.byzantine,
        "windows": args.windows,
        "local_epochs": args.epochs,
        "outer": args.outer,
        "seed": args.seed,
        "workload": args.workload,
        "wall_s": time.perf_counter() - start,
    }
    if args.plot:
        plot(cells, clean, default, args.plot, args.trainers, args.byzantine, args.workload)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()

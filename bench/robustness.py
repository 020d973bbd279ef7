"""Robustness table: final accuracy (digits or mnist1d) for every (attack, aggregation rule) cell (spec/design.md §5).

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

``--defenses`` also runs every cell with the protocol's defences (spec/protocol.md §6, §6.1, §6.2, §9), at the
engine's parameters: cohort screening (the executor's own ``adapters/compute.py`` ``cohort_outliers``, at the
manifest's defaults), the loss check on 64 of the author's own leased samples (``workload.loss`` with the update
applied and applied the opposite way, with the executor's ``loss_check_batch`` and ``loss_check_passes``; its
rejections are not strikes), outliers as strikes with the engine's quarantine records
(`core.quarantine.next_records`: 3 strikes in 5 windows quarantine a trainer for 10), and sampled audits at
``--audit-rate`` 0.75 (over the aggregated updates and those the loss check rejected, as validators select
them), under which every crafted update (all attacks but label-flip, an honest computation on flipped data)
that is selected fails and quarantines its author one window later (`run_defended_cell`). The
report then adds ``defended_cells`` (each with ``caught``: what each defence caught),
``defended_default_rule`` (same choice, against the same undefended ``clean_accuracy``) and ``defenses``; the
plot adds the defended rows. ``--defenses loss,audit`` (any subset of ``screen,loss,audit``) is an ablation.
The undefended table is unchanged by the flag. The bench does not model the engine's ``screen-replay`` check,
which would reject the second of two byte-identical ALIE / IPM updates: an attacker evades it with a one-ulp
change. """

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
import numpy as np

from peerloom.adapters.compute import NumpyCompute, loss_check_batch, loss_check_passes
from peerloom.adapters.compute import cohort_outliers as engine_outliers
from peerloom.backends.attacks import alie_z, craft_update, label_flipped
from peerloom.backends.datasets import shard_indices
from peerloom.backends.mnist1d import make_mnist1d_numpy_workload
from peerloom.backends.numpy.aggregate import aggregate, outer_step
from peerloom.backends.numpy.workload import make_digits_numpy_workload
from peerloom.core.audit import audit_selected, loss_batch_seed
from peerloom.core.objects import Manifest
from peerloom.core.quarantine import next_records

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


# The protocol's defences (`--defenses`), at the engine's defaults (`Manifest`) unless stated.
_DEFAULTS = {name: field.default for name, field in attrs.fields_dict(Manifest).items()}
NORM_RATIO = float(_DEFAULTS["norm_ratio"])  # cohort screening: norm > 10 x the median norm is an outlier
NORM_MADS = int(_DEFAULTS["norm_mads"])  # ... or beyond the cohort's spread of norms ** 6, whichever is larger
MIN_COSINE = float(_DEFAULTS["min_cosine"])  # -1: the cosine test is off by default, as in the engine
LOSS_SAMPLES = 64  # loss check batch (`loss_check_samples`; the manifest default 0 turns the check off)
LOSS_MIN_DROP = float(_DEFAULTS["loss_min_drop"])
AUDIT_RATE = 0.75  # sampled audits after the fact (`audit_rate`; detection needs 0.75, bench/README.md)
QUARANTINE = SimpleNamespace(quarantine_strikes=_DEFAULTS["quarantine_strikes"],  # 3 strikes ...
                             strike_windows=_DEFAULTS["strike_windows"],  # ... within 5 windows ...
                             quarantine_windows=_DEFAULTS["quarantine_windows"])  # ... quarantine for 10
DEFENSES = ("screen", "loss", "audit")  # cohort screening, loss check, sampled audits (`--defenses`)
HONEST_COMPUTATIONS = frozenset({"label-flip"})  # trains honestly (on flipped labels): passes any audit


def window_updates(workload: Any, flipped: Any, shards: list[list[int]], attack: tuple[str, dict[str, Any]] | None,
                   byzantine: set[int], present: list[int], params: Any, w: int, seed: int,
                   rng: np.random.Generator) -> dict[int, dict[str, np.ndarray]]:
    """The update of each trainer in `present` (canonical order) for window `w`: honest trainers' deltas of
    `workload.train`; attackers' crafted ones, with this window's honest deltas of the present honest
    trainers as their omniscient `references`."""
    honest_deltas: dict[int, dict[str, np.ndarray]] = {}
    for i in present:
        trainer = flipped if (i in byzantine and attack is not None and attack[0] == "label-flip") else workload
        honest_deltas[i] = trainer.train(params, shards[i], seed * 100_003 + w * 101 + i)[0]
    refs = [honest_deltas[i] for i in present if i not in byzantine]
    crafted = None
    out: dict[int, dict[str, np.ndarray]] = {}
    for i in present:
        if i not in byzantine:
            out[i] = honest_deltas[i]
            continue
        name, kw = attack  # type: ignore[misc]  # not None for a byzantine peer
        if name in ("alie", "ipm"):  # colluding attackers send one crafted update
            if crafted is None:
                crafted = craft_update(name, honest_deltas[i], refs or [honest_deltas[i]], rng, **kw)
            out[i] = crafted
        else:
            out[i] = craft_update(name, honest_deltas[i], refs or [honest_deltas[i]], rng, **kw)
    return out


def run_cell(workload: Any, flipped: Any, shards: list[list[int]], attack: tuple[str, dict[str, Any]] | None,
             rule: str, windows: int, seed: int, outer: str = "fedavg", byzantine_count: int = BYZANTINE) -> float:
    """Final test accuracy of one (attack, rule) cell after `windows` windows (outer optimizer `outer`:
    ``fedavg`` = SGD lr 1, ``diloco`` = Nesterov lr 0.7 momentum 0.9), without the protocol's defences."""
    params = workload.initial_params(seed)
    state = None
    weights = [len(s) for s in shards]
    byzantine = set() if attack is None else set(range(byzantine_count))  # the first shards, a fixed choice
    rng = np.random.default_rng(seed + 1)
    everyone = list(range(len(shards)))
    for w in range(windows):
        updates = window_updates(workload, flipped, shards, attack, byzantine, everyone, params, w, seed, rng)
        cohort = [updates[i] for i in everyone]
        centre = aggregate(rule, cohort, weights, **RULES[rule])
        params, state = outer_step(outer, params, centre, state)
        if not all(np.isfinite(t).all() for t in params.values()):
            return float(np.mean(workload.y_train == 0))  # diverged: report chance-level, not NaN
    return float(workload.evaluate(params)["accuracy"])


def _update_id(seed: int, w: int, author: int) -> bytes:
    """Stand-in for an update's id (the hash of its signed announcement): fixes its loss-check batch and,
    with the head's, its audit draw; the same in every cell, so cells differ only by attack and rule."""
    return hashlib.sha256(f"robustness-bench/update/{seed}/{w}/{author}".encode()).digest()


def _head_id(seed: int, w: int) -> bytes:
    return hashlib.sha256(f"robustness-bench/head/{seed}/{w}".encode()).digest()


def loss_check(workload: Any, params: dict[str, np.ndarray], delta: dict[str, np.ndarray], shard: list[int],
               update_id: bytes, samples: int = LOSS_SAMPLES, min_drop: float = LOSS_MIN_DROP) -> bool:
    """spec/protocol.md §6.1 with the executor's own batch and verdict (`loss_check_batch`,
    `loss_check_passes`): the workload's loss on `samples` of the author's leased samples with the update
    applied and applied the opposite way (forward passes only); passes iff it points downhill."""
    batch = loss_check_batch(shard, samples, loss_batch_seed(update_id))
    applied = {n: np.subtract(params[n], delta[n], dtype=np.float32) for n in params}
    opposite = {n: np.add(params[n], delta[n], dtype=np.float32) for n in params}
    return loss_check_passes(float(workload.loss(applied, batch)), float(workload.loss(opposite, batch)), min_drop)


def cohort_outliers(deltas: list[dict[str, np.ndarray]], norm_ratio: float = NORM_RATIO,
                    min_cosine: float = MIN_COSINE, norm_mads: int = NORM_MADS) -> dict[int, str]:
    """Cohort screening (spec/protocol.md §6): the executor's own `peerloom.adapters.compute.cohort_outliers`
    (numpy backend) at the engine's defaults. {index: reason}."""
    return {i: reason for i, reason, _ in engine_outliers(NumpyCompute(), deltas, norm_ratio, min_cosine, norm_mads)}


def run_defended_cell(workload: Any, flipped: Any, shards: list[list[int]],
                      attack: tuple[str, dict[str, Any]] | None, rule: str, windows: int, seed: int,
                      outer: str = "fedavg", byzantine_count: int = BYZANTINE,
                      audit_rate: float = AUDIT_RATE,
                      defenses: tuple[str, ...] = DEFENSES) -> tuple[float, dict[str, int]]:
    """`run_cell` with the protocol's defences: (final test accuracy, what each defence caught).

    Each window, in the engine's order: trainers quarantined by the previous head get no lease (no update);
    every update gets the loss check (§6.1; rejected = ``screen-loss``, left out but not a strike); the
    accepted ones are cohort-screened (norm ratio; outliers are strikes) and the rest reduced with `rule`. The head of
    window `w` then records the window's strikes (`core.quarantine.next_records`: 3 within 5 windows
    quarantine for 10) and the audit verdicts on window `w - 1`'s cohort. Sampled audits (§6.2): each
    aggregated update is selected with probability `audit_rate` (`core.audit.audit_selected` on stand-in
    ids); a selected update that is not the honest computation of its lease (every attack but label-flip)
    fails, and the next head quarantines its author at once: it already counted in window `w`'s aggregate,
    still holds its lease for `w + 1` (leases come from head `w`) and is excluded from `w + 2` for 10
    windows. `defenses` picks a subset of `DEFENSES` (an ablation; strikes and quarantine come with any).
    Attackers are not told which of their updates were rejected or audited; they attack every window they
    hold a lease. Counters (``attacker_*`` / ``honest_*``): ``updates`` sent, rejected by the
    ``loss`` check, cohort ``outlier``s, ``aggregated``, ``audited``, ``audit_failed``; ``quarantined_strikes``
    / ``quarantined_audit`` (times a trainer was quarantined), ``quarantined_windows`` (windows spent excluded).
    """
    params = workload.initial_params(seed)
    state = None
    weights = [len(s) for s in shards]
    byzantine = set() if attack is None else set(range(byzantine_count))
    crafted = attack is not None and attack[0] not in HONEST_COMPUTATIONS
    rng = np.random.default_rng(seed + 1)
    head = SimpleNamespace(quarantine=(), strikes=())  # what `next_records` reads of a parent head
    failed_audits: list[int] = []  # authors whose update in the previous head's cohort failed its audit
    caught: Counter[str] = Counter()

    def role(i: int) -> str:
        return "attacker" if i in byzantine else "honest"

    for w in range(windows):
        excluded = {p for p, until in head.quarantine if until > w}  # the parent head's `quarantined`
        for i in excluded:
            caught[f"{role(i)}_quarantined_windows"] += 1
        present = [i for i in range(len(shards)) if i not in excluded]
        updates = window_updates(workload, flipped, shards, attack, byzantine, present, params, w, seed, rng)
        struck: list[int] = []
        accepted: list[int] = []
        loss_rejected: list[int] = []
        for i in present:
            caught[f"{role(i)}_updates"] += 1
            if "loss" not in defenses or loss_check(workload, params, updates[i], shards[i], _update_id(seed, w, i)):
                accepted.append(i)
            else:  # left out of the aggregate; not a strike (spec/protocol.md §6.1), but still audited (§6.2)
                caught[f"{role(i)}_loss"] += 1
                loss_rejected.append(i)
        outliers = cohort_outliers([updates[i] for i in accepted]) if "screen" in defenses else {}
        for k in outliers:
            struck.append(accepted[k])
            caught[f"{role(accepted[k])}_outlier"] += 1
        kept = [i for k, i in enumerate(accepted) if k not in outliers]
        if kept:
            centre = aggregate(rule, [updates[i] for i in kept], [weights[i] for i in kept], **RULES[rule])
            params, state = outer_step(outer, params, centre, state)
            if not all(np.isfinite(t).all() for t in params.values()):
                return float(np.mean(workload.y_train == 0)), dict(caught)
        # the head of window w: this window's strikes, and the audit verdicts on window w-1's cohort
        # (only for authors the parent does not quarantine)
        audits = [i for i in failed_audits if i not in excluded]
        before = dict(head.quarantine)
        # the ignore: int ids stand in for peer ids
        quarantine, strikes = next_records(head, w, struck, audits, QUARANTINE)  # type: ignore[arg-type]
        for p, until in quarantine:
            if before.get(p) != until:
                caught[f"{role(p)}_quarantined_{'audit' if p in audits else 'strikes'}"] += 1
        head = SimpleNamespace(quarantine=quarantine, strikes=strikes)
        # sampled audits of head w's cohort and of the updates the loss check rejected, run while window w+1
        # trains; verdicts go into head w+1
        failed_audits = []
        for i in kept:
            caught[f"{role(i)}_aggregated"] += 1
        for i in sorted(kept + loss_rejected):
            if "audit" in defenses and audit_selected(_head_id(seed, w), _update_id(seed, w, i), audit_rate):
                caught[f"{role(i)}_audited"] += 1
                if i in byzantine and crafted:
                    caught[f"{role(i)}_audit_failed"] += 1
                    failed_audits.append(i)
    return float(workload.evaluate(params)["accuracy"]), dict(caught)


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
         byzantine: int = BYZANTINE, workload: str = "digits", defended: list[dict[str, Any]] | None = None,
         defended_default: str | None = None) -> None:
    """The table as a heatmap (bold: below 90% of `clean`); with `defended` cells, their rows
    (``<rule> + defenses``) below the undefended ones."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attacks = list(dict.fromkeys(c["attack"] for c in cells))
    rows: list[tuple[str, dict[str, float]]] = []
    for group, best, suffix in ((cells, default, ""), (defended or [], defended_default, " + defenses")):
        for r in dict.fromkeys(c["rule"] for c in group):
            label = f"{r}{suffix}" + (" (default)" if r == best else "")
            rows.append((label, {c["attack"]: c["accuracy"] for c in group if c["rule"] == r}))
    grid = np.array([[row[a] for a in attacks] for _, row in rows])
    fig, ax = plt.subplots(figsize=(1.1 * len(attacks) + 3, 0.6 * len(rows) + 1.8))
    im = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(attacks)), attacks, rotation=35, ha="right")
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    if defended:
        ax.axhline(len(rows) - len({c["rule"] for c in defended}) - 0.5, color="white", linewidth=3)
    for y in range(len(rows)):
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
    parser.add_argument("--defenses", nargs="?", const=",".join(DEFENSES), default=None, metavar="LIST",
                        help="also run every cell with the protocol's defences (`defended_cells`): cohort screening, "
                             "the loss check (both with strikes and quarantine) and sampled audits; LIST picks some "
                             f"of {','.join(DEFENSES)} (default all)")
    parser.add_argument("--audit-rate", type=float, default=AUDIT_RATE, help="with --defenses: audit_rate")
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
    defenses = tuple(args.defenses.split(",")) if args.defenses else ()
    for name in defenses:
        if name not in DEFENSES:
            parser.error(f"unknown defence {name!r}; known: {', '.join(DEFENSES)}")
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
    defended: list[dict[str, Any]] = []
    if args.defenses:
        for attack in attacks:
            for rule in rules:
                acc, caught = run_defended_cell(workload, flipped, shards, table[attack], rule, args.windows, *extra,
                                                audit_rate=args.audit_rate, defenses=defenses)
                defended.append({"attack": attack, "rule": rule, "accuracy": acc, "caught": caught})
                print(f"{attack:>16} {rule:>14} {100 * acc:6.1f}% defended {caught}", file=sys.stderr, flush=True)
    report = {
        "clean_accuracy": clean,
        "default_rule": default,
        "cells": cells,
        "rule_params": {r: RULES[r] for r in rules},
        # the ignore: table[a] is not None here
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
    }
    if args.defenses:
        report["defended_cells"] = defended
        report["defended_default_rule"] = choose_default(defended, clean)
        report["defenses"] = {"enabled": list(defenses), "norm_ratio": NORM_RATIO, "norm_mads": NORM_MADS,
                              "min_cosine": MIN_COSINE,
                              "loss_check_samples": LOSS_SAMPLES, "loss_min_drop": LOSS_MIN_DROP,
                              "audit_rate": args.audit_rate, **vars(QUARANTINE)}
    report["wall_s"] = time.perf_counter() - start
    if args.plot:
        plot(cells, clean, default, args.plot, args.trainers, args.byzantine, args.workload,
             defended or None, report.get("defended_default_rule"))
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()

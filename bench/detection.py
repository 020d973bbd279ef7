"""Detection of cheating trainers: how fast sampled audits, behind the loss check, quarantine a cheater, and
whether the defenses ever strike an honest trainer (spec/protocol.md §6.1-6.3).

Setup (`sim/scenarios/cheaters.toml`): 4 validators (quorum 3, so 2 audit verdicts quarantine an author),
1 reducer, 7 trainers (the last one cheats, the other 6 are honest), 7 shards, DiLoCo (outer lr 0.7,
Nesterov 0.9) with H = 8 inner steps, centered clipping, `min_updates` 4, the simulator's real engines on
its virtual clock; the run stops once the honest validators hold the head of window `--windows` (10).
Defenses (flags): the loss check on `--loss-check-samples` (64) of the update's leased samples with
`--loss-min-drop` (0), sampled audits with `--audit-rate` (0.75), the manifest's quarantine thresholds
(3 strikes within 5 windows); `--manifest KEY=VALUE` (repeatable, TOML values) sets any other manifest key
as is, e.g. ``--manifest audit_segments=8`` (segment audits, §6.3).

Workload (`--workload`): ``digits-numpy`` by default (the bundled digits MLP 64-128-10, Adam 5e-3, batch
32, in numpy; the same model as the scenario's ``digits`` but ~3x faster), ``mnist1d-numpy``, ``digits``
(torch) or ``synthetic`` (the simulator's noisy quadratic, dim 16). The simulator's [workload] table knows
only ``synthetic`` and ``digits``, so this script resolves the numpy names through
`peerloom.backends.registry.build_workload` itself, and passes `--manifest` keys the simulator's [manifest]
table does not list yet (``audit_segments``) straight to the core `Manifest`, in its own processes only.
The quadratic does tell a lazy update from an honest one (cosine to the recomputation 0.97 from genesis,
~0.75 later, H = 8), but it is no stand-in for learning here: a random vector shaped like
``free-rider-noise`` passes about one audit in eight there (in 16 dimensions its cosine to the honest
delta reaches 0.99 when every lease pulls the same way), and its gradient noise does not come from the
samples the loss check evaluates.

Adversaries (sim/adversary.py, backends/attacks.py): ``lazy`` (H/4 inner steps scaled to the honest norm),
``replayer`` (its own delta of 2 train calls ago, perturbed; the first 2 calls are honest),
``free-rider-noise`` (a random vector with the honest norm and cosine to the cohort mean),
``lazy-1-in-5`` (lazy in calls 0, 5, 10, ...), and ``honest`` (the control: all 7 honest).

For each adversary and each seed 0 .. `--seeds` - 1 (200; `--quick`: 2) it records, from the certified
heads: the first window whose head quarantines the cheater and why (``audit``: the head's ``audits`` name
its update; ``strikes``: strikes reached ``quarantine_strikes``), the cheater's struck updates split into
cheating and honest ones (from the adversary's trace lines), its cheating updates certified into a cohort
and those a sampled audit replayed (failed: caught; passed: the replay could not tell them from honest
work), the rejections validator v0 logged by reason (a `screen-loss` rejection keeps an update out of the
cohort but is no strike, spec/protocol.md §6.1), and every honest trainer struck (a head's ``rejected``),
named by a failed audit, quarantined, or merely rejected at v0.

Prints progress to stderr and one JSON object on the last stdout line::

    {"settings": {...}, "wall_s", "runs", "adversaries": {name: {"seeds", "detected", "detection_rate",
     "detection_rate_ci95", "median_first_window", "first_window_histogram", "mechanism": {"audit",
     "strikes", "both", "none"}, "reject_reasons", "cheater_strikes": {"cheating", "honest"},
     "cheating_updates": {"sent", "certified", "seeds_any_certified", "audit_failed", "audit_passed"},
     "honest": {"seeds_struck", "seeds_quarantined", "seeds_audited", "strikes", "seeds_rejected",
     "reject_reasons"}, "skipped_windows", "final_accuracy", "invariant_failures", "wall_s"}},
     "honest_false": {"runs", "seeds_struck", "seeds_quarantined", "seeds_audited", "strikes",
     "seeds_rejected"},
     "targets": {...}, "met": {...}}

``detected``: seeds whose cheater a head of window <= `--windows` quarantines; the target is >= 99% for a
trainer that cheats every window (``lazy``, ``free-rider-noise``, and ``replayer`` after its 2 honest
windows); ``honest_false``: seeds (all adversaries and the control) in which an honest trainer was struck
(target 0), quarantined or named by a failed audit.

Measured (bench/README.md has the tables): with `--audit-rate 0.75 --manifest audit_segments=8` (segment
audits, which also select the updates the loss check rejected) lazy 100%, replayer 99.5%, free-rider-noise
99.5% of 200 seeds each within 10 windows, no honest trainer struck, quarantined or named by an audit in
600 runs. At rate 0.5 with segments a lazy trainer, whose first quarter is real work, is caught per window
with probability 0.375 only (96.5% measured), hence the default 0.75.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
import tomllib
from collections import Counter
from pathlib import Path
from typing import Any

# One BLAS thread per process: the workers already fill the cores, and OpenBLAS's spinning threads slow a
# loaded machine down several times over. (numpy is imported later, inside the functions.)
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "sim" / "scenarios" / "cheaters.toml"
ADVERSARIES = ("lazy", "replayer", "free-rider-noise", "lazy-1-in-5")
CONTROL = "honest"
WORKLOADS = ("digits-numpy", "mnist1d-numpy", "digits", "synthetic")
EVERY_WINDOW = ("lazy", "replayer", "free-rider-noise")  # the >= 99% target applies to these
TARGET_DETECTION = 0.99


# --- the simulator, extended in this process only ----------------------------------------------------------

def _extend_simulator(manifest_keys: dict[str, Any] | None = None) -> None:
    """Let `run_scenario` build the registry's numpy workloads its [workload] table does not name yet
    (``digits-numpy``, ``mnist1d-numpy``: shards and sizes exactly as `registry.build_workload` cuts them),
    and pass the `--manifest` keys its [manifest] table does not know yet to the core `Manifest` as they are,
    when `Manifest` has such a field (a key it has not is left for the simulator to refuse by name). Names
    and keys the simulator knows are left to it."""
    import attrs

    import peerloom.sim.scenario as scenario_mod
    from peerloom.core.objects import Manifest

    fields = {f.name for f in attrs.fields(Manifest)}
    own = set(scenario_mod.SCALARS["manifest"]) | set(scenario_mod.MANIFEST_PASSTHROUGH)
    for key, value in (manifest_keys or {}).items():
        if key in fields and key not in own:
            scenario_mod.MANIFEST_PASSTHROUGH[key] = type(value)
    if getattr(scenario_mod.build_workload, "_detection_bench", False):
        return
    original = scenario_mod.build_workload

    def build_workload(spec: Any, num_shards: int) -> Any:
        name = spec.get("name", "synthetic")
        try:
            return original(spec, num_shards)
        except scenario_mod.ScenarioError:
            if name not in ("digits-numpy", "mnist1d-numpy"):
                raise
        from peerloom.backends import registry

        workload, shards = registry.build_workload(name, int(spec.get("seed", 0)), num_shards)
        return workload, shards, [len(s) for s in shards]

    build_workload._detection_bench = True  # type: ignore[attr-defined]  # a marker attribute on the function
    scenario_mod.build_workload = build_workload


# --- one run ------------------------------------------------------------------------------------------------

class _TraceFilter:
    """A trace sink that keeps only the lines this bench reads (strike reasons, audit results, adversary
    actions), parsed; everything else is dropped unparsed."""

    KEEP = ('"event":"reject"', '"event":"audit-failed"', '"event":"audit-passed"', '"kind":"adversary"')

    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []

    def write(self, line: str) -> None:
        if any(k in line for k in self.KEEP):
            self.lines.append(json.loads(line))


def build_scenario(base: dict[str, Any], adversary: str, args: argparse.Namespace) -> dict[str, Any]:
    """The scenario of one adversary: `base` with the workload, window count and defense settings of `args`."""
    scenario = copy.deepcopy(base)
    scenario["name"] = f"cheaters-{adversary}"
    scenario["stop_window"] = args.windows
    scenario["duration_s"] = max(float(scenario.get("duration_s", 0.0)), 12.0 * float(
        scenario["manifest"].get("window_s", 4.0)) * (args.windows + 1))
    scenario["workload"] = {**{k: v for k, v in scenario.get("workload", {}).items()
                               if args.workload == "synthetic" and k != "name"}, "name": args.workload}
    if args.workload == "synthetic":
        scenario["workload"].setdefault("dim", 16)
    m = scenario["manifest"]
    m["inner_steps"] = args.inner_steps
    m["loss_check_samples"] = args.loss_check_samples
    if args.loss_min_drop:
        m["loss_min_drop"] = args.loss_min_drop
    else:
        m.pop("loss_min_drop", None)
    m["audit"] = args.audit_rate > 0.0
    if args.audit_rate > 0.0:
        m["audit_rate"] = args.audit_rate
    else:
        m.pop("audit_rate", None)
    m.update(args.manifest)
    if not m["loss_check_samples"]:
        m.pop("loss_check_samples")
        m.pop("loss_min_drop", None)
    scenario["adversaries"] = [] if adversary == CONTROL else [{"behaviour": adversary, "count": 1}]
    return scenario


def run_one(task: tuple[str, int, dict[str, Any], dict[str, Any]]) -> dict[str, Any]:
    """Run one (adversary, seed, scenario, `--manifest` keys) and return what the heads and the trace say
    about it (plain data)."""
    adversary, seed, scenario, extra_keys = task
    _extend_simulator(extra_keys)
    from peerloom.core.auditing import audit_authors
    from peerloom.sim.adversary import TrainingAttack
    from peerloom.sim.scenario import run_scenario

    t0 = time.perf_counter()
    sink = _TraceFilter()
    result = run_scenario(scenario, seed=seed, trace_out=sink)
    sim, final = result.sim, result.checkers.final
    stop = int(scenario["stop_window"])
    trainers = {name: node for name, node in sim.nodes.items() if node.role == "trainer"}
    cheaters = {node.peer_id for node in trainers.values() if not node.honest}
    honest = {node.peer_id for node in trainers.values() if node.honest}
    cheater = next(iter(cheaters), None)
    cheater_name = next((n for n, node in trainers.items() if not node.honest), None)

    # The windows in which the cheater sent a cheating update: a training attack says what each train call
    # sent ("honest", "lazy", "replay") in its trace lines; a crafted-update attack cheats in every window.
    if cheater_name is not None and isinstance(trainers[cheater_name].behaviour, TrainingAttack):
        actions = {int(line["window"]): str(line["action"]) for line in sink.lines
                   if line["kind"] == "adversary" and line["node"] == cheater_name}
        cheated = {w for w, a in actions.items() if a != "honest"}
    else:
        cheated = {ann.window for signer, ann in sim.updates.values() if signer == cheater}

    first_q: int | None = None
    mechanism = "none"
    struck = {"cheating": 0, "honest": 0}
    honest_strikes = 0
    honest_struck_peers: set[str] = set()
    honest_quarantined: set[str] = set()
    honest_audited: set[str] = set()
    certified_cheats = 0
    audit_hits = 0
    for window, head in sorted(final.items()):
        if window > stop:
            break
        audited = set(audit_authors(head.audits)) if head.audits else set()
        audit_hits += int(cheater in audited)
        honest_audited |= {str(p) for p in audited & honest}
        honest_quarantined |= {str(p) for p, _ in head.quarantine if p in honest}
        for update_id in head.rejected:
            signer, ann = sim.updates[update_id]
            if signer == cheater:
                struck["cheating" if ann.window in cheated else "honest"] += 1
            elif signer in honest:
                honest_strikes += 1
                honest_struck_peers.add(str(signer))
        for update_id in head.cohort:
            signer, ann = sim.updates[update_id]
            certified_cheats += int(signer == cheater and ann.window in cheated)
        if first_q is None and cheater is not None and any(p == cheater for p, _ in head.quarantine):
            first_q = window
            # strikes alone would have done it: the parent's live strikes plus this head's reach the threshold
            parent = final.get(window - 1)
            live = sum(n for p, n, latest in (parent.strikes if parent else ())
                       if p == cheater and latest > window - sim.manifest.strike_windows)
            live += sum(1 for u in head.rejected if sim.updates[u][0] == cheater)
            by_strikes = live >= sim.manifest.quarantine_strikes
            mechanism = ("both" if by_strikes else "audit") if cheater in audited else "strikes"

    reasons: Counter[str] = Counter()
    honest_reasons: Counter[str] = Counter()
    for line in sink.lines:
        if line["kind"] == "log" and line.get("event") == "reject" and line["node"] == "v0":
            if cheater is not None and line.get("peer") == str(cheater):
                reasons[str(line.get("reason"))] += 1
            elif line.get("peer") in {str(p) for p in honest}:
                honest_reasons[str(line.get("reason"))] += 1
    # sampled audits of the cheater's cheating updates (by window, whichever validators ran them): a pass
    # is a cheat the replay could not tell from honest work
    audited_cheats: dict[str, set[int]] = {"failed": set(), "passed": set()}
    for line in sink.lines:
        if line["kind"] == "log" and line.get("event") in ("audit-failed", "audit-passed") and \
                cheater is not None and line.get("author") == str(cheater) and int(line["window"]) in cheated:
            audited_cheats[line["event"].removeprefix("audit-")].add(int(line["window"]))
    last = final[max(final)] if final else None
    return {
        "adversary": adversary, "seed": seed, "wall_s": time.perf_counter() - t0,
        "ok": result.ok, "certified": result.summary["windows"]["certified"],
        "skipped": result.summary["windows"]["skipped"], "height": max(final) if final else 0,
        "first_quarantine": first_q, "mechanism": mechanism, "audit_hits": audit_hits,
        "cheater_struck": struck, "cheated_windows": len(cheated), "certified_cheats": certified_cheats,
        "cheats_audited": {k: len(v) for k, v in audited_cheats.items()},
        "reasons": dict(reasons), "honest_reasons": dict(honest_reasons),
        "honest_strikes": honest_strikes, "honest_struck": sorted(honest_struck_peers),
        "honest_quarantined": sorted(honest_quarantined), "honest_audited": sorted(honest_audited),
        "accuracy": float(last.metrics.get("test_accuracy", float("nan"))) if last else float("nan"),
    }


# --- the report ---------------------------------------------------------------------------------------------

def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion k / n (95% by default)."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4))


def summarize(runs: list[dict[str, Any]], windows: int) -> dict[str, Any]:
    n = len(runs)
    firsts = [r["first_quarantine"] for r in runs if r["first_quarantine"] is not None]
    detected = sum(1 for w in firsts if w <= windows)
    reasons: Counter[str] = Counter()
    honest_reasons: Counter[str] = Counter()
    for r in runs:
        reasons.update(r["reasons"])
        honest_reasons.update(r["honest_reasons"])
    accuracy = [r["accuracy"] for r in runs if not math.isnan(r["accuracy"])]
    return {
        "seeds": n,
        "detected": detected,
        "detection_rate": round(detected / n, 4) if n else 0.0,
        "detection_rate_ci95": list(wilson(detected, n)),
        "median_first_window": statistics.median(firsts) if firsts else None,
        "first_window_histogram": {str(w): c for w, c in sorted(Counter(firsts).items())},
        "mechanism": {k: sum(1 for r in runs if r["mechanism"] == k) for k in ("audit", "strikes", "both", "none")},
        "reject_reasons": dict(sorted(reasons.items())),
        "cheater_strikes": {k: sum(r["cheater_struck"][k] for r in runs) for k in ("cheating", "honest")},
        "cheating_updates": {"sent": sum(r["cheated_windows"] for r in runs),
                             "certified": sum(r["certified_cheats"] for r in runs),
                             "seeds_any_certified": sum(1 for r in runs if r["certified_cheats"]),
                             "audit_failed": sum(r["cheats_audited"]["failed"] for r in runs),
                             "audit_passed": sum(r["cheats_audited"]["passed"] for r in runs)},
        "honest": {"seeds_struck": sum(1 for r in runs if r["honest_struck"]),
                   "seeds_quarantined": sum(1 for r in runs if r["honest_quarantined"]),
                   "seeds_audited": sum(1 for r in runs if r["honest_audited"]),
                   "strikes": sum(r["honest_strikes"] for r in runs),
                   "seeds_rejected": sum(1 for r in runs if r["honest_reasons"]),
                   "reject_reasons": dict(sorted(honest_reasons.items()))},
        "skipped_windows": sum(r["skipped"] for r in runs),
        "final_accuracy": round(statistics.mean(accuracy), 4) if accuracy else None,
        "invariant_failures": sum(1 for r in runs if not r["ok"]),
        "wall_s": round(sum(r["wall_s"] for r in runs), 2),
    }


def _manifest_item(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        parsed = tomllib.loads(f"v = {value.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value.strip()  # a bare word is a string
    return key.strip(), parsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200, help="seeds per adversary (default 200)")
    parser.add_argument("--quick", action="store_true", help="2 seeds per adversary (the test's form)")
    parser.add_argument("--windows", type=int, default=10, help="detection horizon: heads of windows 1..N")
    parser.add_argument("--adversaries", default=",".join((*ADVERSARIES, CONTROL)),
                        help="comma-separated; 'honest' is the all-honest control")
    parser.add_argument("--workload", choices=WORKLOADS, default="digits-numpy")
    parser.add_argument("--inner-steps", type=int, default=8)
    parser.add_argument("--loss-check-samples", type=int, default=64, help="0 turns the loss check off")
    parser.add_argument("--loss-min-drop", type=float, default=0.0)
    parser.add_argument("--audit-rate", type=float, default=0.75, help="0 turns audits off")
    parser.add_argument("--manifest", type=_manifest_item, action="append", default=[], metavar="KEY=VALUE",
                        help="any other manifest key (TOML value), e.g. audit_segments=8; repeatable")
    parser.add_argument("--scenario", type=Path, default=SCENARIO)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--runs-out", type=Path, default=None, help="also write every run's record (JSON lines)")
    args = parser.parse_args()
    if args.quick:
        args.seeds = 2
    args.manifest = dict(args.manifest)
    adversaries = [a.strip() for a in args.adversaries.split(",") if a.strip()]
    unknown = [a for a in adversaries if a not in (*ADVERSARIES, CONTROL)]
    if unknown:
        parser.error(f"unknown adversaries {unknown}; known: {', '.join((*ADVERSARIES, CONTROL))}")

    from peerloom.sim.scenario import load_scenario

    base = load_scenario(args.scenario)
    scenarios = {a: build_scenario(base, a, args) for a in adversaries}
    tasks = [(a, seed, scenarios[a], args.manifest) for a in adversaries for seed in range(args.seeds)]
    print(f"detection: {len(adversaries)} configurations x {args.seeds} seeds on {args.workload}, "
          f"{args.workers} workers", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in adversaries}
    done = 0
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    with context.Pool(max(1, args.workers), initializer=_extend_simulator, initargs=(args.manifest,)) as pool:
        for record in pool.imap_unordered(run_one, tasks, chunksize=1):
            runs[record["adversary"]].append(record)
            done += 1
            if done % 10 == 0 or done == len(tasks) or len(runs[record["adversary"]]) == args.seeds:
                caught = sum(1 for r in runs[record["adversary"]]
                             if r["first_quarantine"] is not None and r["first_quarantine"] <= args.windows)
                print(f"[{done}/{len(tasks)}] {time.perf_counter() - t0:.0f} s: {record['adversary']} "
                      f"{caught}/{len(runs[record['adversary']])} caught", file=sys.stderr, flush=True)
    wall = time.perf_counter() - t0
    if args.runs_out is not None:
        with args.runs_out.open("w") as fh:
            for a in adversaries:
                for r in sorted(runs[a], key=lambda r: r["seed"]):
                    fh.write(json.dumps(r, sort_keys=True) + "\n")

    summaries = {a: summarize(sorted(runs[a], key=lambda r: r["seed"]), args.windows) for a in adversaries}
    every = [r for a in adversaries for r in runs[a]]
    honest_false = {"runs": len(every),
                    "seeds_struck": sum(1 for r in every if r["honest_struck"]),
                    "seeds_quarantined": sum(1 for r in every if r["honest_quarantined"]),
                    "seeds_audited": sum(1 for r in every if r["honest_audited"]),
                    "strikes": sum(r["honest_strikes"] for r in every),
                    "seeds_rejected": sum(1 for r in every if r["honest_reasons"])}
    manifest = scenarios[adversaries[0]]["manifest"] if adversaries else {}
    report = {
        "settings": {"workload": args.workload, "seeds": args.seeds, "windows": args.windows,
                     "roles": dict(base.get("roles", {})), "manifest": manifest, "workers": args.workers},
        "wall_s": round(wall, 2),
        "runs": len(every),
        "adversaries": summaries,
        "honest_false": honest_false,
        "targets": {"detection_rate": TARGET_DETECTION, "every_window": list(EVERY_WINDOW),
                    "honest_seeds_struck": 0},
        "met": {"detection": all(summaries[a]["detection_rate"] >= TARGET_DETECTION
                                 for a in EVERY_WINDOW if a in summaries),
                "no_honest_strikes": honest_false["seeds_struck"] == 0 and honest_false["seeds_quarantined"] == 0
                and honest_false["seeds_audited"] == 0},
    }
    for a in adversaries:
        s = summaries[a]
        print(f"{a:>17}: detected {s['detected']}/{s['seeds']} ({s['detection_rate']:.1%}) median window "
              f"{s['median_first_window']} mechanism {s['mechanism']} honest struck in "
              f"{s['honest']['seeds_struck']} seeds", file=sys.stderr)
    print(f"wall {wall:.1f} s", file=sys.stderr)
    print(json.dumps(report))


if __name__ == "__main__":
    main()

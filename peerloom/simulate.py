"""`peerloom sim SCENARIO --seed N --out DIR`: run one deterministic simulation (spec/simulator.md).

SCENARIO is a TOML file, or the name of a scenario shipped with peerloom (`happy`, `churn`...).

Writes DIR/trace.jsonl (one event per line; byte-identical for the same scenario and seed),
DIR/summary.json, DIR/chain/ (the signed manifest and each final head with its quorum certificate, which
`peerloom verify DIR/chain` checks) and DIR/plots/*.png. Exit status 0 when every invariant holds; 1 on a
violation, after printing the seed and the command that reproduces it; 2 for a malformed scenario.
"""

from __future__ import annotations

import argparse
import errno
import json
import shlex
import sys
import time
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from peerloom.sim.scenario import Result


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = subparsers.add_parser("sim", help="run a deterministic simulation of a scenario (TOML)")
    p.add_argument("scenario", type=Path, help=f"scenario file, or a shipped scenario's name: {', '.join(shipped())}")
    p.add_argument("--seed", type=int, default=0, help="master seed (network, churn, compute, adversaries)")
    p.add_argument("--out", type=Path, default=Path("peerloom-sim"), help="output directory")
    p.add_argument("--no-plots", action="store_true", help="skip DIR/plots/*.png")
    p.add_argument("--keep-going", action="store_true", help="do not stop at the first invariant violation")
    p.add_argument("--quiet", action="store_true", help="no progress line per final window on stderr")
    return p


def shipped() -> list[str]:
    """Names of the scenarios that ship with peerloom (package data of peerloom.sim)."""
    folder = resources.files("peerloom.sim") / "scenarios"
    return sorted(p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml"))


def resolve(scenario: Path) -> Path | Traversable:
    """`scenario` if it is a file; else the shipped scenario of that name. FileNotFoundError if neither."""
    if scenario.exists() or scenario.suffix == ".toml" or len(scenario.parts) > 1:
        return scenario
    packaged = resources.files("peerloom.sim") / "scenarios" / f"{scenario}.toml"
    if packaged.is_file():
        return packaged
    raise FileNotFoundError(errno.ENOENT, f"no such file, nor a shipped scenario ({', '.join(shipped())})",
                            str(scenario))


def run(args: argparse.Namespace) -> int:
    from peerloom.sim.scenario import ScenarioError, load_scenario, run_scenario

    try:
        scenario = load_scenario(resolve(args.scenario))
    except ScenarioError as exc:
        raise ScenarioError(f"{args.scenario}: {exc}") from exc  # one line by the CLI, exit 2
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    wall0 = time.perf_counter()

    def progress(window: int, virtual_s: float) -> None:
        if not args.quiet:
            print(f"  window {window} final at {virtual_s:.1f} s virtual ({time.perf_counter() - wall0:.1f} s wall)",
                  file=sys.stderr, flush=True)

    try:
        with open(out / "trace.jsonl", "w", encoding="utf-8", newline="\n") as trace:
            result = run_scenario(scenario, seed=args.seed, trace_out=trace,
                                  stop_on_violation=not args.keep_going, on_window=progress)
    except ScenarioError as exc:
        raise ScenarioError(f"{args.scenario}: {exc}") from exc  # one line by the CLI, exit 2
    summary = result.summary
    write_chain(result, out / "chain")
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    if not args.no_plots:
        try:
            write_plots(result, out / "plots")
        except ModuleNotFoundError as exc:
            print(f"peerloom sim: plots skipped ({exc.name} is not installed: pip install 'peerloom[demo]')",
                  file=sys.stderr)
    w = summary["windows"]
    print(f"{summary['scenario']} seed {args.seed}: {w['certified']} windows certified, {w['skipped']} skipped "
          f"in {summary['sim_time_s']:.1f} s virtual ({summary['wall_s']:.1f} s wall, {summary['events']} events)")
    for name, verdict in summary["invariants"].items():
        print(f"  {'ok  ' if verdict['ok'] else 'FAIL'} {name}: {verdict['detail']}")
    print(f"  trace sha256 {summary['trace_sha256']}  ->  {out}")
    if result.ok:
        return 0
    first = result.checkers.first_violation
    where = f" at t={first[0]:.3f} s ({first[1]})" if first else ""
    print(f"INVARIANT VIOLATED{where} with seed {args.seed}. Reproduce with:\n"
          f"  peerloom sim {shlex.quote(str(args.scenario))} --seed {args.seed} --out {shlex.quote(str(out))}",
          file=sys.stderr)
    return 1


def write_chain(result: Result, chain_dir: Path) -> None:
    """The run's chain as a chain directory (manifest.cbor + NNNNNN.cbor, as `peerloom node` stores it): every
    final head from window 1 on with the certificate honest nodes promoted it with, up to the first gap."""
    from peerloom.core.chain import encode_chain_entry

    chain_dir.mkdir(parents=True, exist_ok=True)
    for old in chain_dir.glob("[0-9]*.cbor"):
        old.unlink()
    (chain_dir / "manifest.cbor").write_bytes(result.sim.revision.envelope.to_bytes())
    checkers = result.checkers
    window = 1
    while window in checkers.final and window in checkers.final_certs:
        entry = encode_chain_entry(checkers.final[window], checkers.final_certs[window])
        (chain_dir / f"{window:06d}.cbor").write_bytes(entry)
        window += 1


# --- plots (matplotlib, Agg): loss vs time, head height per node, bytes per link --------------------

MAX_NODES_PLOTTED = 24
MAX_LINKS_PLOTTED = 30


def write_plots(result: Result, out: Path) -> list[Path]:
    """Write loss.png, heights.png and link_bytes.png under `out`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    sim = result.sim
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4))
    if result.loss:
        times, _, losses = zip(*result.loss, strict=True)
        ax.plot(times, losses, marker="o")
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("test loss of the certified head")
    ax.set_title(f"{result.summary['scenario']} seed {result.summary['seed']}: loss vs time")
    paths.append(_save(fig, out / "loss.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    names = [n for n in sim.nodes if sim.nodes[n].role != "trainer"]
    names += [n for n in sim.nodes if sim.nodes[n].role == "trainer"][:max(0, MAX_NODES_PLOTTED - len(names))]
    for name in names:
        heads = sim.nodes[name].heads
        if heads:
            ts = [0.0] + [t for t, _, _ in heads]
            ws = [0] + [w for _, w, _ in heads]
            end = sim.now if sim.nodes[name].up else ts[-1]  # a node that is down stops where it fell
            ax.step([*ts, end], [*ws, ws[-1]], where="post", label=name, alpha=0.8)
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("head window")
    ax.set_title("certified head height per node")
    if len(names) <= 12:
        ax.legend(fontsize="small")
    paths.append(_save(fig, out / "heights.png"))

    fig, ax = plt.subplots(figsize=(8, 5))
    top = sorted(sim.network.bytes.items(), key=lambda kv: (-kv[1], kv[0]))[:MAX_LINKS_PLOTTED]
    ax.barh([f"{a}->{b}" for (a, b), _ in top][::-1], [v / 1e6 for _, v in top][::-1])
    ax.set_xlabel("MB sent")
    ax.set_title(f"bytes per link (top {len(top)} of {len(sim.network.bytes)})")
    paths.append(_save(fig, out / "link_bytes.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path

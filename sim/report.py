"""Plots of one simulation run (matplotlib, Agg backend): loss vs time, head height per node, bytes
per link. Written as PNG files; nothing here affects the trace."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .scenario import Result

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
        ts, _, losses = zip(*result.loss, strict=True)
        ax.plot(ts, losses, marker="o")
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
            ax.step([*ts, sim.now], [*ws, ws[-1]], where="post", label=name, alpha=0.8)
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


def _save(fig, path: Path) -> Path:  # type: ignore[no-untyped-def]
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path

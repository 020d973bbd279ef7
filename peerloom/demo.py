"""`peerloom demo`: a real fleet of OS processes training one model over TCP+Noise on 127.0.0.1.

The demo plays the experiment authority: it makes identities, the initial parameters and the signed
manifest, starts validators (one in the smoke profile, four with a Byzantine quorum of three in the
default one), a reducer and several trainers as separate `peerloom node` processes,
shows each certified window as it happens, and leaves behind ``report.json``, ``chain/`` (the signed
heads and their quorum certificates, plus the manifest) and ``plots/``. It also trains the same model
centrally on the same data in the same run, as the baseline. Exit status 0 only if every window of the
profile was certified (not skipped) and the chain verifies.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import tomli_w
from rich.console import Console

import peerloom
from peerloom.adapters.keys import generate_identity, save_identity
from peerloom.adapters.storage import ArtifactStore, atomic_write
from peerloom.backends.numpy.tensors import schema_of, tensor_digest, to_safetensors
from peerloom.backends.registry import build_workload
from peerloom.core.chain import decode_chain_entry, verify_chain
from peerloom.core.errors import PeerloomError
from peerloom.core.identity import Identity
from peerloom.core.leases import leases_of
from peerloom.core.objects import Manifest, Revision

WORKLOAD = "digits-mlp"
MARKER = ".peerloom-demo"


@attrs.frozen(kw_only=True)
class Profile:
    validators: int
    trainers: int
    windows: int
    shards: int
    window_s: float
    min_updates: int
    time_limit_s: float


PROFILES = {
    "smoke": Profile(validators=1, trainers=4, windows=3, shards=8, window_s=8.0, min_updates=2,
                     time_limit_s=80.0),
    "default": Profile(validators=4, trainers=6, windows=20, shards=12, window_s=10.0, min_updates=3,
                       time_limit_s=280.0),
}


@attrs.define
class NodeProc:
    name: str
    role: str
    identity: Identity
    directory: Path
    behaviour: str = "honest"
    port: int = 0
    process: subprocess.Popen[bytes] | None = None


_console = Console(highlight=False, soft_wrap=True)


def _say(text: str, *, markup: bool = False) -> None:
    _console.print(text, markup=markup)


def _prepare_out(out: Path) -> None:
    if out.exists():
        if not (out / MARKER).exists() and any(out.iterdir()):
            raise SystemExit(f"peerloom demo: {out} exists and is not a demo directory; choose another --out")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / MARKER).touch()


def byzantine_quorum(n: int) -> int:
    """Smallest quorum q with 3q > 2n (spec/agreement.md §2): tolerates n - q Byzantine validators."""
    return 2 * n // 3 + 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _write_config(node: NodeProc, manifest_path: Path, authority: Identity, bootstrap: list[str],
                  windows: int) -> Path:
    d = node.directory
    config = {
        "name": node.name, "roles": [node.role], "key": "key", "manifest": str(manifest_path),
        "authority": authority.peer_id.to_text(), "store": "store", "listen": f"127.0.0.1:{node.port}",
        "bootstrap": bootstrap, "port_file": "port", "events": "events.jsonl", "stats": "stats.json",
        "threads": 1, "stop_after_window": windows,
    }
    path = d / "node.toml"
    path.write_text(tomli_w.dumps(config))
    return path


def _spawn(node: NodeProc, config: Path) -> None:
    log = open(node.directory / "node.log", "wb")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    node.process = subprocess.Popen([sys.executable, "-m", "peerloom", "node", "--config", str(config)],
                                    stdout=log, stderr=subprocess.STDOUT, env=env)


def _wait_port(node: NodeProc, deadline: float) -> int:
    path = node.directory / "port"
    while time.monotonic() < deadline:
        if path.exists():
            return int(path.read_text())
        if node.process is not None and node.process.poll() is not None:
            raise SystemExit(f"peerloom demo: {node.name} exited early; see {node.directory / 'node.log'}")
        time.sleep(0.05)
    raise SystemExit(f"peerloom demo: {node.name} did not start in time")


class EventTail:
    """Reads new JSON lines from a node's event log as they are written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            data = fh.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


def _kill_leaseholder(validator: NodeProc, revision: Revision, trainers: list[NodeProc], window: int) -> NodeProc:
    """SIGKILL a trainer that holds a lease in `window`, which has just opened at the validator.

    The leases come from the certified head before it, exactly as every peer computes them, so the
    victim's lease goes unreported and the window must close on its deadline.
    """
    if window == 1:
        head = revision.genesis()
    else:
        head, _ = decode_chain_entry((validator.directory / "store" / "chain" / f"{window - 1:06d}.cbor").read_bytes())
    leases = leases_of(head, revision.manifest)
    victim = next((t for t in trainers if t.identity.peer_id in leases), trainers[0])
    assert victim.process is not None
    victim.process.send_signal(signal.SIGKILL)
    victim.behaviour = "killed"
    _say(f"  killed {victim.name} (pid {victim.process.pid}, lease on shards "
         f"{list(leases.get(victim.identity.peer_id, ()))}) with SIGKILL as window {window} opened")
    return victim


def _stop(nodes: list[NodeProc]) -> None:
    for node in nodes:
        if node.process is not None and node.process.poll() is None:
            node.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for node in nodes:
        if node.process is None:
            continue
        try:
            node.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            node.process.kill()
            node.process.wait()


def run_demo(*, profile: str = "default", out: Path = Path("peerloom-demo"), seed: int = 0,
             kill_trainer_at: int | None = None) -> int:
    """Run the demo; returns the process exit status (0 = every window certified and verified)."""
    import torch

    from peerloom.backends.torch.models import train_centralized

    torch.set_num_threads(1)
    p = PROFILES[profile]
    started = time.monotonic()
    out = out.resolve()
    _prepare_out(out)
    _say(f"peerloom {peerloom.__version__} demo: profile {profile}, seed {seed}, "
         f"{p.trainers} trainers, {p.windows} windows, output {out}")

    workload, shards = build_workload(WORKLOAD, seed, p.shards)
    _say("training the centralized baseline on the same data ...")
    baseline = train_centralized(workload, epochs=p.windows, seed=seed)
    _say(f"  baseline: test accuracy {baseline['test_accuracy']:.4f} after {baseline['epochs']} epochs "
         f"({baseline['wall_s']:.1f} s)")

    authority = generate_identity()
    nodes = [NodeProc(name=f"validator-{i}", role="validator", identity=generate_identity(),
                      directory=out / "nodes" / f"validator-{i}") for i in range(1, p.validators + 1)]
    nodes.append(NodeProc(name="reducer", role="reducer", identity=generate_identity(),
                          directory=out / "nodes" / "reducer"))
    nodes += [NodeProc(name=f"trainer-{i}", role="trainer", identity=generate_identity(),
                       directory=out / "nodes" / f"trainer-{i}") for i in range(1, p.trainers + 1)]
    for node in nodes:
        node.directory.mkdir(parents=True)
        save_identity(node.identity, node.directory / "key")

    params = workload.initial_params(seed)
    genesis_bytes = to_safetensors(params)
    chunk_size = 64 * 1024
    genesis_refs = [ArtifactStore(n.directory / "store", chunk_size=chunk_size).put(genesis_bytes)
                    for n in nodes if n.role in ("validator", "reducer")]
    trainers = [n for n in nodes if n.role == "trainer"]
    manifest = Manifest(
        experiment=f"peerloom-demo-{seed}", workload=WORKLOAD, workload_seed=seed,
        schema=schema_of(params), shards=tuple(len(s) for s in shards),
        validators=tuple(n.identity.peer_id for n in nodes if n.role == "validator"),
        quorum=byzantine_quorum(p.validators), window_s=p.window_s, min_updates=p.min_updates,
        max_capacity=4, aggregation="mean", outer_optimizer="fedavg", outer_lr=1.0, chunk_size=chunk_size,
        genesis_params=genesis_refs[0], genesis_params_digest=tensor_digest(params),
        roster=tuple(sorted((t.identity.peer_id, 1) for t in trainers)),
    )
    envelope = manifest.seal(authority)
    revision = Revision.verify(envelope, authority.peer_id)
    manifest_path = out / "manifest.cbor"
    atomic_write(manifest_path, envelope.to_bytes())

    deadline = started + p.time_limit_s
    heads: list[dict[str, Any]] = []
    rejected: dict[str, int] = {}
    killed: NodeProc | None = None
    try:
        validator = nodes[0]
        for node in nodes:
            node.port = _free_port()
        servers = [n for n in nodes if n.role in ("validator", "reducer")]
        for node in nodes:
            # Trainers dial every validator and the reducer; servers dial the servers listed before them.
            targets = servers if node.role == "trainer" else servers[:servers.index(node)]
            _spawn(node, _write_config(node, manifest_path, authority, [f"127.0.0.1:{t.port}" for t in targets],
                                       p.windows))
        for node in nodes:
            _wait_port(node, deadline)
        _say(f"started {len(nodes)} node processes on 127.0.0.1: {p.validators} validators (quorum "
             f"{manifest.quorum}), 1 reducer, {p.trainers} trainers; pids "
             f"{', '.join(str(n.process.pid) for n in nodes if n.process)}")
        tail = EventTail(validator.directory / "events.jsonl")
        wire_tails = {n.name: EventTail(n.directory / "events.jsonl") for n in nodes}
        wire_sent: dict[str, int] = {}
        while time.monotonic() < deadline and (not heads or heads[-1]["window"] < p.windows):
            if validator.process is not None and validator.process.poll() is not None:
                _say("validator exited unexpectedly; see its node.log")
                break
            for name, node_tail in wire_tails.items():
                for line in node_tail.read():
                    if line["event"] == "wire":
                        wire_sent[name] = line["sent"]
            for line in tail.read():
                if line["event"] == "reject":
                    rejected[line["reason"]] = rejected.get(line["reason"], 0) + 1
                elif line["event"] == "window-deadline":
                    _say(f"  window {line['window']}: deadline reached with {line['reported']} of "
                         f"{line['leases']} leases reported")
                elif line["event"] == "head":
                    heads.append(line)
                    m = line["metrics"]
                    status = "[bold red]SKIPPED (too few updates)[/]" if line["skipped"] else (
                        f"accuracy [bold green]{m.get('test_accuracy', 0):.4f}[/]  loss {m.get('test_loss', 0):.4f}")
                    _say(f"window {line['window']:>3}/{p.windows}  {status}  updates {line['cohort']}  "
                         f"wire {sum(wire_sent.values()) / 1e6:6.2f} MB  t={time.monotonic() - started:5.1f}s",
                         markup=True)
                elif line["event"] == "window-open" and line["window"] == kill_trainer_at and killed is None:
                    killed = _kill_leaseholder(validator, revision, trainers, kill_trainer_at)
            time.sleep(0.1)
    finally:
        _stop(nodes)

    return _finish(out, profile, seed, p, nodes, revision, baseline, rejected, started)


def _finish(out: Path, profile: str, seed: int, p: Profile, nodes: list[NodeProc], revision: Revision,
            baseline: dict[str, Any], rejected: dict[str, int], started: float) -> int:
    chain_src = nodes[0].directory / "store" / "chain"
    chain_dir = out / "chain"
    chain_dir.mkdir()
    shutil.copy(out / "manifest.cbor", chain_dir / "manifest.cbor")
    entries = []
    for path in sorted(chain_src.glob("*.cbor")) if chain_src.exists() else []:
        shutil.copy(path, chain_dir / path.name)
        entries.append(decode_chain_entry(path.read_bytes()))
    try:
        checked = verify_chain(revision, entries)
        verified = True
    except PeerloomError as exc:
        checked, verified = [f"FAILED: {exc}"], False
    stats = {}
    for node in nodes:
        path = node.directory / "stats.json"
        if path.exists():
            stats[node.name] = json.loads(path.read_text())
    final = entries[-1][0] if entries else revision.genesis()
    certified = sum(1 for h, _ in entries if not h.skipped)
    skipped = sum(1 for h, _ in entries if h.skipped)
    v_stats = stats.get(nodes[0].name, {})
    report = {
        "peerloom_version": peerloom.__version__, "profile": profile, "seed": seed, "workload": WORKLOAD,
        "transport": "tcp+noise",
        "nodes": [{"name": n.name, "role": n.role, "peer_id": n.identity.peer_id.to_text(),
                   "pid": n.process.pid if n.process else None, "behaviour": n.behaviour} for n in nodes],
        "windows": {"certified": certified, "skipped": skipped},
        "final_head": {"id": final.id.hex(), "window": final.window,
                       "test_accuracy": final.metrics.get("test_accuracy", 0.0),
                       "test_loss": final.metrics.get("test_loss", 0.0)},
        "baseline": {"test_accuracy": baseline["test_accuracy"], "epochs": baseline["epochs"],
                     "wall_s": baseline["wall_s"]},
        "updates": {"accepted": sum(len(h.cohort) for h, _ in entries),
                    "rejected": sum(v_stats.get("rejected_by_reason", {}).values()),
                    "rejected_by_reason": v_stats.get("rejected_by_reason", {})},
        "bytes_on_wire": sum(s["bytes_sent"] for s in stats.values()),
        "wall_s": round(time.monotonic() - started, 3),
        "verified": verified,
        "history": [{"window": h.window, "skipped": h.skipped, "cohort": len(h.cohort), **dict(h.metrics)}
                    for h, _ in entries],
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(out, report)
    _say("chain check:")
    shown = checked if len(checked) <= 7 else [*checked[:3], f"... {len(checked) - 5} more windows ...",
                                               *checked[-2:]]
    for line in shown:
        _say(f"  {line}")
    ok = certified >= p.windows and verified
    gap = report["baseline"]["test_accuracy"] - report["final_head"]["test_accuracy"]
    verdict = "[bold green]OK[/]" if ok else "[bold red]FAILED[/]"
    _say(f"{verdict}: {certified}/{p.windows} windows certified, {skipped} skipped; "
         f"final accuracy {report['final_head']['test_accuracy']:.4f} vs centralized "
         f"{report['baseline']['test_accuracy']:.4f} ({gap * 100:+.2f} points behind); "
         f"{report['bytes_on_wire'] / 1e6:.1f} MB on the wire; {report['wall_s']:.1f} s.", markup=True)
    _say(f"report: {out / 'report.json'}  chain: {out / 'chain'}  plot: {out / 'plots' / 'accuracy.png'}")
    return 0 if ok else 1


def _plot(out: Path, report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = [h for h in report["history"] if "test_accuracy" in h]
    (out / "plots").mkdir(exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([h["window"] for h in history], [h["test_accuracy"] for h in history], marker="o",
            label="peerloom (certified heads)")
    ax.axhline(report["baseline"]["test_accuracy"], color="grey", linestyle="--",
               label=f"centralized baseline ({report['baseline']['epochs']} epochs)")
    ax.set_xlabel("window")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"digits MLP, {sum(1 for n in report['nodes'] if n['role'] == 'trainer')} trainers")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "plots" / "accuracy.png", dpi=100)
    plt.close(fig)

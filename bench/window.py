"""Window benchmark: what one window costs a fleet of real `peerloom node` processes at model
scale, against a gloo ``all_reduce`` + ``broadcast`` of the same parameters; one JSON object on the last line.

    python bench/window.py [--params 1000000,10000000] [--windows 5] [--trainers 2] [--validators 1]
                           [--verification inline|sampled|sampled-whole|both] [--train-s S] [--overlap N]
                           [--quick] [--out DIR]

For each parameter count P the benchmark writes an experiment (`peerloom.experiment.Experiment`: the demo's
protocol settings, centered clipping, DiLoCo with 4 inner steps, 1 MiB chunks; ``--verification`` picks
the audits: ``inline``, every update replayed by every validator and the reducer before it enters a cohort,
or ``sampled``, the loss check and three in four of each head's updates audited after it on one of 4
committed segments, spec/protocol.md §6.1-6.3; ``both`` runs one fleet each), starts 1 validator (4 with
``--validators 4``), 1 reducer and `--trainers` trainers as ``python -m peerloom node`` processes on
127.0.0.1, and lets them certify `--windows` windows. The workload (`flat_factory`) is one float32 tensor
of P parameters whose "training" is a fixed-cost step (one multiply: ``delta = c * params``), so what is
measured is the protocol: storing, hashing, moving, screening, auditing, reducing and agreeing.
``--train-s S`` adds an idle wait of S seconds to each train task (`time.sleep`, standing in for training
on a GPU while the protocol has the CPUs; replays of training wait their share too: `FlatWorkload`), so
that what users pay shows as utilization (below). ``--overlap N`` writes ``overlap = N`` into the manifest
(overlapped windows: a trainer starts window w+1 as soon as it has published window w); the bench stops
with a message naming the field when this tree's manifest does not know it.

Per window (medians over the windows after the first, which warms up): the wall time from the earliest
trainer's ``lease`` to the validator's certified ``head`` (seconds), split into phases read from the nodes'
event logs (``events.jsonl``; every line carries a unix time ``t``):

    fetch_head   lease -> the trainers' fetch of the previous head's params done (0 when held already)
    train        the trainers' ``train`` task (the fixed-cost step, plus encoding and storing the delta)
    publish      train done -> the last ``announce`` (signing and sending the announcement)
    fetch        last announce -> the validator's last update fetched (an announced delta; the checkpoints
                    a sampled audit fetches beside them do not count)
    screen       -> the validator's last ``screen`` task done (screening, the loss check, an inline
                    audit's replay; sampled audits run as ``audit`` tasks after the head, on the validator's
                    audit worker, in ``tasks``)
    reduce       -> the first reduction done: the reducer's ``proposal`` or the validator's own ``reduce``
                    task (cohort screening, aggregation, DiLoCo step), whichever came first
    agree        -> the validator's ``head`` (the check of the proposal or of its own head, votes, evaluation)

and the bytes on the wire per role (the runtime's counters, ``wire`` lines at each head; sent + received)
against the model's size ``4 P`` bytes; the peak RSS of each role (``VmHWM`` of /proc/PID/status, read
before the nodes stop) against ``4 P``; the baseline: the median over `--baseline-repeats` of one
``torch.distributed`` gloo ``all_reduce`` (sum) plus one ``broadcast`` of P float32 among as many processes
as the fleet has, run in the same invocation right before the fleet; and ``ratio`` = the window's
protocol overhead (wall minus the train task) / the baseline.

**Utilization** (what users pay): per trainer, the training time of its train task in window w over the
wall time from the start of that task to the start of its train task in window w+1 (the runtime's
``task-done`` lines name their task's start, ``started``), median over the windows after the first; the
training time is S with ``--train-s S`` and the whole train task's seconds without. 1 means the trainer's
GPU never waits for the protocol; with ``--overlap`` and ``--train-s`` this is the headline figure.
Where a train task's time beyond S goes: ``train_parts``, the medians of its parts as the runtime's
``task-done`` lines give them (``start``: the params it starts from, with an overlapped update's eager
start; ``training``: the workload's, S included; ``store``: encoding, hashing and storing the delta).

Output (last line): ``{"cpus", "results": [{"params", "model_bytes", "windows", "window_s" (median wall),
"overhead_s", "phases": {name: median s}, "tasks": {role: {kind: median s}}, "wire_bytes": {role: median
per window}, "wire_ratio": {role: bytes / model_bytes}, "peak_rss_bytes": {role: max}, "rss_ratio": {role:
peak / model_bytes}, "skipped", "train_s", "overlap", "verification", "baseline_s", "ratio",
"utilization_median" (across trainers; null without two train tasks after the first window),
"utilization": {trainer: median or null}, "train_parts": {part: median s over the trainers' windows}}]}``.
``--quick``: P = 1M, 3 windows.

Disk: nodes delete a window's artifacts two heads later (node config ``keep_windows = 2``, as a deployment
at this scale would set it; spec/protocol.md §8.1), so a fleet holds about ``4 P x 12 x 4`` bytes at most
with one validator and two trainers (19 GB at 100M) however many windows run; each fleet's directory is
removed once measured (unless `--out`), and a size that would not fit, with 2 GiB to spare, is refused
before it starts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

PARAMS_ENV = "PEERLOOM_BENCH_PARAMS"
TRAIN_S_ENV = "PEERLOOM_BENCH_TRAIN_S"  # seconds of idle wait per train task (`--train-s`)
PHASES = ("fetch_head", "train", "publish", "fetch", "screen", "reduce", "agree")
KEEP_WINDOWS = 2  # node config keep_windows: what a fleet at this scale runs with (module docstring)


class FlatWorkload:
    """P float32 parameters ``{"w": [P]}`` with a fixed-cost "training" (module docstring).

    `train` runs H steps (``inner_steps``, else 1) of ``w <- w * (1 - c / H)`` (float32) with ``c = 1e-3 * (1 +
    (first index % 7) / 100)`` and returns ``delta = params - w``: one multiply per step, in place, a
    different update per lease (distinct digests, so no replay rejection), all pointing the same way (honest
    under centred clipping and cosine screening), and a pure function of (params, indices), so an audit
    reproduces it bit for bit. With ``checkpoints`` it reports ``{"w", "train_state.step"}`` after each
    segment, and `resume` replays a segment from one (segment audits, spec/protocol.md §6.3). `evaluate`
    reports the mean square of the parameters.

    `train_s` (seconds, ``--train-s``) stands in for GPU training: each step takes ``train_s / H`` seconds in
    all, its arithmetic and then an idle wait for the rest (`time.sleep`, so the protocol keeps the CPUs as it
    would beside a GPU), so a `train` call takes `train_s` and a `resume` of steps ``start..stop`` takes
    ``train_s * (stop - start) / H``: replaying training (an inline audit calls `train`, a segment audit
    `resume`) costs what training does. The arithmetic is the stand-in GPU's work, not the protocol's.

    Training reuses one model-size buffer from call to call, as a GPU keeps its model (on these machines a
    fresh model-size buffer costs ~10x a reused one: 1.2 s against 0.1 s at 100M), and the delta is computed
    into it: the returned delta is valid until the next `train` call, which the executor stores before it
    returns. That buffer stands for the GPU's copy of the model; it is the one model size in a trainer's RSS
    that is not the protocol's.
    """

    def __init__(self, params: int, num_train: int, train_s: float = 0.0) -> None:
        self.params, self.num_train, self.train_s = params, num_train, train_s
        self._buffer: np.ndarray | None = None  # the model being trained, then the delta (class docstring)

    def _reused(self) -> np.ndarray:
        if self._buffer is None:
            self._buffer = np.empty(self.params, dtype=np.float32)
        return self._buffer

    def schema(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        return (("w", "float32", (self.params,)),)

    def initial_params(self, seed: int) -> dict[str, np.ndarray]:
        return {"w": np.random.default_rng(seed).standard_normal(self.params, dtype=np.float32)}

    def train(self, params: dict[str, np.ndarray], indices: Any, seed: int, *, inner_steps: int | None = None,
              checkpoints: int = 0, on_checkpoint: Any = None, **_: Any) -> tuple[dict, dict]:
        steps = inner_steps or 1
        bounds = {(j * steps) // checkpoints: j for j in range(1, checkpoints + 1)} if checkpoints else {}
        began = time.monotonic()
        w = self._reused()
        np.copyto(w, params["w"])
        began += self._steps(w, indices, steps, 0, steps, lambda k: on_checkpoint(bounds[k], self._state(w, k))
                             if on_checkpoint is not None and k in bounds else None, self.train_s, began)
        delta = np.subtract(params["w"], w, out=w)  # into the model's own buffer: one model size in all
        if self.train_s > 0:  # the call takes train_s in all, the copies in and out included (class docstring)
            time.sleep(max(0.0, began + self.train_s - time.monotonic()))
        return {"w": delta}, {"train_loss": 1.0, "samples": len(indices)}

    def resume(self, state: dict[str, np.ndarray], indices: Any, seed: int, *, inner_steps: int, start: int,
               stop: int) -> dict[str, np.ndarray]:
        """The state after step `stop`, continued from `state` (the state after step `start`, or the params
        alone at 0). ValueError for bad bounds or a step count that is not `start`."""
        if not 0 <= start < stop <= inner_steps or (
                "train_state.step" in state and int(state["train_state.step"][0]) != start):
            raise ValueError("bad segment bounds or state")
        began = time.monotonic()
        w = np.array(state["w"], dtype=np.float32, copy=True)
        began += self._steps(w, indices, inner_steps, start, stop, None, self.train_s, began)
        if self.train_s > 0:
            time.sleep(max(0.0, began + self.train_s * (stop - start) / inner_steps - time.monotonic()))
        return self._state(w, stop)

    @staticmethod
    def _state(w: np.ndarray, step: int) -> dict[str, np.ndarray]:
        return {"w": w, "train_state.step": np.array([step], dtype=np.float32)}

    @staticmethod
    def _steps(w: np.ndarray, indices: Any, steps: int, start: int, stop: int, after: Any,
               train_s: float, began: float) -> float:
        """Steps ``start..stop`` of `w` in place, step k ending no earlier than ``began + train_s * (k + 1 -
        start) / steps`` (idle until then), the last one's wait left to the caller (`train` computes the
        delta in it). `after(k)` (a checkpoint: the protocol's work, not the GPU's) runs on top of that: its
        seconds, returned, push the later deadlines back."""
        keep = np.float32(1.0 - 1e-3 * (1.0 + (int(indices[0]) % 7) / 100.0) / steps)
        extra = 0.0
        for k in range(start, stop):
            w *= keep
            if train_s > 0 and k + 1 < stop:  # the rest of the GPU's share of this step (class docstring)
                time.sleep(max(0.0, began + extra + train_s * (k + 1 - start) / steps - time.monotonic()))
            if after is not None:
                called = time.monotonic()
                after(k + 1)
                extra += time.monotonic() - called
        return extra

    def loss(self, params: dict[str, np.ndarray], indices: Any) -> float:
        """The mean square of the parameters (as `evaluate`; `train`'s step shrinks it) whatever the samples:
        a float, for a validator's loss check. ValueError for empty or out-of-range indices or a wrong schema."""
        index = np.asarray(indices, dtype=np.int64)
        if index.ndim != 1 or len(index) == 0 or int(index.min()) < 0 or int(index.max()) >= self.num_train:
            raise ValueError(f"indices must be a non-empty sequence of ints in [0, {self.num_train})")
        w = params.get("w")
        if len(params) != 1 or w is None or w.dtype != np.float32 or w.shape != (self.params,):
            raise ValueError(f"params must be {self.schema()}")
        return self.evaluate(params)["loss"]

    def evaluate(self, params: dict[str, np.ndarray]) -> dict[str, float]:
        w = params["w"]
        return {"loss": float(np.dot(w, w)) / max(1, w.size)}


def flat_factory(seed: int, num_shards: int) -> tuple[FlatWorkload, list[list[int]]]:
    """Workload factory (``workload = "bench.window:flat_factory"``): P from the environment variable
    ``PEERLOOM_BENCH_PARAMS`` (default 1,000,000), the idle wait per train task from
    ``PEERLOOM_BENCH_TRAIN_S`` (seconds, default 0), one sample per shard."""
    params = int(os.environ.get(PARAMS_ENV, "1000000"))
    train_s = float(os.environ.get(TRAIN_S_ENV, "0"))
    return FlatWorkload(params, num_shards, train_s), [[i] for i in range(num_shards)]


# --- baseline: gloo all_reduce + broadcast ------------------------------------------------------------------

def _gloo_worker(rank: int, world: int, port: int, params: int, repeats: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tensor = torch.ones(params, dtype=torch.float32)
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(tensor)
        tensor /= world
        dist.broadcast(tensor, 0)
        times.append(time.perf_counter() - started)
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"times": times[1:]}), flush=True)


def gloo_baseline(world: int, params: int, repeats: int) -> float:
    """Median seconds of one gloo all_reduce + broadcast of `params` float32 among `world` processes."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--gloo-worker", str(rank), str(world), str(port),
                               str(params), str(repeats)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) for rank in range(world)]
    out = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"gloo baseline failed: {[p.returncode for p in procs]}")
    return statistics.median(json.loads(out[0].strip().splitlines()[-1])["times"])


def _free_port() -> int:
    """A port free on 127.0.0.1 now, below the ephemeral range as `peerloom init` draws its nodes' ports: one
    from that range (what binding port 0 gives) can meanwhile become the local end of an outgoing connection,
    and the rendezvous then fails with "Address already in use"."""
    from peerloom.experiment import _unused_ports

    return _unused_ports(1)[0]


# --- the fleet ---------------------------------------------------------------------------------------------

def _peak_rss(pid: int) -> int:
    """VmHWM (peak resident set) of a live process, bytes; 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _events(path: Path) -> list[dict[str, Any]]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def disk_needed(params: int, windows: int, trainers: int, validators: int) -> int:
    """Bytes the fleet's stores fill at most: per window each trainer stores its delta and the head, and
    each validator and the reducer the deltas, params and optimizer state; nodes keep the windows of the
    last `KEEP_WINDOWS` heads and the one under way (retention), plus the genesis params."""
    per_window = 2 * trainers + (validators + 1) * (trainers + 2) + trainers * 4  # + checkpoints (sampled)
    return 4 * params * (per_window * min(windows + 1, KEEP_WINDOWS + 2) + validators + 1)


VERIFICATION = {
    # Every validator and the reducer replay every update's whole training before it can enter a cohort.
    "inline": {},
    # The loss check on every update; after each head, three in four of its updates (and of those the loss
    # check rejected) audited on one of 4 segments.
    "sampled": {"loss_check_samples": 64, "audit_rate": 0.75, "audit_segments": 4},
    # The same without committed segments: a sampled audit replays the whole training, and trainers write
    # no checkpoints (what a fleet whose trainers should stay busy training runs: spec/protocol.md §6.2).
    "sampled-whole": {"loss_check_samples": 64, "audit_rate": 0.75},
}
INNER_STEPS = 4  # the flat workload's steps per window, in both settings


def check_overlap(overlap: int) -> None:
    """SystemExit with one line naming the field unless `peerloom init` (`Experiment`) takes the manifest
    field ``overlap`` = `overlap`."""
    from peerloom.experiment import Experiment

    try:
        Experiment(workload="bench.window:flat_factory", manifest_options={"overlap": overlap})
    except ValueError as exc:
        raise SystemExit(f"bench/window.py: --overlap {overlap} needs the manifest field `overlap` (overlapped "
                         f"windows), which this tree's `peerloom init` refuses: {exc}") from None


def run_fleet(params: int, *, windows: int, trainers: int, validators: int, out: Path,
              keep: bool = False, verification: str = "inline", train_s: float = 0.0,
              overlap: int = 0) -> dict[str, Any]:
    """Run one fleet for `windows` certified windows; returns its measurements (module docstring).
    SystemExit when the disk under `out` lacks room for the run (`disk_needed`), or when `overlap` > 0 and
    this tree's manifest has no ``overlap`` field. `verification` names the manifest's audit settings
    (`VERIFICATION`); `train_s` is the flat workload's idle wait per train task (`FlatWorkload`); `overlap`
    is written into the manifest as ``overlap`` when positive (overlapped windows: a trainer starts window
    w+1 once it has published window w)."""
    from peerloom.experiment import Experiment, Fleet

    need = disk_needed(params, windows, trainers, validators)
    free = shutil.disk_usage(out).free
    if free < need + (2 << 30):  # and leave 2 GiB to everyone else
        raise SystemExit(f"bench/window.py: {params} parameters x {windows} windows need {need / 1e9:.1f} GB "
                         f"under {out}, {free / 1e9:.1f} GB free")
    os.environ[PARAMS_ENV] = str(params)  # the nodes build the workload from these (`flat_factory`)
    os.environ[TRAIN_S_ENV] = repr(float(train_s))
    manifest_options = dict(VERIFICATION[verification]) | ({"overlap": overlap} if overlap > 0 else {})
    directory = out / f"p{params}-{verification}-overlap{overlap}"
    shutil.rmtree(directory, ignore_errors=True)
    # Collection time: generous, so a slow machine never closes a window early (a window closes as soon as
    # every lease has reported, so this does not add to the measured time).
    window_s = 20.0 + params / 2e6
    window_s += 3 * train_s  # the collection deadline must not close a window while its trainers train
    if overlap > 0:
        check_overlap(overlap)
    experiment = Experiment(
        workload="bench.window:flat_factory", name="bench-window", trainers=trainers, validators=validators,
        reducers=1, shards=trainers, window_s=window_s, min_updates=trainers, aggregation="centered_clip",
        outer_optimizer="diloco", audit=True, chunk_size=1 << 20, base_port=0, inner_steps=INNER_STEPS,
        manifest_options=manifest_options)
    experiment = attrs.evolve(experiment, node_options={
        name: {"keep_windows": KEEP_WINDOWS} | ({"stop_after_window": windows} if role == "validator" else {})
        for name, role in experiment.node_names()})
    experiment.write(directory)
    fleet = Fleet.open(directory)
    names = [n["name"] for n in fleet.layout["nodes"]]
    roles = {n["name"]: n["role"] for n in fleet.layout["nodes"]}
    deadline = time.monotonic() + 120 + windows * (10 + params / 1e6 * 3 + 4 * train_s)
    fleet.start()
    skipped = 0
    rss: dict[str, int] = {}
    try:
        fleet.wait_started(timeout_s=120)
        tail = fleet.events()
        heads = 0
        while heads < windows:
            for event in tail.read():
                if event.get("event") == "head":
                    heads += 1
                    skipped += bool(event.get("skipped"))
            exited = [n for n, p in fleet.processes.items() if p.poll() is not None]
            if exited and heads < windows:
                raise RuntimeError(f"{exited[0]} exited: {fleet.last_log_line(exited[0])}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{heads} of {windows} windows certified in time")
            time.sleep(0.1)
        time.sleep(0.5)  # let trailing lines of the last window reach the logs
        rss = {name: _peak_rss(p.pid) for name, p in fleet.processes.items()}
    finally:
        fleet.stop()
    logs = {name: _events(fleet.node_dir(name) / "events.jsonl") for name in names}
    if not keep:
        shutil.rmtree(directory, ignore_errors=True)  # gigabytes of artifacts at 100M: never leave them behind
    result = analyse(logs, roles, params, windows, train_s=train_s)
    result["train_s"], result["overlap"] = train_s, overlap
    result["skipped"] = skipped
    by_role: dict[str, int] = {}
    for name, value in rss.items():
        by_role[roles[name]] = max(by_role.get(roles[name], 0), value)
    result["peak_rss_bytes"] = by_role
    result["rss_ratio"] = {r: round(v / (4 * params), 2) for r, v in by_role.items()}
    return result


def _by_window(lines: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Each line under the window it belongs to: lines carrying `window` by it, others (task-done,
    artifact-fetched, wire) by the latest window a line named before them. A sampled audit's lines
    (``audit-passed``, ``audit-failed``, ...) name the window of the head that selected it, not the one
    under way: they do not move the window the next lines belong to."""
    out: dict[int, list[dict[str, Any]]] = {}
    current = 0
    for line in lines:
        if isinstance(line.get("window"), int) and line["event"] != "wire" and not line["event"].startswith("audit"):
            current = line["window"]
        out.setdefault(line.get("window", current) if line["event"] == "wire" else current, []).append(line)
    return out


def train_starts(lines: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(unix start, seconds) of each finished ``train`` task in a node's event log, in start order (the
    runtime's ``task-done`` line names its task's start, ``started``; lines without it give ``t - seconds``)."""
    return sorted((e.get("started", e["t"] - e["seconds"]), e["seconds"]) for e in lines
                  if e["event"] == "task-done" and e["kind"] == "train")


def utilization(lines: list[dict[str, Any]], train_s: float) -> float | None:
    """A trainer's training time over wall time (module docstring): for each window after the first (a
    warm-up), the training time of its train task over the time from that task's start to the start of the
    trainer's next train task, median over those windows; None with fewer than two such tasks. The training
    time is `train_s` when positive (the idle wait that stands in for the GPU), else the whole task's
    seconds."""
    starts = train_starts(lines)[1:]  # the first window warms up
    shares = [(train_s if train_s > 0 else took) / (nxt - start)
              for (start, took), (nxt, _) in itertools.pairwise(starts) if nxt > start]
    return round(statistics.median(shares), 4) if shares else None


def analyse(logs: dict[str, list[dict[str, Any]]], roles: dict[str, str], params: int,
            windows: int, *, train_s: float = 0.0) -> dict[str, Any]:
    """Phases, tasks, wire bytes and the trainers' utilization from the nodes' event logs (module
    docstring)."""
    validator = next(n for n in logs if roles[n] == "validator")
    reducer = next(n for n in logs if roles[n] == "reducer")
    trainers = [n for n in logs if roles[n] == "trainer"]
    heads = {e["window"]: e for e in logs[validator] if e["event"] == "head"}
    walls, phases_all = [], {p: [] for p in PHASES}
    tasks: dict[str, dict[str, list[float]]] = {}
    parts: dict[str, list[float]] = {}  # a trainer's train task's parts (`train_parts`)
    wire: dict[str, list[int]] = {}
    for w in range(2, windows + 1):  # window 1 warms up (imports, first connections)
        if w not in heads or heads[w].get("skipped"):
            continue
        leases = [e["t"] for n in trainers for e in logs[n] if e["event"] == "lease" and e.get("window") == w]
        announces = [e["t"] for n in trainers for e in logs[n] if e["event"] == "announce" and e.get("window") == w]
        if not leases or not announces:
            continue
        start, end = min(leases), heads[w]["t"]
        per_trainer = [_by_window(logs[n]).get(w, []) for n in trainers]
        fetched_head = max((e["t"] for lines in per_trainer for e in lines if e["event"] == "artifact-fetched"),
                           default=start)
        trained = max((e["t"] for lines in per_trainer for e in lines
                       if e["event"] == "task-done" and e["kind"] == "train"), default=fetched_head)
        vlines = _by_window(logs[validator]).get(w, [])
        announced = max(announces)
        # the window's updates (the announced deltas), not the checkpoints a sampled audit fetches beside them
        deltas = {e.get("delta") for n in trainers for e in logs[n]
                  if e["event"] == "announce" and e.get("window") == w}
        fetched = max((e["t"] for e in vlines if e["event"] == "artifact-fetched" and start <= e["t"] <= end
                       and (None in deltas or e["digest"] in deltas)), default=announced)
        screened = max((e["t"] for e in vlines if e["event"] == "task-done" and e["kind"] == "screen"
                        and e["t"] <= end), default=fetched)
        # the first reduction done: the reducer's proposal or the validator's own (whichever came first)
        reduced = [e["t"] for e in logs[reducer] if e["event"] == "proposal" and e.get("window") == w]
        reduced += [e["t"] for e in vlines if e["event"] == "task-done" and e["kind"] == "reduce" and e["t"] <= end]
        proposed = min(reduced) if reduced else screened
        marks = [start, fetched_head, trained, announced, fetched, screened, proposed, end]
        for i, name in enumerate(PHASES):
            phases_all[name].append(max(0.0, marks[i + 1] - max(marks[: i + 1])))
        walls.append(end - start)
        for name in logs:
            for e in _by_window(logs[name]).get(w, []):
                if e["event"] == "task-done":
                    tasks.setdefault(roles[name], {}).setdefault(e["kind"], []).append(e["seconds"])
                    if roles[name] == "trainer" and e["kind"] == "train":
                        for part, seconds in e.get("parts", {}).items():
                            parts.setdefault(part, []).append(seconds)
            sent = {e["window"]: e["sent"] + e["received"] for e in logs[name] if e["event"] == "wire"}
            if w in sent and w - 1 in sent:
                wire.setdefault(roles[name], []).append(sent[w] - sent[w - 1])
    model = 4 * params
    wall = statistics.median(walls) if walls else float("nan")
    train = statistics.median(phases_all["train"]) if walls else 0.0
    wire_med = {r: int(statistics.median(v)) for r, v in wire.items()}
    shares = {n: utilization(logs[n], train_s) for n in trainers}
    measured = [v for v in shares.values() if v is not None]
    return {
        "utilization": shares,
        "utilization_median": round(statistics.median(measured), 4) if measured else None,
        "params": params, "model_bytes": model, "windows": len(walls), "window_s": round(wall, 4),
        "overhead_s": round(wall - train, 4),
        "phases": {p: round(statistics.median(v), 4) if v else None for p, v in phases_all.items()},
        "tasks": {r: {k: round(statistics.median(v), 4) for k, v in kinds.items()} for r, kinds in tasks.items()},
        "wire_bytes": wire_med, "wire_ratio": {r: round(v / model, 2) for r, v in wire_med.items()},
        "train_parts": {part: round(statistics.median(v), 4) for part, v in parts.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="1000000,10000000", help="comma-separated parameter counts")
    parser.add_argument("--windows", type=int, default=5, help="windows per fleet (the first is a warm-up)")
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--validators", type=int, default=1, choices=(1, 4))
    parser.add_argument("--baseline-repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None,
                        help="run the fleets here and keep their directories (default: a temporary directory, "
                             "each fleet removed once measured)")
    parser.add_argument("--quick", action="store_true", help="1M parameters, 3 windows")
    parser.add_argument("--verification", default="inline", choices=(*VERIFICATION, "both"),
                        help="audits: inline (every update replayed by every validator and the reducer), "
                             "sampled (loss check, sampled segment audits), sampled-whole (loss check, sampled "
                             "whole replays: trainers write no checkpoints), or both (inline and sampled)")
    parser.add_argument("--train-s", type=float, default=0.0,
                        help="seconds of idle wait per train task, standing in for GPU training (default 0)")
    parser.add_argument("--overlap", default="0",
                        help="manifest `overlap` (overlapped windows; written only when > 0); comma-separated "
                             "values run one fleet each, e.g. 0,1 for today's figure beside the overlapped one")
    parser.add_argument("--gloo-worker", nargs=5, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gloo_worker:
        _gloo_worker(*args.gloo_worker)
        return
    overlaps = [int(v) for v in args.overlap.split(",")]
    if args.train_s < 0 or min(overlaps) < 0:
        parser.error("--train-s and --overlap must not be negative")
    if max(overlaps) > 0:
        check_overlap(max(overlaps))  # before the baseline: a tree without the field stops at once
    sizes = [1_000_000] if args.quick else [int(float(p)) for p in args.params.split(",")]
    windows = 3 if args.quick else args.windows
    out = args.out or Path(tempfile.mkdtemp(prefix="peerloom-bench-window-"))
    out.mkdir(parents=True, exist_ok=True)
    world = args.validators + 1 + args.trainers
    results = []
    try:
        modes = ("inline", "sampled") if args.verification == "both" else (args.verification,)
        for params in sizes:
            baseline = gloo_baseline(world, params, 3 if args.quick else args.baseline_repeats)
            for mode, overlap in ((m, o) for m in modes for o in overlaps):
                result = run_fleet(params, windows=windows, trainers=args.trainers, validators=args.validators,
                                   out=out, keep=args.out is not None, verification=mode,
                                   train_s=args.train_s, overlap=overlap)
                result["verification"] = mode
                result["baseline_s"] = round(baseline, 4)
                result["ratio"] = round(result["overhead_s"] / baseline, 2) if baseline > 0 else None
                for key in ("utilization_median", "utilization"):  # next to the ratio in the JSON
                    result[key] = result.pop(key)
                print(json.dumps(result), file=sys.stderr, flush=True)
                results.append(result)
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    print(json.dumps({"cpus": os.cpu_count(), "processes": world, "results": results}))


if __name__ == "__main__":
    main()

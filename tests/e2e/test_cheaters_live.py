"""Cheating trainers in a live fleet (spec/protocol.md §6.1 loss check, §6.2 sampled audits, §6.3 segment
audits): real `peerloom node` processes over TCP+Noise on 127.0.0.1, started from an `Experiment` directory
the way `peerloom up` starts them (`Fleet`).

Two fleets run side by side with the same settings and the defences on (the loss check on 64 leased
samples, every certified update audited after the fact, DiLoCo with H = 8 inner steps, segment audits where
the workload can commit to checkpoints): a *clean* one (1 validator, 1 reducer, 4 honest trainers) and a
*cheating* one, the same plus a ``lazy`` trainer (H/4 steps, scaled to the honest norm) and a
``free-rider-noise`` one (a random direction with the honest norm). With `audit_rate` 1 every certified
update is replayed, and a lazy or free-riding update fails a replay with probability >= 3/4 (a quarter of
the work done; a free-rider's delta is not the end of its trajectory at all), and the loss check keeps about
half of a free-rider's noise out of the cohort; so both cheaters are quarantined within a few certified
windows, whatever the keys, leases and seeds of the run. The assertions are those robust outcomes:

- a certified head quarantines each cheater, and no head ever quarantines an honest trainer or names one in
  its `audits`; the clean fleet's heads name no one in their `audits` either (honest replays reproduce);
- `peerloom verify` accepts the cheating fleet's chain (its validator's store) and reports exactly the failed
  audits its heads carry (usually one or two; none when the loss check struck every cheating update before
  one could be certified and audited);
- the cheaters cost no accuracy: the median test accuracy of the certified heads `WINDOWS - COMPARED + 1` ..
  `WINDOWS` is at most `MAX_ACCURACY_DROP` below the clean fleet's. Certified heads are counted, not
  windows, because a slow start skips a different number of windows in each fleet. The median of a few
  heads, because one digits head's accuracy (450 test samples) moves by 2-3 points from one run to another,
  clean or not, and on a loaded machine one head can certify a partial cohort (2 of 4 trainers in time) and
  dip by 3-4 points; one-sided, because a cheating fleet that happens to do better lost nothing.

An honest update can fail the loss check on a shard the model has fit (`screen-loss`); that rejection is no
strike (spec/protocol.md §6.1), so it never quarantines an honest trainer. A run in which one is
quarantined fails, and rightly.
"""

from __future__ import annotations

import inspect
import os
import signal
import sqlite3
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from peerloom.core.audit import check_audit_evidence
from peerloom.core.chain import decode_chain_entry
from peerloom.core.objects import Head
from peerloom.experiment import Experiment, Fleet
from peerloom.verify import run_verify, verified_chain
from tests.node_zygote import forked_popen

pytestmark = pytest.mark.slow

CHEATERS = {"trainer-5": "lazy", "trainer-6": "free-rider-noise"}
HONEST = 4
SHARDS = 12  # both fleets cut the data alike: 2 shards a trainer with the cheaters, 3 once they are out
INNER_STEPS = 8
SEGMENTS = 4
DEFENCES = {"loss_check_samples": 64, "audit_rate": 1.0}
WINDOWS = 10  # certified heads each fleet runs for and is compared at (late enough that the curve is flat)
# The cheating fleet runs on past WINDOWS, up to here, only while a cheater is not caught. Needed: a validator's
# first replay pays the workload's warm-up (torch: 2-6 s on these loaded cores), while windows that close as
# soon as every lease reports take 0.4-1 s; the audits of the windows certified meanwhile can then start after
# their authors dropped the checkpoints (AUDIT_WINDOWS heads later: `audit-stalled`), and a late verdict is
# too old to enter a head. A later window's audit, the worker warm, catches the cheater.
MAX_WINDOWS = 20
COMPARED = 3
WINDOW_S = 2.0  # a window closes once every lease reported; this only bounds the wait for a late trainer
MAX_ACCURACY_DROP = 0.02
TIMEOUT_S = 240.0  # generous: 14 processes on 2 loaded cores


def torch_checkpoints() -> bool:
    """Whether `TorchWorkload.train` can commit to checkpoints (segment audits, spec/protocol.md §6.3)."""
    from peerloom.backends.torch.workload import TorchWorkload

    return "checkpoints" in inspect.signature(TorchWorkload.train).parameters and hasattr(TorchWorkload, "resume")


def _experiment(workload: str, *, cheaters: bool, segments: int) -> Experiment:
    trainers = HONEST + (len(CHEATERS) if cheaters else 0)
    node_options: dict[str, dict[str, Any]] = {name: {"threads": 1} for name in
                                               ("validator-1", "reducer-1",
                                                *(f"trainer-{i}" for i in range(1, trainers + 1)))}
    if cheaters:
        for name, behaviour in CHEATERS.items():
            node_options[name]["behaviour"] = behaviour
    manifest = dict(DEFENCES, **({"audit_segments": segments} if segments else {}))
    return Experiment(workload=workload, name="cheaters" if cheaters else "clean", trainers=trainers,
                      validators=1, reducers=1, shards=SHARDS, window_s=WINDOW_S, inner_steps=INNER_STEPS, audit=True,
                      base_port=0, manifest_options=manifest, node_options=node_options)


def _ports(fleet: Fleet) -> set[int]:
    listens = [n["listen"] for n in fleet.layout["nodes"]] + [fleet.layout["dashboard"].rstrip("/")]
    return {int(address.rsplit(":", 1)[1]) for address in listens}


def _write_fleets(tmp_path: Path, workload: str, segments: int) -> tuple[Fleet, Fleet]:
    """The clean and the cheating experiment, on disjoint ports (each picks free ones on its own)."""
    clean = Fleet.open(_experiment(workload, cheaters=False, segments=segments).write(tmp_path / "clean"))
    for attempt in range(5):
        cheating = Fleet.open(_experiment(workload, cheaters=True, segments=segments)
                              .write(tmp_path / f"cheating-{attempt}"))
        if not _ports(clean) & _ports(cheating):
            return clean, cheating
    raise AssertionError("no disjoint ports for the two fleets")


def _store(fleet: Fleet) -> Path:
    return fleet.node_dir("validator-1") / "store"


def _heads(fleet: Fleet) -> list[Head]:
    """The certified heads (window 1 on) validator-1 holds now, read while the node writes its database."""
    path = _store(fleet) / "node.db"
    if not path.exists():
        return []
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
        try:
            rows = conn.execute("SELECT entry FROM heads WHERE window > 0 ORDER BY window").fetchall()
        finally:
            conn.close()
    except sqlite3.OperationalError:  # not created yet, or busy: read again at the next poll
        return []
    return [decode_chain_entry(bytes(entry))[0] for (entry,) in rows]


def _names(fleet: Fleet) -> dict[str, str]:
    """Peer id text -> node name."""
    return {n["peer"]: n["name"] for n in fleet.layout["nodes"]}


def _quarantined(fleet: Fleet, heads: Sequence[Head]) -> set[str]:
    """Every node a head of `heads` quarantines."""
    names = _names(fleet)
    return {names[peer.to_text()] for head in heads for peer, _ in head.quarantine}


def _summary(fleet: Fleet, heads: Sequence[Head]) -> str:
    names = _names(fleet)
    revision = fleet.revision()
    lines = []
    for head in heads:
        audited = sorted(names[check_audit_evidence(v, revision.id, revision.manifest)[0].signer.to_text()]
                         for v in head.audits)
        lines.append(f"  window {head.window:>2} {'skipped' if head.skipped else 'certified'} cohort "
                     f"{len(head.cohort)} rejected {len(head.rejected)} accuracy "
                     f"{head.metrics.get('test_accuracy', float('nan')):.4f} audits {audited} quarantine "
                     f"{sorted(names[p.to_text()] for p, _ in head.quarantine)} strikes "
                     f"{ {names[p.to_text()]: n for p, n, _ in head.strikes} }")
    return f"{revision.manifest.experiment}:\n" + "\n".join(lines)


def _terminate(fleet: Fleet) -> None:
    """SIGTERM every running node of `fleet` without waiting (`Fleet.stop` waits, and the other fleet would
    run on meanwhile); `Fleet.stop` then reaps them."""
    for process in fleet.processes.values():
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)


def _stop(fleet: Fleet, timeout_s: float = 20.0) -> None:
    """Wait for the nodes `_terminate` signalled (a second SIGTERM would cut a node's clean shutdown short),
    then `Fleet.stop` (it signals and, past its timeout, kills what still runs)."""
    deadline = time.monotonic() + timeout_s
    for process in fleet.processes.values():
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            break
    fleet.stop()


def run_fleets(fleets: dict[str, Fleet], done: Callable[[str, Fleet, list[Head]], bool], timeout_s: float, *,
               preload: str = "") -> None:
    """Run `fleets` side by side, each stopped as soon as ``done(label, fleet, its heads)``: AssertionError when
    a node exits on its own or `timeout_s` runs out. `Fleet.start` starts each node as it always does, but
    forked from a fork server (tests/node_zygote.py) that has imported peerloom (and `preload`, modules
    separated by commas) with the start-up environment `Fleet.start` gives its nodes: many real processes
    without as many interpreter start-ups."""
    running = dict(fleets)
    deadline = time.monotonic() + timeout_s
    zygote_env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                  "PEERLOOM_ZYGOTE_PRELOAD": preload}
    try:
        for fleet in running.values():
            with forked_popen(**zygote_env):
                fleet.start()  # no `wait_started`: a fleet's heads are what counts, polled from the start
        while running:
            for label, fleet in list(running.items()):
                heads = _heads(fleet)
                if done(label, fleet, heads):
                    _terminate(fleet)
                    del running[label]  # signalled once: a second SIGTERM would cut its shutdown short
                    continue
                exited = [name for name, p in fleet.processes.items() if p.poll() is not None]
                assert not exited, f"{label}: {exited[0]} exited: {fleet.last_log_line(exited[0])}"
                assert time.monotonic() < deadline, \
                    f"{label}: {len(heads)} heads after {timeout_s} s\n{_summary(fleet, heads)}"
            time.sleep(0.2)
    finally:
        for fleet in running.values():
            _terminate(fleet)
        for fleet in fleets.values():
            _stop(fleet)


def _run(clean: Fleet, cheating: Fleet, *, preload: str = "") -> None:
    """Both fleets side by side: the clean one until it holds `WINDOWS` certified heads, the cheating one
    until then and a head quarantines both cheaters (at most `MAX_WINDOWS` certified heads)."""
    def done(label: str, fleet: Fleet, heads: list[Head]) -> bool:
        certified = len(_certified(heads))
        if label == "clean":
            return certified >= WINDOWS
        return certified >= MAX_WINDOWS or (certified >= WINDOWS and set(CHEATERS) <= _quarantined(fleet, heads))

    run_fleets({"clean": clean, "cheating": cheating}, done, TIMEOUT_S, preload=preload)


def _certified(heads: Sequence[Head]) -> list[Head]:
    """The heads that are not skipped: one outer step each (a skipped head keeps its parent's params)."""
    return [h for h in heads if not h.skipped]


def _accuracy(heads: Sequence[Head]) -> float:
    """Median test accuracy of the certified heads `WINDOWS - COMPARED + 1` .. `WINDOWS` (counted from 1)."""
    chosen = _certified(heads)[WINDOWS - COMPARED:WINDOWS]
    assert len(chosen) == COMPARED
    return statistics.median(h.metrics["test_accuracy"] for h in chosen)


def _check(clean: Fleet, cheating: Fleet) -> None:
    clean_heads = [h for h, _ in verified_chain(_store(clean), clean.layout["authority"])[1]]
    lines: list[str] = []
    status = run_verify(_store(cheating), cheating.layout["authority"], echo=lines.append)
    revision, entries = verified_chain(_store(cheating), cheating.layout["authority"])
    heads = [h for h, _ in entries]
    report = f"{_summary(clean, clean_heads)}\n{_summary(cheating, heads)}"
    print(report)

    # `peerloom verify` accepts the chain and reports exactly the failed audits its heads carry. (There may
    # be none: a cheater whose every update the loss check strikes is never certified, so never audited,
    # and its strikes alone quarantine it; the lazy trainer's H/4 steps scaled to the honest norm sometimes
    # raise its own batch's loss.)
    assert status == 0 and lines[-1].startswith("OK:"), "\n".join(lines)
    failed_audits = sum(len(head.audits) for head in heads)
    reported = [int(line.split()[0]) for line in lines if "failed sampled audit(s)" in line]
    assert reported == ([failed_audits] if failed_audits else []), "\n".join(lines)

    # Both cheaters quarantined; no honest trainer ever quarantined or audited.
    assert set(CHEATERS) <= _quarantined(cheating, heads), report
    assert _quarantined(cheating, heads) <= set(CHEATERS), report
    names = _names(cheating)
    audited = {names[check_audit_evidence(v, revision.id, revision.manifest)[0].signer.to_text()]
               for head in heads for v in head.audits}
    assert audited <= set(CHEATERS), report
    assert not any(head.audits for head in clean_heads), report

    # The cheaters cost no accuracy.
    assert _accuracy(heads) >= _accuracy(clean_heads) - MAX_ACCURACY_DROP, report


def test_cheaters_quarantined_numpy(tmp_path):
    """digits-numpy, segment audits (S = 4 of H = 8 steps)."""
    clean, cheating = _write_fleets(tmp_path, "digits-numpy", SEGMENTS)
    _run(clean, cheating)
    _check(clean, cheating)


def test_cheaters_quarantined_torch(tmp_path):
    """digits-mlp (torch): segment audits when `TorchWorkload` can commit to checkpoints, else whole replays."""
    pytest.importorskip("torch")
    clean, cheating = _write_fleets(tmp_path, "digits-mlp", SEGMENTS if torch_checkpoints() else 0)
    _run(clean, cheating, preload="torch")
    _check(clean, cheating)

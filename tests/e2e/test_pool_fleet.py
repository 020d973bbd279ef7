"""A 2-rank gloo trainer pool (spec/pools.md) (``[pool] ranks = 2``) as a trainer in a real fleet of
`peerloom node` processes, next to an ordinary trainer. Its updates are certified, the chain verifies, and
killing its rank 1 makes it skip a window loudly (task failed, no announcement) and then recover with a
re-formed pool (spec/pools.md "Failure")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peerloom.core.chain import decode_chain_entry
from peerloom.experiment import Experiment, Fleet
from tests.node_zygote import run_cli

ROOT = Path(__file__).resolve().parents[2]


def children(pid: int) -> list[int]:
    """The pids of `pid`'s child processes, whichever of its threads started them (Linux /proc)."""
    out = []
    for path in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out += [int(p) for p in path.read_text().split()]
        except OSError:  # the thread ended meanwhile
            continue
    return sorted(out)


def certified_updates(fleet: Fleet) -> set[str]:
    """The update ids (hex) in the cohorts of every head in the first validator's chain directory."""
    out: set[str] = set()
    for path in sorted((fleet.node_dir("validator-1") / "store" / "chain").glob("*")):
        if path.name.startswith("."):  # a chain entry being written (".<name>.<pid>.<thread>.tmp"), renamed soon
            continue
        head, _ = decode_chain_entry(path.read_bytes())
        out.update(u.hex() for u in head.cohort)
    return out


def wait_for(what: str, predicate, timeout_s: float = 150.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.25)


@pytest.mark.slow
def test_a_two_rank_pool_trains_in_a_fleet_skips_a_window_when_a_rank_dies_and_recovers(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # node processes import tests.pool_workloads
    experiment = Experiment(workload="tests.pool_workloads:factory", trainers=2, reducers=1, window_s=3.0,
                            base_port=0, node_options={"trainer-1": {"pool": {"ranks": 2, "timeout_s": 30.0}}})
    fleet = Fleet.open(experiment.write(tmp_path / "exp"))
    pool_node = fleet.node_dir("trainer-1")
    log_path = pool_node / "node.log"
    fleet.start()
    try:
        fleet.wait_started(timeout_s=180.0)

        def events() -> list[dict]:
            return _events(pool_node)

        def announced() -> dict[str, int]:
            return {e["update"]: e["window"] for e in events() if e.get("event") == "announce"}

        # 1. The pool's updates are certified.
        wait_for("a certified pool update", lambda: set(announced()) & certified_updates(fleet))
        (rank1,) = children(fleet.processes["trainer-1"].pid)

        # 2. Killing rank 1 fails the next train task loudly.
        os.kill(rank1, signal.SIGKILL)
        wait_for("the pool's task failure", lambda: any(e.get("event") == "task-failed" for e in events()))
        log_text = log_path.read_text(errors="replace")
        assert '"level":"error"' in log_text and "trainer pool failed: this window's update is skipped" in log_text
        failed_at = next(i for i, e in enumerate(events()) if e.get("event") == "task-failed")

        # 3. The pool re-forms with a fresh rank 1 and its updates are certified again.
        def recovered() -> bool:
            later = {e["update"] for e in events()[failed_at:] if e.get("event") == "announce"}
            return bool(later & certified_updates(fleet))

        wait_for("a certified update after the failure", recovered)
        # ... and the window whose task failed was leased but never announced: skipped, nothing published.
        history = events()
        before = max(e["window"] for e in history[:failed_at] if e.get("event") == "announce")
        after = min(e["window"] for e in history[failed_at:] if e.get("event") == "announce")
        skipped = {e["window"] for e in history if e.get("event") == "lease" and before < e["window"] < after}
        assert skipped and not skipped & set(announced().values())
        assert log_path.read_text(errors="replace").count("trainer pool formed") >= 2
        (new_rank1,) = children(fleet.processes["trainer-1"].pid)
        assert new_rank1 != rank1
    finally:
        statuses = fleet.stop()
    assert statuses["trainer-1"] == 0, log_path.read_text(errors="replace")[-3000:]
    wait_for("the pool's rank to exit with its node", lambda: not Path(f"/proc/{new_rank1}").exists(), 30.0)
    verify = run_cli(["verify", fleet.node_dir("validator-1")], cwd=ROOT, timeout=120)
    assert verify.returncode == 0 and "OK:" in verify.stdout, verify.stdout + verify.stderr


def _events(directory: Path) -> list[dict]:
    import json

    path = directory / "events.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


@pytest.mark.slow
def test_a_trainer_started_under_torchrun_is_one_peer_of_two_ranks(tmp_path, monkeypatch):
    """README's command: `torchrun --nproc-per-node 2 -m peerloom node --config trainer.toml` (gloo on the
    CPU here). Rank 0 is the peer; its updates are certified like any trainer's."""
    monkeypatch.chdir(ROOT)
    experiment = Experiment(workload="tests.pool_workloads:factory", trainers=2, reducers=1, window_s=3.0,
                            base_port=0)
    fleet = Fleet.open(experiment.write(tmp_path / "exp"))
    pool_node = fleet.node_dir("trainer-1")
    fleet.start(["validator-1", "reducer-1", "trainer-2"])
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    with open(pool_node / "node.log", "ab") as log:
        torchrun = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                                     "peerloom", "node", "--config", str(pool_node / "node.toml")],
                                    stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        def certified() -> bool:
            announced = {e["update"] for e in _events(pool_node) if e.get("event") == "announce"}
            return bool(announced & certified_updates(fleet))

        wait_for("a certified update from the torchrun pool", certified)
        text = (pool_node / "node.log").read_text(errors="replace")
        assert '"launcher":"torchrun"' in text and '"node":"trainer-1/rank1"' in text
    finally:
        torchrun.send_signal(signal.SIGTERM)  # torchrun stops both ranks (and exits 1 on a signal)
        try:
            torchrun.wait(timeout=60)
        except subprocess.TimeoutExpired:
            torchrun.kill()
            torchrun.wait()
        fleet.stop()


@pytest.mark.slow
def test_an_fsdp_pool_of_two_ranks_trains_in_a_fleet_and_the_chain_verifies(tmp_path, monkeypatch):
    """``[pool] parallel = "fsdp"`` (spec/pools.md §6): trainer-1 is one peer whose two ranks each hold half of
    the model; its node streams the head in and the pseudo-gradient into its store. Its updates are certified
    in several windows, and `peerloom verify` passes on the validator's chain."""
    monkeypatch.chdir(ROOT)
    experiment = Experiment(workload="tests.pool_workloads:factory", trainers=2, reducers=1, window_s=3.0,
                            base_port=0, node_options={"trainer-1": {"pool": {
                                "ranks": 2, "timeout_s": 30.0, "parallel": "fsdp"}}})
    fleet = Fleet.open(experiment.write(tmp_path / "exp"))
    pool_node = fleet.node_dir("trainer-1")
    fleet.start()
    try:
        fleet.wait_started(timeout_s=180.0)

        def certified_pool_windows() -> set[int]:
            announced = {e["update"]: e["window"] for e in _events(pool_node) if e.get("event") == "announce"}
            return {announced[u] for u in set(announced) & certified_updates(fleet)}

        wait_for("pool updates certified in two windows", lambda: len(certified_pool_windows()) >= 2)
        text = (pool_node / "node.log").read_text(errors="replace")
        assert '"parallel":"fsdp"' in text and "trainer pool failed" not in text
        assert not any(e.get("event") == "task-failed" for e in _events(pool_node))
    finally:
        statuses = fleet.stop()
    assert statuses["trainer-1"] == 0, (pool_node / "node.log").read_text(errors="replace")[-3000:]
    verify = run_cli(["verify", fleet.node_dir("validator-1")], cwd=ROOT, timeout=120)
    assert verify.returncode == 0 and "OK:" in verify.stdout, verify.stdout + verify.stderr

"""`peerloom init`, `up` and `status`: an experiment directory from the public API, run as
a local fleet of OS processes, stopped cleanly, its chain verified."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peerloom.experiment import Experiment, Fleet
from tests.node_cluster import free_port
from tests.node_zygote import run_cli

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = "tests.node_cluster:numpy_digits"  # numpy: no torch import in each node


def _peerloom(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m peerloom <args>` as a real process, forked from the session's fork server (no import cost)."""
    return run_cli(list(args), cwd=ROOT, timeout=180)


def test_write_makes_a_verifiable_experiment_directory(tmp_path):
    root = Experiment(workload=WORKLOAD, trainers=2, validators=4, reducers=0, window_s=2.0,
                      base_port=free_port()).write(tmp_path / "exp")
    fleet = Fleet.open(root)
    revision = fleet.revision()  # signed by the authority the layout names
    assert revision.manifest.quorum == 3 and len(revision.manifest.validators) == 4
    assert len(revision.manifest.roster) == 2 and len(revision.manifest.shards) == 4
    names = [n["name"] for n in fleet.layout["nodes"]]
    assert names == ["validator-1", "validator-2", "validator-3", "validator-4", "trainer-1", "trainer-2"]
    for name in names:
        assert (root / "nodes" / name / "node.toml").exists()
        assert oct((root / "nodes" / name / "key").stat().st_mode & 0o777) == "0o600"
    assert oct((root / "authority.key").stat().st_mode & 0o777) == "0o600"
    with pytest.raises(FileExistsError):
        Experiment(workload=WORKLOAD).write(root)  # never overwritten
    with pytest.raises(ValueError):
        Experiment(workload=WORKLOAD, trainers=0)
    with pytest.raises(ValueError):
        Experiment(workload=WORKLOAD, aggregation="avg")


def test_init_errors_are_one_line(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "experiment.toml").write_text("")  # an experiment is never overwritten
    for args in (["init", str(tmp_path / "full"), "--workload", WORKLOAD],
                 ["init", str(tmp_path / "a"), "--workload", WORKLOAD, "--trainers", "0"],
                 ["init", str(tmp_path / "b"), "--workload", "no_such_module:factory"],
                 ["up", str(tmp_path / "nothing-here")], ["status", str(tmp_path / "nothing-here")]):
        out = _peerloom(*args)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, (args, out.stderr)
        assert "Traceback" not in out.stderr


def test_init_takes_the_verification_settings(tmp_path):
    """`init` reaches the manifest's loss check and sampled segment audits (spec/protocol.md §6.1-6.3), and a
    setting the manifest refuses (segments beyond the inner steps) is a one-line error."""
    out = _peerloom("init", str(tmp_path / "e"), "--workload", WORKLOAD, "--inner-steps", "8", "--audit-rate", "0.5",
                    "--audit-segments", "4", "--loss-check", "64", "--base-port", "0")
    assert out.returncode == 0, out.stderr
    m = Fleet.open(tmp_path / "e").revision().manifest
    assert (m.audit, m.audit_rate, m.audit_segments, m.loss_check_samples) == (True, 0.5, 4, 64)
    bad = _peerloom("init", str(tmp_path / "f"), "--workload", WORKLOAD, "--inner-steps", "2", "--audit-rate", "0.5",
                    "--audit-segments", "4", "--base-port", "0")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "audit_segments" in bad.stderr


def test_init_takes_the_cohort_screening_thresholds(tmp_path):
    """`init --norm-ratio/--norm-mads/--min-cosine` reach the manifest's cohort screening (spec/protocol.md
    §6), 0 included (the norm test off); a cosine outside [-1, 1] is a one-line error naming the field."""
    out = _peerloom("init", str(tmp_path / "e"), "--workload", WORKLOAD, "--norm-ratio", "0", "--min-cosine", "0.25",
                    "--norm-mads", "0", "--base-port", "0")
    assert out.returncode == 0, out.stderr
    m = Fleet.open(tmp_path / "e").revision().manifest
    assert (m.norm_ratio, m.norm_mads, m.min_cosine) == (0.0, 0, 0.25)
    plain = _peerloom("init", str(tmp_path / "d"), "--workload", WORKLOAD, "--base-port", "0")
    m = Fleet.open(tmp_path / "d").revision().manifest
    assert plain.returncode == 0 and (m.norm_ratio, m.norm_mads, m.min_cosine) == (10.0, 6, -1.0)  # the defaults
    bad = _peerloom("init", str(tmp_path / "f"), "--workload", WORKLOAD, "--min-cosine", "1.5", "--base-port", "0")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "min_cosine" in bad.stderr


@pytest.mark.slow
def test_init_up_status_then_ctrl_c_stops_every_node(tmp_path):
    root = tmp_path / "exp"
    out = _peerloom("init", str(root), "--workload", WORKLOAD, "--trainers", "2", "--window-s", "2",
                    "--base-port", "0")
    assert out.returncode == 0 and "peerloom up" in out.stdout, out.stderr
    up = _peerloom("up", str(root), "--windows", "2")
    assert up.returncode == 0, up.stdout + up.stderr
    lines = up.stdout.splitlines()
    assert any(line.startswith("dashboard: http://127.0.0.1:") for line in lines)
    assert [line.split()[1] for line in lines if line.startswith("window")][:2] == ["1", "2"]
    assert "stopped 4 nodes" in up.stdout
    status = _peerloom("status", str(root))
    assert status.returncode == 0 and status.stdout.count("stopped") == 4, status.stdout
    assert "latest head: window" in status.stdout and "test_accuracy" in status.stdout
    verify = _peerloom("verify", str(root / "nodes" / "validator-1"))
    assert verify.returncode == 0 and "OK:" in verify.stdout, verify.stdout + verify.stderr

    # Ctrl-C, and SIGTERM: `up` stops every node it started and exits cleanly. The first `up` inherits SIGINT
    # ignored, as a background job of a non-interactive shell (and a CI runner) does; Python keeps it
    # ignored unless `up` installs its own handler.
    for stop, ignore_sigint in ((signal.SIGINT, True), (signal.SIGTERM, False)):
        def preexec(ignore=ignore_sigint):
            signal.signal(signal.SIGINT, signal.SIG_IGN if ignore else signal.default_int_handler)

        process = subprocess.Popen([sys.executable, "-m", "peerloom", "up", str(root)], cwd=ROOT,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=preexec)
        pids_dir = [root / "nodes" / n for n in ("validator-1", "reducer-1", "trainer-1", "trainer-2")]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all((d / "pid").exists() and (d / "port").exists()
                                                      for d in pids_dir):
            time.sleep(0.1)
        pids = [int((d / "pid").read_text()) for d in pids_dir]
        running = _peerloom("status", str(root))
        assert running.stdout.count("running") == 4, running.stdout
        process.send_signal(stop)
        output, _ = process.communicate(timeout=90)  # the nodes get SIGTERM, then SIGKILL after 15 s
        assert process.returncode == 0 and "stopped 4 nodes" in output, (stop, output)
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


def test_status_shows_each_nodes_rejected_updates_and_last_error(tmp_path):
    """`peerloom status` reads every node's event log: a trainer's updates the first validator rejected
    (how many, the last reason with its numbers) and each node's last failed task; a healthy node gets no
    such line."""
    from peerloom.experiment import status_lines

    root = Experiment(workload=WORKLOAD, trainers=3, base_port=0).write(tmp_path / "exp")
    fleet = Fleet.open(root)
    peers = {n["name"]: n["peer"] for n in fleet.layout["nodes"]}

    def events(name, *lines):
        (root / "nodes" / name / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))

    events("validator-1",
           {"event": "reject", "peer": peers["trainer-1"], "reason": "screen-loss", "detail": "loss 2 applied"},
           {"event": "reject", "peer": peers["trainer-1"], "reason": "screen-norm-outlier",
            "detail": "norm 31 > 10 x median 2.9"},
           {"event": "reject", "peer": peers["reducer-1"], "reason": "bad-proposal", "detail": ""},
           {"event": "task-failed", "task": "evaluate-7", "reason": "MemoryError"})
    events("trainer-2", {"event": "task-failed", "task": "train-3", "reason": "OSError: disk\nfull"},
           {"event": "task-failed", "task": "train-4", "reason": "ValueError: sample 17"})
    events("trainer-1", {"event": "reject", "peer": peers["trainer-2"], "reason": "ignored", "detail": ""})
    lines = status_lines(root)
    text = "\n".join(lines)

    def under(name):  # the indented lines right below a node's own line
        start = next(i for i, line in enumerate(lines) if line.strip().startswith(name + " ")) + 1
        end = start
        while end < len(lines) and lines[end].startswith("      "):
            end += 1
        return [line.strip() for line in lines[start:end]]

    assert under("trainer-1") == ["updates rejected: 2 (last: screen-norm-outlier (norm 31 > 10 x median 2.9))"]
    assert under("trainer-2") == ["last error: train task failed: ValueError: sample 17"]  # only the first
    assert under("validator-1") == ["last error: evaluate task failed: MemoryError"]      # validator counts
    assert under("trainer-3") == [] and under("reducer-1") == [], text


def test_late_joiners_manifest_and_node_options(tmp_path):
    import tomllib

    experiment = Experiment(workload=WORKLOAD, trainers=2, late_joiners=1, base_port=0,
                            manifest_options={"norm_ratio": 3.0, "lease_s": 1.0},
                            node_options={"trainer-2": {"behaviour": "alie", "threads": 1}})
    root = experiment.write(tmp_path / "exp")
    fleet = Fleet.open(root)
    manifest = fleet.revision().manifest
    assert (manifest.norm_ratio, manifest.lease_s) == (3.0, 1.0)
    peers = {n["name"]: n for n in fleet.layout["nodes"]}
    roster = {p for p, _ in manifest.roster}
    assert peers["trainer-3"]["late_joiner"] and len(roster) == 2  # the late joiner must ask to join
    assert all(p.to_text() != peers["trainer-3"]["peer"] for p in roster)
    config = tomllib.loads((root / "nodes" / "trainer-2" / "node.toml").read_text())
    assert config["behaviour"] == "alie" and config["threads"] == 1
    ports = [int(n["listen"].rsplit(":", 1)[1]) for n in fleet.layout["nodes"]]
    assert len(set(ports)) == len(ports) and all(p > 1024 for p in ports)  # base_port 0: free ports
    with pytest.raises(ValueError, match="unknown or derived"):
        Experiment(workload=WORKLOAD, manifest_options={"quorum": 1})


@pytest.mark.slow
def test_own_model_through_init_up_export_and_plain_torch(tmp_path):
    """The README's path: a model trained with peers through `init` and `up`, exported, loaded into plain
    torch, evaluates to the accuracy the validators certified in the head."""
    import torch

    from peerloom import load_head
    from peerloom.backends.datasets import load_digits_split
    from peerloom.backends.torch.models import mlp

    root = tmp_path / "exp"
    assert _peerloom("init", str(root), "--workload", "digits-mlp", "--trainers", "2", "--window-s", "3",
                     "--base-port", "0").returncode == 0
    up = _peerloom("up", str(root), "--windows", "2")
    assert up.returncode == 0, up.stdout + up.stderr
    model_file = tmp_path / "model.safetensors"
    export = _peerloom("export", str(root / "nodes" / "validator-1"), "--head", "2", "--out", str(model_file))
    assert export.returncode == 0, export.stdout + export.stderr
    model = load_head(model_file, mlp((64, 128, 10)))
    _, _, x_test, y_test = load_digits_split(0)
    with torch.no_grad():
        accuracy = float((model(torch.from_numpy(x_test)).argmax(dim=1).numpy() == y_test).mean())
    head = [json.loads(line) for line in (root / "nodes" / "validator-1" / "events.jsonl").read_text().splitlines()
            if '"event": "head"' in line or '"event":"head"' in line]
    certified = next(h for h in head if h["window"] == 2)
    assert accuracy == pytest.approx(certified["metrics"]["test_accuracy"], abs=1e-9)


def _window_lines(stdout: str) -> list[int]:
    return [int(line.split()[1]) for line in stdout.splitlines() if line.startswith("window ")]


def _set_node_workload(root: Path, name: str, workload: str) -> None:
    config = root / "nodes" / name / "node.toml"
    config.write_text("\n".join(f'workload = "{workload}"' if line.startswith("workload =") else line
                                for line in config.read_text().splitlines()) + "\n")


@pytest.mark.slow
def test_up_counts_windows_resumes_and_names_failed_trainers(tmp_path):
    """`init --windows` is a stop criterion; `up --windows N` certifies exactly N new windows and
    prints only those, after a restart too; a trainer whose training fails is named with the reason in the
    windows it failed and in the summary; verify and export take the experiment directory."""
    from peerloom.adapters.database import DB_NAME, Database

    root = tmp_path / "exp"
    out = _peerloom("init", str(root), "--workload", WORKLOAD, "--trainers", "3", "--window-s", "1", "--windows", "2",
                    "--base-port", "0")
    assert out.returncode == 0, out.stderr
    _set_node_workload(root, "trainer-3", "tests.faulty_workloads:failing_digits")

    def head_window() -> int:
        db = Database(root / "nodes" / "validator-1" / "store" / DB_NAME)
        try:
            return db.heads(limit=1)[0][0]
        finally:
            db.close()

    up = _peerloom("up", str(root))  # experiment.toml's windows = 2
    assert up.returncode == 0, up.stdout + up.stderr
    assert _window_lines(up.stdout) == [1, 2] and head_window() == 2, up.stdout
    failed = [line for line in up.stdout.splitlines() if line.split()[:1] == ["trainer-3"]]
    assert failed and all("train task failed" in line and "sample 17: cannot read image file" in line
                          for line in failed), up.stdout
    summary = up.stdout.split("problems in windows 1-2:")[1]
    assert "trainer-3" in summary and "sample 17" in summary, up.stdout
    status = _peerloom("status", str(root)).stdout.split("trainer-3", 1)[1]
    assert "last error: train task failed" in status.splitlines()[1] and "sample 17" in status, status
    again = _peerloom("up", str(root))
    assert again.returncode == 0 and "at window 2 already" in again.stdout and not _window_lines(again.stdout)

    _set_node_workload(root, "trainer-3", WORKLOAD)
    more = _peerloom("up", str(root), "--windows", "3")
    assert more.returncode == 0, more.stdout + more.stderr
    assert "resuming after window 2" in more.stdout
    assert _window_lines(more.stdout) == [3, 4, 5] and head_window() == 5, more.stdout
    assert "problems" not in more.stdout, more.stdout

    verify = _peerloom("verify", str(root))
    assert verify.returncode == 0 and "OK: 5 certified heads" in verify.stdout, verify.stdout + verify.stderr
    export = _peerloom("export", str(root), "--out", str(tmp_path / "model.safetensors"))
    assert export.returncode == 0 and "wrote window 5" in export.stdout, export.stdout + export.stderr


def _one_line_exit_2(out: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert out.returncode == 2 and "Traceback" not in out.stderr, (out.returncode, out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert all(needle in lines[0] for needle in needles), (needles, lines[0])
    return lines[0]


@pytest.mark.slow
def test_up_ends_in_a_nodes_one_line_start_up_error(tmp_path):
    """A node that cannot start (an unknown config key; a workload whose schema is not the
    manifest's) ends `up` with that node's one line and exit 2, every other node stopped."""
    root = Experiment(workload=WORKLOAD, trainers=2, base_port=0).write(tmp_path / "exp")
    config = root / "nodes" / "trainer-1" / "node.toml"
    good = config.read_text()
    config.write_text(good + 'devcie = "cpu"\n')
    _one_line_exit_2(_peerloom("up", str(root), "--windows", "1"), "peerloom up: trainer-1:", "devcie: unknown key",
                     "did you mean 'device'?")
    config.write_text(good)
    _set_node_workload(root, "trainer-2", "tests.faulty_workloads:wide_digits")
    _one_line_exit_2(_peerloom("up", str(root), "--windows", "1"), "peerloom up: trainer-2:",
                     "tensor '0.bias' is float32 (64,)", "the manifest's is float32 (128,)")
    for name in ("validator-1", "reducer-1", "trainer-1", "trainer-2"):
        assert not (root / "nodes" / name / "pid").exists()  # `up` stopped what it started


def test_up_refuses_an_experiment_toml_edited_after_init(tmp_path):
    """Settings are signed at `init`; an edit that no longer matches the manifest, an unknown key
    and `node_options` for no such node are one-line errors naming the key, and nothing starts."""
    root = Experiment(workload=WORKLOAD, trainers=2, base_port=0, window_s=2.0).write(tmp_path / "exp")
    layout = root / "experiment.toml"
    text = layout.read_text()
    for edited, needles in (
            (text.replace("window_s = 2.0", "window_s = 5.0"), ("window_s = 5.0", "signed manifest has 2.0")),
            (text.replace("window_s = 2.0", "windw_s = 2.0"), ("windw_s: unknown key", "did you mean 'window_s'?")),
            (text.replace("trainers = 2", "trainers = 3"), ("trainers = 3", "signed manifest has 2")),
            (text + '\n[experiment.node_options.trainr-1]\ndevice = "cpu"\n',
             ("node_options.trainr-1: no such node", "did you mean 'trainer-1'?")),
            (text + '\n[experiment.node_options.trainer-1]\ndevice = "cpu"\n',
             ("node_options.trainer-1.device", "node.toml has None"))):
        layout.write_text(edited)
        _one_line_exit_2(_peerloom("up", str(root)), *needles)
        assert not (root / "nodes" / "validator-1" / "node.log").exists()  # nothing started
    with pytest.raises(ValueError, match="did you mean 'trainer-1'"):
        Experiment(workload=WORKLOAD, node_options={"trainr-1": {"threads": 1}})


def test_verify_and_export_point_from_an_experiment_never_run(tmp_path):
    root = Experiment(workload=WORKLOAD, trainers=1, base_port=0).write(tmp_path / "exp")
    for args in (["verify", str(root)], ["export", str(root), "--out", str(tmp_path / "m.safetensors")]):
        _one_line_exit_2(_peerloom(*args), "validator-1/store: holds no chain yet", f"peerloom up {root}")


def test_init_private_data_admits_private_trainers_and_names_their_files(tmp_path):
    """`init --private-data` sets the manifest's private_data; `--data TRAINER=PATH` gives that trainer its own
    .npz (node config ``data``, spec/protocol.md §10) and lists it in the manifest's `private` (it is in the
    genesis roster, which never joins, so the manifest flags it); `Fleet.check` accepts the directory, and
    every config loads."""
    import tomllib

    import numpy as np

    from peerloom.node import load_config

    np.savez(tmp_path / "part1.npz", x=np.zeros((10, 64), np.float32), y=np.zeros(10, np.int64))
    out = _peerloom("init", str(tmp_path / "e"), "--workload", WORKLOAD, "--trainers", "2", "--data",
                    f"trainer-1={tmp_path / 'part1.npz'}", "--base-port", "0")
    assert out.returncode == 0, out.stderr
    fleet = Fleet.open(tmp_path / "e")
    manifest = fleet.revision().manifest
    peers = {n["name"]: n["peer"] for n in fleet.layout["nodes"]}
    assert manifest.private_data and [p.to_text() for p in manifest.private] == [peers["trainer-1"]]
    assert sorted(p.to_text() for p, _ in manifest.roster) == sorted([peers["trainer-1"], peers["trainer-2"]])
    assert fleet.revision().genesis().private == manifest.private
    config = tomllib.loads((tmp_path / "e" / "nodes" / "trainer-1" / "node.toml").read_text())
    assert config["data"] == str(tmp_path / "part1.npz")
    assert fleet.check().trainer_data == {"trainer-1": str(tmp_path / "part1.npz")}
    for name in peers:
        load_config(tmp_path / "e" / "nodes" / name / "node.toml")
    plain = _peerloom("init", str(tmp_path / "p"), "--workload", WORKLOAD, "--private-data", "--base-port", "0")
    assert plain.returncode == 0 and Fleet.open(tmp_path / "p").revision().manifest.private_data
    bad = _peerloom("init", str(tmp_path / "f"), "--workload", WORKLOAD, "--data", "trainer-9=x.npz",
                    "--base-port", "0")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "trainer_data.trainer-9" in bad.stderr

"""Build and run small fleets of `peerloom node` OS processes on 127.0.0.1 for end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from peerloom.adapters.keys import generate_identity, save_identity
from peerloom.adapters.storage import ArtifactStore, atomic_write
from peerloom.backends.numpy.tensors import schema_of, tensor_digest, to_safetensors
from peerloom.core.chain import decode_chain_entry
from peerloom.core.identity import Identity
from peerloom.core.objects import Manifest, Revision
from tests import node_zygote

# PEERLOOM_TEST_FRESH_NODES=1: every `Node.start` runs a fresh interpreter instead of forking from the fork server.
FRESH_INTERPRETERS = os.environ.get("PEERLOOM_TEST_FRESH_NODES", "") not in ("", "0")


def numpy_digits(seed: int, num_shards: int) -> tuple[Any, list[list[int]]]:
    """Workload factory (`workload = "tests.node_cluster:numpy_digits"`): the digits MLP in numpy, one local
    epoch; the same schema as ``digits-mlp`` without importing torch, so node processes start faster."""
    from peerloom.backends.datasets import load_digits_split, shard_indices
    from peerloom.backends.numpy.workload import make_digits_numpy_workload

    workload = make_digits_numpy_workload(seed=seed, local_epochs=1)
    return workload, shard_indices(len(load_digits_split(seed)[0]), num_shards, seed)


_handed_out: set[int] = set()


def free_port() -> int:
    """A port free on 127.0.0.1 now for a node to bind later, drawn below the kernel's ephemeral range as
    `peerloom init` draws them (`peerloom.experiment._unused_ports`): a port from that range (what binding
    port 0 gives) can meanwhile become the local end of some outgoing connection, and the node then fails
    with "Address already in use" (seen under load, with other fleets dialling). Never one it gave before."""
    from peerloom.experiment import _unused_ports

    while True:
        (port,) = _unused_ports(1)
        if port not in _handed_out:
            _handed_out.add(port)
            return port


@dataclass
class Node:
    name: str
    role: str
    identity: Identity
    directory: Path
    port: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | node_zygote.ForkedProcess | None = None

    @property
    def config_path(self) -> Path:
        return self.directory / "node.toml"

    def write_config(self, **extra: Any) -> Path:
        self.config.update(extra)
        self.config_path.write_text(tomli_w.dumps(self.config))
        return self.config_path

    def start(self, *, fresh_interpreter: bool = FRESH_INTERPRETERS) -> None:
        """Start `peerloom node --config <node.toml>`, output appended to node.log: forked from the session's
        fork server (tests/node_zygote.py: a real process running the real command line, without the seconds
        of imports a fresh interpreter pays), or with `fresh_interpreter` as `python -m peerloom node`."""
        (self.directory / "port").unlink(missing_ok=True)
        argv = ["node", "--config", str(self.config_path)]
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        if not fresh_interpreter:
            self.process = node_zygote.shared().start(argv, log=self.directory / "node.log", env=env)
            return
        log = open(self.directory / "node.log", "ab")
        self.process = subprocess.Popen([sys.executable, "-m", "peerloom", *argv], stdout=log,
                                        stderr=subprocess.STDOUT, env=env)
        log.close()

    def wait_port(self, timeout_s: float = 30.0) -> int:
        deadline = time.monotonic() + timeout_s
        path = self.directory / "port"
        while time.monotonic() < deadline:
            if path.exists() and path.read_text().strip():
                return int(path.read_text())
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {(self.directory / 'node.log').read_text()[-3000:]}")
            time.sleep(0.02)
        raise TimeoutError(f"{self.name} did not start: {(self.directory / 'node.log').read_text()[-3000:]}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM and wait; SIGKILL if it does not exit in time. Returns the exit status."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def events(self) -> list[dict[str, Any]]:
        path = self.directory / "events.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut by SIGKILL
        return out


def make_fleet(root: Path, *, validators: int, trainers: int, quorum: int, window_s: float = 1.0,
               min_updates: int = 1, shards: int = 4, stop_after_window: int | None = None,
               extra_roster: tuple[Identity, ...] = (), manifest_options: dict[str, Any] | None = None) -> list[Node]:
    """Write keys, a signed manifest (digits workload; `manifest_options`: other `Manifest` fields) and one
    node.toml per node; start nothing."""
    model, shard_lists = numpy_digits(0, shards)
    authority = generate_identity()
    nodes = [Node(f"validator-{i}", "validator", generate_identity(), root / f"validator-{i}")
             for i in range(1, validators + 1)]
    nodes += [Node(f"trainer-{i}", "trainer", generate_identity(), root / f"trainer-{i}")
              for i in range(1, trainers + 1)]
    params = model.initial_params(0)
    genesis = to_safetensors(params)
    refs = []
    for node in nodes:
        node.directory.mkdir(parents=True)
        save_identity(node.identity, node.directory / "key")
        node.port = free_port()
        if node.role == "validator":
            refs.append(ArtifactStore(node.directory / "store", chunk_size=64 * 1024).put(genesis))
    manifest = Manifest(
        experiment="test-fleet", workload="digits-mlp", workload_seed=0, schema=schema_of(params),
        shards=tuple(len(s) for s in shard_lists), validators=tuple(n.identity.peer_id for n in nodes[:validators]),
        quorum=quorum, window_s=window_s, min_updates=min_updates, max_capacity=4, aggregation="mean",
        outer_optimizer="fedavg", outer_lr=1.0, chunk_size=64 * 1024, genesis_params=refs[0],
        genesis_params_digest=tensor_digest(params),
        roster=tuple(sorted([(n.identity.peer_id, 1) for n in nodes if n.role == "trainer"]
                            + [(i.peer_id, 1) for i in extra_roster])), **(manifest_options or {}))
    envelope = manifest.seal(authority)
    Revision.verify(envelope, authority.peer_id)
    atomic_write(root / "manifest.cbor", envelope.to_bytes())
    (root / "authority").write_text(authority.peer_id.to_text())
    servers = nodes[:validators]
    for node in nodes:
        targets = servers if node.role == "trainer" else servers[:servers.index(node)]
        node.config = {
            "name": node.name, "roles": [node.role], "key": "key", "manifest": str(root / "manifest.cbor"),
            "authority": authority.peer_id.to_text(), "store": "store", "listen": f"127.0.0.1:{node.port}",
            "bootstrap": [f"127.0.0.1:{t.port}" for t in targets], "port_file": "port",
            "events": "events.jsonl", "stats": "stats.json", "threads": 1,
            "workload": "tests.node_cluster:numpy_digits",
        }
        if stop_after_window is not None:
            node.config["stop_after_window"] = stop_after_window
        node.write_config()
    return nodes


def batchnorm_digits(seed: int, num_shards: int) -> tuple[Any, list[list[int]]]:
    """Workload factory (`workload = "tests.node_cluster:batchnorm_digits"`): a torch MLP on digits with a
    BatchNorm layer, which DP-SGD cannot train (its outputs mix a batch's samples; Opacus refuses it)."""
    import torch
    from torch import nn

    from peerloom.backends.datasets import load_digits_split, shard_indices
    from peerloom.workloads import torch_workload

    x, y, xt, yt = load_digits_split(seed)
    workload = torch_workload(model=lambda: nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(),
                                                           nn.Linear(32, 10)),
                              loss=nn.functional.cross_entropy, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                              train_data=(x, y), eval_data=(xt, yt), batch_size=32)
    return workload, shard_indices(len(x), num_shards, seed)


def chain(node) -> list:
    """The heads in `node`'s chain directory so far (a file being written is skipped)."""
    directory = node.directory / "store" / "chain"
    heads = []
    for path in sorted(directory.glob("*.cbor")) if directory.exists() else []:
        try:
            heads.append(decode_chain_entry(path.read_bytes())[0])
        except Exception:
            pass  # being written
    return heads


def wait_until(cond, timeout_s: float, what: str, nodes) -> None:
    """Poll `cond` until it holds; fail naming `what` after `timeout_s`, or at once with the log of a node
    that exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        for node in nodes:
            if node.process is not None and node.process.poll() is not None:
                raise AssertionError(f"{node.name} exited: {(node.directory / 'node.log').read_text()[-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def peerloom(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    """`python -m peerloom ARGS` in a new process, its output captured as text."""
    return subprocess.run([sys.executable, "-m", "peerloom", *args], capture_output=True, text=True,
                          timeout=timeout_s)


def run_fleet_until(nodes: list, done, timeout_s: float) -> None:
    """Start every node, wait for their ports, poll `done()` until it holds (failing with the nodes' log
    tails after `timeout_s`, or at once with the log of a node that exited), then stop them all."""
    try:
        for node in nodes:
            node.start()
        for node in nodes:
            node.wait_port()
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, [n.directory.joinpath("node.log").read_text()[-2000:] for n in nodes]
            for node in nodes:
                assert node.process is not None and node.process.poll() is None, \
                    node.directory.joinpath("node.log").read_text()[-3000:]
            time.sleep(0.2)
    finally:
        for node in nodes:
            node.stop()


def chain_windows(node) -> list[int]:
    """The windows (genesis left out) whose certified heads `node` has written to its chain directory."""
    return sorted(int(p.stem) for p in (node.directory / "store" / "chain").glob("[0-9]*.cbor") if int(p.stem) > 0)


def check_chain(validator, windows: int) -> None:
    """`validator`'s store verifies (`peerloom verify`), reaches `windows` certified windows, and some window
    certified a trainer's update."""
    from peerloom.verify import run_verify

    lines: list[str] = []
    assert run_verify(validator.directory / "store", echo=lines.append) == 0, lines
    entries = [decode_chain_entry(p.read_bytes()) for p in sorted((validator.directory / "store" / "chain")
                                                                   .glob("[0-9]*.cbor"))]
    assert max(h.window for h, _ in entries) >= windows
    assert any(h.cohort for h, _ in entries), "no window certified any trainer's update"


def run_runtimes_until(runtimes: list, done, timeout_s: float) -> None:
    """Run in-process `NodeRuntime`s in one trio run until `done()` holds (a TooSlowError after
    `timeout_s`), then cancel them and close each."""
    import trio

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for runtime in runtimes:
                await nursery.start(runtime.run)
            with trio.fail_after(timeout_s):
                while not done():
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        for runtime in runtimes:
            runtime.close()

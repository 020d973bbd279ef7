"""Experiments as directories: the public way to set up a fleet (`peerloom init`, `up`, `status`).

An `Experiment` names a workload, the roles and their counts, and the protocol's settings (aggregation rule,
outer optimizer, codec, window), each with a default. `Experiment.write(DIR)` plays the experiment
authority once and leaves everything a fleet needs:

    DIR/experiment.toml          the settings and the nodes, read by `peerloom up` and `peerloom status`
    DIR/authority.key            the authority's key: it signed the manifest (keep it; mode 0600)
    DIR/manifest.cbor            the signed manifest, the revision every node checks
    DIR/nodes/<name>/key         each node's identity key (mode 0600)
    DIR/nodes/<name>/node.toml   each node's config: `peerloom node --config DIR/nodes/<name>/node.toml`
    DIR/nodes/<name>/store/      validators' and reducers' stores, holding the genesis params

For a real deployment copy `DIR/manifest.cbor` and one `DIR/nodes/<name>/` to each machine, edit its
`listen` and `bootstrap` addresses, and run `peerloom node` there. `up` runs the same configs as local
processes on 127.0.0.1. Which nodes exist and where they listen is in `experiment.toml`.

    from peerloom.experiment import Experiment
    Experiment(workload="mypkg.train:factory", trainers=4).write("run")   # then: peerloom up run

A workload is a registry name (`peerloom.backends.registry.WORKLOADS`) or ``module:function``, a factory
called as ``factory(seed, num_shards) -> (workload, shards)`` in every process (so the module must be
importable by the nodes: `up` starts them in the current directory).
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

from peerloom.core.errors import PeerloomError
from peerloom.core.objects import AGGREGATION_RULES, CODECS, OUTER_OPTIMIZERS, Manifest, Revision

LAYOUT_FILE = "experiment.toml"
# Manifest fields an Experiment sets itself (the rest may come from `manifest_options`).
MANIFEST_FROM_EXPERIMENT = frozenset({
    "experiment", "workload", "workload_seed", "schema", "shards", "validators", "quorum", "window_s",
    "min_updates", "max_capacity", "aggregation", "outer_optimizer", "outer_lr", "inner_steps", "codec",
    "audit", "chunk_size", "genesis_params", "genesis_params_digest", "roster"})


class ExperimentError(PeerloomError, ValueError):
    """An experiment directory that cannot run as it is (settings edited after `init`, a node that failed to
    start); the message is one line naming the key or the node."""


class NodeStartError(ExperimentError, RuntimeError):
    """A node of the fleet exited or timed out while starting (`Fleet.wait_started`); the message is one line:
    the node's name and its own error line."""


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value!r}")


@attrs.frozen(kw_only=True)
class Experiment:
    """What to train, by whom, and how (spec/protocol.md). Every field but `workload` has a default.

    `late_joiners` more trainers get keys and configs but are not in the genesis roster: they ask to join
    when started (spec/protocol.md §5). `trainer_data` gives trainers data only they hold (spec/protocol.md
    §10): trainer name -> path of an .npz of x and y (node config key ``data``; a relative path is relative
    to the trainer's directory ``nodes/<name>/``); it sets the manifest's ``private_data`` and lists those
    trainers (of the genesis roster) in the manifest's ``private``, so the genesis head lists them as private.
    `manifest_options` sets any other `Manifest` field (screening
    thresholds, `lease_s`, `idle_windows`, ...; ValueError for an unknown or derived one);
    `node_options` adds keys to a node's config by node name (see `peerloom.node`: `behaviour`,
    `threads`, `device`, ...), checked when the node starts; a name that is not a node is a ValueError.
    `base_port` 0 picks free ports when the directory is written.

    `trainers`, `validators` and `reducers` are process counts; the validators' quorum is the Byzantine
    quorum ``floor(2n/3) + 1`` (spec/agreement.md §2). `shards` is how many data shards the workload is cut
    into (default twice the trainers). `window_s` is each window's collection deadline in seconds, not its
    pace: a window closes as soon as every lease has its update, or at the deadline (`window_s` after it
    opened, extended while a leaseholder is reachable up to ``3 * window_s``; spec/protocol.md §6), so a
    small model can certify several windows a second. `windows` is the
    stop criterion `peerloom up` uses when given no ``--windows``: the fleet opens no window after this one
    (None: run until Ctrl-C); unlike the other settings it is not signed and may be edited later. The rule,
    optimizer and codec are validated against the protocol's lists (`AGGREGATION_RULES`, `OUTER_OPTIMIZERS`,
    `CODECS`); an unknown one raises ValueError. `base_port` is the first TCP port of the local fleet (node
    i listens on base_port + i); the first validator also serves the HTTP edge on ``base_port - 1``.
    """

    workload: str
    name: str = "experiment"
    trainers: int = attrs.field(default=3, validator=_positive)
    validators: int = attrs.field(default=1, validator=_positive)
    reducers: int = attrs.field(default=1, validator=attrs.validators.ge(0))
    seed: int = 0
    shards: int | None = None
    window_s: float = attrs.field(default=10.0, validator=_positive)
    min_updates: int = attrs.field(default=1, validator=_positive)
    aggregation: str = attrs.field(default="centered_clip", validator=attrs.validators.in_(AGGREGATION_RULES))
    outer_optimizer: str = attrs.field(default="diloco", validator=attrs.validators.in_(OUTER_OPTIMIZERS))
    outer_lr: float = attrs.field(default=0.7, validator=_positive)
    inner_steps: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    codec: str = attrs.field(default="none", validator=attrs.validators.in_(CODECS))
    audit: bool = False
    chunk_size: int = 1 << 20
    base_port: int = attrs.field(default=7100, validator=attrs.validators.in_((0, *range(1025, 65000))))
    late_joiners: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    windows: int | None = attrs.field(default=None, validator=attrs.validators.optional(_positive))
    manifest_options: dict[str, Any] = attrs.field(factory=dict, converter=lambda v: _manifest_options(v))
    node_options: dict[str, dict[str, Any]] = attrs.field(factory=dict, converter=lambda v: _node_options(v))
    trainer_data: dict[str, str] = attrs.field(factory=dict, converter=lambda v: _trainer_paths(v))

    @trainer_data.validator
    def _check_trainer_data(self, attribute: attrs.Attribute, value: dict[str, str]) -> None:
        trainers = [name for name, role in self.node_names() if role == "trainer"]
        for name, path in sorted(value.items()):
            if name not in trainers:
                raise ValueError(f"trainer_data.{name}: no such trainer; trainers: {', '.join(trainers)}")
            if not isinstance(path, str) or not path:
                raise ValueError(f"trainer_data.{name} must be the path of an .npz file, got {path!r}")
        if value and self.manifest_options.get("private_data") is False:
            raise ValueError("trainer_data needs manifest_options.private_data (private-data trainers admitted)")

    @node_options.validator
    def _check_node_options(self, attribute: attrs.Attribute, value: dict[str, Any]) -> None:
        names = [name for name, _ in self.node_names()]
        for name in sorted(set(value) - set(names)):
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"node_options.{name}: no such node{hint}; nodes: {', '.join(names)}")

    @manifest_options.validator
    def _check_manifest_options(self, attribute: attrs.Attribute, value: dict[str, Any]) -> None:
        settable = {f.name for f in attrs.fields(Manifest)} - MANIFEST_FROM_EXPERIMENT
        unknown = sorted(set(value) - settable)
        if unknown:
            raise ValueError(f"manifest_options: unknown or derived key(s) {', '.join(unknown)}; settable: "
                             f"{', '.join(sorted(settable))}")

    @property
    def num_shards(self) -> int:
        return self.shards if self.shards is not None else 2 * self.trainers

    def node_names(self) -> list[tuple[str, str]]:
        """(name, role) of every node, validators first (the first one is the fleet's seed), late joiners
        last."""
        names = [(f"validator-{i}", "validator") for i in range(1, self.validators + 1)]
        names += [(f"reducer-{i}", "reducer") for i in range(1, self.reducers + 1)]
        return names + [(f"trainer-{i}", "trainer") for i in range(1, self.trainers + self.late_joiners + 1)]

    def _ports(self, count: int) -> list[int]:
        """`count` + 1 ports: the HTTP edge's, then each node's (`base_port` 0: `_unused_ports`)."""
        if self.base_port:
            return list(range(self.base_port - 1, self.base_port + count))
        return _unused_ports(count + 1)

    def write(self, directory: str | Path) -> Path:
        """Create the experiment directory (see the module docstring); returns its path.

        Raises FileExistsError if `directory` exists and is not empty (an experiment is never
        overwritten: its keys are its identity), and the workload factory's errors (ConfigError when it
        cannot be imported or returns the wrong number of shards).
        """
        import tomli_w

        from peerloom.adapters.keys import generate_identity, save_identity
        from peerloom.adapters.storage import ArtifactStore, atomic_write
        from peerloom.backends.numpy.tensors import schema_of, tensor_digest, to_safetensors
        from peerloom.core.objects import byzantine_quorum, make_artifact_ref
        from peerloom.node import build_node_workload

        root = Path(directory)
        if root.exists() and any(p.name in (LAYOUT_FILE, "nodes", "manifest.cbor") for p in root.iterdir()):
            raise FileExistsError(17, "holds an experiment already; an experiment is never overwritten", str(root))
        workload, shards = build_node_workload({"workload": self.workload}, self.workload, self.seed,
                                               self.num_shards)
        privacy = _manifest_options(self.manifest_options).get("privacy")
        if privacy is not None:
            # Every node would refuse it at start: say so now, in one line (Opacus's reason for a layer it
            # cannot train, a numpy workload, a missing [dp] extra; spec/protocol.md §10).
            from peerloom.node import ConfigError, apply_privacy

            try:
                apply_privacy(workload, privacy, self.workload)
            except ConfigError as exc:
                raise ExperimentError(f"--dp-epsilon (manifest privacy): {exc}") from None
        params = workload.initial_params(self.seed)
        genesis = to_safetensors(params)
        root.mkdir(parents=True, exist_ok=True)
        authority = generate_identity()
        save_identity(authority, root / "authority.key")
        nodes: list[dict[str, Any]] = []
        names = self.node_names()
        http_port, *ports = self._ports(len(names))
        joiners = {name for name, _ in names[len(names) - self.late_joiners:]} if self.late_joiners else set()
        for i, (name, role) in enumerate(names):
            identity = generate_identity()
            directory_i = root / "nodes" / name
            directory_i.mkdir(parents=True)
            save_identity(identity, directory_i / "key")
            if role != "trainer":
                ArtifactStore(directory_i / "store", chunk_size=self.chunk_size).put(genesis)
            nodes.append({"name": name, "role": role, "peer": identity.peer_id.to_text(),
                          "listen": f"127.0.0.1:{ports[i]}", "late_joiner": name in joiners})
        manifest = Manifest(
            experiment=self.name, workload=self.workload, workload_seed=self.seed, schema=schema_of(params),
            shards=tuple(len(s) for s in shards),
            validators=tuple(_peer(n) for n in nodes if n["role"] == "validator"),
            quorum=byzantine_quorum(self.validators), window_s=self.window_s, min_updates=self.min_updates,
            max_capacity=4, aggregation=self.aggregation, outer_optimizer=self.outer_optimizer,
            outer_lr=self.outer_lr, inner_steps=self.inner_steps, codec=self.codec, audit=self.audit,
            chunk_size=self.chunk_size, genesis_params=make_artifact_ref(genesis, self.chunk_size),
            genesis_params_digest=tensor_digest(params),
            roster=tuple(sorted((_peer(n), 1) for n in nodes if n["role"] == "trainer" and not n["late_joiner"])),
            **{**self.manifest_options, **({"private_data": True} if self.trainer_data else {}),
               **({"private": tuple(sorted(_peer(n) for n in nodes if n["name"] in self.trainer_data
                                           and not n["late_joiner"]))} if self.trainer_data else {})})
        atomic_write(root / "manifest.cbor", manifest.seal(authority).to_bytes())
        servers = [n for n in nodes if n["role"] != "trainer"]
        http = f"127.0.0.1:{http_port}"
        for node in nodes:
            # Trainers dial every server; servers dial the servers listed before them.
            targets = servers if node["role"] == "trainer" else servers[:servers.index(node)]
            config: dict[str, Any] = {
                "name": node["name"], "roles": [node["role"]], "key": "key", "manifest": "../../manifest.cbor",
                "authority": authority.peer_id.to_text(), "store": "store", "listen": node["listen"],
                "bootstrap": [t["listen"] for t in targets], "port_file": "port", "events": "events.jsonl",
                "stats": "stats.json", "workload": self.workload,
            }
            if node is nodes[0]:
                config["http"] = {"enabled": True, "listen": http}
            if node["name"] in self.trainer_data:
                config["data"] = self.trainer_data[node["name"]]
            config.update(self.node_options.get(node["name"], {}))
            (root / "nodes" / node["name"] / "node.toml").write_text(tomli_w.dumps(config))
        layout = {"experiment": attrs.asdict(self, filter=lambda a, v: v is not None), "authority":
                  authority.peer_id.to_text(), "dashboard": f"http://{http}/", "nodes": nodes}
        source = _import_root(self.workload)
        if source is not None:
            layout["pythonpath"] = str(source)  # where `up` finds the workload module, whatever its cwd
        (root / LAYOUT_FILE).write_text(tomli_w.dumps(layout))
        return root


def _manifest_options(value: Any) -> dict[str, Any]:
    """`Experiment.manifest_options` as a dict, its ``privacy`` as `PrivacyParams` (experiment.toml holds it as
    a table of its fields)."""
    from peerloom.core.objects import PrivacyParams

    options = dict(value)
    if isinstance(options.get("privacy"), dict):
        options["privacy"] = PrivacyParams(**options["privacy"])
    return options


def chain_node_dir(path: Path) -> Path | None:
    """Where `peerloom verify`, `peerloom export` and `load_head` read an experiment directory's chain and
    weights: the node directory of its first validator (every validator holds the whole chain and each
    head's params). None when `path` is not an experiment directory (no experiment.toml). FileNotFoundError
    naming the store when that validator has certified nothing yet."""
    if not (path / LAYOUT_FILE).is_file():
        return None
    layout = tomllib.loads((path / LAYOUT_FILE).read_text())
    first = next((n["name"] for n in layout.get("nodes", []) if n.get("role") == "validator"), None)
    if first is None:
        raise FileNotFoundError(2, f"no validator in {LAYOUT_FILE}; give a node directory", str(path))
    node = path / "nodes" / first
    if not (node / "store" / "manifest.cbor").is_file():  # written by the node when it first starts
        raise FileNotFoundError(2, f"holds no chain yet (run `peerloom up {path}` first)", str(node / "store"))
    return node


def _import_root(workload: str) -> Path | None:
    """The sys.path entry the workload factory's module was imported from (None for a registry name)."""
    if ":" not in workload:
        return None
    module_name = workload.partition(":")[0]
    module = sys.modules.get(module_name)
    file = getattr(module, "__file__", None)
    if file is None:
        return None
    root = Path(file).resolve().parent
    for _ in range(module_name.count(".")):
        root = root.parent
    return root


def _peer(node: dict[str, Any]) -> Any:
    from peerloom.core.identity import PeerId

    return PeerId.from_text(node["peer"])


class EventTail:
    """Reads the new JSON lines of a node's event log as they are written (from where the last read ended;
    `from_end`: from the end of what the file holds now, so a restarted fleet's old lines are not read)."""

    def __init__(self, path: Path, *, from_end: bool = False) -> None:
        self.path = path
        self.offset = path.stat().st_size if from_end and path.exists() else 0

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            data = fh.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        lines = []
        for line in data[:end].splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:  # a line torn by SIGKILL
                continue
        return lines


@attrs.define
class Fleet:
    """An experiment directory's nodes as local processes (`peerloom up`)."""

    root: Path
    layout: dict[str, Any]
    processes: dict[str, subprocess.Popen[bytes]] = attrs.field(factory=dict)

    @classmethod
    def open(cls, directory: str | Path) -> Fleet:
        """The experiment in `directory`. FileNotFoundError if it holds no experiment.toml."""
        root = Path(directory)
        path = root / LAYOUT_FILE
        if not path.is_file():
            raise FileNotFoundError(2, f"not an experiment directory (no {LAYOUT_FILE}; create one with "
                                       "`peerloom init`)", str(root))
        return cls(root=root, layout=tomllib.loads(path.read_text()))

    def node_dir(self, name: str) -> Path:
        return self.root / "nodes" / name

    def check(self) -> Experiment:
        """The `Experiment` that experiment.toml describes, checked against what `init` made of it: the
        signed manifest, the nodes and their configs. ExperimentError names the first key that no longer
        matches (the settings are fixed at `init`; only `windows`, the stop criterion, may change), an
        unknown key (with the closest valid one) or a `node_options` entry its node's config lacks."""
        from peerloom.core.config_checks import check_keys

        where = self.root / LAYOUT_FILE
        table = dict(self.layout.get("experiment", {}))
        try:
            check_keys(table, [f.name for f in attrs.fields(Experiment)], "experiment")
            experiment = Experiment(**table)
        except (TypeError, ValueError) as exc:
            raise ExperimentError(f"{where}: {exc}") from None
        manifest = self.revision().manifest
        signed = {"name": manifest.experiment, "workload": manifest.workload, "seed": manifest.workload_seed,
                  "trainers": len(manifest.roster),
                  "validators": len(manifest.validators),
                  "shards": len(manifest.shards), "window_s": manifest.window_s,
                  "min_updates": manifest.min_updates, "aggregation": manifest.aggregation,
                  "outer_optimizer": manifest.outer_optimizer, "outer_lr": manifest.outer_lr,
                  "inner_steps": manifest.inner_steps, "codec": manifest.codec, "audit": manifest.audit,
                  "chunk_size": manifest.chunk_size}
        signed.update({f"manifest_options.{k}": _plain(getattr(manifest, k)) for k in experiment.manifest_options})
        ours = {**{k: getattr(experiment, k) for k in signed if "." not in k}, "shards": experiment.num_shards,
                **{f"manifest_options.{k}": _plain(v) for k, v in experiment.manifest_options.items()}}
        for key, value in signed.items():
            if ours[key] != value:
                raise ExperimentError(f"{where}: {key} = {ours[key]!r}, but the signed manifest has {value!r}; "
                                      "settings are fixed when `peerloom init` signs the manifest (init a new "
                                      "directory to change them)")
        nodes = self.layout.get("nodes", [])
        made = {"reducers": sum(n["role"] == "reducer" for n in nodes),
                "late_joiners": sum(bool(n.get("late_joiner")) for n in nodes)}
        for key, value in made.items():
            if getattr(experiment, key) != value:
                raise ExperimentError(f"{where}: {key} = {getattr(experiment, key)!r}, but `peerloom init` made "
                                      f"{value} (init a new directory to change them)")
        if experiment.trainer_data and not manifest.private_data:
            raise ExperimentError(f"{where}: trainer_data is set, but the signed manifest admits no private-data "
                                  "trainers (private_data)")
        named = {n["name"]: n["peer"] for n in nodes}
        private = {named.get(name) for name in experiment.trainer_data if not self._late_joiner(name)}
        if private != {p.to_text() for p in manifest.private}:
            raise ExperimentError(f"{where}: trainer_data names other genesis-roster trainers than the signed "
                                  "manifest's private list (init a new directory to change them)")
        for name, path in sorted(experiment.trainer_data.items()):
            config_path = self.node_dir(name) / "node.toml"
            config = tomllib.loads(config_path.read_text()) if config_path.is_file() else {}
            if config.get("data") != path:
                raise ExperimentError(f"{where}: trainer_data.{name} = {path!r}, but {config_path} has "
                                      f"{config.get('data')!r}; nodes run their node.toml, so edit it there")
        for name, options in sorted(experiment.node_options.items()):
            config_path = self.node_dir(name) / "node.toml"
            config = tomllib.loads(config_path.read_text()) if config_path.is_file() else {}
            for key, value in sorted(options.items()):
                if config.get(key) != value:
                    raise ExperimentError(f"{where}: node_options.{name}.{key} = {value!r}, but {config_path} "
                                          f"has {config.get(key)!r}; nodes run their node.toml, so edit it there")
        return experiment

    def _late_joiner(self, name: str) -> bool:
        return any(n["name"] == name and n.get("late_joiner") for n in self.layout.get("nodes", []))

    def head_window(self) -> int:
        """The newest certified window in any validator's store (0 before the first): where a restarted
        fleet resumes."""
        from peerloom.adapters.database import DB_NAME, Database

        newest = 0
        for node in self.layout["nodes"]:
            db_path = self.node_dir(node["name"]) / "store" / DB_NAME
            if node["role"] != "validator" or not db_path.exists():
                continue
            db = Database(db_path)
            try:
                heads = db.heads(limit=1)
            finally:
                db.close()
            newest = max(newest, heads[0][0] if heads else 0)
        return newest

    def start(self, names: list[str] | None = None, *, stop_after_window: int | None = None) -> None:
        """Start `names` (default: every node but the late joiners) as `python -m peerloom node`, trainers
        first (a validator opens window 1 as soon as it starts), in the current directory so a workload
        module there can be imported. A node's output is appended to its node.log. `stop_after_window`: the
        nodes open no window after this one (`peerloom node --stop-after-window`)."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        paths = (self.layout.get("pythonpath", ""), os.getcwd(), env.get("PYTHONPATH", ""))
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        stop = [] if stop_after_window is None else ["--stop-after-window", str(stop_after_window)]
        chosen = [n for n in self.layout["nodes"] if (n["name"] in names if names is not None
                                                       else not n.get("late_joiner"))]
        for node in sorted(chosen, key=lambda n: n["role"] != "trainer"):
            directory = self.node_dir(node["name"])
            (directory / "port").unlink(missing_ok=True)
            # A stop signal between the process starting and its being recorded would leave it running,
            # unknown to whoever stops the fleet: the signal waits until it is recorded.
            with open(directory / "node.log", "ab") as log, signals_deferred():
                self.processes[node["name"]] = subprocess.Popen(
                    [sys.executable, "-m", "peerloom", "node", "--config", str(directory / "node.toml"), *stop],
                    stdout=log, stderr=subprocess.STDOUT, env=env)
            (directory / "pid").write_text(f"{self.processes[node['name']].pid}\n")

    def wait_started(self, timeout_s: float = 60.0, names: list[str] | None = None) -> None:
        """Wait until every started node (or `names`) wrote its port. NodeStartError with the one line of a
        node that exited (a config error's own line: `peerloom node` prints one) or did not start in time."""
        deadline = time.monotonic() + timeout_s
        waiting = [n for n in self.processes if names is None or n in names]
        while waiting:
            for name in list(waiting):
                port = self.node_dir(name) / "port"
                if port.exists() and port.read_text().strip():
                    waiting.remove(name)
                elif self.processes[name].poll() is not None:
                    raise NodeStartError(self.exit_line(name))
            if waiting and time.monotonic() > deadline:
                raise NodeStartError(f"{waiting[0]} did not start within {timeout_s:g} s; its log: "
                                      f"{self.node_dir(waiting[0]) / 'node.log'}")
            time.sleep(0.05)

    def exit_line(self, name: str) -> str:
        """One line on why node `name` exited: its own error line (exit status 2: a config or workload
        error, a port in use), else its status, its log's last line and where the log is."""
        code = self.processes[name].returncode
        line = self.last_log_line(name).removeprefix("peerloom node: ")
        if code == 2:
            return f"{name}: {line}"
        return f"{name} exited with status {code}: {line} (its log: {self.node_dir(name) / 'node.log'})"

    def last_log_line(self, name: str) -> str:
        log = self.node_dir(name) / "node.log"
        lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
        return lines[-1] if lines else "(no log)"

    def heads(self) -> list[dict[str, Any]]:
        """Every head line of the first validator's event log so far (certified or skipped)."""
        return [e for e in self.events().read() if e.get("event") == "head"]

    def events(self, name: str | None = None, *, from_end: bool = False) -> EventTail:
        """A reader of a node's event log (default: the first validator's), from its start or its end."""
        return EventTail(self.node_dir(name or self.layout["nodes"][0]["name"]) / "events.jsonl",
                         from_end=from_end)

    def stop(self, timeout_s: float = 15.0) -> dict[str, int | None]:
        """SIGTERM every node, SIGKILL what has not exited after `timeout_s`; returns exit statuses."""
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for name in self.processes:
            self.node_dir(name).joinpath("pid").unlink(missing_ok=True)
        return {name: p.returncode for name, p in self.processes.items()}

    def revision(self) -> Revision:
        from peerloom.core.envelope import SignedEnvelope
        from peerloom.core.identity import PeerId

        envelope = SignedEnvelope.from_bytes((self.root / "manifest.cbor").read_bytes())
        return Revision.verify(envelope, PeerId.from_text(self.layout["authority"]))


def _plain(value: Any) -> Any:
    """A manifest value as TOML holds it (tuples as lists, peer ids as text)."""
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if hasattr(value, "to_cbor") and attrs.has(type(value)):  # a manifest sub-table (privacy)
        return value.to_cbor()
    return value.to_text() if hasattr(value, "to_text") else value


class Problems:
    """What went wrong in a running fleet, by window, from the nodes' event logs: each update the first
    validator rejected from a trainer (`reject` events naming the trainer, with the reason and detail), and
    each task that failed on any node (`task-failed`, with the exception). `poll()` returns the lines to
    print: a head's window line, then one line per (node, problem) seen since the head before it."""

    def __init__(self, fleet: Fleet, *, after: int) -> None:
        nodes = fleet.layout["nodes"]
        self.after = after
        self.observer = fleet.events(from_end=True)
        self.tails = {n["name"]: fleet.events(n["name"], from_end=True) for n in nodes[1:]}
        self.trainers = {n["peer"]: n["name"] for n in nodes if n["role"] == "trainer"}
        self.pending: dict[tuple[str, str], int] = {}
        self.totals: dict[str, dict[str, int]] = {}
        self.last_window = after

    def poll(self) -> list[str]:
        for name, tail in self.tails.items():
            for event in tail.read():
                if event.get("event") == "task-failed":
                    self._note(name, _task_failed(event))
        lines = []
        for event in self.observer.read():
            if event.get("event") == "task-failed":
                self._note(self.observer.path.parent.name, _task_failed(event))
            elif event.get("event") == "reject" and event.get("peer") in self.trainers:
                self._note(self.trainers[event["peer"]], f"update rejected: {_rejection(event)}")
            elif event.get("event") == "head" and event.get("window", 0) > self.last_window:
                self.last_window = event["window"]
                lines.append(_window_line(event))
                for (name, what), count in self.pending.items():
                    lines.append(f"    {name:<12} {what}{f'  (x{count})' if count > 1 else ''}")
                    self.totals.setdefault(name, {}).setdefault(what, 0)
                    self.totals[name][what] += count
                self.pending.clear()
        return lines

    def _note(self, name: str, what: str) -> None:
        self.pending[(name, what)] = self.pending.get((name, what), 0) + 1

    def summary(self) -> list[str]:
        """One line per node that had problems in the windows shown: how many of each."""
        lines = []
        for name, problems in sorted(self.totals.items()):
            shown = "; ".join(f"{what} x{count}" if count > 1 else what for what, count in problems.items())
            lines.append(f"  {name:<12} {shown}")
        return [f"problems in windows {self.after + 1}-{self.last_window}:", *lines] if lines else []


def _task_failed(event: dict[str, Any]) -> str:
    """A ``task-failed`` event as one line: the task's kind and the exception."""
    return f"{str(event.get('task', 'task')).rsplit('-', 1)[0]} task failed: {_short(event.get('reason', ''))}"


def _rejection(event: dict[str, Any]) -> str:
    """A ``reject`` event as one line: its reason, then its detail (the numbers) in parentheses."""
    detail = f" ({_short(event['detail'])})" if event.get("detail") else ""
    return f"{event.get('reason')}{detail}"


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _window_line(head: dict[str, Any]) -> str:
    metrics = head.get("metrics", {})
    shown = "  ".join(f"{k.removeprefix('test_')} {v:.4f}" for k, v in sorted(metrics.items())
                      if k.startswith("test_"))
    result = "skipped" if head.get("skipped") else f"{shown}  cohort {head.get('cohort')}"
    return f"window {head['window']:>4}  {result}"


def run_up(directory: str | Path, *, windows: int | None = None, echo: Callable[[str], None] = print) -> int:
    """`peerloom up DIR`: start the fleet, print each window as it is certified with the trainers whose
    update was rejected or whose task failed in it (and a summary at exit), and stop cleanly on Ctrl-C or
    after `windows` more certified windows (None: experiment.toml's `windows`, the window to stop after, if
    it has one). A restarted fleet resumes from the validators' stores and prints from there.

    Returns 0, or 1 when a node exited on its own while running. ExperimentError (one line, exit 2) when
    experiment.toml no longer matches what `init` made (`Fleet.check`), or when a node fails to start:
    that node's own error line.
    """
    fleet = Fleet.open(directory)
    experiment = fleet.check()
    revision = fleet.revision()
    resumed = fleet.head_window()
    stop = resumed + windows if windows is not None else experiment.windows
    if stop is not None and resumed >= stop:
        echo(f"peerloom up: {revision.manifest.experiment} is at window {resumed} already, its stop criterion "
             f"(windows = {stop} in {LAYOUT_FILE}); `peerloom up --windows N` certifies N more")
        return 0
    until = f"they stop after window {stop}, or on Ctrl-C" if stop is not None else "Ctrl-C stops them"
    echo(f"peerloom up: {revision.manifest.experiment}: {len(fleet.layout['nodes'])} nodes, workload "
         f"{revision.manifest.workload}, rule {revision.manifest.aggregation}; {until}")
    if resumed:
        echo(f"resuming after window {resumed} (the validators' stores)")
    problems = Problems(fleet, after=resumed)
    status = 0
    with signals_interrupt():
        try:
            fleet.start(stop_after_window=stop)
            fleet.wait_started()
            echo(f"dashboard: {fleet.layout['dashboard']}")
            while stop is None or problems.last_window < stop:
                for line in problems.poll():
                    echo(line)
                exited = [n for n, p in fleet.processes.items() if p.poll() is not None]
                if exited:
                    echo(fleet.exit_line(exited[0]))
                    status = 1
                    break
                time.sleep(0.2)
        except KeyboardInterrupt:
            echo("stopping ...")
        finally:
            with signals_ignored():  # a second Ctrl-C must not leave nodes running: the stop is bounded
                codes = fleet.stop()
            for line in problems.summary():
                echo(line)
    echo(f"stopped {len(codes)} nodes")
    return status


def status_lines(directory: Path) -> list[str]:
    """`peerloom status DIR`: one line per node (role, running or not, its latest head window; a trainer's
    epsilon and private data where the manifest has them, `privacy_columns`), under it the updates from it
    that the first validator rejected and its last failed task where it has any (`node_problems`), and the
    latest certified head's metrics."""
    from peerloom.adapters.database import DB_NAME, Database

    fleet = Fleet.open(directory)
    lines = [f"{fleet.layout['experiment']['name']}: workload {fleet.layout['experiment']['workload']}, "
             f"dashboard {fleet.layout['dashboard']}"]
    privacy = privacy_columns(fleet)
    lines += privacy.pop("", [])
    problems = node_problems(fleet)
    for node in fleet.layout["nodes"]:
        directory_i = fleet.node_dir(node["name"])
        pid_file = directory_i / "pid"
        running = pid_file.exists() and _alive(int(pid_file.read_text()))
        db_path = directory_i / "store" / DB_NAME
        window = "-"
        if db_path.exists():
            db = Database(db_path)
            try:
                heads = db.heads()
                window = str(heads[0][0]) if heads else "0"
            finally:
                db.close()
        lines.append(f"  {node['name']:<14} {node['role']:<9} {'running' if running else 'stopped':<8} "
                     f"head window {window:>4}  " + "  ".join([f"{node['listen']:<21}", *privacy[node["name"]]]
                                                             if privacy.get(node["name"]) else [node["listen"]]))
        health = problems.get(node["name"], {})
        if health.get("rejected"):
            lines.append(f"      updates rejected: {health['rejected']} (last: {health['last_rejection']})")
        if health.get("last_error"):
            lines.append(f"      last error: {health['last_error']}")
    last = fleet.heads()
    if last:
        metrics = last[-1].get("metrics", {})
        lines.append(f"latest head: window {last[-1]['window']}, " +
                     ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items())))
    return lines


def latest_head(fleet: Fleet) -> Any:
    """The newest certified head in the first validator's store (the `Head`), or None before the first."""
    from peerloom.adapters.database import DB_NAME, Database
    from peerloom.core.chain import decode_chain_entry

    first = next((n["name"] for n in fleet.layout["nodes"] if n["role"] == "validator"), None)
    db_path = fleet.node_dir(first) / "store" / DB_NAME if first is not None else None
    if db_path is None or not db_path.exists():
        return None
    db = Database(db_path)
    try:
        heads = db.heads(limit=1)
    finally:
        db.close()
    return decode_chain_entry(heads[0][2])[0] if heads else None


def privacy_columns(fleet: Fleet) -> dict[str, list[str]]:
    """What `status` shows of private data and differential privacy (spec/protocol.md §10), from the signed
    manifest and the latest certified head: under key ``""`` the lines below the title (the DP-SGD parameters
    and the budget; which trainers hold private data; ledger entries of peers that are no node here), and
    under each trainer's name the columns its line ends with (``epsilon E of BUDGET (S steps)``, ``private
    data``). Empty for a manifest with neither."""
    manifest = fleet.revision().manifest
    if manifest.privacy is None and not manifest.private_data:
        return {}
    head = latest_head(fleet)
    window = head.window if head is not None else 0
    names = {n["peer"]: n["name"] for n in fleet.layout["nodes"] if n["role"] == "trainer"}
    out: dict[str, list[str]] = {"": []}
    if manifest.privacy is not None:
        p = manifest.privacy
        out[""].append(f"privacy: DP-SGD, epsilon budget {p.epsilon_budget:g} per trainer over the revision "
                       f"(sigma {p.noise_multiplier:.4g}, clip {p.max_grad_norm:g}, q {p.sample_rate:g}, delta "
                       f"{p.delta:g}); epsilon as of head window {window}")
        ledger = {peer.to_text(): (steps, eps) for peer, steps, eps in (head.privacy if head is not None else ())}
        for peer, name in names.items():
            steps, eps = ledger.pop(peer, (0, 0.0))
            out.setdefault(name, []).append(f"epsilon {eps:.3f} of {p.epsilon_budget:g} ({steps} steps)")
        for peer, (steps, eps) in sorted(ledger.items()):  # trainers that joined from elsewhere
            out[""].append(f"  peer {peer}  epsilon {eps:.3f} of {p.epsilon_budget:g} ({steps} steps)")
    if manifest.private_data:
        private = sorted(names.get(peer.to_text(), peer.to_text()) for peer in (head.private if head else ()))
        out[""].append(f"private data: admitted; private trainers as of head window {window}: "
                       f"{', '.join(private) or 'none'}")
        for peer in head.private if head is not None else ():
            if peer.to_text() in names:
                out.setdefault(names[peer.to_text()], []).append("private data")
    return out


def node_problems(fleet: Fleet) -> dict[str, dict[str, Any]]:
    """Each node's problems over its whole event log, by name: ``last_error`` (its last failed task, the
    task kind and the exception; absent if none) and, for a trainer, ``rejected`` (how many of its updates
    the first validator rejected) and ``last_rejection`` (the last one's reason and detail)."""
    nodes = fleet.layout["nodes"]
    trainers = {n["peer"]: n["name"] for n in nodes if n["role"] == "trainer"}
    found: dict[str, dict[str, Any]] = {}
    for index, node in enumerate(nodes):
        for event in fleet.events(node["name"]).read():
            kind = event.get("event")
            if kind == "task-failed":
                found.setdefault(node["name"], {})["last_error"] = _task_failed(event)
            elif kind == "reject" and index == 0 and event.get("peer") in trainers:
                entry = found.setdefault(trainers[event["peer"]], {})
                entry["rejected"] = entry.get("rejected", 0) + 1
                entry["last_rejection"] = _rejection(event)
    return found


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt here (in the main thread; elsewhere nothing changes), so
    `up` stops its nodes on either, even where it inherited SIGINT ignored (a background job of a
    non-interactive shell: Python then keeps it ignored) and where the default SIGTERM would end `up` alone
    and leave its nodes running."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    with _handlers(interrupt):
        yield


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM held here (in the main thread) and delivered again when the block ends, to whatever
    handles them there, if one came: for a step that must not be cut in the middle, such as starting a process
    and recording it."""
    came: list[int] = []
    with _handlers(lambda signum, frame: came.append(signum)):
        yield
    for signum in dict.fromkeys(came):
        signal.raise_signal(signum)


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM ignored here (in the main thread): for a bounded stop that must not be cut short."""
    with _handlers(signal.SIG_IGN):
        yield


@contextlib.contextmanager
def _handlers(handler: Any) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


# --- the `init`, `up` and `status` commands ---------------------------------------------------------

COMMANDS = ("init", "up", "status")


def add_parsers(subparsers: Any) -> None:
    init = subparsers.add_parser("init", help="create an experiment directory: manifest, keys, node configs")
    init.add_argument("directory", type=Path)
    init.add_argument("--workload", required=True,
                      help="a registry name (digits-mlp, ...) or module:function returning (workload, shards)")
    init.add_argument("--name", default="experiment")
    for role, default in (("trainers", 3), ("validators", 1), ("reducers", 1)):
        init.add_argument(f"--{role}", type=int, default=default, help=f"how many {role} (default {default})")
    init.add_argument("--shards", type=int, default=None, help="data shards (default: 2 per trainer)")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--window-s", type=float, default=10.0,
                      help="each window's collection deadline in seconds, not its pace: a window closes as soon "
                           "as every lease has its update (default 10)")
    init.add_argument("--windows", type=_positive_int, default=None,
                      help="stop criterion: `up` stops after this window unless given --windows (default: none)")
    init.add_argument("--min-updates", type=int, default=1)
    init.add_argument("--rule", default="centered_clip", choices=AGGREGATION_RULES, help="aggregation rule")
    init.add_argument("--optimizer", default="diloco", choices=OUTER_OPTIMIZERS, help="outer optimizer")
    init.add_argument("--outer-lr", type=float, default=0.7)
    init.add_argument("--inner-steps", type=int, default=0, help="inner steps per window (0: the workload's)")
    init.add_argument("--codec", default="none", choices=CODECS)
    init.add_argument("--audit", action="store_true", help="validators re-run every update's training")
    init.add_argument("--audit-rate", type=float, default=0.0,
                      help="audit this share of certified updates after the fact instead (implies --audit)")
    init.add_argument("--audit-segments", type=int, default=0,
                      help="replay one of this many committed segments per audit (needs --audit-rate, "
                           "--inner-steps)")
    init.add_argument("--loss-check", type=int, default=0, metavar="SAMPLES",
                      help="reject updates that do not lower the loss on this many of their samples")
    init.add_argument("--norm-ratio", type=float, default=None,
                      help="reject an update whose norm exceeds this many times the cohort's median norm "
                           "(default 10; 0: off; cohort screening, spec/protocol.md §6)")
    init.add_argument("--norm-mads", type=int, default=None,
                      help="widen the norm bound to the cohort's spread of norms to this power when that is above "
                           "--norm-ratio (default 6; 0: the fixed ratio alone; spec/protocol.md §6)")
    init.add_argument("--min-cosine", type=float, default=None,
                      help="reject an update whose cosine to the cohort's centre is below this (default -1: off)")
    init.add_argument("--overlap", type=int, default=0, choices=(0, 1, 2),
                      help="trainers start the next window as soon as they have published one, training from a "
                           "head up to this many windows older, applied one window late (spec/protocol.md §5.2)")
    # Differential privacy (spec/protocol.md §10): every trainer trains with DP-SGD, the chain keeps its epsilon.
    init.add_argument("--dp-epsilon", type=float, default=None, metavar="BUDGET",
                      help="train with DP-SGD: each trainer's epsilon budget over the revision (needs "
                           "--inner-steps, --dp-sample-rate and a torch workload; the [dp] extra)")
    init.add_argument("--dp-noise-multiplier", type=float, default=None, metavar="SIGMA",
                      help="DP-SGD's noise multiplier (default: the smallest that fits --dp-epsilon over --windows "
                           "x --inner-steps steps)")
    init.add_argument("--dp-max-grad-norm", type=float, default=None, metavar="C",
                      help="DP-SGD's per-sample gradient clipping norm (default 1.0)")
    init.add_argument("--dp-delta", type=float, default=None, help="the delta of (epsilon, delta)-DP (default 1e-5)")
    init.add_argument("--dp-sample-rate", type=float, default=None, metavar="Q",
                      help="DP-SGD's Poisson sampling rate: each leased sample's chance to be in a step's batch")
    init.add_argument("--private-data", action="store_true",
                      help="admit trainers that train on data only they hold (manifest private_data; "
                           "spec/protocol.md §10); give each its file with --data or the data key of its node.toml "
                           "(it must then be a late joiner: a genesis-roster trainer never joins as private)")
    init.add_argument("--unauditable-trainers", action="store_true",
                      help="with audits, admit trainers whose training cannot be replayed, e.g. browser peers "
                           "(manifest unauditable_trainers; spec/protocol.md §6.4): their updates get screening "
                           "and the loss check but no recomputation audit")
    init.add_argument("--data", action="append", default=[], metavar="TRAINER=PATH",
                      help="trainer TRAINER (e.g. trainer-1) trains on the .npz file PATH (arrays x and y) that only "
                           "it holds, and joins instead of being in the genesis roster; implies --private-data; "
                           "repeat for each such trainer")
    init.add_argument("--base-port", type=int, default=7100, help="first TCP port of the local fleet")
    up = subparsers.add_parser("up", help="start an experiment's fleet as local processes (Ctrl-C stops it)")
    up.add_argument("directory", type=Path)
    up.add_argument("--windows", type=_positive_int, default=None,
                    help="certify this many more windows, then stop (default: experiment.toml's windows, the "
                         "window to stop after, if it has one; else until Ctrl-C)")
    status = subparsers.add_parser("status", help="an experiment's nodes and its latest head")
    status.add_argument("directory", type=Path)


def run(args: Any) -> int:
    if args.command == "init":
        from peerloom.core.config_checks import TableError

        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # a workload module next to the user, as `up` runs the nodes
        try:
            experiment = _experiment_from(args)
        except (TypeError, ValueError) as exc:
            raise TableError(str(exc)) from None  # one line from the CLI, exit 2
        root = experiment.write(args.directory)
        print(f"wrote {root}: {len(experiment.node_names())} nodes; start them with `peerloom up {root}`")
        return 0
    if args.command == "up":
        return run_up(args.directory, windows=args.windows)
    print("\n".join(status_lines(args.directory)))
    return 0


def _positive_int(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _node_options(options: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """`Experiment.node_options` as plain dicts (node name -> config keys), copied."""
    return {name: dict(keys) for name, keys in options.items()}


def _trainer_paths(paths: Mapping[str, str]) -> dict[str, str]:
    """`Experiment.trainer_data` as a plain dict (trainer name -> data path), copied."""
    return dict(paths)


def _trainer_data(items: list[str]) -> dict[str, str]:
    """``--data TRAINER=PATH`` arguments as trainer name -> absolute path (the node reads it from its own
    directory). ValueError for one without ``=``."""
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--data {item!r}: must be TRAINER=PATH, e.g. trainer-1=data/part1.npz")
        out[name] = str(Path(path).resolve())
    return out


def _experiment_from(args: Any) -> Experiment:
    return Experiment(
        workload=args.workload, name=args.name, trainers=args.trainers, validators=args.validators,
        reducers=args.reducers, shards=args.shards, seed=args.seed, window_s=args.window_s,
        min_updates=args.min_updates, aggregation=args.rule, outer_optimizer=args.optimizer,
        outer_lr=args.outer_lr, inner_steps=args.inner_steps, codec=args.codec,
        audit=args.audit or args.audit_rate > 0, base_port=args.base_port, windows=args.windows,
        trainer_data=_trainer_data(args.data),
        manifest_options={**{k: v for k, v in (("audit_rate", args.audit_rate),
                                               ("audit_segments", args.audit_segments),
                                               ("loss_check_samples", args.loss_check),
                                               ("overlap", args.overlap),
                                               ("private_data", args.private_data or bool(args.data)),
                                               ("unauditable_trainers", args.unauditable_trainers)) if v},
                          **_privacy_option(args),
                          **{k: v for k, v in (("norm_ratio", args.norm_ratio), ("norm_mads", args.norm_mads),
                                                ("min_cosine", args.min_cosine))
                             if v is not None}})


DP_OPTIONS = ("dp_epsilon", "dp_noise_multiplier", "dp_max_grad_norm", "dp_delta", "dp_sample_rate")


def _privacy_option(args: Any) -> dict[str, Any]:
    """``{"privacy": PrivacyParams}`` from `init`'s ``--dp-*`` options (spec/protocol.md §10), ``{}`` without
    them. Without ``--dp-noise-multiplier``, sigma is the smallest whose ``windows x inner_steps`` DP-SGD steps
    fit the budget (`peerloom.privacy.noise_multiplier_for`). ValueError (one line) for a ``--dp-*`` option
    without ``--dp-epsilon``, no ``--inner-steps``, no ``--dp-sample-rate``, no sigma and no ``--windows``, a
    value out of range, or no opacus (naming ``pip install 'peerloom[dp]'``)."""
    import warnings

    from peerloom.core.errors import DecodeError
    from peerloom.core.objects import PrivacyParams
    from peerloom.privacy import PrivacyUnavailable, noise_multiplier_for, require_opacus

    given = [f"--{name.replace('_', '-')}" for name in DP_OPTIONS if getattr(args, name, None) is not None]
    if not given:
        return {}
    if args.dp_epsilon is None:
        raise ValueError(f"{', '.join(given)}: DP-SGD needs --dp-epsilon BUDGET (each trainer's epsilon budget)")
    if not args.inner_steps:
        raise ValueError("--dp-epsilon needs --inner-steps N > 0 (DP-SGD accounts a fixed number of steps per "
                         "window)")
    if args.dp_sample_rate is None:
        raise ValueError("--dp-epsilon needs --dp-sample-rate Q (each leased sample's chance to be in a DP-SGD "
                         "batch)")
    delta = 1e-5 if args.dp_delta is None else args.dp_delta
    clip = 1.0 if args.dp_max_grad_norm is None else args.dp_max_grad_norm
    try:
        require_opacus()
        sigma = args.dp_noise_multiplier
        if sigma is None:
            if args.windows is None:
                raise ValueError("--dp-epsilon without --dp-noise-multiplier needs --windows N (sigma is chosen so "
                                 "that N x --inner-steps DP-SGD steps fit the budget); or give "
                                 "--dp-noise-multiplier SIGMA")
            with warnings.catch_warnings():  # opacus on orders at the edge of its range: not the user's concern
                warnings.simplefilter("ignore")
                sigma = noise_multiplier_for(epsilon=args.dp_epsilon, delta=delta, sample_rate=args.dp_sample_rate,
                                             steps=args.windows * args.inner_steps)
        return {"privacy": PrivacyParams(noise_multiplier=float(sigma), max_grad_norm=float(clip),
                                         delta=float(delta), sample_rate=float(args.dp_sample_rate),
                                         epsilon_budget=float(args.dp_epsilon))}
    except (PrivacyUnavailable, DecodeError) as exc:
        raise ValueError(str(exc)) from None


def _unused_ports(count: int) -> list[int]:
    """`count` distinct ports free on 127.0.0.1 now, drawn below the kernel's ephemeral range: the nodes bind
    them only at `up`, and a port from that range (what binding port 0 gives) can meanwhile become the local
    end of some outgoing connection ("Address already in use")."""
    import random
    import socket

    low = 32768  # Linux's default ip_local_port_range starts here
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < count:
        port = rng.randrange(1025, max(low, 2048))
        if port in ports:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
    return ports

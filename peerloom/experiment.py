"""Experiments as directories: the public way to set up a fleet (`peerloom init`, `up`, `status`; issue 17).

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

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from peerloom.core.objects import AGGREGATION_RULES, CODECS, OUTER_OPTIMIZERS, Manifest, Revision

LAYOUT_FILE = "experiment.toml"
# Manifest fields an Experiment sets itself (the rest may come from `manifest_options`).
MANIFEST_FROM_EXPERIMENT = frozenset({
    "experiment", "workload", "workload_seed", "schema", "shards", "validators", "quorum", "window_s",
    "min_updates", "max_capacity", "aggregation", "outer_optimizer", "outer_lr", "inner_steps", "codec",
    "audit", "chunk_size", "genesis_params", "genesis_params_digest", "roster"})
ROLES = ("validator", "reducer", "trainer")


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value!r}")


@attrs.frozen(kw_only=True)
class Experiment:
    """What to train, by whom, and how (spec/protocol.md). Every field but `workload` has a default.

    `late_joiners` more trainers get keys and configs but are not in the genesis roster: they ask to join
    when started (spec/protocol.md §5). `manifest_options` sets any other `Manifest` field (screening
    thresholds, `lease_s`, `idle_windows`, ...; ValueError for an unknown or derived one);
    `node_options` adds keys to a node's config by node name (see `peerloom.node`: `behaviour`,
    `threads`, `stop_after_window`, `device`, ...), checked when the node starts. `base_port` 0 picks free
    ports when the directory is written.

    `trainers`, `validators` and `reducers` are process counts; the validators' quorum is the Byzantine
    quorum ``floor(2n/3) + 1`` (spec/agreement.md §2). `shards` is how many data shards the workload is cut
    into (default twice the trainers). `window_s` is each window's collection time in seconds. The rule,
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
    manifest_options: dict[str, Any] = attrs.field(factory=dict, converter=dict)
    node_options: dict[str, dict[str, Any]] = attrs.field(factory=dict, converter=dict)

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
        params = workload.initial_params(self.seed)
        genesis = to_safetensors(params)
        root.mkdir(parents=True, exist_ok=True)
        authority = generate_identity()
        save_identity(authority, root / "authority.key")
        nodes = []
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
            **self.manifest_options)
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
            config.update(self.node_options.get(node["name"], {}))
            (root / "nodes" / node["name"] / "node.toml").write_text(tomli_w.dumps(config))
        layout = {"experiment": attrs.asdict(self, filter=lambda a, v: v is not None), "authority":
                  authority.peer_id.to_text(), "dashboard": f"http://{http}/", "nodes": nodes}
        source = _import_root(self.workload)
        if source is not None:
            layout["pythonpath"] = str(source)  # where `up` finds the workload module, whatever its cwd
        (root / LAYOUT_FILE).write_text(tomli_w.dumps(layout))
        return root


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


def _peer(node: dict[str, str]) -> Any:
    from peerloom.core.identity import PeerId

    return PeerId.from_text(node["peer"])


class EventTail:
    """Reads the new JSON lines of a node's event log as they are written (from where the last read ended)."""

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

    def start(self, names: list[str] | None = None) -> None:
        """Start `names` (default: every node but the late joiners) as `python -m peerloom node`, trainers
        first (a validator opens window 1 as soon as it starts), in the current directory so a workload
        module there can be imported. A node's output is appended to its node.log."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        paths = (self.layout.get("pythonpath", ""), os.getcwd(), env.get("PYTHONPATH", ""))
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        chosen = [n for n in self.layout["nodes"] if (n["name"] in names if names is not None
                                                       else not n.get("late_joiner"))]
        for node in sorted(chosen, key=lambda n: n["role"] != "trainer"):
            directory = self.node_dir(node["name"])
            (directory / "port").unlink(missing_ok=True)
            with open(directory / "node.log", "ab") as log:
                self.processes[node["name"]] = subprocess.Popen(
                    [sys.executable, "-m", "peerloom", "node", "--config", str(directory / "node.toml")],
                    stdout=log, stderr=subprocess.STDOUT, env=env)
            (directory / "pid").write_text(f"{self.processes[node['name']].pid}\n")

    def wait_started(self, timeout_s: float = 60.0, names: list[str] | None = None) -> None:
        """Wait until every started node (or `names`) wrote its port. RuntimeError naming a node that exited
        (with its log's last line) or did not start in time."""
        deadline = time.monotonic() + timeout_s
        for name, process in self.processes.items():
            if names is not None and name not in names:
                continue
            port = self.node_dir(name) / "port"
            while not (port.exists() and port.read_text().strip()):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not start: {self.last_log_line(name)}")
                time.sleep(0.05)

    def last_log_line(self, name: str) -> str:
        log = self.node_dir(name) / "node.log"
        lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
        return lines[-1] if lines else "(no log)"

    def heads(self) -> list[dict[str, Any]]:
        """Every head line of the first validator's event log so far (certified or skipped)."""
        return [e for e in self.events().read() if e.get("event") == "head"]

    def events(self) -> EventTail:
        """A reader of the first validator's event log, from its start."""
        return EventTail(self.node_dir(self.layout["nodes"][0]["name"]) / "events.jsonl")

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


def run_up(directory: Path, *, windows: int | None = None, echo: Callable[[str], None] = print) -> int:
    """`peerloom up DIR`: start the fleet, print each window as it is certified, stop cleanly on Ctrl-C (or
    after `windows` certified windows). Returns the exit status: 0, or 1 when a node exited on its own."""
    fleet = Fleet.open(directory)
    revision = fleet.revision()
    echo(f"peerloom up: {revision.manifest.experiment}: {len(fleet.layout['nodes'])} nodes, workload "
         f"{revision.manifest.workload}, rule {revision.manifest.aggregation}; Ctrl-C stops them")
    fleet.start()
    status = 0
    try:
        fleet.wait_started()
        echo(f"dashboard: {fleet.layout['dashboard']}")
        seen, events = 0, fleet.events()
        while windows is None or seen < windows:
            for head in (e for e in events.read() if e.get("event") == "head"):  # only lines new since last time
                metrics = head.get("metrics", {})
                shown = "  ".join(f"{k.removeprefix('test_')} {v:.4f}" for k, v in sorted(metrics.items())
                                  if k.startswith("test_"))
                result = "skipped" if head.get("skipped") else f"{shown}  cohort {head.get('cohort')}"
                echo(f"window {head['window']:>4}  {result}")
                seen += 1
            exited = [n for n, p in fleet.processes.items() if p.poll() is not None]
            if exited:
                echo(f"{exited[0]} exited: {fleet.last_log_line(exited[0])}")
                status = 1
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        echo("stopping ...")
    finally:
        codes = fleet.stop()
    echo(f"stopped {len(codes)} nodes")
    return status


def status_lines(directory: Path) -> list[str]:
    """`peerloom status DIR`: one line per node (role, running or not, its latest head window) and the
    latest certified head's metrics."""
    from peerloom.adapters.database import DB_NAME, Database

    fleet = Fleet.open(directory)
    lines = [f"{fleet.layout['experiment']['name']}: workload {fleet.layout['experiment']['workload']}, "
             f"dashboard {fleet.layout['dashboard']}"]
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
                     f"head window {window:>4}  {node['listen']}")
    last = fleet.heads()
    if last:
        metrics = last[-1].get("metrics", {})
        lines.append(f"latest head: window {last[-1]['window']}, " +
                     ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items())))
    return lines


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
    init.add_argument("--window-s", type=float, default=10.0, help="window collection time, seconds")
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
    init.add_argument("--base-port", type=int, default=7100, help="first TCP port of the local fleet")
    up = subparsers.add_parser("up", help="start an experiment's fleet as local processes (Ctrl-C stops it)")
    up.add_argument("directory", type=Path)
    up.add_argument("--windows", type=int, default=None, help="stop after this many windows (default: never)")
    status = subparsers.add_parser("status", help="an experiment's nodes and its latest head")
    status.add_argument("directory", type=Path)


def run(args: Any) -> int:
    if args.command == "init":
        from peerloom.core.tables import TableError

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


def _experiment_from(args: Any) -> Experiment:
    return Experiment(
        workload=args.workload, name=args.name, trainers=args.trainers, validators=args.validators,
        reducers=args.reducers, shards=args.shards, seed=args.seed, window_s=args.window_s,
        min_updates=args.min_updates, aggregation=args.rule, outer_optimizer=args.optimizer,
        outer_lr=args.outer_lr, inner_steps=args.inner_steps, codec=args.codec,
        audit=args.audit or args.audit_rate > 0, base_port=args.base_port,
        manifest_options={k: v for k, v in (("audit_rate", args.audit_rate), ("audit_segments", args.audit_segments),
                                            ("loss_check_samples", args.loss_check)) if v})


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

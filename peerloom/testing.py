"""Public building blocks for testing a deployment's settings: simulator scenarios, adversaries, invariants,
a deterministic cluster of real engines (`Cluster`) and Hypothesis strategies over fault schedules and
adversary mixes (spec/simulator.md §8); and an in-memory `EdgeView` (`InMemoryEdgeView`) to test an HTTP
client against the edge without a node (spec/design.md §6).

    from hypothesis import given
    from peerloom.testing import run_scenario, scenario, small_scenarios

    @given(small_scenarios())
    def test_my_settings_stay_safe(drawn):
        result = run_scenario({**drawn, "manifest": {**drawn["manifest"], "aggregation": "krum"}}, seed=1)
        assert all(result.summary["invariants"][n]["ok"] for n in result.checkers.SAFETY)

The strategies draw plain scenario fragments (the dicts a scenario TOML file holds) from small integers and
sampled names, so a failing schedule shrinks to few faults, early times and few adversaries. They need
Hypothesis (`pip install hypothesis`); the rest of this module does not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from peerloom.adapters.compute import ComputeExecutor
from peerloom.adapters.edge_view import ChainIndex, LeaseInfo, PeerInfo, SubmitResult, ViewIdentity
from peerloom.adapters.storage import ArtifactStore
from peerloom.core import events as ev
from peerloom.core.engine import Engine
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.identity import Identity, PeerId
from peerloom.core.objects import (
    AdmissionRevocation,
    Head,
    JoinRequest,
    QuorumCertificate,
    Revision,
    UpdateAnnouncement,
    make_artifact_ref,
)
from peerloom.sim.adversary import BEHAVIOURS, REDUCER_BEHAVIOURS, VALIDATOR_BEHAVIOURS, make_behaviour
from peerloom.sim.invariants import Checkers
from peerloom.sim.kernel import SimNode, Simulation, Trace
from peerloom.sim.network import Latency, LinkSpec
from peerloom.sim.scenario import Result, ScenarioError, load_scenario, run_scenario
from peerloom.simulate import shipped  # the names of the scenarios that ship with peerloom

try:
    from hypothesis import strategies as st
except ModuleNotFoundError:  # the strategies below need it; everything else works without
    st = None  # type: ignore[assignment]  # the module, or None where hypothesis is not installed

__all__ = ["BEHAVIOURS", "Checkers", "Cluster", "ClusterNode", "InMemoryEdgeView", "Result", "ScenarioError",
           "Simulation", "adversary_mixes", "fault_schedules", "load_scenario", "make_behaviour", "run_scenario",
           "scenario", "shipped", "small_scenarios"]


class ClusterNode:
    """One node of a `Cluster`: the simulator's node, its disk as `store` (an `ArtifactStore` on disk, or
    a `SimDisk`), and the heads it promoted as
    (virtual time, Head, QuorumCertificate). Setting `engine` swaps the engine the node runs (e.g. one
    restored from a snapshot, or built with another config) before its queued events reach it."""

    def __init__(self, node: SimNode) -> None:
        self.node = node
        self.heads: list[tuple[float, Head, QuorumCertificate]] = []

    name = property(lambda self: self.node.name)
    identity = property(lambda self: self.node.identity)
    roles = property(lambda self: self.node.roles)
    store = property(lambda self: self.node.disk)
    executor = property(lambda self: self.node.executor)

    @property
    def engine(self) -> Any:
        return self.node.engine

    @engine.setter
    def engine(self, engine: Engine) -> None:
        self.node.engine = engine


class _DurableStore(ArtifactStore):
    """An on-disk `ArtifactStore` with the simulator's disk interface (`sim/disk.py`): a record is durable as
    soon as it is written, so a crash loses none."""

    def write_pending(self, token: int, key: str, record: bytes) -> None:
        self.put_record(key, record)

    def sync(self, token: int) -> bool:
        return True

    def has_record(self, key: str) -> bool:
        return key in self.records()

    def crash(self, *, lose_unsynced: bool = True) -> int:
        return 0

    def wipe(self) -> None:
        raise ValueError("a Cluster node's store on disk is never wiped")


class _Logs(Trace):
    """Keeps engine `Log` effects as (time, node, event, fields) instead of writing JSON lines."""

    def __init__(self, logs: list[tuple[float, str, str, dict[str, Any]]]) -> None:
        super().__init__(None, level="log")
        self.logs = logs

    def emit(self, t: float, node: str, kind: str, fields: Any) -> None:
        if kind == "log":
            rest = dict(fields)
            self.logs.append((t, node, str(rest.pop("event")), rest))


class InMemoryEdgeView(ChainIndex, ViewIdentity):
    """A thread-safe in-memory `EdgeView` (adapters/edge_view.py) for testing HTTP clients against a real
    `adapters.http_edge.EdgeServer` without a node: heads are added with `promote`, submissions are checked
    with `check_submission` (as a node would) and recorded in `updates` / `joins` / `revocations` /
    `rejected`; artifacts are files named by their hex id in `artifacts_dir`.
    """

    def __init__(self, *, identity_peer: PeerId, revision: Revision, registry: Any,
                 roles: Iterable[str] = ("validator",), artifacts_dir: Path, addresses: Sequence[str] = ()) -> None:
        super().__init__(revision)
        self._addresses = tuple(addresses)
        self._peer_id = identity_peer
        self._roles = frozenset(roles)
        self._revision = revision
        self._registry = registry
        self._dir = Path(artifacts_dir)
        self._dir.mkdir(parents=True, exist_ok=True)
        self._peers: list[PeerInfo] = []
        self.updates: list[tuple[UpdateAnnouncement, SignedEnvelope]] = []
        self.joins: list[tuple[PeerId, int]] = []
        self.revocations: list[AdmissionRevocation] = []
        self.rejected: list[str] = []

    # --- test controls ----------------------------------------------------------------------------

    def put_artifact(self, data: bytes, chunk_size: int | None = None) -> bytes:
        """Store `data` and return its artifact id in `chunk_size` chunks (default: the manifest's)."""
        digest = make_artifact_ref(data, chunk_size or self._revision.manifest.chunk_size).digest
        (self._dir / digest.hex()).write_bytes(data)
        return digest

    def add_peer(self, info: PeerInfo) -> None:
        with self._lock:
            self._peers.append(info)

    # --- EdgeView ---------------------------------------------------------------------------------

    def artifact_path(self, digest: bytes) -> Path | None:
        path = self._dir / digest.hex()
        return path if path.exists() else None

    def leases(self, peer: PeerId) -> LeaseInfo:
        return self.lease_info(self._revision, peer)

    def submit(self, envelope: bytes, artifact: bytes | None) -> SubmitResult:
        checked = self.check_submission(self._revision, envelope, artifact)
        if isinstance(checked, SubmitResult):
            with self._lock:
                self.rejected.append(checked.reason)
            return checked
        env, obj = checked
        if isinstance(obj, JoinRequest):
            with self._lock:
                self.joins.append((env.signer, obj.capacity))
        elif isinstance(obj, AdmissionRevocation):
            with self._lock:
                self.revocations.append(obj)
        else:
            assert artifact is not None
            self.put_artifact(artifact, obj.delta.chunk_size)
            with self._lock:
                self.updates.append((obj, env))
        return SubmitResult(accepted=True, envelope_id=env.id)

    def peers(self) -> Sequence[PeerInfo]:
        with self._lock:
            return list(self._peers)

    def addresses(self) -> Sequence[str]:
        return self._addresses


class Cluster:
    """A few real engines on the simulator (`sim/kernel.py`) with a plain network: every message arrives
    `latency_s` after it is sent, records are durable once written (a crash loses none), a task reports
    back `task_s[kind]` after it starts on its node's one compute queue, a hung-up link stays down. For
    h11/aioquic-style tests of whole engines: add nodes, `connect` them, `start()`, then
    `run_until(done, max_time=...)`. `logs` holds every Log effect as (time, node, event, fields).
    `engine_options` are `EngineConfig` fields given to every engine (e.g. ``{"keep_windows": 1}``)."""

    def __init__(self, revision: Revision, *, seed: int = 0, latency_s: float = 0.005, persist_s: float = 0.001,
                 task_s: dict[str, float] | None = None, engine_options: dict[str, Any] | None = None) -> None:
        self.revision = revision
        self.seed = seed
        self.logs: list[tuple[float, str, str, dict[str, Any]]] = []
        self.nodes: dict[str, ClusterNode] = {}
        self._latency_s, self._persist_s, self._task_s = latency_s, persist_s, task_s
        self._engine_options = dict(engine_options or {})
        self.sim: Simulation | None = None  # built with the first node's workload

    @property
    def now(self) -> float:
        return self.sim.now if self.sim is not None else 0.0

    def _simulation(self, workload: Any, shards: list[list[int]]) -> Simulation:
        if self.sim is None:
            self.sim = Simulation(self.revision, seed=self.seed, workload=workload, shards=shards,
                                  default_link=LinkSpec(latency=Latency(median_s=self._latency_s)),
                                  task_s=self._task_s, persist_s=self._persist_s, lose_unsynced=False,
                                  detect_s=0.0, redial_s=None, trace=_Logs(self.logs),
                                  engine_options=self._engine_options)
            self.sim.observers.append(self)
        return self.sim

    def add_node(self, name: str, identity: Identity, roles: Iterable[str], store_dir: Path | None,
                 workload: Any, shards: list[list[int]], *, compute: str = "numpy") -> ClusterNode:
        """A node with its own store: an `ArtifactStore` in `store_dir`, or in memory (a `SimDisk`) for None;
        `compute` is its backend for screening and reduction (numpy or torch)."""
        sim = self._simulation(workload, shards)
        first, *more = sorted(roles)
        store = None if store_dir is None else _DurableStore(store_dir, chunk_size=self.revision.manifest.chunk_size)
        # A _DurableStore (an ArtifactStore with SimDisk's methods) stands in for the SimDisk that add_node takes;
        # ComputeExecutor takes either (its `Store` Protocol).
        node = sim.add_node(name, first, identity=identity, extra_roles=more, compute=compute,
                            disk=store)  # type: ignore[arg-type]  # see above
        if workload is not sim.workload or shards is not sim.shards:
            node.executor = ComputeExecutor(
                node.disk, self.revision.manifest, workload, shards, compute=compute)
        self.nodes[name] = ClusterNode(node)
        return self.nodes[name]

    def start(self) -> None:
        assert self.sim is not None, "add nodes first"
        self.sim.start()

    def connect(self, a: str, b: str) -> None:
        """Link `a` and `b`: connected now if both run, and again whenever both run after a restart."""
        assert self.sim is not None
        self.sim.link(a, b)

    def crash(self, name: str) -> None:
        """Kill a node (its disk survives); its peers see the connections drop at once."""
        assert self.sim is not None
        self.sim.crash(name)

    def restart(self, name: str, links: Iterable[str] = (), *, engine: Engine | None = None) -> None:
        """Boot a crashed (or not yet started) node and connect it to its links plus `links`; `engine`
        replaces the fresh engine it would build (e.g. `Engine.restore` of a snapshot)."""
        sim = self.sim
        assert sim is not None
        for other in links:
            sim.adjacent[name].add(other)
            sim.adjacent[other].add(name)
        node = sim.nodes[name]
        factory = node.engine_factory
        if engine is not None:
            node.engine_factory = lambda *args, **kwargs: engine
        try:
            sim.restart(name)
        finally:
            node.engine_factory = factory

    def feed(self, name: str, event: ev.Event) -> None:
        """Feed node `name`'s engine one event by hand, through its driver (which executes the effects)."""
        assert self.sim is not None
        self.sim.feed(name, event)

    def run_until(self, done: Callable[[Cluster], bool], *, max_time: float) -> bool:
        """Process events in time order until `done(self)` or virtual time `max_time`; True iff done."""
        assert self.sim is not None
        return self.sim.run(until=max_time, stop=lambda _sim: done(self))

    # simulator observer: heads as (time, Head, QuorumCertificate) per node
    def on_head(self, sim: Simulation, node: SimNode, head: Head, cert: QuorumCertificate) -> None:
        self.nodes[node.name].heads.append((sim.now, head, cert))

    def on_tick(self, sim: Simulation) -> None:
        pass

    def on_validator_message(self, sim: Simulation, node: SimNode, data: bytes) -> None:
        pass


def scenario(name: str, **overrides: Any) -> dict[str, Any]:
    """A shipped scenario as a dict, with top-level keys replaced by `overrides` (e.g. ``stop_window=3``).
    FileNotFoundError for an unknown name."""
    path = resources.files("peerloom.sim") / "scenarios" / f"{name}.toml"
    if not path.is_file():
        raise FileNotFoundError(2, f"no shipped scenario {name!r} ({', '.join(shipped())})", name)
    return {**load_scenario(path), **overrides}


def _strategy(fn: Any) -> Any:
    if st is None:
        def missing(*args: Any, **kwargs: Any) -> Any:
            raise ModuleNotFoundError("peerloom.testing strategies need hypothesis: pip install hypothesis",
                                      name="hypothesis")
        missing.__doc__ = fn.__doc__
        return missing
    return st.composite(fn)


TRAINER_ATTACKS = ("sign-flip", "sign-flip-scale", "scaling", "gaussian-noise", "alie", "ipm", "free-rider",
                   "replay", "lease-squatting")


def _names(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


@_strategy
def fault_schedules(draw: Any, *, validators: int, trainers: int, reducers: int = 1,
                    heal_at: float = 20.0, max_faults: int = 4) -> list[dict[str, Any]]:
    """Faults at whole seconds in [1, heal_at), then one heal at `heal_at`: partitions (symmetric among
    validators, asymmetric anywhere), crashes with restarts (trainers with or without disk, validators
    always with theirs), clogging and swizzle-clogging."""
    vals, trs, reds = _names("v", validators), _names("t", trainers), _names("r", reducers)
    everyone = vals + trs + reds
    times = st.integers(1, max(1, int(heal_at) - 1)).map(float)
    partition = st.builds(
        lambda t, cut: {"at": t, "kind": "partition", "groups": [vals[:cut], vals[cut:]]},
        times, st.integers(1, max(1, validators - 1)))
    block = st.builds(lambda t, a, b: {"at": t, "kind": "block", "from": a, "to": b}, times,
                      st.lists(st.sampled_from(everyone), min_size=1, max_size=2, unique=True),
                      st.lists(st.sampled_from(everyone), min_size=1, max_size=2, unique=True))
    crash_trainer = st.builds(
        lambda t, n, keep, back: {"at": t, "kind": "crash", "nodes": [n], "keep_disk": keep, "restart_after_s": back},
        times, st.sampled_from(trs), st.booleans(), st.integers(1, 8).map(float))
    crash_validator = st.builds(
        lambda t, n, back: {"at": t, "kind": "crash", "nodes": [n], "keep_disk": True, "restart_after_s": back},
        times, st.sampled_from(vals), st.integers(1, 8).map(float))
    clog = st.builds(lambda t, n, d: {"at": t, "kind": "clog", "nodes": [n], "duration_s": d},
                     times, st.sampled_from(everyone), st.integers(1, 6).map(float))
    swizzle = st.builds(lambda t, d: {"at": t, "kind": "swizzle", "nodes": vals + reds, "duration_s": d},
                        times, st.integers(1, 6).map(float))
    faults = draw(st.lists(st.one_of(partition, block, crash_trainer, crash_validator, clog, swizzle),
                           max_size=max_faults))
    return [*sorted(faults, key=lambda f: f["at"]), {"at": heal_at, "kind": "heal"}]


@_strategy
def adversary_mixes(draw: Any, *, validators: int, trainers: int) -> list[dict[str, Any]]:
    """Named Byzantine behaviours: fewer than n/3 validators, at most 30% of trainers, maybe the reducer."""
    mix: list[dict[str, Any]] = []
    max_bad_validators = (validators - 1) // 3
    for behaviour in draw(st.lists(st.sampled_from(VALIDATOR_BEHAVIOURS), max_size=max_bad_validators)):
        mix.append({"behaviour": behaviour, "count": 1})
    for behaviour in draw(st.lists(st.sampled_from(TRAINER_ATTACKS), max_size=max(0, (3 * trainers) // 10))):
        mix.append({"behaviour": behaviour, "count": 1})
    if draw(st.booleans()):
        mix.append({"behaviour": draw(st.sampled_from(REDUCER_BEHAVIOURS)), "count": 1})
    return mix


@_strategy
def small_scenarios(draw: Any, *, heal_at: float = 20.0) -> dict[str, Any]:
    """A whole small scenario (4 validators, 1 reducer, 6 trainers, synthetic objective) with drawn faults
    and adversaries; the safety phase ends at `heal_at`."""
    validators, trainers = 4, 6
    return {
        "name": "hypothesis",
        "duration_s": heal_at + 20.0,
        "workload": {"name": "synthetic", "dim": 8},
        "roles": {"validators": validators, "reducers": 1, "trainers": trainers},
        "manifest": {"window_s": 3.0, "min_updates": 2, "shards": trainers, "aggregation": "median"},
        "compute": {"train": 0.4, "jitter": 0.2},
        "network": {"default": {"latency": {"dist": "lognormal", "median_s": 0.01, "sigma": 0.5},
                                "loss": draw(st.sampled_from([0.0, 0.0, 0.01]))}},
        "faults": draw(fault_schedules(validators=validators, trainers=trainers, heal_at=heal_at)),
        "adversaries": draw(adversary_mixes(validators=validators, trainers=trainers)),
        "trace": {"level": "heads"},
    }

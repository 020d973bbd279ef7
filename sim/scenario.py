"""Scenarios: a TOML file describes a whole run (spec/simulator.md §5); `run_scenario` executes it.

A scenario names roles and counts, manifest parameters, the workload, the network (a default link class
and overrides per role pair), compute times, faults at given times, random churn, adversaries and the
phases: faults happen before `liveness.heal_at` (the safety phase); after it the network is healed and
honest validators must certify `liveness.min_windows` windows within `liveness.bound_s` (the liveness
phase). The run ends at `duration_s` of virtual time or once honest validators reach `stop_window`.
"""

from __future__ import annotations

import time
import tomllib
from collections.abc import Callable, Mapping
from functools import partial
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import IO, Any

import attrs

from peerloom.backends.numpy.tensors import schema_of, tensor_digest, to_safetensors
from peerloom.core.config_checks import TableError, check_keys, typed
from peerloom.core.errors import DecodeError
from peerloom.core.objects import Manifest, Revision, make_artifact_ref

from .adversary import SYBIL_BEHAVIOURS, make_behaviour, role_of_behaviour
from .invariants import Checkers
from .kernel import Simulation, Trace, sim_identity
from .network import LinkSpec

ROLE_PREFIX = {"validator": "v", "reducer": "r", "trainer": "t"}
FAULT_KINDS = ("partition", "block", "heal", "crash", "restart", "leave", "join", "clog", "swizzle")
# [manifest] keys handed to core Manifest as they are (spec/simulator.md §5), with their types.
MANIFEST_PASSTHROUGH = {"quarantine_strikes": int, "strike_windows": int, "quarantine_windows": int,
                        "norm_ratio": float, "min_cosine": float, "max_update_norm": float, "lease_s": float,
                        "outer_optimizer": str, "outer_momentum": float, "inner_steps": int,
                        "audit": bool, "audit_min_cosine": float, "idle_windows": int,
                        "unproven_share": float, "max_joins": int, "audit_rate": float, "audit_segments": int,
                        "loss_check_samples": int, "loss_min_drop": float, "norm_mads": int}
TOP_KEYS = {"name", "description", "duration_s", "stop_window", "workload", "roles", "manifest", "compute",
            "network", "faults", "churn", "adversaries", "liveness", "engine", "disk", "trace"}


class ScenarioError(ValueError):
    """The scenario file is malformed (unknown key, bad value)."""


@attrs.define
class Result:
    summary: dict[str, Any]
    sim: Simulation
    checkers: Checkers
    loss: list[tuple[float, int, float]]  # (time, window, test loss) of each final head

    @property
    def ok(self) -> bool:
        return self.checkers.ok


# The scalar keys of each table and their types, checked before anything is built, so that a wrong type
# gets "must be an integer" naming the key (spec/simulator.md §5).
SCALARS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "scenario": {"name": str, "description": str, "duration_s": float, "stop_window": int},
    "roles": {"validators": int, "reducers": int, "trainers": int},
    "manifest": {"window_s": float, "min_updates": int, "quorum": int, "shards": int, "aggregation": str,
                 "max_capacity": int, "chunk_size": int, "outer_lr": float, **MANIFEST_PASSTHROUGH},
    "workload": {"name": str, "seed": int, "samples_per_shard": int, "dim": int, "a_min": float,
                 "data_noise": float, "grad_noise": float, "lr": float, "local_steps": int},
    "disk": {"persist_s": float, "lose_unsynced": bool},
    "liveness": {"heal_at": float, "bound_s": float, "min_windows": int, "max_skipped_run": int,
                 "honest_share": float},
    "churn": {"crash_rate_per_s": float, "restart_after_s": float, "disk_loss": float, "until": float,
              "start": float, "partition_rate_per_s": float, "partition_s": float},
    "faults": {"at": float, "kind": str, "keep_disk": bool, "duration_s": float, "until": float,
               "restart_after_s": float, "signed": bool, "linger_s": float},
    "adversaries": {"behaviour": str, "count": int, "fraction": float, "join_at": float},
}


def load_scenario(path: str | Path | Traversable) -> dict[str, Any]:
    """Read a scenario TOML file (a path, or a shipped scenario from `importlib.resources`). ScenarioError
    for invalid TOML; OSError if unreadable. The scenario's name defaults to the file's stem."""
    path = Path(path) if isinstance(path, str) else path
    with path.open("rb") as fh:
        try:
            data = tomllib.load(fh)
        except tomllib.TOMLDecodeError as exc:
            raise ScenarioError(f"invalid TOML: {exc}") from None
    data.setdefault("name", path.name.removesuffix(".toml"))
    return data


def _check_keys(d: Mapping[str, Any], allowed: set[str], where: str) -> None:
    if not isinstance(d, Mapping):
        raise ScenarioError(f"{where} must be a table, got {d!r}")
    try:
        check_keys(d, allowed, where if where != "scenario" else "")
    except TableError as exc:
        raise ScenarioError(str(exc)) from None


def _check_types(scenario: Mapping[str, Any]) -> None:
    """ScenarioError naming the first scalar of a known table whose value has the wrong type."""
    try:
        for table, keys in SCALARS.items():
            found = scenario if table == "scenario" else scenario.get(table, {})
            tables = found if isinstance(found, list) else [found]
            for item in tables:
                if not isinstance(item, Mapping):
                    raise ScenarioError(f"{table} must be a table, got {item!r}")
                for key, types in keys.items():
                    typed(item, key, types, where="" if table == "scenario" else table)
        for key, value in scenario.get("compute", {}).items():
            typed({key: value}, key, float, where="compute")
    except TableError as exc:
        raise ScenarioError(str(exc)) from None


def build_workload(spec: Mapping[str, Any], num_shards: int) -> tuple[Any, list[list[int]], list[int]]:
    """(workload, shard -> sample indices, samples per shard) for the scenario's [workload] table."""
    name = spec.get("name", "synthetic")
    seed = int(spec.get("seed", 0))
    if name == "synthetic":
        from peerloom.backends.synthetic import QuadraticWorkload

        per = int(spec.get("samples_per_shard", 8))
        options = {k: spec[k] for k in ("dim", "a_min", "data_noise", "grad_noise", "lr", "local_steps")
                   if k in spec}
        workload = QuadraticWorkload(seed, num_train=per * num_shards, **options)
        shards = [list(range(s * per, (s + 1) * per)) for s in range(num_shards)]
        return workload, shards, [per] * num_shards
    if name == "digits":
        from peerloom.backends.registry import build_workload as build

        workload, shards = build("digits-mlp", seed, num_shards)
        return workload, shards, [len(s) for s in shards]
    raise ScenarioError(f"unknown workload {name!r} (synthetic or digits)")


def _link_specs(net: Mapping[str, Any]) -> tuple[LinkSpec, list[tuple[frozenset[str], LinkSpec]]]:
    _check_keys(net, {"default", "links", "redial_s", "detect_s"}, "network")
    default = LinkSpec.from_dict(net.get("default", {}))
    overrides = []
    for item in net.get("links", []):
        between = item.get("between")
        if not (isinstance(between, list) and len(between) == 2):
            raise ScenarioError("network.links entries need between = [role, role]")
        overrides.append((frozenset(between), LinkSpec.from_dict(item, default)))
    return default, overrides


def run_scenario(scenario: Mapping[str, Any], *, seed: int, trace_out: IO[str] | None = None,
                 trace: bool = True, stop_on_violation: bool = True, engine_factories: Mapping[str, Any] | None = None,
                 behaviours: Mapping[str, Any] | None = None,
                 on_window: Callable[[int, float], None] | None = None) -> Result:
    """Build and run one scenario with one master seed. `trace_out` receives the JSONL trace.

    `engine_factories` / `behaviours` map node names to an engine factory / a Behaviour, overriding
    the scenario (tests use them to plant a broken engine variant). `on_window(window, virtual_s)` is
    called as each window becomes final (progress for long runs).
    """
    wall0 = time.perf_counter()
    _check_keys(scenario, TOP_KEYS, "scenario")
    _check_types(scenario)
    roles = scenario.get("roles", {})
    _check_keys(roles, {"validators", "reducers", "trainers"}, "roles")
    n_val, n_red, n_tr = int(roles.get("validators", 4)), int(roles.get("reducers", 1)), int(roles.get("trainers", 4))
    m = scenario.get("manifest", {})
    _check_keys(m, {"window_s", "min_updates", "quorum", "shards", "aggregation", "max_capacity", "chunk_size",
                    "outer_lr", *MANIFEST_PASSTHROUGH}, "manifest")
    num_shards = int(m.get("shards", n_tr))
    workload, shards, sizes = build_workload(scenario.get("workload", {}), num_shards)
    wl_seed = int(scenario.get("workload", {}).get("seed", 0))
    params = workload.initial_params(wl_seed)
    genesis = to_safetensors(params)
    chunk_size = int(m.get("chunk_size", 16 * 1024))

    names = {role: [f"{ROLE_PREFIX[role]}{i}" for i in range(n)]
             for role, n in (("validator", n_val), ("reducer", n_red), ("trainer", n_tr))}
    ids = {name: sim_identity(seed, name) for role in names for name in names[role]}
    quorum = int(m.get("quorum", 2 * n_val // 3 + 1))
    authority = sim_identity(seed, "authority")
    try:
        passthrough = {k: MANIFEST_PASSTHROUGH[k](m[k]) for k in MANIFEST_PASSTHROUGH if k in m}
        manifest = Manifest(
            experiment=str(scenario.get("name", "sim")),
            workload=str(scenario.get("workload", {}).get("name", "synthetic")),
            workload_seed=wl_seed, schema=schema_of(params), shards=tuple(sizes),
            validators=tuple(ids[n].peer_id for n in names["validator"]), quorum=quorum,
            window_s=float(m.get("window_s", 5.0)), min_updates=int(m.get("min_updates", 1)),
            max_capacity=int(m.get("max_capacity", 4)), aggregation=str(m.get("aggregation", "mean")),
            outer_lr=float(m.get("outer_lr", 1.0)), chunk_size=chunk_size,
            genesis_params=make_artifact_ref(genesis, chunk_size), genesis_params_digest=tensor_digest(params),
            roster=tuple(sorted((ids[n].peer_id, 1) for n in names["trainer"])),
            # only the keys the scenario sets, so Manifest's defaults (DiLoCo's momentum...) stay in force
            **{"outer_optimizer": "fedavg", **passthrough})
    except (DecodeError, TypeError, ValueError) as exc:
        raise ScenarioError(f"manifest: {exc}") from exc
    revision = Revision.verify(manifest.seal(authority), authority.peer_id)

    compute = dict(scenario.get("compute", {}))
    jitter = float(compute.pop("jitter", 0.0))
    speed_sigma = float(compute.pop("speed_sigma", 0.0))
    net = scenario.get("network", {})
    default, overrides = _link_specs(net)
    disk = scenario.get("disk", {})
    _check_keys(disk, {"persist_s", "lose_unsynced"}, "disk")
    trace_cfg = scenario.get("trace", {})
    tracer = Trace(trace_out, level=str(trace_cfg.get("level", "log"))) if trace else None
    sim = Simulation(revision, seed=seed, workload=workload, shards=shards, default_link=default,
                     link_overrides=overrides, task_s=compute, compute_jitter=jitter, speed_sigma=speed_sigma,
                     persist_s=float(disk.get("persist_s", 0.001)), lose_unsynced=bool(disk.get("lose_unsynced", True)),
                     detect_s=float(net.get("detect_s", 0.5)),
                     redial_s=None if net.get("redial_s", 5.0) is False else float(net.get("redial_s", 5.0)),
                     trace=tracer, engine_options=scenario.get("engine", {}))

    # adversaries: which nodes behave how (the first `count` nodes of the role, or extra Sybil nodes)
    assigned: dict[str, Any] = {}
    sybils: list[tuple[str, Any]] = []
    for adv in scenario.get("adversaries", []):
        _check_keys(adv, {"behaviour", "count", "fraction", "params", "nodes", "join_at"}, "adversaries")
        behaviour = str(adv["behaviour"])
        role = role_of_behaviour(behaviour)
        pool = names[role]
        count = int(adv["count"]) if "count" in adv else round(float(adv.get("fraction", 0.0)) * len(pool))
        if behaviour in SYBIL_BEHAVIOURS:
            base = len(sybils)
            sybils.extend((f"s{base + i}", adv) for i in range(count))
            continue
        chosen = list(adv.get("nodes", [])) or ([n for n in pool if n not in assigned][-count:] if count else [])
        for name in chosen:
            assigned[name] = make_behaviour(behaviour, **adv.get("params", {}))
    assigned.update(behaviours or {})
    factories = dict(engine_factories or {})

    for role in ("validator", "reducer", "trainer"):
        for name in names[role]:
            sim.add_node(name, role, identity=ids[name], behaviour=assigned.get(name),
                         genesis=genesis if role != "trainer" else None, engine_factory=factories.get(name))
    for name in names["trainer"]:
        for other in names["validator"] + names["reducer"]:
            sim.link(name, other)
    servers = names["validator"] + names["reducer"]
    for i, a in enumerate(servers):
        for b in servers[i + 1:]:
            sim.link(a, b)
    sim.start()

    def spawn(name: str, behaviour: Any = None) -> None:
        if name not in sim.nodes:
            sim.add_node(name, "trainer", behaviour=behaviour)
            for other in servers:
                sim.adjacent[name].add(other)
                sim.adjacent[other].add(name)
        sim.record(name, "join")
        sim.boot(name)

    for name, adv in sybils:
        sybil = make_behaviour(str(adv["behaviour"]), **adv.get("params", {}))
        sim.at(float(adv.get("join_at", 0.0)), partial(spawn, name, sybil))

    heal_at = _schedule_faults(sim, scenario.get("faults", []), names, spawn)
    _schedule_churn(sim, scenario.get("churn", {}), names, heal_at)

    live = scenario.get("liveness", {})
    _check_keys(live, {"heal_at", "bound_s", "min_windows", "max_skipped_run", "honest_share"}, "liveness")
    heal = float(live["heal_at"]) if "heal_at" in live else heal_at
    checkers = Checkers(heal_at=heal if "bound_s" in live else None, bound_s=live.get("bound_s"),
                        min_windows=int(live.get("min_windows", 1)), stop_on_violation=stop_on_violation,
                        on_final=on_window, max_skipped_run=live.get("max_skipped_run"),
                        honest_share=live.get("honest_share"))
    sim.observers.append(checkers)

    duration = float(scenario.get("duration_s", 60.0))
    stop_window = scenario.get("stop_window")
    honest_validators = [n for n in names["validator"] if sim.nodes[n].honest]

    def reached(s: Simulation) -> bool:
        return stop_window is not None and all(s.height(n) >= int(stop_window) for n in honest_validators)

    sim.run(until=duration, stop=reached)
    checkers.finish(sim)
    return Result(summary=_summary(scenario, sim, checkers, seed, time.perf_counter() - wall0), sim=sim,
                  checkers=checkers, loss=[(checkers.final_at[w], w, float(h.metrics.get("test_loss", float("nan"))))
                                           for w, h in sorted(checkers.final.items())])


def _nodes(sim: Simulation, spec: Any, names: Mapping[str, list[str]]) -> list[str]:
    """Node names from a list of names and role names ("validator" means every validator)."""
    items = spec if isinstance(spec, list) else [spec]
    out: list[str] = []
    for item in items:
        role = str(item).rstrip("s")
        out.extend(names[role] if role in names else [str(item)])
    for n in out:
        if n not in sim.nodes and not n.startswith(("j", "s")):
            raise ScenarioError(f"unknown node {n!r}")
    return out


def _schedule_faults(sim: Simulation, faults: list[Mapping[str, Any]], names: Mapping[str, list[str]],
                     spawn: Any) -> float | None:
    """Schedule each [[faults]] entry; returns the time of the last heal (end of the safety phase)."""
    last_heal = None
    for f in faults:
        _check_keys(f, {"at", "kind", "groups", "nodes", "from", "to", "keep_disk", "duration_s", "until",
                        "restart_after_s", "signed", "linger_s"}, "faults")
        kind, t = f.get("kind"), float(f.get("at", 0.0))
        if kind not in FAULT_KINDS:
            raise ScenarioError(f"unknown fault kind {kind!r}; known: {FAULT_KINDS}")
        if kind == "partition":
            groups = [_nodes(sim, g, names) for g in f["groups"]]
            sim.at(t, partial(sim.partition, groups))
        elif kind == "block":
            src, dst = _nodes(sim, f["from"], names), _nodes(sim, f["to"], names)
            sim.at(t, partial(sim.block, src, dst))
        elif kind == "heal":
            sim.at(t, sim.heal)
            last_heal = max(last_heal or t, t)
        elif kind == "crash":
            keep = bool(f.get("keep_disk", True))
            for n in _nodes(sim, f["nodes"], names):
                sim.at(t, partial(sim.crash, n, keep_disk=keep))
                if "restart_after_s" in f:
                    sim.at(t + float(f["restart_after_s"]), partial(sim.restart, n))
        elif kind == "restart":
            for n in _nodes(sim, f["nodes"], names):
                sim.at(t, partial(sim.restart, n))
        elif kind == "leave":
            signed, linger = bool(f.get("signed", True)), float(f.get("linger_s", 2.0))
            for n in _nodes(sim, f["nodes"], names):
                sim.at(t, partial(sim.leave, n, signed=signed, linger_s=linger))
        elif kind == "join":
            for n in f["nodes"]:
                sim.at(t, partial(spawn, str(n)))
        elif kind == "clog":
            nodes = _nodes(sim, f["nodes"], names)
            until = t + float(f.get("duration_s", 5.0))
            pairs = [(a, b) for a in nodes for b in sim.links_of(a)] + [(b, a) for a in nodes for b in sim.links_of(a)]
            sim.at(t, partial(sim.clog, pairs, until))
        elif kind == "swizzle":
            nodes = _nodes(sim, f.get("nodes", ["validator", "reducer"]), names)
            d = float(f.get("duration_s", 5.0))
            sim.at(t, partial(sim.swizzle, nodes, t, d))
    return last_heal


def _schedule_churn(sim: Simulation, churn: Mapping[str, Any], names: Mapping[str, list[str]],
                    heal_at: float | None) -> None:
    """Random crashes at `crash_rate_per_s` (Poisson, across the chosen roles) until `until` (default:
    the heal), each restarting `restart_after_s` later; a `disk_loss` fraction lose their disk. Random
    partitions of the validators and reducers at `partition_rate_per_s`, each healed `partition_s` later."""
    if not churn:
        return
    _check_keys(churn, {"crash_rate_per_s", "restart_after_s", "disk_loss", "roles", "until", "start",
                        "partition_rate_per_s", "partition_s"}, "churn")
    rng = sim.rngs["churn"]
    rate = float(churn.get("crash_rate_per_s", 0.0))
    until = float(churn.get("until", heal_at if heal_at is not None else 0.0))
    pool = [n for r in churn.get("roles", ["trainer"]) for n in names[r.rstrip("s")]]
    t = float(churn.get("start", 0.0))
    while rate > 0 and pool:
        t += rng.expovariate(rate)
        if t >= until:
            break
        victim = pool[rng.randrange(len(pool))]
        keep = rng.random() >= float(churn.get("disk_loss", 0.0))
        sim.at(t, partial(sim.crash, victim, keep_disk=keep))
        sim.at(t + float(churn.get("restart_after_s", 5.0)), partial(sim.restart, victim))
    # random partitions: a random split of the validators and reducers, healed `partition_s` later
    servers = names["validator"] + names["reducer"]
    rate, t = float(churn.get("partition_rate_per_s", 0.0)), float(churn.get("start", 0.0))
    while rate > 0 and len(servers) > 1:
        t += rng.expovariate(rate)
        if t >= until:
            break
        side = rng.sample(servers, rng.randrange(1, len(servers)))
        groups = [sorted(side), [n for n in servers if n not in side]]
        sim.at(t, partial(sim.partition, groups))
        sim.at(min(until, t + float(churn.get("partition_s", 5.0))), sim.heal)


def _summary(scenario: Mapping[str, Any], sim: Simulation, checkers: Checkers, seed: int,
             wall_s: float) -> dict[str, Any]:
    final = checkers.final
    return {
        "seed": seed,
        "scenario": scenario.get("name", ""),
        "nodes": len(sim.nodes),
        "sim_time_s": round(sim.now, 6),
        "wall_s": round(wall_s, 3),
        "events": sim.events,
        "windows": {"certified": sum(1 for h in final.values() if not h.skipped),
                    "skipped": sum(1 for h in final.values() if h.skipped)},
        "invariants": checkers.summary(),
        "trace_sha256": sim.trace.sha256() if sim.trace is not None else None,
        "network": {"messages": sim.network.messages, "dropped": sim.network.dropped,
                    "duplicated": sim.network.duplicated, "bytes": sum(sim.network.bytes.values())},
        "tasks": dict(sorted(sim.task_counts.items())),
        "final_metrics": dict(final[max(final)].metrics) if final else {},
    }

"""The smoke fleet over every transport (spec/transport.md §9): the same fleet (tests/node_cluster.py make_fleet: two
validators, two trainers, quorum 2) certifies its windows over tcp, http and memory, and over a mixed fleet
where half the nodes listen only on HTTP, with only the node configs' ``[transport]`` tables and bootstrap
addresses changed; each time `peerloom verify` accepts a validator's chain.

tcp, http and mixed run real `peerloom node` processes; memory runs the same configs as `NodeRuntime`s in
one trio run sharing one `MemoryNetwork` (the in-memory transport reaches only its own process)."""

from __future__ import annotations

from pathlib import Path

import pytest

from peerloom.adapters.memory import MemoryNetwork
from peerloom.node import build_runtime, load_config
from tests.node_cluster import Node, chain_windows, check_chain, make_fleet, run_fleet_until, run_runtimes_until

WINDOWS = 3  # certified windows each run must reach


def address_of(node: Node, kind: str) -> str:
    return {"tcp": f"/ip4/127.0.0.1/tcp/{node.port}", "http": f"http://127.0.0.1:{node.port}",
            "memory": f"memory://{node.name}"}[kind]


def configure(nodes: list[Node], kinds: dict[str, str]) -> None:
    """Rewrite each node's config to listen only on its kind (`kinds[name]`) and to dial its bootstrap
    peers at their own kind's address: the only change between runs."""
    by_port = {f"127.0.0.1:{n.port}": n for n in nodes}
    for node in nodes:
        config = dict(node.config)
        config.pop("listen")
        config["transport"] = {"kind": kinds[node.name], "listen": address_of(node, kinds[node.name])}
        config["bootstrap"] = [address_of(by_port[a], kinds[by_port[a].name]) for a in node.config["bootstrap"]]
        node.config = config
        node.write_config()


def transports_used(nodes: list[Node]) -> set[str]:
    return {e.get("transport") for n in nodes for e in n.events() if e.get("event") == "connected"}


def run_processes(nodes: list[Node]) -> None:
    run_fleet_until(nodes, lambda: min(len(chain_windows(n)) for n in nodes if n.role == "validator") >= WINDOWS,
                    90)


def run_in_process(nodes: list[Node]) -> None:
    network = MemoryNetwork()
    runtimes = [build_runtime(load_config(n.config_path), memory_network=network) for n in nodes]
    # the last head reaches the chain directory once durable: the validators' chain files are waited for too
    run_runtimes_until(
        runtimes, lambda: min(r.engine.head.window for r in runtimes if "validator" in r.engine.config.roles)
        >= WINDOWS and min(len(chain_windows(n)) for n in nodes if n.role == "validator") >= WINDOWS, 90)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tcp", "http", "memory", "mixed"])
def test_the_smoke_fleet_certifies_over_every_transport(tmp_path: Path, mode: str) -> None:
    nodes = make_fleet(tmp_path, validators=2, trainers=2, quorum=2, window_s=1.0)
    if mode == "mixed":  # validator-2 and trainer-2 are reachable only over HTTP
        kinds = {n.name: "http" if n.name.endswith("-2") else "tcp" for n in nodes}
    else:
        kinds = {n.name: mode for n in nodes}
    configure(nodes, kinds)
    if mode == "memory":
        run_in_process(nodes)
    else:
        run_processes(nodes)
    expected = {"mixed": {"tcp", "http"}}.get(mode, {mode})
    assert transports_used(nodes) == expected
    for node in nodes:
        if node.role == "validator":
            check_chain(node, WINDOWS)

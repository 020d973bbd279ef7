"""`peerloom node --config node.toml`: run one node from a config file until SIGTERM/SIGINT.

Config keys (TOML)::

    name = "trainer-1"                 # for logs
    roles = ["trainer"]                # any of trainer, reducer, validator
    key = "trainer-1.key"              # identity key file (created with mode 0600 if missing)
    manifest = "manifest.cbor"         # the signed revision manifest (a SignedEnvelope)
    authority = "12D3KooW..."          # peer id that must have signed the manifest
    store = "trainer-1/"               # artifact + record store directory
    listen = "127.0.0.1:0"             # host:port; port 0 picks a free port
    bootstrap = ["127.0.0.1:7001"]     # addresses to dial and keep dialing
    capacity = 1                       # declared capacity for leases (clamped by the manifest)
    port_file = "trainer-1/port"       # optional: where to write the bound port
    events = "trainer-1/events.jsonl"  # optional: structured event log
    stats = "trainer-1/stats.json"     # optional: counters written at shutdown
    threads = 1                        # compute threads (torch)
    stop_after_window = 20             # optional: open no window after this one

Relative paths are relative to the config file's directory.
"""

from __future__ import annotations

import json
import signal
import tomllib
from pathlib import Path
from typing import Any

import trio

from peerloom.adapters.compute import ComputeExecutor
from peerloom.adapters.keys import load_or_create_identity
from peerloom.adapters.runtime import NodeRuntime, RuntimeOptions
from peerloom.adapters.storage import ArtifactStore, atomic_write
from peerloom.backends.registry import build_workload
from peerloom.core.chain import encode_chain_entry
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.identity import PeerId
from peerloom.core.objects import Head, QuorumCertificate, Revision

REQUIRED = ("name", "roles", "key", "manifest", "authority", "store")


class ConfigError(ValueError):
    """The node config is missing a key or has a bad value; the message says which."""


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"address {text!r} must be host:port")
    return host, int(port)


def load_config(path: Path) -> dict[str, Any]:
    try:
        config = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    missing = [k for k in REQUIRED if k not in config]
    if missing:
        raise ConfigError(f"{path}: missing {', '.join(missing)}")
    base = path.parent
    for key in ("key", "manifest", "store", "port_file", "events", "stats"):
        if key in config:
            config[key] = base / config[key]
    return config


def write_chain_entry(chain_dir: Path, head: Head, cert: QuorumCertificate) -> None:
    """Append a certified head to a chain directory as ``<window>.cbor`` (canonical CBOR)."""
    chain_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(chain_dir / f"{head.window:06d}.cbor", encode_chain_entry(head, cert))


def run_node(config_path: Path) -> None:
    config = load_config(config_path)
    threads = int(config.get("threads", 1))
    import torch

    torch.set_num_threads(threads)
    identity = load_or_create_identity(config["key"])
    envelope = SignedEnvelope.from_bytes(Path(config["manifest"]).read_bytes())
    revision = Revision.verify(envelope, PeerId.from_text(config["authority"]))
    manifest = revision.manifest
    store = ArtifactStore(config["store"], chunk_size=manifest.chunk_size)
    workload, shards = build_workload(manifest.workload, manifest.workload_seed, len(manifest.shards))
    executor = ComputeExecutor(store, manifest, workload, shards)
    host, port = _address(config.get("listen", "127.0.0.1:0"))
    options = RuntimeOptions(listen_host=host, listen_port=port,
                             bootstrap=tuple(_address(a) for a in config.get("bootstrap", [])))
    chain_dir = Path(config["store"]) / "chain"
    atomic_write(Path(config["store"]) / "manifest.cbor", envelope.to_bytes())
    runtime = NodeRuntime(name=config["name"], identity=identity, revision=revision, roles=set(config["roles"]),
                          store=store, executor=executor, options=options, events_path=config.get("events"),
                          capacity=int(config.get("capacity", 1)), stop_after_window=config.get("stop_after_window"),
                          on_head=lambda h, c: write_chain_entry(chain_dir, h, c))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(runtime.run)
            if "port_file" in config:
                atomic_write(Path(config["port_file"]), f"{port}\n".encode())
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break

    try:
        trio.run(main)
    finally:
        if "stats" in config:
            sent, received = runtime.wire_bytes()
            stats = {"name": config["name"], "peer_id": identity.peer_id.to_text(), "bytes_sent": sent,
                     "bytes_received": received, "head_window": runtime.engine.head.window,
                     "counters": dict(runtime.engine.stats),
                     "rejected_by_reason": dict(runtime.engine.rejected_by_reason)}
            atomic_write(Path(config["stats"]), json.dumps(stats, indent=2).encode())

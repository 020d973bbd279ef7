"""`peerloom node --config node.toml`: run one node from a config file until SIGTERM/SIGINT.

Config keys (TOML)::

    name = "trainer-1"                 # for logs
    roles = ["trainer"]                # any of trainer, reducer, validator
    key = "trainer-1.key"              # identity key file (created with mode 0600 if missing)
    manifest = "manifest.cbor"         # the signed revision manifest (a SignedEnvelope)
    authority = "12D3KooW..."          # peer id that must have signed the manifest
    store = "trainer-1/"               # artifact + record store directory
    listen = "127.0.0.1:0"             # host:port of the TCP+Noise listener; port 0 picks a free port
                                       # (not with [transport] tables, which say where to listen instead)
    bootstrap = ["/ip4/127.0.0.1/tcp/7001", "http://127.0.0.1:8001"]  # addresses to dial and keep dialing:
                                       # /ip4/H/tcp/P, /ip6/H/tcp/P or H:P (tcp), http://H:P (the HTTP
                                       # transport), memory://NAME (same process); H an IP literal
    capacity = 1                       # declared capacity for leases (clamped by the manifest)
    port_file = "trainer-1/port"       # optional: where to write the bound port
    events = "trainer-1/events.jsonl"  # optional: structured event log
    stats = "trainer-1/stats.json"     # optional: counters written at shutdown
    threads = 1                        # compute threads (torch)
    device = "auto"                    # optional: where a torch workload trains and evaluates: cpu, cuda,
                                       # cuda:N, mps or auto (cuda if available, else mps if available, else
                                       # cpu); updates move to the CPU as float32 for hashing and encoding.
                                       # A device this machine lacks is a ConfigError naming it; a numpy
                                       # workload takes only cpu or auto (= cpu). Default: where the workload
                                       # factory put it (the CPU unless it chose a device)
    compute = "numpy"                  # optional: backend of screening, cohort screening, aggregation and the
                                       # outer step on validators and reducers: numpy or torch (needs torch).
                                       # Both give the same bytes, so a fleet may mix them. Default numpy
    compute_threads = 2                # optional: threads of those kernels (1 to 8; the same bytes on any
                                       # count, spec/design.md §5). Default: this machine's cores, at most 8
    stop_after_window = 20             # optional: open no window after this one
    keep_windows = 2                   # optional: artifacts (params, optimizer state, updates) are deleted
                                       # from the store this many heads after the window they served, all but
                                       # the current head's (spec/protocol.md §8.1), so the disk holds a few
                                       # windows' worth however long the run (at 100M parameters a small
                                       # fleet stores ~5 GB per window). Default 0: keep every artifact (any
                                       # head's weights can be exported)
    agreement_timeout_s = 2.0          # optional, validators: Tendermint's base timeout in seconds (a round
                                       # without a proposal or a quorum moves on after it, growing with the
                                       # round; spec/agreement.md). Default 2.0
    audit_worker = true                # optional, validators under sampled audits: run the audits on a second
                                       # worker thread with a workload instance of its own, beside the screens
                                       # and reductions (spec/protocol.md §6.3 "Scheduling"; one more model
                                       # in memory). Default true; false runs them between the other tasks
    workload = "mypkg.train:factory"   # optional: a user's workload factory (module:function) or a registry
                                       # name; default: the manifest's workload from the registry
    behaviour = "alie"                 # optional, trainers only: a Byzantine attack from backends.attacks.ATTACKS
                                       # (for demos and tests of the defences; default honest)
    log_format = "auto"                # auto (JSON lines unless stderr is a TTY), json or text
    log_level = "info"
    admission = "trainer-1/admission.cbor"  # optional, trainers only: this node's admission certificate (a
                                       # SignedEnvelope from `peerloom admit`), sent with its joins; needed
                                       # under a manifest with admission = "certificate" (spec/protocol.md §5)
    leave_on_exit = false              # optional, trainers only: on SIGTERM/SIGINT first leave the roster
                                       # (a signed leave, spec/protocol.md §5 "Leave"; it also withdraws a
                                       # join still pending), then shut down
    leave_grace_s = 30.0               # how long to wait for a head without this node before shutting
                                       # down anyway (seconds; a second signal stops at once)
    data = "trainer-1/data.npz"        # optional, nodes whose only role is trainer: train on data only this
                                       # node holds (spec/protocol.md §10), an .npz file with arrays x
                                       # (float, [n, ...] as the workload's inputs) and y (int64 [n]); needs a
                                       # manifest with private_data, and a trainer that joins (not one in the
                                       # manifest's genesis roster). Its joins say private, its leases are
                                       # sample counts of this data (`backends.sharding.private_shards_for`)
                                       # and it trains with a secret seed (`adapters.compute.private_seed`);
                                       # not with a trainer pool

    [http]                             # optional HTTP edge (aiohttp) for light peers and dashboards
    enabled = true
    listen = "127.0.0.1:8080"

    [discovery]                        # optional zeroconf (mDNS) on 127.0.0.1 only
    mdns = true

    [transport]                        # optional: where to listen for peers, by transport (spec/transport.md
    kind = "http"                      # §9): tcp, http (HTTP/1.1 WebSocket, passes HTTP-only proxies) or
    listen = "http://127.0.0.1:8001"   # memory (in-process fleets); listen defaults to 127.0.0.1:0 (tcp),
                                       # http://127.0.0.1:0 (http); memory needs memory://NAME. Several
                                       # listeners: [[transport]] tables, one per listener. Every node dials
                                       # tcp and http addresses whatever it listens on. dial_only = true
                                       # (no listen key): no listener for this table; a node whose every
                                       # table says so listens nowhere and only dials (`peerloom light`)

    [relay]                            # optional (spec/transport.md §12)
    enabled = true                     # relay for peers that cannot be dialed, on its own listener:
    listen = "/ip4/127.0.0.1/tcp/7100" # a direct address (default 127.0.0.1:0); limits, all
    reservation_s = 3600.0             # optional: a reservation's lifetime (renewed at half), a circuit's
    circuit_s = 3600.0                 # duration (s) and bytes (both ways), the most reservations, circuits
    circuit_bytes = 1073741824         # in all, and circuits to one reserved peer
    max_reservations = 128             # (adapters.relay.RelayLimits)
    max_circuits = 256
    max_circuits_per_reservation = 16
    max_reservations_per_ip = 8        # reservations made from one remote address
    window_s = 60.0                    # per period of this many seconds, bytes one circuit and one
    circuit_window_bytes = 268435456   # reservation's circuits together relay (beyond: they wait for the
    reservation_window_bytes = 536870912  # next period)
    via = ["/ip4/127.0.0.1/tcp/7100"]  # or, on a node that cannot be dialed: hold a reservation at each of
                                       # these relays and listen at "<relay>/p2p-circuit/<peer id>" there
                                       # (the first is the address the node advertises); without listen or
                                       # [transport] tables the node then listens nowhere directly
    only = false                       # true: dial nothing but circuit addresses (a network that lets
                                       # nothing through but the relays)

    [limits]                           # optional: connection limits (spec/transport.md §13 gives each
    max_pending = 64                   # default and why; adapters.limits.Limits lists every key): open_files,
    max_pending_per_ip = 8             # fd_reserve, max_inbound(_per_ip), max_pending(_per_ip),
    max_strangers = 32                 # max_peers(_per_ip), max_strangers, handshake_rate, handshake_burst,
    handshake_rate = 20.0              # handshake_start_s, http_header_timeout_s, max_edge_connections(_per_ip),
    protected_peers = ["12D3KooW..."]  # tracked_addresses, protected_peers (peer ids always known: reducers)

    [pool]                             # optional, trainers only: train on N processes as one peer
    ranks = 2                          # (torch.distributed; spec/pools.md): rank 0 is this node, it spawns
    timeout_s = 60.0                   # ranks 1..N-1 on 127.0.0.1; timeout_s bounds every collective;
    backend = "auto"                   # gloo, nccl or auto (nccl on CUDA). Under `torchrun --nproc-per-node
                                       # N` the pool is torchrun's N ranks instead (peerloom/adapters/pool.py)
    parallel = "ddp"                   # ddp (every rank the whole model), fsdp (FSDP2: each rank 1/N of the
                                       # params, gradients and optimizer state) or pipeline (each rank one
                                       # stage of an nn.Sequential; spec/pools.md §6-7). A pipeline also takes
    # split_points = ["4"]             # children where stages 1..N-1 begin (default: balanced by params),
    # schedule = "gpipe"               # gpipe or 1f1b, and microbatches = N per global batch

A workload factory is called as ``factory(seed, num_shards)`` with the manifest's ``workload_seed`` and
shard count, and returns ``(workload, shards)`` like `peerloom.backends.registry.build_workload`; every peer
of a revision must build the same model and shard contents. Relative paths are relative to the config
file's directory. `load_config` checks every key and type and raises ConfigError naming the problem; an
``admission`` file is checked against the manifest and the node's key there too (so the key must exist).
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import json
import logging
import os
import re
import signal
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from peerloom.adapters.compute import MAX_THREADS, ComputeExecutor
from peerloom.adapters.database import Database
from peerloom.adapters.disk import is_disk_full
from peerloom.adapters.keys import load_identity, load_or_create_identity
from peerloom.adapters.limits import KEYS as LIMITS_KEYS
from peerloom.adapters.limits import Limits, raise_nofile
from peerloom.adapters.logs import setup_logging
from peerloom.adapters.pool import (
    DEFAULT_TIMEOUT_S,
    PoolError,
    PoolWorkload,
    RankEnv,
    TrainerPool,
    check_pool_table,
    run_worker,
)
from peerloom.adapters.relay import RelayLimits
from peerloom.adapters.runtime import DEFAULT_KEEP_WINDOWS, NodeRuntime, RuntimeOptions
from peerloom.adapters.storage import ArtifactStore, atomic_write
from peerloom.adapters.transport import address_kind, canonical_address
from peerloom.backends.behaviours import wrap_workload
from peerloom.backends.devices import DeviceError, resolve_device
from peerloom.backends.workload import LocalData, Placeable, Private, has
from peerloom.core.chain import encode_chain_entry
from peerloom.core.config_checks import TableError, check_keys, check_table, typed
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.errors import PeerloomError
from peerloom.core.identity import PeerId
from peerloom.core.messages import ROLES
from peerloom.core.objects import (
    PROTOCOL_VERSION,
    AdmissionCertificate,
    Head,
    Manifest,
    PrivacyParams,
    QuorumCertificate,
    Revision,
    check_admission,
)

REQUIRED = ("name", "roles", "key", "manifest", "authority", "store")
# key -> accepted types; ``behaviour`` is read by the demo's Byzantine trainers.
KEYS: dict[str, tuple[type, ...]] = {
    "name": (str,), "roles": (list,), "key": (str,), "manifest": (str,), "authority": (str,), "store": (str,),
    "listen": (str,), "bootstrap": (list,), "capacity": (int,), "port_file": (str,), "events": (str,),
    "stats": (str,), "threads": (int,), "stop_after_window": (int,), "workload": (str,), "log_format": (str,),
    "log_level": (str,), "http": (dict,), "discovery": (dict,), "behaviour": (str,), "admission": (str,),
    "leave_on_exit": (bool,), "leave_grace_s": (float, int), "device": (str,), "compute": (str,),
    "compute_threads": (int,),
    "pool": (dict,), "transport": (dict, list), "relay": (dict,), "keep_windows": (int,), "limits": (dict,),
    "audit_worker": (bool,), "agreement_timeout_s": (float, int), "data": (str,),
}
RELAY_KEYS: dict[str, tuple[type, ...]] = {
    "enabled": (bool,), "listen": (str,), "via": (list,), "only": (bool,), "reservation_s": (float, int),
    "circuit_s": (float, int), "circuit_bytes": (int,), "max_reservations": (int,), "max_circuits": (int,),
    "max_circuits_per_reservation": (int,), "max_reservations_per_ip": (int,), "window_s": (float, int),
    "circuit_window_bytes": (int,), "reservation_window_bytes": (int,)}
TRANSPORT_KEYS: dict[str, tuple[type, ...]] = {"kind": (str,), "listen": (str,), "dial_only": (bool,)}
DEFAULT_LISTEN = {"tcp": "127.0.0.1:0", "http": "http://127.0.0.1:0"}
COMPUTE = ("numpy", "torch")
log = logging.getLogger("peerloom.node")


class ConfigError(ValueError):
    """The node config is missing a key or has a bad value; the message says which."""


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"address {text!r} must be host:port")
    return host, int(port)


def load_config(path: Path) -> dict[str, Any]:
    """Read and check a node config (see the module docstring). ConfigError names the file and the key."""
    try:
        config = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    missing = [k for k in REQUIRED if k not in config]
    if missing:
        raise ConfigError(f"{path}: missing {', '.join(missing)}")
    try:
        _check(config)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    base = path.parent
    for key in ("key", "manifest", "store", "port_file", "events", "stats", "admission", "data"):
        if key in config:
            config[key] = base / config[key]
    if "admission" in config:
        try:
            _, revision = _load_revision(config)
            if not Path(config["key"]).exists():
                raise ConfigError(f"admission: key {config['key']} does not exist; a certificate admits one "
                                  "existing key's peer id (create the key with `peerloom keygen` first)")
            try:
                peer = load_identity(config["key"]).peer_id
            except (OSError, ValueError) as exc:
                raise ConfigError(f"key: {exc}") from None
            load_admission(Path(config["admission"]), revision, peer)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    if "data" in config:
        try:
            _check_private_data(config)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    return config


def _check_private_data(config: dict[str, Any]) -> None:
    """The ``data`` key (spec/protocol.md §10): a readable .npz of x and y, a manifest with ``private_data``,
    and a trainer that joins or that the manifest lists as private in its genesis roster (one in the genesis
    roster never sends a join, so only the manifest can make it private). ConfigError names the file and what
    is wrong."""
    _, revision = _load_revision(config)
    if not revision.manifest.private_data:
        raise ConfigError(f"data: the manifest {config['manifest']} admits no private-data trainers (its "
                          "private_data is off); remove data, or sign a manifest with private_data "
                          "(`peerloom init --private-data`)")
    key = Path(config["key"])
    if key.exists():
        try:
            peer = load_identity(key).peer_id
        except (OSError, ValueError) as exc:
            raise ConfigError(f"key: {exc}") from None
        genesis = revision.genesis()
        if peer in genesis.roster_peers and peer not in genesis.private_peers:
            raise ConfigError(f"data: this trainer ({peer.to_text()}) is in the manifest's genesis roster but not "
                              "in its private list, so no head lists it as private; sign a manifest that lists it "
                              "(`peerloom init --data`), or leave it out of the roster (a late joiner)")
    load_private_data(Path(config["data"]))


def load_private_data(path: Path) -> tuple[Any, Any]:
    """A private-data trainer's samples (config key ``data``): ``(x, y)`` from an .npz file holding exactly the
    arrays ``x`` (floating point, ``[n, ...]``, returned as float32) and ``y`` (integer ``[n]``, returned as
    int64), n >= 1. ConfigError (``data <path>: ...``) for a file that cannot be read or holds other arrays,
    dtypes or shapes; the shapes are checked against the workload when the node builds it."""
    import zipfile

    import numpy as np

    try:
        with np.load(path, allow_pickle=False) as npz:
            if not hasattr(npz, "files"):
                raise ConfigError(f"data {path}: not an .npz file (a .npy holds one array; save x and y with "
                                  "numpy.savez)")
            if sorted(npz.files) != ["x", "y"]:
                raise ConfigError(f"data {path}: must hold exactly the arrays x and y, holds "
                                  f"{', '.join(sorted(npz.files)) or 'none'}")
            x, y = npz["x"], npz["y"]
    except OSError as exc:
        raise ConfigError(f"data {path}: cannot read: {exc.strerror or exc}") from None
    except (ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise ConfigError(f"data {path}: not an .npz file of numeric arrays: {exc}") from None
    if not np.issubdtype(x.dtype, np.floating) or x.ndim < 2:
        raise ConfigError(f"data {path}: x must be a floating-point array [n, ...], got {x.dtype} {list(x.shape)}")
    if not np.issubdtype(y.dtype, np.integer) or y.ndim != 1:
        raise ConfigError(f"data {path}: y must be an integer array [n], got {y.dtype} {list(y.shape)}")
    if len(x) != len(y) or len(y) == 0:
        raise ConfigError(f"data {path}: x and y must hold the same number n >= 1 of samples, got {len(x)} "
                          f"and {len(y)}")
    return x.astype(np.float32, copy=False), y.astype(np.int64, copy=False)


def _check(config: dict[str, Any]) -> None:
    try:
        check_table(config, KEYS)
    except TableError as exc:
        raise ConfigError(str(exc)) from None
    roles = config["roles"]
    if not roles or not all(isinstance(r, str) and r in ROLES for r in roles):
        raise ConfigError(f"roles must be a non-empty list of {', '.join(sorted(ROLES))}; got {roles!r}")
    _address(config.get("listen", "127.0.0.1:0"))
    transport_listens(config)
    relay_settings(config)
    limits_settings(config)
    for address in config.get("bootstrap", []):
        if not isinstance(address, str):
            raise ConfigError(f"bootstrap entries must be address strings, got {address!r}")
        try:
            canonical_address(address)
        except ValueError as exc:
            raise ConfigError(f"bootstrap: {exc}") from None
    for key in ("capacity", "threads"):
        if key in config and config[key] < 1:
            raise ConfigError(f"{key} must be at least 1, got {config[key]}")
    if not 1 <= config.get("compute_threads", 1) <= MAX_THREADS:
        raise ConfigError(f"compute_threads must be in [1, {MAX_THREADS}], got {config['compute_threads']}")
    if config.get("agreement_timeout_s", 1.0) <= 0:
        raise ConfigError(f"agreement_timeout_s must be positive, got {config['agreement_timeout_s']}")
    if config.get("keep_windows", 0) < 0:
        raise ConfigError(f"keep_windows must be 0 (keep every artifact) or more, got {config['keep_windows']}")
    try:
        PeerId.from_text(config["authority"])
    except Exception:
        raise ConfigError(f"authority {config['authority']!r} is not a peer id") from None
    if config.get("log_format", "auto") not in ("auto", "json", "text"):
        raise ConfigError(f"log_format must be auto, json or text, got {config['log_format']!r}")
    if config.get("log_level", "info").upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ConfigError(f"log_level must be debug, info, warning or error, got {config['log_level']!r}")
    http = config.get("http", {})
    if set(http) - {"enabled", "listen"}:
        raise ConfigError(f"http: unknown keys {', '.join(sorted(set(http) - {'enabled', 'listen'}))}")
    if not isinstance(http.get("enabled", False), bool):
        raise ConfigError("http.enabled must be true or false")
    if "listen" in http:
        if not isinstance(http["listen"], str):
            raise ConfigError("http.listen must be a host:port string")
        _address(http["listen"])
    discovery = config.get("discovery", {})
    if set(discovery) - {"mdns"} or not isinstance(discovery.get("mdns", False), bool):
        raise ConfigError("discovery takes one key, mdns = true or false")
    if "workload" in config:
        _workload_factory(config["workload"])  # importable and callable, checked before anything starts
    if "behaviour" in config:
        from peerloom.backends.attacks import ATTACKS, TRAINING_ATTACKS

        known = (*ATTACKS, *TRAINING_ATTACKS)
        if config["behaviour"] not in (*known, "honest"):
            raise ConfigError(f"behaviour must be honest or one of {', '.join(known)}; got {config['behaviour']!r}")
        if config["behaviour"] != "honest" and roles != ["trainer"]:
            raise ConfigError("behaviour applies to nodes whose only role is trainer")
    if "data" in config and roles != ["trainer"]:
        raise ConfigError(f"data (private training data, spec/protocol.md §10) applies to nodes whose only role "
                          f"is trainer: validators and reducers hold no private data; roles are {roles!r}")
    for key in ("admission", "leave_on_exit"):
        if key in config and "trainer" not in roles:
            raise ConfigError(f"{key} applies to nodes with the trainer role; roles are {roles!r}")
    grace = config.get("leave_grace_s", 30.0)
    if not 0 <= grace < float("inf"):
        raise ConfigError(f"leave_grace_s must be a finite number of seconds >= 0, got {grace!r}")
    if "device" in config:
        try:
            resolve_device(config["device"])  # spelt right and present on this machine
        except DeviceError as exc:
            raise ConfigError(str(exc)) from None
    compute = config.get("compute", "numpy")
    if compute not in COMPUTE:
        raise ConfigError(f"compute must be numpy or torch, got {compute!r}")
    if compute == "torch" and importlib.util.find_spec("torch") is None:
        raise ConfigError("compute = \"torch\" needs torch: pip install 'peerloom[torch]'")
    _check_pool(config)


def _check_pool(config: dict[str, Any]) -> None:
    """The ``[pool]`` table and torchrun's variables (spec/pools.md): a pool is a trainer's, honest, with torch."""
    try:
        check_pool_table(config.get("pool", {}))
        env = RankEnv.from_environ()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if env is None and config.get("pool", {}).get("ranks", 1) <= 1:
        return
    if "trainer" not in config["roles"]:
        raise ConfigError("a trainer pool ([pool] or torchrun) needs the trainer role")
    if config.get("behaviour", "honest") != "honest":
        raise ConfigError("a trainer pool trains honestly: drop behaviour or the pool")
    if "data" in config:
        raise ConfigError("a trainer pool trains on the manifest's shared data: drop data or the pool")
    if importlib.util.find_spec("torch") is None:
        raise ConfigError("a trainer pool needs torch: pip install 'peerloom[torch]'")


def transport_listens(config: dict[str, Any]) -> tuple[str, ...]:
    """The addresses to listen on from the ``[transport]`` table or ``[[transport]]`` tables (kind and
    listen; spec/transport.md §9), or () when there are none (then ``listen`` is the tcp listener) or when
    every table is ``dial_only``. ConfigError names an unknown key or kind, a malformed address, ``listen``
    given beside them, or a ``dial_only`` table with a listen address."""
    tables = config.get("transport", [])
    tables = [tables] if isinstance(tables, dict) else tables
    if tables and "listen" in config:
        raise ConfigError("give either listen (tcp) or [transport] tables, not both")
    out = []
    for table in tables:
        if not isinstance(table, dict):
            raise ConfigError("transport entries must be tables with kind and listen")
        try:
            check_table(table, TRANSPORT_KEYS, "transport")
        except TableError as exc:
            raise ConfigError(str(exc)) from None
        kind = table.get("kind")
        if kind not in ("tcp", "http", "memory"):
            raise ConfigError(f"transport.kind must be tcp, http or memory, got {kind!r}")
        if table.get("dial_only", False):
            if "listen" in table:
                raise ConfigError(f"transport {kind}: dial_only = true opens no listener; drop listen")
            continue
        listen = table.get("listen", DEFAULT_LISTEN.get(kind))
        if listen is None:
            raise ConfigError("a memory transport needs listen = \"memory://NAME\"")
        prefix = {"http": "http://", "memory": "memory://"}.get(kind, "")
        if prefix and not listen.startswith(prefix):
            raise ConfigError(f"transport {kind}: listen must start with {prefix}, got {listen!r}")
        if kind == "tcp" and "://" in listen:
            raise ConfigError(f"transport tcp: listen must be HOST:PORT or /ip4/HOST/tcp/PORT, got {listen!r}")
        if kind == "http":
            _address(listen[len(prefix):])
        elif kind == "tcp" and listen.startswith(("/ip4/", "/ip6/")):
            parts = listen.split("/")
            if len(parts) != 5 or parts[3] != "tcp" or not parts[4].isdigit():
                raise ConfigError(f"transport tcp: listen {listen!r} must be /ip4/HOST/tcp/PORT")
        elif kind == "tcp":
            _address(listen)
        out.append(listen)
    return tuple(out)


def limits_settings(config: dict[str, Any]) -> Limits:
    """The node's connection limits from its ``[limits]`` table (spec/transport.md §13; every key optional,
    defaults in `adapters.limits.Limits`). ConfigError names an unknown key (with the closest valid one), a
    bad type or a value out of range."""
    table = config.get("limits", {})
    try:
        check_keys(table, LIMITS_KEYS, "limits")
        values = {key: typed(table, key, types, where="limits") for key, types in LIMITS_KEYS.items() if key in table}
        if "protected_peers" in values:
            if not all(isinstance(p, str) for p in values["protected_peers"]):
                raise ConfigError("limits.protected_peers must be a list of peer id strings")
            values["protected_peers"] = tuple(values["protected_peers"])
        return Limits(**values)
    except (TableError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def relay_settings(config: dict[str, Any]) -> tuple[str | None, RelayLimits | None, tuple[str, ...]]:
    """From the ``[relay]`` table (spec/transport.md §12): the address to relay for others on (None when
    not enabled), its limits, and the circuit listen addresses ``<relay>/p2p-circuit`` of `via`.
    ConfigError names an unknown key, a bad type or value, or an address that is not a direct one."""
    table = config.get("relay", {})
    try:
        check_table(table, RELAY_KEYS, "relay")
    except TableError as exc:
        raise ConfigError(str(exc)) from None

    def direct(text: str, what: str, *, listening: bool = False) -> str:
        probe = re.sub(r"(:|/tcp/)0$", r"\g<1>1", text) if listening else text  # port 0: pick one
        try:
            kind = address_kind(canonical_address(probe))
        except ValueError as exc:
            raise ConfigError(f"relay.{what}: {exc}") from None
        if kind == "relay":
            raise ConfigError(f"relay.{what}: {text!r} must be a direct (tcp, http or memory) address")
        return text if listening else canonical_address(text)

    listen, limits = None, None
    if table.get("enabled", False):
        listen = direct(table.get("listen", "127.0.0.1:0"), "listen", listening=True)
        try:
            limits = RelayLimits(**{k: table[k] for k in RELAY_KEYS if k in table
                                    and k not in ("enabled", "listen", "via", "only")})
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    elif set(table) - {"enabled", "via", "only"}:
        raise ConfigError("relay: listen and limits need enabled = true")
    via = table.get("via", [])
    if not all(isinstance(a, str) for a in via) or len(set(via)) != len(via):
        raise ConfigError("relay.via must be a list of distinct address strings")
    return listen, limits, tuple(f"{direct(a, 'via')}/p2p-circuit" for a in via)


def _workload_factory(spec: str) -> Callable[[int, int], tuple[Any, Any]]:
    """A workload factory from ``module:function`` or a registry name. ConfigError if it cannot be used."""
    from peerloom.backends.registry import WORKLOADS, build_workload

    if ":" not in spec:
        if spec not in WORKLOADS:
            raise ConfigError(f"workload {spec!r} is not a registry name ({', '.join(WORKLOADS)}) "
                              "nor a module:function import path")
        return lambda seed, num_shards: build_workload(spec, seed, num_shards)
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"workload {spec!r}: cannot import {module_name}: {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"workload {spec!r}: {module_name} has no callable {attr!r}")
    return factory


def build_node_workload(config: dict[str, Any], manifest_workload: str, seed: int,
                        num_shards: int) -> tuple[Any, Any]:
    """(workload, shards) for this node: the config's factory if it names one, else the manifest's name."""
    spec = config.get("workload", manifest_workload)
    if ":" not in spec and spec != manifest_workload:
        raise ConfigError(f"workload {spec!r} differs from the manifest's {manifest_workload!r}; every peer "
                          "of a revision must train the same model")
    workload, shards = _workload_factory(spec)(seed, num_shards)
    if len(shards) != num_shards:
        raise ConfigError(f"workload {spec!r} returned {len(shards)} shards, the manifest has {num_shards}")
    return workload, shards


def check_workload_schema(workload: Any, schema: Any, spec: str) -> None:
    """ConfigError naming the first tensor whose name, dtype or shape in `workload.schema()` differs from
    the manifest's `schema`: such a node could take leases but train nothing the validators accept."""
    ours = {name: (dtype, tuple(shape)) for name, dtype, shape in workload.schema()}
    signed = {name: (dtype, tuple(shape)) for name, dtype, shape in schema}
    for name in sorted(set(ours) | set(signed)):
        if ours.get(name) == signed.get(name):
            continue
        if name not in signed:
            problem = "is not in the manifest's schema"
        elif name not in ours:
            problem = f"is missing (the manifest has {signed[name][0]} {signed[name][1]})"
        else:
            problem = f"is {ours[name][0]} {ours[name][1]}, the manifest's is {signed[name][0]} {signed[name][1]}"
        raise ConfigError(f"workload {spec!r}: tensor {name!r} {problem}; every peer must build the model the "
                          "manifest was made with")


def _node_workload(config: dict[str, Any], manifest: Manifest) -> tuple[Any, Any]:
    """(workload, shards) as this node runs them (`build_node_workload`, placed on the config's ``device``,
    wrapped in its ``behaviour``), without a trainer pool. With ``data`` (a private-data trainer,
    spec/protocol.md §10) the workload trains on that file's samples and shard s is `private_shards_for`'s
    ``manifest.shards[s]`` indices of them."""
    workload, shards = build_node_workload(config, manifest.workload, manifest.workload_seed, len(manifest.shards))
    check_workload_schema(workload, manifest.schema, config.get("workload", manifest.workload))
    if "data" in config:
        workload, shards = private_workload(workload, manifest, Path(config["data"]))
    if "device" in config:  # else the workload stays where its factory put it (the CPU by default)
        place_workload(workload, config["device"])
    if config.get("behaviour", "honest") != "honest":
        workload = wrap_workload(workload, config["behaviour"], seed=manifest.workload_seed)
    if manifest.privacy is not None:
        apply_privacy(workload, manifest.privacy, config.get("workload", manifest.workload))
    return workload, shards


def apply_privacy(workload: Any, privacy: PrivacyParams, name: str) -> None:
    """Make `workload` train with DP-SGD under a manifest's `privacy` (spec/protocol.md §10): every role's,
    since a validator's recomputation audit replays the noise. ConfigError in one line without opacus (the
    ``[dp]`` extra), for a workload that cannot train with DP-SGD (numpy workloads; a model Opacus refuses)."""
    from peerloom.backends.privacy import PrivacyUnavailable, dp_of

    if not has(workload, Private):
        raise ConfigError(f"workload {name!r} cannot train with DP-SGD (the manifest has privacy): DP-SGD needs a "
                          "torch workload")
    try:
        workload.with_privacy(dp_of(privacy))
    except (PrivacyUnavailable, ValueError) as exc:
        raise ConfigError(f"workload {name!r}: {exc}") from None


def private_workload(workload: Any, manifest: Manifest, path: Path) -> tuple[Any, list[list[int]]]:
    """(`workload` training on the samples in `path`, the private shard map) for a private-data trainer
    (config key ``data``; spec/protocol.md §10): ``workload.with_train_data(x, y)`` and
    `private_shards_for` (manifest shard sizes, local length, ``workload_seed``). ConfigError naming the file
    when the workload cannot train on local data or the arrays do not fit it."""
    from peerloom.backends.sharding import private_shards_for

    x, y = load_private_data(path)
    if not has(workload, LocalData):
        raise ConfigError(f"data {path}: the workload {type(workload).__name__} cannot train on local data (it "
                          "has no with_train_data)")
    try:
        workload = workload.with_train_data(x, y)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"data {path}: does not fit the workload {type(workload).__name__}: {exc}") from None
    return workload, private_shards_for(manifest.shards, len(y), manifest.workload_seed)


def place_workload(workload: Any, device: str) -> Any:
    """Move `workload`'s training and evaluation to `device` (config key ``device``; `resolve_device`):
    a `Placeable` workload (`TorchWorkload`) moves there; any other (numpy) runs on the CPU, so it
    takes only ``"cpu"`` or ``"auto"``. Returns the workload. ConfigError names a device that is absent or
    that the workload cannot use."""
    try:
        resolved = resolve_device(device)
    except DeviceError as exc:
        raise ConfigError(str(exc)) from None
    if has(workload, Placeable):
        workload.to_device(resolved)
    elif device not in ("cpu", "auto"):
        raise ConfigError(f"device {device!r}: the workload {type(workload).__name__} runs on the CPU only "
                          "(device applies to torch workloads); use cpu or auto")
    return workload


def write_chain_entry(chain_dir: Path, head: Head, cert: QuorumCertificate) -> None:
    """Add a certified head to a chain directory as ``<window>.cbor`` (canonical CBOR)."""
    chain_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(chain_dir / f"{head.window:06d}.cbor", encode_chain_entry(head, cert))


def fill_chain_dir(db: Database, chain_dir: Path) -> list[int]:
    """Write every certified head the store's database holds that `chain_dir` lacks (a SIGKILL between the
    database commit and the file leaves one out); returns the windows written."""
    chain_dir.mkdir(parents=True, exist_ok=True)
    present = {p.name for p in chain_dir.glob("[0-9]*.cbor")}
    written = []
    for window, _, entry in reversed(db.heads()):
        if window > 0 and f"{window:06d}.cbor" not in present:
            atomic_write(chain_dir / f"{window:06d}.cbor", entry)
            written.append(window)
    return written


def _write_if_changed(path: Path, data: bytes) -> None:
    """`atomic_write`, skipped when `path` already holds `data` (a restart then writes nothing)."""
    try:
        if path.read_bytes() == data:
            return
    except OSError:
        pass
    atomic_write(path, data)


def _write_or_warn(path: Path, data: bytes, runtime: NodeRuntime) -> None:
    """`atomic_write`; on a full disk no exit: a warning, unless the runtime already said the disk is full
    (the port and stats files)."""
    try:
        atomic_write(path, data)
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        if not runtime.disk_full:
            log.warning("disk full: not written", extra={"fields": {"path": str(path)}})


def _load_revision(config: dict[str, Any]) -> tuple[SignedEnvelope, Revision]:
    try:
        envelope = SignedEnvelope.from_bytes(Path(config["manifest"]).read_bytes())
        return envelope, Revision.verify(envelope, PeerId.from_text(config["authority"]))
    except OSError as exc:
        raise ConfigError(f"manifest: {exc}") from None
    except PeerloomError as exc:
        raise ConfigError(f"manifest {config['manifest']}: not a revision signed by {config['authority']}: "
                          f"{exc}") from None


def load_admission(path: Path, revision: Revision, peer: PeerId) -> SignedEnvelope:
    """Read an admission certificate envelope (`SignedEnvelope.to_bytes()`, as `peerloom admit` writes it)
    and check it the way validators do (`check_admission`, spec/protocol.md §5 "Admission"): signed by the
    manifest's ``admission_authority``, for `revision` and for `peer`. ConfigError says what is wrong."""
    try:
        envelope = SignedEnvelope.from_bytes(path.read_bytes())
    except OSError as exc:
        raise ConfigError(f"admission: {exc}") from None
    except PeerloomError as exc:
        raise ConfigError(f"admission {path}: not a signed envelope: {exc}") from None
    authority = revision.manifest.admission_authority
    if authority is None:
        raise ConfigError(f"admission {path}: the manifest names no admission_authority (its admission policy "
                          f"is {revision.manifest.admission!r}); remove the admission key")
    if envelope.signer != authority:
        raise ConfigError(f"admission {path}: signed by {envelope.signer.to_text()}, not by the manifest's "
                          f"admission_authority {authority.to_text()}")
    try:
        cert = AdmissionCertificate.from_cbor(envelope.open(AdmissionCertificate.KIND, PROTOCOL_VERSION))
    except PeerloomError as exc:
        raise ConfigError(f"admission {path}: not an admission certificate: {exc}") from None
    if cert.revision != revision.id:
        raise ConfigError(f"admission {path}: for revision {cert.revision.hex()}, not the manifest's "
                          f"{revision.id.hex()}")
    if cert.peer != peer:
        raise ConfigError(f"admission {path}: for peer {cert.peer.to_text()}, not this node's "
                          f"{peer.to_text()} (its key)")
    try:  # what the validators will check; anything the checks above missed (capacity 0) is caught here
        check_admission(envelope, revision.id, revision.manifest, peer)
    except PeerloomError as exc:
        raise ConfigError(f"admission {path}: {exc}") from None
    return envelope


def start_pool(config: dict[str, Any], workload: Any, config_path: Path | None) -> Any:
    """`workload`, or a `PoolWorkload` training on a formed trainer pool when the config's ``[pool] ranks``
    is above 1 or torchrun started this process (rank 0; spec/pools.md). The pool is closed at exit.
    ConfigError if the pool cannot form."""
    env = RankEnv.from_environ()
    table = config.get("pool", {})
    ranks = env.world if env is not None else int(table.get("ranks", 1))
    if ranks <= 1:
        return workload
    if env is None and config_path is None:
        raise ConfigError("a pool that spawns its ranks needs the config's path")
    argv = None if env is not None else [sys.executable, "-m", "peerloom", "node", "--config", str(config_path)]
    pool = TrainerPool(workload, ranks=ranks, timeout_s=float(table.get("timeout_s", DEFAULT_TIMEOUT_S)),
                       backend=table.get("backend", "auto"), argv=argv, env=env,
                       parallel=table.get("parallel", "ddp"), split_points=table.get("split_points"),
                       schedule=table.get("schedule", "gpipe"), microbatches=table.get("microbatches"))
    try:
        pool.start()
    except PoolError as exc:
        raise ConfigError(f"pool: {exc}") from None
    atexit.register(pool.close)
    return PoolWorkload(workload, pool)


def run_pool_worker(config: dict[str, Any]) -> int:
    """A pool rank above 0 (spec/pools.md): only the workload (on ``cuda:LOCAL_RANK`` when it trains on
    CUDA), no key, connections or store; runs rank 0's train tasks until told to stop. Returns the exit
    status."""
    env = RankEnv.from_environ()
    assert env is not None and env.rank > 0
    _, revision = _load_revision(config)
    manifest = revision.manifest
    workload, _ = build_node_workload(config, manifest.workload, manifest.workload_seed, len(manifest.shards))
    device = config.get("device")
    if device is not None and resolve_device(device).startswith("cuda"):
        device = f"cuda:{env.local_rank}"  # one GPU per rank
    if device is not None:
        place_workload(workload, device)
    elif getattr(getattr(workload, "device", None), "type", "cpu") == "cuda":  # the factory chose CUDA
        workload.to_device(f"cuda:{env.local_rank}")
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(config.get("threads", 1)))
    table = config.get("pool", {})
    return run_worker(workload, env, timeout_s=float(table.get("timeout_s", DEFAULT_TIMEOUT_S)),
                      backend=table.get("backend", "auto"))


def build_runtime(config: dict[str, Any], config_path: Path | None = None, *,
                  memory_network: Any = None) -> NodeRuntime:
    """Everything `peerloom node` builds before it runs: identity, store, workload, runtime (`config_path`:
    where a trainer pool's spawned ranks read the config; `memory_network`: the `MemoryNetwork` that
    memory:// addresses reach, for several nodes in one process)."""
    try:
        identity = load_or_create_identity(config["key"])
    except (OSError, ValueError) as exc:
        raise ConfigError(f"key: {exc}") from None
    envelope, revision = _load_revision(config)
    manifest = revision.manifest
    admission = None
    if "admission" in config:
        admission = load_admission(Path(config["admission"]), revision, identity.peer_id)
    elif (manifest.admission == "certificate" and "trainer" in config["roles"]
          and identity.peer_id not in revision.genesis().roster_peers):
        log.warning("no admission certificate: the manifest admits by certificate and this trainer is not in "
                    "its roster, so the validators will refuse its joins (see `peerloom admit`)")
    try:
        store = ArtifactStore(config["store"], chunk_size=manifest.chunk_size)
    except OSError as exc:
        raise ConfigError(f"store: {exc}") from None
    workload, shards = _node_workload(config, manifest)
    if config.get("behaviour", "honest") != "honest":
        log.warning("byzantine trainer", extra={"fields": {"behaviour": config["behaviour"]}})
    if "torch" in sys.modules:  # only workloads that use torch pay for importing it
        sys.modules["torch"].set_num_threads(int(config.get("threads", 1)))
    workload = start_pool(config, workload, config_path)
    private = "data" in config  # a private-data trainer (spec/protocol.md §10): a secret train seed
    executor = ComputeExecutor(store, manifest, workload, shards, state_dir=Path(config["store"]),
                               compute=config.get("compute", "numpy"),
                               compute_threads=config.get("compute_threads"),
                               seed_key=identity.seed if private else None)
    audit_executor = None
    if "validator" in config["roles"] and manifest.audit and manifest.audit_rate > 0.0 and \
            config.get("audit_worker", True):
        # Sampled audits beside the other tasks (`ComputeSlot`): an executor is not thread-safe, so a second
        # one over the same store, with a workload instance of its own.
        audit_executor = ComputeExecutor(store, manifest, _node_workload(config, manifest)[0], shards,
                                         compute=config.get("compute", "numpy"),
                                         compute_threads=config.get("compute_threads"))
    host, port = _address(config.get("listen", "127.0.0.1:0"))
    http = config.get("http", {})
    http_listen = _address(http.get("listen", "127.0.0.1:0")) if http.get("enabled", False) else None
    listens = transport_listens(config)
    relay_listen, relay_limits, circuits = relay_settings(config)
    if circuits:  # listen at the relays, and directly only where the config says so
        listens = (listens or ((config["listen"],) if "listen" in config else ())) + circuits
    if memory_network is None and any(a.startswith("memory://") for a in listens):
        from peerloom.adapters.memory import MemoryNetwork

        memory_network = MemoryNetwork()  # reachable from this process only
    dial_only = not listens and bool(config.get("transport"))  # every [transport] table is dial_only
    agreement: dict[str, Any] = ({"agreement_timeout_s": float(config["agreement_timeout_s"])}
                                 if "agreement_timeout_s" in config else {})  # else RuntimeOptions' default
    options = RuntimeOptions(listen_host=host, listen_port=port, listen=listens, dial_only=dial_only,
                             bootstrap=tuple(config.get("bootstrap", [])), memory_network=memory_network,
                             http_listen=http_listen, mdns=bool(config.get("discovery", {}).get("mdns", False)),
                             relay_listen=relay_listen, relay_limits=relay_limits,
                             relay_only=bool(config.get("relay", {}).get("only", False)),
                             keep_windows=int(config.get("keep_windows", DEFAULT_KEEP_WINDOWS)),
                             limits=limits_settings(config), private_data=private,
                             **agreement)
    # The store's chain directory: one file per certified head the node holds, kept as they become durable.
    chain_dir = Path(config["store"]) / "chain"
    try:  # on a full disk the node still starts, in the disk-full state (spec/transport.md §15)
        _write_if_changed(Path(config["store"]) / "manifest.cbor", envelope.to_bytes())
        repaired = fill_chain_dir(store.db, chain_dir)
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        repaired = []
        log.warning("disk full: store manifest and chain directory not checked", extra={"fields": {"error": str(exc)}})
    if repaired:
        log.info("chain directory repaired from the store", extra={"fields": {"windows": repaired}})
    return NodeRuntime(name=config["name"], identity=identity, revision=revision, roles=set(config["roles"]),
                       store=store, executor=executor, audit_executor=audit_executor, options=options,
                       events_path=config.get("events"),
                       capacity=int(config.get("capacity", 1)), stop_after_window=config.get("stop_after_window"),
                       on_chain_entry=lambda h, c: write_chain_entry(chain_dir, h, c), admission=admission)


async def leave_roster(runtime: NodeRuntime, grace_s: float, signals: Any) -> str:
    """Leave the roster before shutting down (config ``leave_on_exit``): feed the engine `LeaveRequested`
    (spec/protocol.md §5 "Leave") and keep running until its head no longer lists this node, at most
    `grace_s` seconds, or until one more signal arrives on `signals` (an async iterable of signal numbers).
    Returns and logs the outcome: "not-rostered" (at once: not rostered and no join pending),
    "withdrawn" (a join was pending: the leave withdraws it, and we wait for the next head, within the
    grace, in case one already rostered us - then we leave as a member does), "left", "grace-expired" or
    "interrupted"."""
    me = runtime.identity.peer_id
    pending = runtime.join_pending()
    runtime.request_leave()
    if me not in runtime.engine.head.roster_peers:
        if not pending:
            log.info("leave: not in the roster", extra={"fields": {"window": runtime.engine.head.window}})
            return "not-rostered"
        log.info("leave: withdrawing a pending join", extra={"fields": {"window": runtime.engine.head.window}})
        with trio.move_on_after(grace_s) as waited:
            await runtime.wait_head_change()
        if me not in runtime.engine.head.roster_peers:
            return "withdrawn"
        grace_s = max(0.0, waited.deadline - trio.current_time())  # what is left of it, to leave as a member
    log.info("leaving the roster", extra={"fields": {"window": runtime.engine.head.window, "grace_s": grace_s}})
    outcome = "grace-expired"

    async def left(cancel: trio.CancelScope) -> None:
        nonlocal outcome
        await runtime.wait_unrostered()
        outcome = "left"
        cancel.cancel()

    async def interrupted(cancel: trio.CancelScope) -> None:
        nonlocal outcome
        async for _ in signals:
            outcome = "interrupted"
            cancel.cancel()

    with trio.move_on_after(grace_s):
        async with trio.open_nursery() as waiting:
            waiting.start_soon(left, waiting.cancel_scope)
            waiting.start_soon(interrupted, waiting.cancel_scope)
    fields = {"window": runtime.engine.head.window}
    if outcome == "left":
        log.info("left the roster", extra={"fields": fields})
    elif outcome == "interrupted":
        log.warning("second signal: shutting down without waiting for the leave", extra={"fields": fields})
    else:
        log.warning("leave grace expired: shutting down while still in the roster",
                    extra={"fields": {**fields, "grace_s": grace_s}})
    return outcome


def run_node(config_path: Path, *, stop_after_window: int | None = None) -> None:
    """Run a node until SIGTERM or SIGINT, then shut down cleanly (connections closed, stats written); with
    ``leave_on_exit`` a trainer first leaves the roster (`leave_roster`). `stop_after_window` (`peerloom
    node --stop-after-window`, which `peerloom up --windows` uses) replaces the config key of that name.

    Raises ConfigError before starting anything if the config, key, manifest or workload is unusable.
    """
    config = load_config(config_path)
    if stop_after_window is not None:
        config["stop_after_window"] = stop_after_window
    level = config.get("log_level", os.environ.get("PEERLOOM_LOG_LEVEL", "info"))
    env = RankEnv.from_environ()
    if env is not None and env.rank > 0:  # a trainer pool's rank: no identity, no network (spec/pools.md)
        setup_logging(config.get("log_format", "auto"), level, name=f"{config['name']}/rank{env.rank}")
        sys.exit(run_pool_worker(config))
    setup_logging(config.get("log_format", "auto"), level, name=config["name"])
    nofile = raise_nofile(limits_settings(config).open_files)  # the descriptor budget's base (§13)
    runtime = build_runtime(config, config_path)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(runtime.run)
            if "port_file" in config and port is not None:  # None: a dial_only node listens nowhere
                _write_or_warn(Path(config["port_file"]), f"{port}\n".encode(), runtime)
            log.info("node started", extra={"fields": {"peer": runtime.identity.peer_id.to_text(), "port": port,
                                                       "roles": sorted(config["roles"]), "nofile": nofile[0],
                                                       "fd_budget": runtime.limiter.fd_budget}})
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("shutting down", extra={"fields": {"signal": signal.Signals(signum).name}})
                    if config.get("leave_on_exit", False):
                        await leave_roster(runtime, float(config.get("leave_grace_s", 30.0)), signals)
                    nursery.cancel_scope.cancel()
                    break

    try:
        trio.run(main)
    finally:
        runtime.close()
        write_stats(runtime, config)


def write_stats(runtime: NodeRuntime, config: dict[str, Any]) -> None:
    """The config's ``stats`` file, if it names one, written as a node stops: JSON with its name, peer id,
    wire bytes (sent, received), last head window, the engine's counters and rejections by reason."""
    if "stats" not in config:
        return
    sent, received = runtime.wire_bytes()
    stats = {"name": config["name"], "peer_id": runtime.identity.peer_id.to_text(), "bytes_sent": sent,
             "bytes_received": received, "head_window": runtime.engine.head.window,
             "counters": dict(runtime.engine.stats), "rejected_by_reason": dict(runtime.engine.rejected_by_reason)}
    _write_or_warn(Path(config["stats"]), json.dumps(stats, indent=2).encode(), runtime)

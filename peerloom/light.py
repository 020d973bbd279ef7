"""`peerloom light --edge URL --authority PEERID --key FILE`: a light trainer, which is an ordinary trainer node
(`peerloom.node.build_runtime`) that listens nowhere and reaches the fleet over the HTTP transport only
(spec/transport.md §9-10; spec/design.md §6).

It writes a trainer node config, ``light.toml``, to `--workdir` (default: a temporary directory): the key
is `--key`, the manifest is the one the edge serves at ``/v1/manifest`` (or `--manifest FILE`), verified to
be signed by `--authority`, ``[transport] kind = "http", dial_only = true``, and the bootstrap addresses are
`--peer` (repeatable) or else the ``http://`` addresses the edge lists in ``/healthz`` ``addresses``. Then it
runs that node: it syncs the chain, joins the roster if absent, trains on its leases and announces its
updates to the validators over its HTTP transport connections, as any trainer does. The same config runs
with `peerloom node --config <workdir>/light.toml`.

It prints one JSON line (``window``, ``shards``, ``joined``, ``update_id``, ``train_loss``) when a certified
head first lists it in the roster (``joined`` true, no update) and one per update of its own that a
certified head's cohort holds (``window`` is that head's window). It exits 0 once `--updates` of its
updates are in certified heads, 1 if `--timeout` seconds passed first, 2 on bad arguments, an unreadable
key, an edge that cannot be reached or fails verification, or a node config that does not load.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import sys
import tempfile
import urllib.parse
from pathlib import Path
from typing import Any

MAX_ADVERTISED = 16  # addresses taken from an edge's /healthz; the rest are ignored


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("light", help="train as a trainer node that only dials the HTTP transport")
    parser.add_argument("--edge", default=None, metavar="URL",
                        help="a node's HTTP edge, e.g. http://127.0.0.1:8080: serves the manifest and lists the "
                             "node's transport addresses (not needed with --manifest and --peer)")
    parser.add_argument("--authority", required=True, metavar="PEERID", help="peer id that signed the manifest")
    parser.add_argument("--key", type=Path, required=True, metavar="FILE", help="identity key file (peerloom keygen)")
    parser.add_argument("--peer", action="append", default=[], metavar="ADDRESS",
                        help="a node's HTTP transport address http://H:P to dial (repeatable); default: the "
                             "http:// addresses the edge lists")
    parser.add_argument("--manifest", type=Path, default=None, metavar="FILE",
                        help="the signed manifest (SignedEnvelope bytes) instead of the edge's")
    parser.add_argument("--updates", type=int, default=1, metavar="N",
                        help="stop once N of this peer's updates are in certified heads")
    parser.add_argument("--threads", type=int, default=1, help="compute threads (torch)")
    parser.add_argument("--capacity", type=int, default=1, help="shards per window to ask for when joining")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS", help="give up after this long")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="node config and store directory (default: a temporary directory)")
    parser.add_argument("--workload", default=None, metavar="MODULE:FUNCTION",
                        help="workload factory (seed, num_shards) -> (workload, shards); default: the manifest's")
    parser.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                        help="the node's log level (logs go to stderr)")


def _fail(message: str) -> int:
    print(f"peerloom light: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Check the arguments, get and verify the manifest, find the addresses to dial, then run the light
    trainer's node (`_run_node`). Returns the exit status of the module docstring."""
    from peerloom.adapters.keys import load_identity
    from peerloom.core.errors import PeerloomError
    from peerloom.core.identity import PeerId

    if args.updates < 1 or args.threads < 1 or args.capacity < 1 or not args.timeout > 0:
        return _fail("--updates, --threads and --capacity must be at least 1, --timeout above 0")
    if args.edge is None and (args.manifest is None or not args.peer):
        return _fail("give --edge, or both --manifest and --peer")
    try:
        load_identity(args.key)
        authority = PeerId.from_text(args.authority)
    except (OSError, ValueError, PeerloomError) as exc:
        return _fail(str(exc))
    try:
        envelope = _manifest(args, authority)
        peers = args.peer or _advertised(args.edge)
    except _Refused as exc:
        return _fail(str(exc))
    if not peers:
        return _fail(f"{args.edge} lists no http:// transport address; pass --peer http://H:P")
    if args.workdir is not None:
        return _run_node(args, envelope, peers, Path(args.workdir))
    with tempfile.TemporaryDirectory(prefix="peerloom-light-") as tmp:
        return _run_node(args, envelope, peers, Path(tmp))


class _Refused(Exception):
    """What stops `peerloom light` before its node starts (exit 2); the message says why."""


def _manifest(args: argparse.Namespace, authority: Any) -> bytes:
    """The manifest envelope's bytes from `--manifest` or the edge, verified to be signed by `authority`."""
    from peerloom.core.envelope import SignedEnvelope
    from peerloom.core.errors import PeerloomError
    from peerloom.core.objects import Revision

    if args.manifest is not None:
        try:
            data = Path(args.manifest).read_bytes()
        except OSError as exc:
            raise _Refused(f"--manifest: {exc}") from None
        where = str(args.manifest)
    else:
        doc = _edge_json(args.edge, "/v1/manifest")
        try:
            data = bytes.fromhex(doc["envelope"])
        except (KeyError, TypeError, ValueError):
            raise _Refused(f"edge failed verification: {args.edge}/v1/manifest has no envelope") from None
        where = f"the edge {args.edge}"
    try:
        Revision.verify(SignedEnvelope.from_bytes(data), authority)
    except PeerloomError as exc:
        raise _Refused(f"edge failed verification: the manifest from {where} is not a revision signed by "
                       f"{authority.to_text()}: {exc}") from None
    return data


def _advertised(edge: str) -> list[str]:
    """The ``http://`` transport addresses the edge's ``/healthz`` lists (at most `MAX_ADVERTISED`), a
    wildcard host replaced by the edge's own host. Anything malformed is skipped: a wrong address costs a
    failed dial, and the Noise handshake and the manifest's signatures decide what is trusted."""
    from peerloom.adapters.transport import canonical_address

    doc = _edge_json(edge, "/healthz")
    listed = doc.get("addresses") if isinstance(doc, dict) else None
    if not isinstance(listed, list):
        return []
    host = urllib.parse.urlsplit(edge).hostname or "127.0.0.1"
    out = []
    for address in listed[:MAX_ADVERTISED]:
        if not isinstance(address, str) or not address.startswith("http://"):
            continue
        parts = urllib.parse.urlsplit(address)
        try:
            if parts.hostname is not None and ipaddress.ip_address(parts.hostname).is_unspecified:
                address = f"http://{f'[{host}]' if ':' in host else host}:{parts.port}"
            out.append(canonical_address(address))
        except ValueError:
            continue
    return out


def _edge_json(edge: str, path: str) -> Any:
    from peerloom.adapters.http_client import EdgeClient, EdgeError
    from peerloom.core.errors import PeerloomError

    try:
        return EdgeClient(edge, timeout_s=10.0, max_retries=2).get_json(path)
    except (OSError, EdgeError, ValueError, PeerloomError) as exc:  # PeerloomError: an answer over 32 MiB
        raise _Refused(f"cannot start from {edge}: {exc}") from None


def _run_node(args: argparse.Namespace, envelope: bytes, peers: list[str], workdir: Path) -> int:
    """Write the node config to `workdir`, run the node until `args.updates` of its updates are certified
    or `args.timeout` seconds pass; returns the exit status."""
    import tomli_w
    import trio

    from peerloom.adapters.logs import setup_logging
    from peerloom.adapters.storage import atomic_write
    from peerloom.node import ConfigError, build_runtime, load_config

    workdir.mkdir(parents=True, exist_ok=True)
    atomic_write(workdir / "manifest.cbor", envelope)
    config: dict[str, Any] = {
        "name": "light", "roles": ["trainer"], "key": str(Path(args.key).resolve()), "manifest": "manifest.cbor",
        "authority": args.authority, "store": "store", "transport": {"kind": "http", "dial_only": True},
        "bootstrap": peers, "capacity": args.capacity, "threads": args.threads, "events": "events.jsonl",
        "log_level": args.log_level,
    }
    if args.workload is not None:
        config["workload"] = args.workload
    path = workdir / "light.toml"
    atomic_write(path, tomli_w.dumps(config).encode())
    try:
        config = load_config(path)
        setup_logging("auto", args.log_level, name="light")
        runtime = build_runtime(config, path)
    except (ConfigError, OSError) as exc:
        return _fail(str(exc))
    watch = _CertifiedUpdates(runtime, wanted=args.updates)
    runtime.on_head = watch.on_head

    async def main() -> None:
        watch.done = trio.Event()
        with trio.move_on_after(args.timeout):
            async with trio.open_nursery() as nursery:
                await nursery.start(runtime.run)
                watch.on_head(runtime.engine.head, None)  # a restart in the same workdir may be done already
                await watch.done.wait()
                nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        runtime.close()
    if watch.certified < args.updates:
        print(f"peerloom light: {watch.certified} of {args.updates} updates in certified heads in "
              f"{args.timeout:g} s", file=sys.stderr)
        return 1
    return 0


class _CertifiedUpdates:
    """Counts this node's updates in the certified heads its runtime promotes and prints the JSON lines.

    An update of ours is an announcement this trainer recorded under `core.trainer.claim_key` for the head's
    window (its own lease or a lease claim) whose envelope id the head's cohort lists."""

    def __init__(self, runtime: Any, *, wanted: int) -> None:
        self.runtime = runtime
        self.wanted = wanted
        self.me = runtime.identity.peer_id
        self.rostered = self.me in runtime.engine.head.roster_peers
        self.seen: set[bytes] = set()
        self.certified = 0
        self.done: Any = None  # a trio.Event, set once `wanted` updates are certified

    def on_head(self, head: Any, certificate: Any) -> None:
        from peerloom.core.envelope import SignedEnvelope
        from peerloom.core.objects import PROTOCOL_VERSION, UpdateAnnouncement
        from peerloom.core.records import claim_key

        if not self.rostered and self.me in head.roster_peers:
            self.rostered = True
            self._line(window=head.window, shards=[], joined=True, update_id="", train_loss=float("nan"))
        own, prefix = claim_key(head.window), claim_key(head.window) + "/"
        cohort = set(head.cohort)
        for key, record in list(self.runtime.engine.records.items()):
            if key != own and not key.startswith(prefix):
                continue
            envelope = SignedEnvelope.from_bytes(record)  # our own record, written by our engine
            if envelope.id not in cohort or envelope.id in self.seen:
                continue
            self.seen.add(envelope.id)
            ann = UpdateAnnouncement.from_cbor(envelope.open(UpdateAnnouncement.KIND, PROTOCOL_VERSION))
            self.certified += 1
            self._line(window=head.window, shards=list(ann.shards), joined=False, update_id=envelope.id.hex(),
                       train_loss=ann.train_loss)
        if self.certified >= self.wanted and self.done is not None:
            self.done.set()

    @staticmethod
    def _line(**fields: Any) -> None:
        print(json.dumps(fields), flush=True)

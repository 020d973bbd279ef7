"""`peerloom light --edge URL --authority PEERID --key FILE`: a light trainer that needs only HTTP access to
one node's edge and its own key (DESIGN §6; `adapters.http_client.LightTrainer`).

Each poll it reads the latest certified head (verified against the manifest signed by `--authority`),
joins the roster if absent, trains on the shards the lease function gives it and uploads one signed update
per window. It prints one JSON line per step that joined or uploaded (``window``, ``shards``, ``joined``,
``update_id``, ``train_loss``) and exits 0 once `--updates` updates were accepted by the edge, 1 if
`--timeout` seconds passed first, 2 on bad arguments, an unreadable key or an edge that fails verification.
A refused upload (HTTP 4xx, e.g. a window that closed meanwhile) or an unreachable edge is reported on
stderr and retried at the next poll.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from peerloom.core.errors import PeerloomError, VerificationError
from peerloom.core.identity import PeerId


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("light", help="train as a light peer through a node's HTTP edge only")
    parser.add_argument("--edge", required=True, metavar="URL", help="the edge's base URL, e.g. http://127.0.0.1:8080")
    parser.add_argument("--authority", required=True, metavar="PEERID", help="peer id that signed the manifest")
    parser.add_argument("--key", type=Path, required=True, metavar="FILE", help="identity key file (peerloom keygen)")
    parser.add_argument("--updates", type=int, default=1, metavar="N", help="stop after N accepted updates")
    parser.add_argument("--threads", type=int, default=1, help="compute threads (torch)")
    parser.add_argument("--capacity", type=int, default=1, help="shards per window to ask for when joining")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS", help="give up after this long")
    parser.add_argument("--poll", type=float, default=0.5, metavar="SECONDS", help="seconds between head polls")
    parser.add_argument("--workdir", type=Path, default=None, help="artifact store directory (default: a temp dir)")
    parser.add_argument("--workload", default=None, metavar="MODULE:FUNCTION",
                        help="workload factory (seed, num_shards) -> (workload, shards); default: the manifest's")


def _fail(message: str) -> int:
    print(f"peerloom light: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from peerloom.adapters.http_client import EdgeClient, EdgeError, LightTrainer
    from peerloom.adapters.keys import load_identity

    if args.updates < 1 or args.threads < 1 or args.capacity < 1 or args.poll < 0:
        return _fail("--updates, --threads and --capacity must be at least 1, --poll at least 0")
    try:
        identity = load_identity(args.key)
        authority = PeerId.from_text(args.authority)
    except (OSError, ValueError, PeerloomError) as exc:
        return _fail(str(exc))
    client = EdgeClient(args.edge)
    try:
        workload = shards = None
        if args.workload is not None:  # the manifest's numbers (seed, shard count) with another factory
            from peerloom.node import ConfigError, build_node_workload

            manifest = client.revision(authority).manifest
            try:
                workload, shards = build_node_workload({"workload": args.workload}, manifest.workload,
                                                       manifest.workload_seed, len(manifest.shards))
            except ConfigError as exc:
                return _fail(str(exc))
        trainer = LightTrainer(client, identity, authority=authority, capacity=args.capacity, workload=workload,
                               shards=shards, workdir=args.workdir)
    except (OSError, EdgeError, PeerloomError) as exc:
        return _fail(f"cannot start from {args.edge}: {exc}")
    if "torch" in sys.modules:  # only workloads that use torch pay for importing it
        sys.modules["torch"].set_num_threads(args.threads)
    try:
        return _loop(trainer, updates=args.updates, timeout_s=args.timeout, poll_s=args.poll)
    finally:
        trainer.close()


def _loop(trainer: Any, *, updates: int, timeout_s: float, poll_s: float) -> int:
    from peerloom.adapters.http_client import EdgeError

    accepted = 0
    deadline = time.monotonic() + timeout_s
    while accepted < updates:
        if time.monotonic() >= deadline:
            print(f"peerloom light: {accepted} of {updates} updates accepted in {timeout_s:g} s", file=sys.stderr)
            return 1
        try:
            step = trainer.step()
        except EdgeError as exc:  # refused (a closed window, a rate limit): try again next window
            print(f"peerloom light: refused: {exc}", file=sys.stderr)
        except VerificationError as exc:  # the edge served something that does not verify: stop trusting it
            return _fail(f"edge failed verification: {exc}")
        except OSError as exc:
            print(f"peerloom light: edge unreachable: {exc}", file=sys.stderr)
        else:
            if step.update_id or step.joined:
                print(json.dumps({"window": step.window, "shards": list(step.shards), "joined": step.joined,
                                  "update_id": step.update_id, "train_loss": step.train_loss}), flush=True)
            accepted += bool(step.update_id)
            if accepted >= updates:
                break
        time.sleep(poll_s)
    return 0

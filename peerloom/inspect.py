"""`peerloom inspect DIR`: what a node's store holds — chain, peers, recent windows, votes — as tables.

DIR is a node's store directory (the one holding ``node.db``) or a directory with a ``store/`` inside (a
node directory as `peerloom demo` lays them out). Read-only in spirit: it opens the database the way the
node does (running pending schema migrations) and never changes records.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from peerloom.adapters.database import DB_NAME, Database
from peerloom.core.chain import decode_chain_entry
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.errors import PeerloomError


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("inspect", help="show a node store's chain, peers and last windows")
    parser.add_argument("dir", type=Path, help="a store directory (with node.db) or a node directory")
    parser.add_argument("--windows", type=int, default=10, help="how many recent windows to list")


def find_store(directory: Path) -> Path:
    """The store directory under `directory`. FileNotFoundError if there is none."""
    for candidate in (directory, directory / "store"):
        if (candidate / DB_NAME).exists():
            return candidate
    raise FileNotFoundError(f"{directory}: no {DB_NAME} here or in {directory / 'store'}")


def _short(data: bytes) -> str:
    return data[2:].hex()[:16] if len(data) > 2 else data.hex()


def render(store: Path, *, windows: int = 10, console: Console | None = None) -> None:
    """Print the tables for the store at `store` (see the module docstring)."""
    console = console or Console()
    db = Database(store / DB_NAME)
    try:
        heads = db.heads(limit=windows)
        manifest = store / "manifest.cbor"
        if manifest.exists():
            try:
                env = SignedEnvelope.from_bytes(manifest.read_bytes())
                console.print(f"revision {_short(env.id)} signed by {env.signer}")
            except PeerloomError as exc:
                console.print(f"[red]manifest.cbor does not parse: {exc}[/]")
        chain = Table(title=f"chain (latest {len(heads)} certified heads)")
        for column in ("window", "head", "parent", "skipped", "cohort", "signatures", "round", "metrics"):
            chain.add_column(column)
        for window, head_id, entry in heads:
            try:
                head, cert = decode_chain_entry(entry)
            except PeerloomError as exc:
                chain.add_row(str(window), _short(head_id), "", "", "", "", "", f"[red]bad entry: {exc}[/]")
                continue
            metrics = " ".join(f"{k.removeprefix('test_')} {v:.3f}" for k, v in head.metrics.items())
            chain.add_row(str(window), _short(head.id), _short(head.parent or b""), "yes" if head.skipped else "",
                          str(len(head.cohort)), str(len(cert.votes)), str(cert.round), metrics)
        console.print(chain)

        votes = db.votes()
        recent = sorted({w for w, *_ in votes})[-windows:]
        vote_table = Table(title=f"votes cast ({len(votes)} in all; last {len(recent)} windows)")
        for column in ("window", "round", "step", "vote id"):
            vote_table.add_column(column)
        for window, round_, step, envelope in votes:
            if window in recent:
                vote_table.add_row(str(window), str(round_), step, _short(SignedEnvelope.from_bytes(envelope).id))
        console.print(vote_table)

        claims = db.claims()[-windows:]
        if claims:
            claim_table = Table(title="lease claims (trainer announcements)")
            claim_table.add_column("window")
            claim_table.add_column("update id")
            for window, envelope in claims:
                claim_table.add_row(str(window), _short(SignedEnvelope.from_bytes(envelope).id))
            console.print(claim_table)

        reputation = db.reputation()
        peers = Table(title="peers")
        for column in ("peer", "address", "last seen", "rejections"):
            peers.add_column(column)
        now = time.time()
        for peer, address, _, last_seen in db.peers():
            charged = ", ".join(f"{r} x{n}" for r, n in sorted(reputation.get(peer, {}).items()))
            peers.add_row(peer, address or "", f"{now - last_seen:.0f} s ago", charged)
        console.print(peers)
        console.print(f"schema version {db.schema_version}, integrity {db.integrity_check()}, "
                      f"pins {len(db.pins())}")
    finally:
        db.close()


def run(args: argparse.Namespace) -> int:
    try:
        store = find_store(args.dir)
    except FileNotFoundError as exc:
        print(f"peerloom inspect: {exc}", file=sys.stderr)
        return 2
    render(store, windows=args.windows)
    return 0

"""Retention and snapshots (spec/protocol.md §8.1, spec/design.md §2): which stored artifacts a node forgets
as its head moves on, and the engine's durable state as canonical CBOR. Pure functions over the engine's
state; the engine emits what they decide (`DropArtifacts`, a `Log`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .encoding import decode, encode
from .errors import DecodeError, LocalProtocolError
from .objects import ArtifactRef, Head

SNAPSHOT_VERSION = 1
SNAPSHOT_KEYS = frozenset({"version", "revision", "now", "records", "stored", "stats", "rejected", "seen_deltas",
                           "joins", "admitted", "leaves", "evidence", "heard", "first_window"})


def retire(stored: dict[bytes, ArtifactRef], stored_at: dict[bytes, int], head: Head, keep_windows: int,
           overlap: int) -> tuple[tuple[bytes, ...], int]:
    """Retention (spec/protocol.md §8.1): forget the stored artifacts first held while the head was older than
    ``window - keep_windows``, except the current head's params and optimizer state; returns their digests
    (sorted, to drop with `DropArtifacts`) and the bytes freed. What a window's work needs (its base head's
    params and state, its updates, the proposals and the next params) is held from the base head on, so it
    outlives the window by `keep_windows` heads; a peer asking for a dropped artifact gets `chunk-missing`.
    Overlapped windows keep `overlap` more: an update's base may be that many heads older (spec/protocol.md
    §5.2). `keep_windows` 0 keeps everything."""
    keep = keep_windows
    if keep <= 0:
        return (), 0
    keep += overlap
    for digest in stored:
        stored_at.setdefault(digest, head.window)  # restored with the node: from now on
    pinned = {head.params.digest}
    if head.outer_state is not None:
        pinned.add(head.outer_state.digest)
    floor = head.window - keep
    old = sorted(d for d, w in stored_at.items() if w < floor and d not in pinned)
    freed = 0
    for digest in old:
        freed += stored.pop(digest).size
        del stored_at[digest]
    return tuple(old), freed


def drop(stored: dict[bytes, ArtifactRef], stored_at: dict[bytes, int], head: Head,
         digests: Iterable[bytes]) -> tuple[bytes, ...]:
    """Forget stored artifacts this node will not serve again, such as a trainer's checkpoints that no audit
    selected (spec/protocol.md §6.3); returns the digests forgotten, sorted. The current head's params and
    optimizer state are never dropped."""
    pinned = {head.params.digest} | ({head.outer_state.digest} if head.outer_state else set())
    gone = tuple(sorted(d for d in set(digests) if d in stored and d not in pinned))
    for digest in gone:
        del stored[digest]
        stored_at.pop(digest, None)
    return gone


def encode_snapshot(*, revision: bytes, now: float, records: Mapping[str, bytes],
                    stored: Mapping[bytes, ArtifactRef], stats: Mapping[str, int], rejected: Mapping[str, int],
                    seen_deltas: Mapping[bytes, int], validator: Mapping[str, Any] | None) -> bytes:
    """The engine's durable state as canonical CBOR (`Engine.snapshot`); `validator` is the validator role's
    `durable_state()`, None on a node without that role."""
    state: dict[str, Any] = {
        "version": SNAPSHOT_VERSION, "revision": revision,
        "now": now if now != float("-inf") else None,
        "records": dict(sorted(records.items())),
        "stored": [r.to_cbor() for _, r in sorted(stored.items())],
        "stats": dict(sorted(stats.items())), "rejected": dict(sorted(rejected.items())),
        "seen_deltas": sorted([d, w] for d, w in seen_deltas.items()),
        "joins": [], "admitted": [], "leaves": [], "evidence": [], "heard": [], "first_window": None,
    }
    if validator is not None:
        # Who was heard when (heartbeats, updates, joins) too: idle expiry picks up where it left off.
        state.update(validator)
    return encode(state)


def decode_snapshot(data: bytes, revision: bytes) -> dict[str, Any]:
    """The state `encode_snapshot` wrote. Raises DecodeError/VerificationError for bytes that are not a
    snapshot, LocalProtocolError for a snapshot of another revision than `revision`."""
    state = decode(data, max_bytes=1 << 30)
    if not isinstance(state, dict) or set(state) != SNAPSHOT_KEYS or state["version"] != SNAPSHOT_VERSION:
        raise DecodeError("bad-snapshot", "not an engine snapshot")
    if state["revision"] != revision:
        raise LocalProtocolError("snapshot of another revision")
    return state

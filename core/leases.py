"""Lease assignment by weighted rendezvous hashing (DESIGN §4, spec/protocol.md §4).

For window w the owner of shard s is a pure function of the certified head of window w-1: every rostered
trainer p with capacity c draws c scores ``SHA-256(domain, head_id, w, s, p, j)`` for j < c, and the trainer
holding the largest score gets the shard. Everyone computes the same leases, so there are no conflicts.

Using c integer draws instead of the textbook ``-c / ln(h)`` score (Schindelhauer & Schomaker 2005;
Thaler & Ravishankar 1998 for plain rendezvous hashing) gives the same capacity-proportional odds with
exact integer comparisons, so no platform's libm can make two honest peers disagree.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from .identity import PeerId
from .objects import Head, Manifest

LEASE_DOMAIN = b"peerloom/lease/v1"


def _score(head_id: bytes, window: int, shard: int, peer: PeerId, capacity: int) -> bytes:
    best = b""
    prefix = LEASE_DOMAIN + head_id + window.to_bytes(8, "big") + shard.to_bytes(4, "big") + peer.to_bytes()
    for j in range(capacity):
        best = max(best, hashlib.sha256(prefix + j.to_bytes(2, "big")).digest())
    return best


def assign_shards(head_id: bytes, window: int, num_shards: int,
                  roster: Sequence[tuple[PeerId, int]], max_capacity: int,
                  excluded: frozenset[PeerId] = frozenset()) -> dict[int, PeerId]:
    """Owner of every shard for `window`. Capacities are clamped to 1..`max_capacity`.

    Returns {} when no eligible trainer exists. Ties (equal 32-byte hashes) break by peer id.
    """
    eligible = [(p, max(1, min(c, max_capacity))) for p, c in roster if p not in excluded]
    leases: dict[int, PeerId] = {}
    if not eligible:
        return leases
    for shard in range(num_shards):
        leases[shard] = max(eligible, key=lambda e: (_score(head_id, window, shard, e[0], e[1]), e[0]))[0]
    return leases


_CACHE: dict[bytes, dict[PeerId, tuple[int, ...]]] = {}
_CACHE_SIZE = 16


def leases_of(head: Head, manifest: Manifest) -> dict[PeerId, tuple[int, ...]]:
    """The leases of window `head.window + 1`: trainer -> its sorted shard numbers (do not mutate).

    Computed once per head and shared (a head id names its revision, hence the manifest): every engine in
    one process - a simulator's ten thousand trainers included - reuses one assignment per window.
    """
    key = head.id
    cached = _CACHE.get(key)
    if cached is None:
        cached = _compute_leases(head, manifest)
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = cached
    return cached


def _compute_leases(head: Head, manifest: Manifest) -> dict[PeerId, tuple[int, ...]]:
    owners = assign_shards(head.id, head.window + 1, len(manifest.shards), head.roster, manifest.max_capacity,
                           head.quarantined)
    by_peer: dict[PeerId, list[int]] = {}
    for shard, peer in owners.items():
        by_peer.setdefault(peer, []).append(shard)
    return {p: tuple(sorted(s)) for p, s in by_peer.items()}


def lease_weight(manifest: Manifest, shards: Sequence[int]) -> int:
    """Sample weight of a lease: the number of samples in its shards, from the manifest only."""
    return sum(manifest.shards[s] for s in shards)

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
    return {s: ranked[0] for s, ranked in rank_shards(head_id, window, num_shards, roster, max_capacity,
                                                      excluded).items()}


def rank_shards(head_id: bytes, window: int, num_shards: int, roster: Sequence[tuple[PeerId, int]],
                max_capacity: int, excluded: frozenset[PeerId] = frozenset()) -> dict[int, tuple[PeerId, ...]]:
    """The two best-ranked trainers of every shard: (owner,) or (owner, next-ranked), one pass each."""
    eligible = [(p, max(1, min(c, max_capacity))) for p, c in roster if p not in excluded]
    ranked: dict[int, tuple[PeerId, ...]] = {}
    if not eligible:
        return ranked
    for shard in range(num_shards):
        best: list[tuple[bytes, PeerId]] = []
        for peer, capacity in eligible:
            key = (_score(head_id, window, shard, peer, capacity), peer)
            if len(best) < 2:
                best.append(key)
                best.sort(reverse=True)
            elif key > best[1]:
                best[1] = key
                best.sort(reverse=True)
        ranked[shard] = tuple(p for _, p in best)
    return ranked


_CACHE: dict[bytes, dict[PeerId, tuple[int, ...]]] = {}
_CLAIMS: dict[bytes, dict[PeerId, dict[PeerId, tuple[int, ...]]]] = {}
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


def claims_of(head: Head, manifest: Manifest) -> dict[PeerId, dict[PeerId, tuple[int, ...]]]:
    """Next-ranked claims of window `head.window + 1`: claimant -> {leaseholder: the leaseholder's shards
    the claimant ranks second for}. A claim is valid only after the lease expired (spec/protocol.md §4)."""
    key = head.id
    if key not in _CLAIMS:
        _compute_leases(head, manifest)
    return _CLAIMS[key]


def _compute_leases(head: Head, manifest: Manifest) -> dict[PeerId, tuple[int, ...]]:
    ranked = rank_shards(head.id, head.window + 1, len(manifest.shards), head.roster, manifest.max_capacity,
                         head.quarantined)
    by_peer: dict[PeerId, list[int]] = {}
    claims: dict[PeerId, dict[PeerId, list[int]]] = {}
    for shard, peers in ranked.items():
        by_peer.setdefault(peers[0], []).append(shard)
        if len(peers) > 1:
            claims.setdefault(peers[1], {}).setdefault(peers[0], []).append(shard)
    if len(_CLAIMS) >= _CACHE_SIZE:
        _CLAIMS.pop(next(iter(_CLAIMS)))
    _CLAIMS[head.id] = {c: {p: tuple(sorted(s)) for p, s in by.items()} for c, by in claims.items()}
    return {p: tuple(sorted(s)) for p, s in by_peer.items()}


def lease_weight(manifest: Manifest, shards: Sequence[int]) -> int:
    """Sample weight of a lease: the number of samples in its shards, from the manifest only."""
    return sum(manifest.shards[s] for s in shards)

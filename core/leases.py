"""Lease assignment by a capacity-weighted random permutation of slots (spec/design.md §4, spec/protocol.md §4).

For window w the owner of shard s is a pure function of the certified head of window w-1: every rostered,
non-quarantined trainer p with capacity c holds c *slots*, slot j keyed ``SHA-256(domain, head_id, w, p,
j)``. Sorting the slots by key gives a fresh uniformly random order every window (the head id changes);
shard s goes to the trainer of slot ``s mod V`` (V slots in all), and its next-ranked trainer is the trainer
of the first later slot (cyclically) held by someone else. Everyone computes the same leases, so there are
no conflicts.

Compared with weighted rendezvous hashing (one score per shard and trainer: O(shards x roster) hashes, 10^8
per window at 10,000 trainers and shards), this costs V hashes and one sort, and it balances exactly:
each slot gets floor(S/V) or ceil(S/V) shards, so a trainer's share is proportional to its capacity in
every window, not only on average. Rendezvous hashing's minimal disruption under roster changes buys
nothing here, because the head id reshuffles every window anyway. Keys are compared as bytes, so no
platform can make two honest peers disagree.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

from .identity import PeerId
from .objects import Head, Manifest

LEASE_DOMAIN = b"peerloom/lease/v2"


def slot_order(head_id: bytes, window: int, roster: Sequence[tuple[PeerId, int]], max_capacity: int,
               excluded: frozenset[PeerId] = frozenset()) -> list[PeerId]:
    """The holders of all slots of `window`, in slot order (one entry per slot: a peer of capacity c
    appears c times). Capacities are clamped to 1..`max_capacity`; `excluded` peers hold no slot. Ties of
    the 32-byte keys (never seen in practice) break by peer id, then slot number."""
    prefix = LEASE_DOMAIN + head_id + window.to_bytes(8, "big")
    keyed: list[tuple[bytes, bytes, int, PeerId]] = []
    for peer, capacity in roster:
        if peer in excluded:
            continue
        peer_bytes = peer.to_bytes()
        for j in range(max(1, min(capacity, max_capacity))):
            key = hashlib.sha256(prefix + peer_bytes + j.to_bytes(2, "big")).digest()
            keyed.append((key, peer_bytes, j, peer))
    keyed.sort(key=lambda k: k[:3])
    return [k[3] for k in keyed]


def assign_shards(head_id: bytes, window: int, num_shards: int,
                  roster: Sequence[tuple[PeerId, int]], max_capacity: int,
                  excluded: frozenset[PeerId] = frozenset()) -> dict[int, PeerId]:
    """Owner of every shard for `window`; {} when no eligible trainer exists."""
    return {s: ranked[0] for s, ranked in rank_shards(head_id, window, num_shards, roster, max_capacity,
                                                      excluded).items()}


def unproven_cap(num_shards: int, share: float) -> int:
    """The most shards unproven trainers may hold in one window (spec/protocol.md §4.1): `share` of them,
    rounded down, but at least one, so that a joiner can always prove itself."""
    return num_shards if share >= 1.0 else max(1, math.floor(share * num_shards))


def rank_shards(head_id: bytes, window: int, num_shards: int, roster: Sequence[tuple[PeerId, int]],
                max_capacity: int, excluded: frozenset[PeerId] = frozenset(),
                unproven: frozenset[PeerId] = frozenset(), unproven_share: float = 1.0,
                ) -> dict[int, tuple[PeerId, ...]]:
    """The owner and next-ranked trainer of every shard: (owner,) when only one trainer is eligible, else
    (owner, next-ranked).

    Shard s goes to slot ``s mod V``. While some eligible trainer is proven, the shards past the first
    `unproven_cap` ones (in shard order) that would go to `unproven` trainers go instead, in turn, to the
    proven slots in slot order (spec/protocol.md §4.1)."""
    slots = slot_order(head_id, window, roster, max_capacity, excluded)
    total = len(slots)
    if not total:
        return {}
    slot_of = [shard % total for shard in range(num_shards)]
    if unproven and unproven_share < 1.0:
        proven_slots = [i for i, p in enumerate(slots) if p not in unproven]
        cap, held, moved = unproven_cap(num_shards, unproven_share), 0, 0
        for shard in range(num_shards) if proven_slots else ():
            if slots[slot_of[shard]] in unproven:
                if held < cap:
                    held += 1
                else:
                    slot_of[shard] = proven_slots[moved % len(proven_slots)]
                    moved += 1
    # following[i]: index of the first slot after i (cyclically) whose holder differs from slot i's; one
    # backward pass over the slots laid out twice, so long runs of one holder cost nothing extra.
    doubled = slots + slots
    after: list[int | None] = [None] * (2 * total)
    for k in range(2 * total - 2, -1, -1):
        after[k] = k + 1 if doubled[k + 1] != doubled[k] else after[k + 1]
    following = [None if (j := after[i]) is None or j - i >= total else j % total for i in range(total)]
    ranked: dict[int, tuple[PeerId, ...]] = {}
    for shard in range(num_shards):
        i = slot_of[shard]
        nxt = following[i]
        ranked[shard] = (slots[i],) if nxt is None else (slots[i], slots[nxt])
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
                         head.quarantined, frozenset(head.unproven), manifest.unproven_share)
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


# --- unproven trainers (spec/protocol.md §4.1) ----------------------------------------------------------


def demotable(parent: Head, manifest: Manifest, skipped: bool) -> frozenset[PeerId]:
    """The trainers that the head after `parent` turns unproven unless they deliver (spec/protocol.md §4.1):
    the leaseholders of its window, or nobody when that head is `skipped` (a skipped window proves and
    disproves nobody). `peerloom verify`, which cannot see an update's author, bounds `unproven` by this."""
    return frozenset() if skipped else frozenset(leases_of(parent, manifest))


def next_unproven(parent: Head, manifest: Manifest, roster: Sequence[tuple[PeerId, int]],
                  proven: frozenset[PeerId], delivered: frozenset[PeerId] | None) -> tuple[PeerId, ...]:
    """The `unproven` of the head after `parent` with `roster` (spec/protocol.md §4.1), sorted: the parent's
    unproven, the newly rostered trainers and the leaseholders of the window that delivered nothing
    (`delivered`: the authors of the head's cohort and rejected updates; None for a skipped head, which
    demotes nobody), less the trainers no longer rostered and the authors of cohort updates (`proven`)."""
    before = parent.roster_peers
    silent = demotable(parent, manifest, delivered is None) - (delivered or frozenset())
    return tuple(sorted(p for p, _ in roster
                        if (p in parent.unproven or p not in before or p in silent) and p not in proven))


def undelivered(parent: Head, manifest: Manifest, delivered: frozenset[PeerId]) -> frozenset[PeerId]:
    """Unproven trainers of `parent` that hold a lease in the next window and are not among `delivered` (the
    authors of the next head's cohort and rejected updates): the next head drops them (§4.1)."""
    if not parent.unproven:
        return frozenset()
    leases = leases_of(parent, manifest)
    return frozenset(p for p in parent.unproven if p in leases and p not in delivered)

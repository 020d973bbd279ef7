"""Lease assignment by a capacity-weighted random permutation of slots (spec/design.md §4, spec/protocol.md §4).

For window w the owner of shard s is a pure function of the certified head of window w-1-overlap (the
*lease head*: w-1 unless the manifest overlaps windows, spec/protocol.md §5.2): every rostered,
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
from collections.abc import Mapping, Sequence

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


_CACHE: dict[tuple[bytes, int], dict[PeerId, tuple[int, ...]]] = {}
_CLAIMS: dict[tuple[bytes, int], dict[PeerId, dict[PeerId, tuple[int, ...]]]] = {}
_CACHE_SIZE = 16


def lease_window(window: int, manifest: Manifest) -> int:
    """The window of the certified head that draws the leases of `window` (its *lease head*): `window - 1 -
    manifest.overlap`, and genesis (0) for the first windows (spec/protocol.md §4, §5.2)."""
    return max(0, window - 1 - manifest.overlap)


def leases_of(head: Head, manifest: Manifest, window: int | None = None) -> dict[PeerId, tuple[int, ...]]:
    """The leases of `window` drawn from `head`, its lease head (`lease_window`; default `head.window + 1`,
    which is the rule without overlap): trainer -> its sorted shard numbers (do not mutate).

    Computed once per (head, window) and shared (a head id names its revision, hence the manifest): every
    engine in one process - a simulator's ten thousand trainers included - reuses one assignment per window.
    """
    key = (head.id, head.window + 1 if window is None else window)
    cached = _CACHE.get(key)
    if cached is None:
        cached = _compute_leases(head, manifest, key[1])
    return cached


def claims_of(head: Head, manifest: Manifest, window: int | None = None) -> dict[PeerId, dict[PeerId, tuple[int, ...]]]:
    """Next-ranked claims of `window` (default `head.window + 1`) drawn from `head`: claimant -> {leaseholder: the
    leaseholder's shards the claimant ranks second for}. A claim is valid only after the lease expired
    (spec/protocol.md §4)."""
    key = (head.id, head.window + 1 if window is None else window)
    if key not in _CLAIMS:
        _compute_leases(head, manifest, key[1])
    return _CLAIMS[key]


def _compute_leases(head: Head, manifest: Manifest, window: int) -> dict[PeerId, tuple[int, ...]]:
    ranked = rank_shards(head.id, window, len(manifest.shards), head.roster, manifest.max_capacity,
                         head.quarantined, frozenset(head.unproven), manifest.unproven_share)
    by_peer: dict[PeerId, list[int]] = {}
    claims: dict[PeerId, dict[PeerId, list[int]]] = {}
    for shard, peers in ranked.items():
        by_peer.setdefault(peers[0], []).append(shard)
        if len(peers) > 1:
            claims.setdefault(peers[1], {}).setdefault(peers[0], []).append(shard)
    for cache in (_CACHE, _CLAIMS):
        if len(cache) >= _CACHE_SIZE:
            cache.pop(next(iter(cache)))
    leases = {p: tuple(sorted(s)) for p, s in by_peer.items()}
    _CLAIMS[(head.id, window)] = {c: {p: tuple(sorted(s)) for p, s in by.items()} for c, by in claims.items()}
    _CACHE[(head.id, window)] = leases
    return leases


def lease_fault(author: PeerId, shards: Sequence[int], leases: Mapping[PeerId, Sequence[int]]) -> str | None:
    """Why an update by `author` for `shards` holds no lease of `leases` (its window's lease table): ``no-lease``
    when `author` holds none (quarantined peers hold none), ``bad-lease`` when it holds other shards; None
    when it holds exactly these. The one rule that the collector and the HTTP edge both apply."""
    held = leases.get(author)
    if held is None:
        return "no-lease"
    return "bad-lease" if tuple(shards) != tuple(held) else None


def lease_weight(manifest: Manifest, shards: Sequence[int]) -> int:
    """Sample weight of a lease: the number of samples in its shards, from the manifest only."""
    return sum(manifest.shards[s] for s in shards)


# --- unproven trainers (spec/protocol.md §4.1) ----------------------------------------------------------


def demotable(leases: Mapping[PeerId, Sequence[int]], skipped: bool) -> frozenset[PeerId]:
    """The trainers that the head of a window turns unproven unless they deliver (spec/protocol.md §4.1):
    the holders of that window's `leases`, or nobody when that head is `skipped` (a skipped window proves
    and disproves nobody). `peerloom verify`, which cannot see an update's author, bounds `unproven` by this."""
    return frozenset() if skipped else frozenset(leases)


def next_unproven(parent: Head, leases: Mapping[PeerId, Sequence[int]], roster: Sequence[tuple[PeerId, int]],
                  proven: frozenset[PeerId], delivered: frozenset[PeerId] | None) -> tuple[PeerId, ...]:
    """The `unproven` of the head after `parent` with `roster` (spec/protocol.md §4.1), sorted: the parent's
    unproven, the newly rostered trainers and the holders of the window's `leases` that delivered nothing
    (`delivered`: the authors of the head's cohort and rejected updates; None for a skipped head, which
    demotes nobody), less the trainers no longer rostered and the authors of cohort updates (`proven`)."""
    before = parent.roster_peers
    silent = demotable(leases, delivered is None) - (delivered or frozenset())
    return tuple(sorted(p for p, _ in roster
                        if (p in parent.unproven or p not in before or p in silent) and p not in proven))


def undelivered(parent: Head, leases: Mapping[PeerId, Sequence[int]],
                delivered: frozenset[PeerId]) -> frozenset[PeerId]:
    """Unproven trainers of `parent` that hold one of the next window's `leases` and are not among `delivered`
    (the authors of the next head's cohort and rejected updates): the next head drops them (§4.1)."""
    if not parent.unproven:
        return frozenset()
    return frozenset(p for p in parent.unproven if p in leases and p not in delivered)

"""Recomputation audits: validators re-run a trainer's training and compare (spec/protocol.md §6).

Statistical screening cannot catch an update crafted to look typical (ALIE, Baruch et al. 2019,
arXiv:1902.06156, sits *closer* to the cohort's centre than honest updates do). What it cannot fake is
the computation itself: a trainer's update is a deterministic function of the base head's params, its
leased shards, the manifest's training settings and a seed that nobody chooses. With ``audit = true`` in
the manifest, every validator and reducer re-runs that training in its `screen` task and rejects an
update whose cosine to the recomputation is below ``audit_min_cosine`` (``screen-audit``, a strike).

This module holds the two pure pieces every peer must agree on: the training seed and the comparison
threshold's meaning. The seed is derived from public values only, so a trainer cannot pick a seed that
happens to favour it, and a claimant training a silent leaseholder's shards gets a seed of its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from .identity import PeerId

SEED_DOMAIN = b"peerloom/train-seed/v1"


def train_seed(base: bytes, window: int, shards: Sequence[int], author: PeerId) -> int:
    """The 32-bit seed a trainer MUST train with: the first 4 bytes (big-endian) of
    SHA-256(``SEED_DOMAIN`` ‖ base head id ‖ window as 8 bytes ‖ each shard as 4 bytes ‖ author peer id bytes).
    """
    h = hashlib.sha256(SEED_DOMAIN)
    h.update(base)
    h.update(window.to_bytes(8, "big"))
    for shard in shards:
        h.update(shard.to_bytes(4, "big"))
    h.update(author.to_bytes())
    return int.from_bytes(h.digest()[:4], "big")

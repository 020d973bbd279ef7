"""Byzantine trainer behaviours for demos and end-to-end tests: a workload wrapper that lies.

A node whose config sets ``behaviour = "sign-flip-scale"`` (or any name in
`peerloom.backends.attacks.ATTACKS`) trains honestly on its lease and then sends the update
`peerloom.backends.attacks.craft_update` makes of it. The node signs and announces that update like any
other: nothing in the protocol marks it, so only screening and the aggregation rule can stop it. The
attacker is alone — it sees no other trainer's update — so ALIE and IPM estimate the cohort from deltas
trained on slices of the attacker's own lease (`local_references`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from peerloom.backends.attacks import (
    ATTACKS,
    DATA_ATTACKS,
    NEEDS_REFERENCES,
    alie_z,
    craft_update,
    label_flipped,
    local_references,
)

# Attack parameters for the demo fleet (8 trainers, 2 of them Byzantine): ALIE's z from Baruch et al. for
# n = 8, f = 2; sign-flip-scale at the ×10 the robustness table uses.
DEMO_PARAMS: dict[str, dict[str, Any]] = {
    "alie": {"z": alie_z(8, 2)},
    "sign-flip-scale": {"scale": 10.0},
    "scaling": {"scale": 10.0},
}


class ByzantineWorkload:
    """Wraps a workload (same interface) so that `train` returns an attacker's update instead of the honest one.

    `train(params, indices, seed) -> (delta, metrics)`: `delta` is a dict of float32 arrays with the honest
    delta's names and shapes; the reported ``train_loss`` stays the honest one (a liar keeps its story
    straight). Deterministic given `seed`. ValueError for an unknown attack.
    """

    def __init__(self, inner: Any, attack: str, *, params: dict[str, Any] | None = None, seed: int = 0) -> None:
        if attack not in ATTACKS:
            raise ValueError(f"unknown behaviour {attack!r}; known: honest, {', '.join(ATTACKS)}")
        self.inner = label_flipped(inner) if attack in DATA_ATTACKS else inner
        self.attack = attack
        self.params = dict(DEMO_PARAMS.get(attack, {}) if params is None else params)
        self.seed = seed

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def train(self, params: dict[str, np.ndarray], indices: Sequence[int], seed: int,
              **options: Any) -> tuple[dict, dict]:
        delta, metrics = self.inner.train(params, indices, seed, **options)
        honest = {k: np.array(v, dtype=np.float32, copy=True) for k, v in delta.items()}
        references: list[dict[str, np.ndarray]] = []
        if self.attack in NEEDS_REFERENCES and len(indices) >= 2:
            references = local_references(self.inner, params, indices, seed, parts=min(4, len(indices)))
        rng = np.random.default_rng([self.seed, seed])
        if self.attack in DATA_ATTACKS:
            return honest, metrics
        return craft_update(self.attack, honest, references, rng, **self.params), metrics


def wrap_workload(workload: Any, behaviour: str | None, *, seed: int = 0) -> Any:
    """`workload` itself for ``None``/``"honest"``, else a `ByzantineWorkload` playing `behaviour`."""
    if behaviour in (None, "honest"):
        return workload
    return ByzantineWorkload(workload, behaviour, seed=seed)

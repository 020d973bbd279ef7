"""Byzantine trainer behaviours: the one shared definition used by the robustness bench, the simulator and
the demo (issue 5, issue 6 "Adversaries", issue 8).

Every model-level attack is a pure function of tensor dicts (``dict[str, np.ndarray]`` of float32 deltas,
DiLoCo sign convention ``delta = params_before - params_after``, see `TorchWorkload.train`):

    craft_update(attack, honest, references, rng, **params) -> delta

* ``honest``: the delta the attacker computed honestly on its own lease this window.
* ``references``: other deltas of the same window that the attacker knows or estimates. The omniscient
  setting of the ALIE and IPM papers gives it the honest cohort's deltas (colluding attackers share
  them). A lone attacker that sees nobody else's update estimates them from its own data: train on
  several disjoint sub-leases of its lease and pass those deltas (`local_references`). Those estimates
  come from fewer samples, so their spread is wider than the real cohort's and ALIE's ``mu - z sigma``
  lands further from the mean than the paper's attacker would put it (easier to detect, not weaker).
  Statistics are always taken over ``[honest, *references]``.
* ``rng``: the attack's only source of randomness (``np.random.Generator``), so runs replay by seed.

The returned dict is new (never aliases `honest` or `references`), same names, shapes and float32 dtype.

======================= ========================================================== =======================
attack                  update sent (parameters, defaults)                          source
======================= ========================================================== =======================
``sign-flip``           ``-honest``                                                 Damaskinos et al. 2018
                                                                                    / Allen-Zhu et al. 2020
``sign-flip-scale``     ``-scale * honest`` (``scale=10``)                          sign flip + scaling
``scaling``             ``scale * honest`` (``scale=10``)                           Bagdasaryan et al. 2018
                                                                                    (arXiv 1807.00459)
                                                                                    model-replacement boost
``gaussian-noise``      ``N(0, sigma^2)`` i.i.d. per coordinate (``sigma=1.0``,      Blanchard et al. 2017
                        absolute; with ``relative=True`` sigma is multiplied by     ("Gaussian" Byzantine
                        the honest delta's RMS)                                     worker), Xie et al.
                                                                                    2018 (1802.10116)
``alie``                ``mu - z * sigma`` coordinate-wise over the references      Baruch et al. 2019
                        (``z`` given, or ``z_max`` from ``num_workers`` n and       (arXiv 1902.06156)
                        ``num_byzantine`` f: ``s = floor(n/2 + 1) - f``,            "A Little Is Enough"
                        ``z = Phi^-1((n - s) / n)``; default z=1.0 without them)
``ipm``                 ``-epsilon * mean(references)`` (``epsilon=0.1``; the       Xie et al. 2019
                        paper's two regimes are 0.1 and 100)                        (arXiv 1903.03936)
                                                                                    inner-product
                                                                                    manipulation
``label-flip``          ``honest`` unchanged: the attack is in the data. The        Biggio et al. 2012;
                        attacker trains on ``flip_labels(y, C) = C - 1 - y``        Fang et al. 2020
                        (`label_flipped`), so its "honest" delta is already the     (arXiv 1911.11815)
                        poisoned one
``free-rider``          the ``previous`` aggregate (tensor dict, e.g. the last      Lin et al. 2019
                        window's pseudo-gradient) plus ``N(0, sigma^2)`` noise      (arXiv 1911.12560),
                        (``sigma=0``); zeros when no ``previous`` is given — it     "delta weights" free
                        never trains                                                rider
======================= ========================================================== =======================

Raises ValueError for an unknown attack, bad parameter values or references whose schema differs from
`honest`; TypeError for parameters the attack does not take.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist
from typing import Any

import numpy as np

TensorDict = dict[str, np.ndarray]

ATTACKS = (
    "sign-flip",
    "sign-flip-scale",
    "scaling",
    "gaussian-noise",
    "alie",
    "ipm",
    "label-flip",
    "free-rider",
)

DATA_ATTACKS = frozenset({"label-flip"})
"""Attacks that change the training data (`label_flipped`), not the update `craft_update` returns."""

NEEDS_REFERENCES = frozenset({"alie", "ipm"})
"""Attacks whose update is computed from `references` (with none they fall back to `honest` alone)."""

_PARAMS: dict[str, frozenset[str]] = {
    "sign-flip": frozenset(),
    "sign-flip-scale": frozenset({"scale"}),
    "scaling": frozenset({"scale"}),
    "gaussian-noise": frozenset({"sigma", "relative"}),
    "alie": frozenset({"z", "num_workers", "num_byzantine"}),
    "ipm": frozenset({"epsilon"}),
    "label-flip": frozenset(),
    "free-rider": frozenset({"previous", "sigma"}),
}

DEFAULT_SCALE = 10.0
DEFAULT_SIGMA = 1.0
DEFAULT_EPSILON = 0.1
DEFAULT_ALIE_Z = 1.0


def alie_z(num_workers: int, num_byzantine: int) -> float:
    """ALIE's ``z_max`` (Baruch et al. 2019, §3): with ``s = floor(n/2 + 1) - f`` honest workers the attacker
    needs on its side, ``z = Phi^-1((n - s) / n)`` (standard normal quantile). n=10, f=2 gives 0.253.
    Raises ValueError unless ``0 <= f < n`` and the quantile's argument lies in (0, 1)."""
    n, f = int(num_workers), int(num_byzantine)
    if n < 1 or not 0 <= f < n:
        raise ValueError(f"need 0 <= num_byzantine < num_workers, got n={n}, f={f}")
    s = math.floor(n / 2 + 1) - f
    p = (n - s) / n
    if not 0.0 < p < 1.0:
        raise ValueError(f"ALIE z_max undefined for n={n}, f={f} (quantile argument {p})")
    return NormalDist().inv_cdf(p)


def flip_labels(y: np.ndarray, num_classes: int) -> np.ndarray:
    """Label flipping: class ``c`` becomes ``num_classes - 1 - c`` (Fang et al. 2020, arXiv 1911.11815, §5).

    `y`: integer labels ``[n]`` in ``0 .. num_classes - 1``; returns a new array of the same dtype.
    Raises ValueError for labels outside that range or ``num_classes < 2``."""
    y = np.asarray(y)
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"labels must be integers, got {y.dtype}")
    if y.size and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes})")
    return (num_classes - 1 - y).astype(y.dtype)


def label_flipped(workload: Any, num_classes: int = 10) -> Any:
    """A copy of a classification workload whose training labels are flipped (`flip_labels`); its honest
    `train` then yields the label-flip attacker's delta. The copy shares the original's model object (both
    load params in place before use, so that is safe in one thread). Needs ``workload.train_labels`` and
    ``workload.with_train_labels(y)`` (`NumpyWorkload` and `TorchWorkload` have both)."""
    return workload.with_train_labels(flip_labels(np.asarray(workload.train_labels), num_classes))


def local_references(
    workload: Any, params: TensorDict, indices: Sequence[int], seed: int, parts: int = 4
) -> list[TensorDict]:
    """A lone attacker's estimate of the cohort: deltas of `workload.train` on `parts` disjoint, near-equal
    slices of its own lease (seeds ``seed + 1 .. seed + parts``). Use them as `references` for ALIE / IPM.
    Raises ValueError unless ``1 <= parts <= len(indices)``."""
    idx = list(indices)
    if not 1 <= parts <= len(idx):
        raise ValueError(f"need 1 <= parts <= {len(idx)}, got {parts}")
    return [workload.train(params, [int(i) for i in part], seed + 1 + k)[0]
            for k, part in enumerate(np.array_split(np.asarray(idx, dtype=np.int64), parts))]


def _check(honest: TensorDict, others: Sequence[TensorDict]) -> None:
    schema = {n: (t.shape, t.dtype) for n, t in honest.items()}
    for d in others:
        if {n: (np.shape(t), np.asarray(t).dtype) for n, t in d.items()} != schema:
            raise ValueError("references must have the honest delta's names, shapes and dtypes")


def _positive(name: str, value: Any) -> float:
    v = float(value)
    if not (math.isfinite(v) and v >= 0.0):
        raise ValueError(f"{name} must be finite and >= 0, got {value}")
    return v


def craft_update(
    attack: str,
    honest: TensorDict,
    references: Sequence[TensorDict],
    rng: np.random.Generator,
    **params: Any,
) -> TensorDict:
    """The delta a Byzantine trainer running `attack` sends this window (table in the module docstring).

    Args:
        attack: one of `ATTACKS`.
        honest: the attacker's honest delta (float32 arrays).
        references: other deltas it knows or estimates (same schema); used by ``alie`` and ``ipm``.
        rng: randomness for ``gaussian-noise`` and ``free-rider`` (others do not draw from it).
        params: the attack's parameters (keyword-only; see the table).
    Returns a new tensor dict, float32, same schema as `honest`.
    """
    if attack not in _PARAMS:
        raise ValueError(f"unknown attack {attack!r}; known: {', '.join(ATTACKS)}")
    unknown = set(params) - _PARAMS[attack]
    if unknown:
        raise TypeError(f"attack {attack!r} takes no parameter(s) {sorted(unknown)}")
    _check(honest, references)

    def each(fn: Any) -> TensorDict:
        return {n: np.asarray(fn(n, t), dtype=t.dtype) for n, t in honest.items()}

    if attack == "sign-flip":
        return each(lambda _, t: -t)
    if attack in ("sign-flip-scale", "scaling"):
        scale = _positive("scale", params.get("scale", DEFAULT_SCALE))
        sign = -1.0 if attack == "sign-flip-scale" else 1.0
        return each(lambda _, t: t * np.float32(sign * scale))
    if attack == "gaussian-noise":
        sigma = _positive("sigma", params.get("sigma", DEFAULT_SIGMA))
        if params.get("relative", False):
            total = sum(float(np.dot(t.ravel().astype(np.float64), t.ravel())) for t in honest.values())
            count = sum(t.size for t in honest.values())
            sigma *= math.sqrt(total / max(count, 1))
        return each(lambda _, t: rng.normal(0.0, sigma, size=t.shape))
    if attack == "label-flip":
        return each(lambda _, t: t.copy())
    if attack == "free-rider":
        sigma = _positive("sigma", params.get("sigma", 0.0))
        previous = params.get("previous")
        if previous is not None:
            _check(honest, [previous])

        def ride(name: str, t: np.ndarray) -> np.ndarray:
            base = np.zeros_like(t) if previous is None else np.array(previous[name], dtype=t.dtype)
            return base + rng.normal(0.0, sigma, size=t.shape) if sigma > 0 else base

        return each(ride)
    members = [honest, *references]
    if attack == "ipm":
        epsilon = _positive("epsilon", params.get("epsilon", DEFAULT_EPSILON))
        return each(lambda n, _: -epsilon * np.mean([np.asarray(m[n], np.float64) for m in members], axis=0))
    # alie
    if params.get("z") is not None:
        z = float(params["z"])
        if not math.isfinite(z):
            raise ValueError(f"z must be finite, got {z}")
    elif params.get("num_workers") is not None:
        z = alie_z(params["num_workers"], params.get("num_byzantine", 0))
    else:
        z = DEFAULT_ALIE_Z

    def alie(name: str, _: np.ndarray) -> np.ndarray:
        stack = np.stack([np.asarray(m[name], np.float64) for m in members])
        return stack.mean(axis=0) - z * stack.std(axis=0)

    return each(alie)


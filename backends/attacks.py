"""Byzantine trainer behaviours: the one shared definition used by the robustness bench, the simulator and
the demo (spec/design.md §5, spec/simulator.md §6).

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
  ALIE and IPM take their statistics over ``[honest, *references]``; ``free-rider-noise`` takes the mean of
  ``references`` alone (the cohort it must look like).
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
``free-rider-noise``    a random Gaussian direction with the honest delta's global  Lin et al. 2019
                        L2 norm; with references, its cosine to the references'     (arXiv 1911.12560),
                        mean is set to the honest delta's cosine to that mean       disguised free rider
                        (`random_with_cosine`). It never uses its own training in   (noise shaped to pass
                        the update: the honest delta is computed only to learn the  norm and cosine
                        norm and cosine to imitate                                  screens)
======================= ========================================================== =======================

Training-level attacks (`TRAINING_ATTACKS`) change *how* the attacker trains, not what it makes of an honest
delta, so `craft_update` does not take them: `peerloom.backends.behaviours.ByzantineWorkload` (real nodes,
and the simulator through `peerloom.sim.adversary.TrainingAttack`) runs them by calling the workload's
``train`` differently; the reported ``train_loss`` stays the honest one. They target the validators' cheap
checks (a loss check on the leased samples, sampled recomputation audits): the "lazy worker" that spoofs a
proof of learning with cheaper training (Jia et al. 2021, arXiv 2103.05633), and the miners that Templar's
"gauntlet" validator guards against by scoring each pseudo-gradient by the loss improvement it gives on the
data the miner was assigned. Their pure tensor parts are here
(`scale_to_norm`, `perturb`, `lazy_work`, `is_lazy_call`):

======================= ==========================================================================
attack                  what the attacker does (parameters, defaults)
======================= ==========================================================================
``lazy``                trains a quarter of the work (``divisor=4``): ``max(1, H // 4)`` inner steps
                        when the window has H inner steps, else the first ``max(1, n // 4)`` of its
                        n leased samples for the workload's local epochs (`lazy_work`); sends that
                        delta scaled to the honest delta's global L2 norm (`scale_to_norm`): the
                        strongest lazy attacker, who knows the norm an honest update would have (the
                        wrapper computes the honest delta too, only to know that norm)
``replayer``            trains honestly, keeps its last ``age`` honest deltas (``age=2``) and sends,
                        in its k-th train call (k >= age, counted from 0), the delta of call
                        ``k - age`` with a negligible perturbation (`perturb`, ``rel=1e-6``) so that
                        its tensor digest differs (validators reject exact digest replays). Calls
                        ``0 .. age - 1`` send the honest delta.
``lazy-1-in-5``         ``lazy`` in the train calls ``k`` (counted from 0) with ``k % period == phase``
                        (``period=5``, ``phase=0``: calls 0, 5, 10, ...; `is_lazy_call`), honest in
                        every other call; ``divisor`` as ``lazy``
``dp-skip-noise``       a DP-SGD trainer (a workload with ``privacy``, spec/protocol.md §10) that skips the noise:
                        trains with the same Poisson batches and per-sample clipping but noise
                        multiplier 0 (no parameters), and reports the metrics an honest DP call
                        reports (``privacy_steps`` included), claiming privacy its update lacks.
                        Without privacy on the workload it trains honestly. A recomputation audit,
                        whose replay draws the noise from the seed, sees cosine far below 0.99
======================= ==========================================================================

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
    "free-rider-noise",
)

TRAINING_ATTACKS = ("lazy", "replayer", "lazy-1-in-5", "dp-skip-noise")
"""Attacks that change how the attacker calls ``train`` (table above); `craft_update` does not take them."""

TRAINING_PARAMS: dict[str, frozenset[str]] = {
    "lazy": frozenset({"divisor"}),
    "replayer": frozenset({"age", "rel"}),
    "lazy-1-in-5": frozenset({"divisor", "period", "phase"}),
    "dp-skip-noise": frozenset(),
}
"""The parameters each training attack takes (`check_training_params`)."""

DEFAULT_LAZY_DIVISOR = 4
DEFAULT_REPLAY_AGE = 2
DEFAULT_PERTURB_REL = 1e-6
DEFAULT_LAZY_PERIOD = 5

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
    "free-rider-noise": frozenset(),
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


def _flat(tensors: TensorDict, names: Sequence[str]) -> np.ndarray:
    """The tensors named `names`, raveled and concatenated in that order, as float64."""
    if not names:
        return np.zeros(0, np.float64)
    return np.concatenate([np.asarray(tensors[n], dtype=np.float64).ravel() for n in names])


def _unflat(template: TensorDict, flat: np.ndarray) -> TensorDict:
    """`flat` cut back into `template`'s names and shapes (in its order), float32, new arrays."""
    out: TensorDict = {}
    start = 0
    for name, t in template.items():
        size = int(np.prod(np.shape(t), dtype=np.int64))
        out[name] = flat[start:start + size].reshape(np.shape(t)).astype(np.float32)
        start += size
    return out


def global_norm(delta: TensorDict) -> float:
    """The global L2 norm of a tensor dict: ``sqrt(sum of squares over every element of every tensor)``,
    summed in float64 (an empty dict has norm 0)."""
    return math.sqrt(sum(float(np.dot(v, v)) for v in (np.asarray(t, np.float64).ravel() for t in delta.values())))


def tensor_cosine(a: TensorDict, b: TensorDict) -> float:
    """Cosine similarity of two tensor dicts with the same names and shapes, over all their elements (float64
    sums); 0.0 when either has norm 0. Raises ValueError when their names or shapes differ."""
    names = list(a)
    if set(names) != set(b) or any(np.shape(a[n]) != np.shape(b[n]) for n in names):
        raise ValueError("tensor dicts must have the same names and shapes")
    x, y = _flat(a, names), _flat(b, names)
    nx, ny = float(np.linalg.norm(x)), float(np.linalg.norm(y))
    return 0.0 if nx == 0.0 or ny == 0.0 else float(np.dot(x, y)) / (nx * ny)


def scale_to_norm(delta: TensorDict, norm: float) -> TensorDict:
    """`delta` rescaled so that its `global_norm` is `norm` (the lazy attacker's disguise: an update trained
    on a fraction of the work but with the norm of an honest one).

    `delta`: float32 tensors of any shapes. Returns new float32 arrays, same names and shapes; the direction is
    kept exactly (one float64 factor, rounded to float32 per element, so the norm matches to ~1e-7 relative).
    A delta of norm 0 has no direction to keep and comes back as zeros. Raises ValueError for a negative or
    non-finite `norm` or a non-finite `delta`.
    """
    target = _positive("norm", norm)
    current = global_norm(delta)
    if not math.isfinite(current):
        raise ValueError("delta must be finite")
    factor = 0.0 if current == 0.0 else target / current
    return {n: (np.asarray(t, np.float64) * factor).astype(np.float32) for n, t in delta.items()}


def random_with_cosine(
    template: TensorDict,
    norm: float,
    rng: np.random.Generator,
    *,
    direction: TensorDict | None = None,
    cosine: float = 0.0,
) -> TensorDict:
    """A random tensor dict with global L2 norm `norm` and, given `direction`, cosine `cosine` to it: the
    disguised free rider's update (Lin et al. 2019, arXiv 1911.12560, free riders that send noise instead of
    training; here the noise is shaped to pass norm and cosine screens).

    With ``u = direction / |direction|`` and ``r`` a standard Gaussian draw made orthogonal to ``u`` (one
    Gram-Schmidt step) and normalised, returns ``v = c |v| u + sqrt(1 - c^2) |v| r`` with ``|v| = norm`` and
    ``c = cosine``, computed in float64 over all elements in `template`'s order. Without `direction`, or
    when it has norm 0, ``v = norm * g / |g|`` for a Gaussian ``g`` (a uniformly random direction) and
    `cosine` is ignored. (With a single element there is no orthogonal direction: ``v = sign(c) norm u``.)

    `template`: names and shapes of the result (its values are not read). `direction`: same names and shapes,
    any float dtype. Returns new float32 arrays with `template`'s names and shapes; draws
    ``size`` standard normals from `rng` (the only randomness). Raises ValueError for a negative or
    non-finite `norm`, `cosine` outside [-1, 1], or `direction` of another schema.
    """
    target = _positive("norm", norm)
    c = float(cosine)
    if not -1.0 <= c <= 1.0:
        raise ValueError(f"cosine must lie in [-1, 1], got {cosine}")
    names = list(template)
    size = sum(int(np.prod(np.shape(template[n]), dtype=np.int64)) for n in names)
    g = rng.standard_normal(size)
    u = None
    if direction is not None:
        if set(direction) != set(names) or any(np.shape(direction[n]) != np.shape(template[n]) for n in names):
            raise ValueError("direction must have the template's names and shapes")
        d = _flat(direction, names)
        length = float(np.linalg.norm(d))
        if not math.isfinite(length):
            raise ValueError("direction must be finite")
        u = d / length if length > 0.0 else None
    if u is None:
        length = float(np.linalg.norm(g))
        return _unflat(template, g * (target / length) if length > 0.0 else g * 0.0)
    g -= float(np.dot(g, u)) * u
    g -= float(np.dot(g, u)) * u  # a second pass removes what rounding left along u
    length = float(np.linalg.norm(g))
    if length == 0.0:
        return _unflat(template, (math.copysign(target, c) if c != 0.0 else target) * u)
    v = c * target * u + math.sqrt(max(0.0, 1.0 - c * c)) * target * (g / length)
    return _unflat(template, v)


def perturb(delta: TensorDict, rel: float = DEFAULT_PERTURB_REL) -> TensorDict:
    """A copy of `delta` that differs in exactly one element: the one of largest magnitude (first in name
    order, then in C order, on ties) multiplied by ``1 + rel`` (and moved one float32 ulp away from zero if
    that rounds back to the same value; an all-zero delta gets the smallest normal float32 in its first
    element). Its tensor digest differs from `delta`'s while their cosine stays ``> 1 - rel^2`` — what a replayer
    sends so that validators' exact-digest replay check misses it.

    `delta`: float32 tensors (at least one element). Returns new float32 arrays, same names and shapes. Raises
    ValueError for an empty delta, a non-float32 tensor, or `rel` that is not finite and > 0.
    """
    r = float(rel)
    if not (math.isfinite(r) and r > 0.0):
        raise ValueError(f"rel must be finite and > 0, got {rel}")
    if any(np.asarray(t).dtype != np.float32 for t in delta.values()):
        raise ValueError("perturb takes float32 tensors")
    out = {n: np.array(t, dtype=np.float32, copy=True) for n, t in delta.items()}
    best: tuple[str, int] | None = None
    best_abs = -1.0
    for name, t in out.items():
        if t.size:
            i = int(np.argmax(np.abs(t.ravel())))
            m = float(abs(t.ravel()[i]))
            if m > best_abs:
                best, best_abs = (name, i), m
    if best is None:
        raise ValueError("cannot perturb a delta without elements")
    flat = out[best[0]].reshape(-1)
    old = flat[best[1]]
    if old == 0.0:
        flat[best[1]] = np.finfo(np.float32).tiny
    else:
        new = np.float32(old * np.float32(1.0 + r))
        if new == old or not np.isfinite(new):
            new = np.nextafter(old, np.float32(math.copysign(math.inf, float(old))))
        flat[best[1]] = new
    return out


def lazy_work(indices: Sequence[int], inner_steps: int | None,
              divisor: int = DEFAULT_LAZY_DIVISOR) -> tuple[list[int], int | None]:
    """The part of a lease's training a lazy trainer runs: ``(indices, inner_steps)`` for its ``train`` call.

    With H = `inner_steps` (DiLoCo inner steps, >= 1): all of `indices` and ``max(1, H // divisor)`` steps.
    Without (None: the workload's local epochs): the first ``max(1, len(indices) // divisor)`` indices and None
    (as many epochs as an honest trainer, over fewer samples). Raises ValueError for an empty lease,
    ``divisor < 1`` or ``inner_steps < 1``.
    """
    idx = [int(i) for i in indices]
    d = int(divisor)
    if not idx:
        raise ValueError("a lease needs at least one sample")
    if d < 1 or d != divisor:
        raise ValueError(f"divisor must be an integer >= 1, got {divisor}")
    if inner_steps is not None:
        if int(inner_steps) < 1:
            raise ValueError(f"inner_steps must be >= 1, got {inner_steps}")
        return idx, max(1, int(inner_steps) // d)
    return idx[:max(1, len(idx) // d)], None


def is_lazy_call(call: int, period: int = DEFAULT_LAZY_PERIOD, phase: int = 0) -> bool:
    """Whether ``lazy-1-in-5`` is lazy in its train call number `call` (counted from 0): ``call % period ==
    phase``; with the defaults calls 0, 5, 10, ... are lazy. Raises ValueError unless ``period >= 1`` and
    ``0 <= phase < period``."""
    if int(period) < 1 or not 0 <= int(phase) < int(period):
        raise ValueError(f"need period >= 1 and 0 <= phase < period, got period={period}, phase={phase}")
    return int(call) % int(period) == int(phase)


def check_training_params(attack: str, params: dict[str, Any]) -> dict[str, Any]:
    """`params` of a training attack (`TRAINING_ATTACKS`) checked and completed with the defaults of the table
    above. Raises ValueError for an unknown attack or a bad value, TypeError for a parameter the attack does
    not take."""
    if attack not in TRAINING_PARAMS:
        raise ValueError(f"unknown training attack {attack!r}; known: {', '.join(TRAINING_ATTACKS)}")
    unknown = set(params) - TRAINING_PARAMS[attack]
    if unknown:
        raise TypeError(f"attack {attack!r} takes no parameter(s) {sorted(unknown)}")
    out = dict(params)
    if attack in ("lazy", "lazy-1-in-5"):
        out.setdefault("divisor", DEFAULT_LAZY_DIVISOR)
        lazy_work([0], None, out["divisor"])  # validates
    if attack == "lazy-1-in-5":
        out.setdefault("period", DEFAULT_LAZY_PERIOD)
        out.setdefault("phase", 0)
        is_lazy_call(0, out["period"], out["phase"])  # validates
    if attack == "replayer":
        out.setdefault("age", DEFAULT_REPLAY_AGE)
        out.setdefault("rel", DEFAULT_PERTURB_REL)
        if isinstance(out["age"], bool) or int(out["age"]) != out["age"] or int(out["age"]) < 1:
            raise ValueError(f"age must be an integer >= 1, got {out['age']}")
        out["age"] = int(out["age"])
        rel = float(out["rel"])
        if not (math.isfinite(rel) and rel > 0.0):
            raise ValueError(f"rel must be finite and > 0, got {out['rel']}")
    return out


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
        references: other deltas it knows or estimates (same schema); used by ``alie``, ``ipm`` and
            ``free-rider-noise`` (the latter takes the mean of the references alone, without `honest`).
        rng: randomness for ``gaussian-noise``, ``free-rider`` and ``free-rider-noise`` (others do not draw
            from it).
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
    if attack == "free-rider-noise":
        norm = global_norm(honest)
        if not references:
            return random_with_cosine(honest, norm, rng)
        mean = {n: np.mean([np.asarray(r[n], np.float64) for r in references], axis=0) for n in honest}
        return random_with_cosine(honest, norm, rng, direction=mean, cosine=tensor_cosine(honest, mean))
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


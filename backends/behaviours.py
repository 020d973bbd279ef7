"""Byzantine trainer behaviours for demos and end-to-end tests: a workload wrapper that lies.

A node whose config sets ``behaviour = "sign-flip-scale"`` (or any name in
`peerloom.backends.attacks.ATTACKS`) trains honestly on its lease and then sends the update
`peerloom.backends.attacks.craft_update` makes of it. The node signs and announces that update like any
other: nothing in the protocol marks it, so only screening and the aggregation rule can stop it. The
attacker is alone — it sees no other trainer's update — so ALIE and IPM estimate the cohort from deltas
trained on slices of the attacker's own lease (`local_references`), and ``free-rider-noise`` sends a random
direction with the honest norm (it has no cohort mean to aim its cosine at).

The training-level attacks (`peerloom.backends.attacks.TRAINING_ATTACKS`: ``lazy``, ``replayer``,
``lazy-1-in-5``, ``dp-skip-noise``) call the wrapped workload's ``train`` differently instead of rewriting its
result; see `ByzantineWorkload.train` and the table in `peerloom.backends.attacks`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from peerloom.backends.attacks import (
    ATTACKS,
    DATA_ATTACKS,
    NEEDS_REFERENCES,
    TRAINING_ATTACKS,
    alie_z,
    check_training_params,
    craft_update,
    global_norm,
    is_lazy_call,
    label_flipped,
    lazy_work,
    local_references,
    perturb,
    scale_to_norm,
)

# The parameters of a crafted attack given none (a node's ``behaviour``, the simulator's adversaries, tests):
# ALIE's z from Baruch et al. for n = 8, f = 2 (the demo's fleet: 8 trainers, 2 of them Byzantine);
# sign-flip-scale and scaling at the ×10 the robustness table uses.
ATTACK_DEFAULTS: dict[str, dict[str, Any]] = {
    "alie": {"z": alie_z(8, 2)},
    "sign-flip-scale": {"scale": 10.0},
    "scaling": {"scale": 10.0},
}


def _copy(delta: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: np.array(v, dtype=np.float32, copy=True) for k, v in delta.items()}


class ByzantineWorkload:
    """Wraps a workload (same interface) so that `train` returns an attacker's update instead of the honest one.

    `train(params, indices, seed, **options) -> (delta, metrics)`: `options` (``inner_steps=``, ``epochs=``)
    go to the wrapped ``train``; `delta` is a dict of float32 arrays with the honest delta's names and shapes;
    the reported metrics (``train_loss``...) stay the honest ones (a liar keeps its story straight).
    Deterministic given `seed` and, for the training attacks, the number of earlier `train` calls (`calls`).
    ValueError for an unknown attack or a bad parameter, TypeError for a parameter the attack does not take.

    `attack` is one of `ATTACKS` (the honest delta rewritten by `craft_update`) or of `TRAINING_ATTACKS`:

    * ``lazy``: trains a quarter of the work (`lazy_work`: ``max(1, H // 4)`` inner steps, or the first
      quarter of the lease for the workload's local epochs) and sends that delta scaled to the honest delta's
      global norm (`scale_to_norm`). The wrapper also runs the honest training, only to know that target norm
      (the strongest lazy attacker knows it; a real one would estimate it from earlier windows): it spends
      more compute than an honest trainer, the update it sends uses a quarter.
    * ``replayer``: trains honestly, keeps its last ``age`` honest deltas (in memory, ``age=2``) and, from
      its ``age``-th call on, sends the delta of ``age`` calls ago with `perturb` applied (a new tensor digest,
      cosine ~1 to the original); earlier calls send the honest delta.
    * ``lazy-1-in-5``: ``lazy`` in the calls ``k`` (counted from 0 over this wrapper's life) with
      ``k % 5 == 0`` (parameters ``period=5``, ``phase=0``: calls 0, 5, 10, ...), honest in the others.
    * ``dp-skip-noise``: when the wrapped workload trains with DP-SGD (its ``privacy``, a
      `peerloom.backends.privacy.DP` with ``noise_multiplier > 0``), trains once with the same privacy but
      ``noise_multiplier=0`` (same seed: same Poisson batches and clipping, no noise) and sends that delta
      with that call's metrics (the same keys and ``privacy_steps`` as an honest call); the workload's
      privacy is put back afterwards. Honest otherwise (nothing to skip).

    H for ``lazy`` is the call's ``inner_steps`` option, else the wrapped workload's ``inner_steps``
    attribute (the bundled workloads train that many steps when the option is absent), else the workload
    trains local epochs and the lazy call gets a quarter of the samples. With ``keep_optimizer_state`` the
    extra honest call advances the kept optimizer state like any other call.

    `calls` counts `train` calls; `last_action` says what the last one sent: ``"honest"``, ``"lazy"``,
    ``"replay"``, ``"no-noise"`` or ``"crafted"`` (a `craft_update` attack).
    """

    TAKES_STEP = False
    """`train` is never handed the run's global step, whatever the wrapped workload takes
    (`peerloom.backends.workload.TakesStep`): an attacker's learning-rate schedule is its own."""

    def __init__(self, inner: Any, attack: str, *, params: dict[str, Any] | None = None, seed: int = 0) -> None:
        if attack not in ATTACKS and attack not in TRAINING_ATTACKS:
            raise ValueError(f"unknown behaviour {attack!r}; known: honest, {', '.join((*ATTACKS, *TRAINING_ATTACKS))}")
        self.inner = label_flipped(inner) if attack in DATA_ATTACKS else inner
        self.attack = attack
        if attack in TRAINING_ATTACKS:
            self.params = check_training_params(attack, {} if params is None else dict(params))
        else:
            self.params = dict(ATTACK_DEFAULTS.get(attack, {}) if params is None else params)
        self.seed = seed
        self.calls = 0
        self.last_action = ""
        # replayer: its last `age` honest deltas, oldest first (no other attack keeps any)
        self.history: deque[dict[str, np.ndarray]] = deque(maxlen=self.params["age"] if attack == "replayer" else 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def train(self, params: dict[str, np.ndarray], indices: Sequence[int], seed: int,
              **options: Any) -> tuple[dict, dict]:
        call = self.calls
        self.calls += 1
        if self.attack in TRAINING_ATTACKS:
            return self._training_attack(call, params, indices, seed, options)
        delta, metrics = self.inner.train(params, indices, seed, **options)
        honest = _copy(delta)
        references: list[dict[str, np.ndarray]] = []
        if self.attack in NEEDS_REFERENCES and len(indices) >= 2:
            references = local_references(self.inner, params, indices, seed, parts=min(4, len(indices)))
        rng = np.random.default_rng([self.seed, seed])
        if self.attack in DATA_ATTACKS:
            self.last_action = "honest"
            return honest, metrics
        self.last_action = "crafted"
        return craft_update(self.attack, honest, references, rng, **self.params), metrics

    def _inner_steps(self, options: dict[str, Any]) -> int | None:
        """H of this call: the ``inner_steps`` option, else the workload's ``inner_steps`` attribute, else None."""
        steps = options.get("inner_steps")
        if steps is None:
            steps = getattr(self.inner, "inner_steps", None)
        if isinstance(steps, bool) or not isinstance(steps, int | np.integer) or steps < 1:
            return None
        return int(steps)

    def _training_attack(self, call: int, params: dict[str, np.ndarray], indices: Sequence[int], seed: int,
                         options: dict[str, Any]) -> tuple[dict, dict]:
        lazy_now = self.attack == "lazy" or (
            self.attack == "lazy-1-in-5" and is_lazy_call(call, self.params["period"], self.params["phase"]))
        if lazy_now and options.get("checkpoints"):
            return self._lazy_committed(params, indices, seed, options)
        if self.attack == "dp-skip-noise":
            return self._skip_noise(params, indices, seed, options)
        delta, metrics = self.inner.train(params, indices, seed, **options)
        honest = _copy(delta)
        if self.attack == "replayer":
            if len(self.history) == self.history.maxlen:
                sent, self.last_action = perturb(self.history[0], self.params["rel"]), "replay"
            else:
                sent, self.last_action = _copy(honest), "honest"
            self.history.append(honest)
            return sent, metrics
        if self.attack == "lazy-1-in-5" and not is_lazy_call(call, self.params["period"], self.params["phase"]):
            self.last_action = "honest"
            return honest, metrics
        lazy_indices, lazy_steps = lazy_work(indices, self._inner_steps(options), self.params["divisor"])
        lazy_options = dict(options)
        if lazy_steps is not None:
            lazy_options["inner_steps"] = lazy_steps
        lazy, _ = self.inner.train(params, lazy_indices, seed, **lazy_options)
        self.last_action = "lazy"
        return scale_to_norm(_copy(lazy), global_norm(honest)), metrics

    def _skip_noise(self, params: dict[str, np.ndarray], indices: Sequence[int], seed: int,
                    options: dict[str, Any]) -> tuple[dict, dict]:
        """``dp-skip-noise``: the wrapped workload's DP-SGD with noise multiplier 0, or its honest training."""
        dp = getattr(self.inner, "privacy", None)
        if dp is None or dp.noise_multiplier == 0:
            self.last_action = "honest"
            return self.inner.train(params, indices, seed, **options)
        self.inner.with_privacy(attrs.evolve(dp, noise_multiplier=0.0))
        try:
            delta, metrics = self.inner.train(params, indices, seed, **options)
        finally:
            self.inner.with_privacy(dp)
        self.last_action = "no-noise"
        return _copy(delta), metrics

    def _lazy_committed(self, params: dict[str, np.ndarray], indices: Sequence[int], seed: int,
                        options: dict[str, Any]) -> tuple[dict, dict]:
        """A lazy trainer that must commit to a trajectory (segment audits, spec/protocol.md §6.3) and cheats
        as well as it can: it really trains the first quarter of the segments (``max(1, S // divisor)`` of
        S, so its checkpoints there are genuine), scales that delta to the honest norm, and fabricates the
        remaining checkpoints on the straight line from its last real state to the params its delta implies
        (the rest of the state copied, step counters advanced). Its trajectory is consistent with its delta,
        so only a replay of a fabricated segment can expose it. The honest run only sets the target norm."""
        steps, segments = self._inner_steps(options), int(options["checkpoints"])
        report = options["on_checkpoint"]
        plain = {k: v for k, v in options.items() if k not in ("checkpoints", "on_checkpoint")}
        honest, metrics = self.inner.train(params, indices, seed, **plain)
        assert steps is not None  # checkpoints need inner steps
        bounds = [(j * steps) // segments for j in range(segments + 1)]
        real = max(1, segments // int(self.params["divisor"]))
        states: dict[int, dict[str, np.ndarray]] = {}
        prefix = dict(plain, inner_steps=bounds[real], checkpoints=real,
                      on_checkpoint=lambda j, st: states.__setitem__(j, _copy(st)))
        lazy, _ = self.inner.train(params, indices, seed, **prefix)
        scaled = scale_to_norm(_copy(lazy), global_norm(honest))
        last = states[real]
        final = {n: np.subtract(params[n], scaled[n], dtype=np.float32) for n in params}
        # What it sends is exactly base - final (float32 rounds params - (params - x) away from x), so its
        # trajectory is consistent with its delta and only a fabricated segment's replay can expose it.
        sent = {n: np.subtract(params[n], final[n], dtype=np.float32) for n in params}
        for j in range(real + 1, segments + 1):
            frac = (bounds[j] - bounds[real]) / (bounds[segments] - bounds[real])
            fake = _copy(last)
            for n in params:
                fake[n] = (last[n] + np.float32(frac) * (final[n] - last[n])).astype(np.float32)
            for n in fake:
                if n.endswith("step"):
                    fake[n] = (last[n] + (bounds[j] - bounds[real])).astype(last[n].dtype)
            if j == segments:
                fake.update(final)  # exactly the params the delta was taken from
            states[j] = fake
        for j in range(1, segments + 1):
            report(j, states[j])
        self.last_action = "lazy"
        return sent, metrics


def wrap_workload(workload: Any, behaviour: str | None, *, seed: int = 0,
                  params: dict[str, Any] | None = None) -> Any:
    """`workload` itself for ``None``/``"honest"``, else a `ByzantineWorkload` playing `behaviour` (one of
    `ATTACKS` or `TRAINING_ATTACKS`) with `params` (None: the attack's defaults, `ATTACK_DEFAULTS` for some)."""
    if behaviour in (None, "honest"):
        return workload
    return ByzantineWorkload(workload, behaviour, params=params, seed=seed)

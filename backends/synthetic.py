"""`QuadraticWorkload`: a noisy quadratic objective for large simulations (spec/simulator.md §9).

The objective is ``f(x) = 1/2 sum_j a_j (x_j - x*_j)^2`` over one float32 tensor ``"x"`` of `dim` coordinates,
with curvatures ``a_j`` log-uniform in ``[a_min, 1]`` and optimum ``x* ~ N(0, 1)`` drawn from the workload
seed — the noisy quadratic model used to study large-batch and local-SGD dynamics (Zhang et al. 2019,
arXiv 1907.04164). Sample ``i`` carries a target ``c_i = x* + data_noise * e_(i mod T)`` (a fixed table of
``T = 4096`` standard-normal rows), so a lease's local optimum is the mean target of its samples: leases
disagree like non-i.i.d. shards do, and the average over all leases is (close to) ``x*``.

`train` runs `local_steps` SGD steps ``x <- x - lr (a (x - c_lease) + grad_noise * xi_k)`` with ``xi_k``
rows of the same table chosen by a hash of (seed, k): no generator is built, nothing is allocated beyond a
few `dim`-sized arrays, so one call costs tens of microseconds (dim 16, 5 steps) and is a pure function
of (params, indices, seed). Same interface as the other workloads (`schema`, `initial_params`, `train`,
`loss`, `evaluate`, `num_train`), so the simulator can swap it in for digits at 10,000 trainers.

Segment audits: the step count H of a `train` call (``inner_steps``, else ``local_steps * epochs``) is its
number of SGD steps, and step k depends on ``x``, the lease and (seed, k) alone, so the training state after
any step is ``{"x": x}``: `train` reports it at segment boundaries (``checkpoints``) and `resume` continues
from it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from peerloom.backends.numpy.tensors import Schema, TensorDict

TABLE_ROWS = 4096
_MASK = (1 << 64) - 1


def _row(seed: int, k: int) -> int:
    """SplitMix64 finaliser of (seed, k) -> a noise-table row (Steele et al. 2014)."""
    z = (seed * 0x9E3779B97F4A7C15 + (k + 1) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) % TABLE_ROWS


class QuadraticWorkload:
    """Noisy quadratic (module docstring). Params ``{"x": float32 [dim]}``.

    Args:
        seed: draws curvatures, optimum and the noise table (``np.random.default_rng(seed)``).
        dim: coordinates. num_train: samples (lease indices are ``0 .. num_train - 1``; no memory per sample).
        a_min: smallest curvature (condition number ``1 / a_min``).
        data_noise: spread of per-sample targets around ``x*`` (non-i.i.d.-ness of leases).
        grad_noise: per-step gradient noise (stochastic-gradient noise).
        lr, local_steps: inner SGD step size and steps per `train` (``lr * 1 < 2`` for stability).
        tolerance: `evaluate`'s "accuracy" counts coordinates within this distance of ``x*``.
    """

    def __init__(
        self,
        seed: int = 0,
        *,
        dim: int = 16,
        num_train: int = 1_000_000,
        a_min: float = 0.1,
        data_noise: float = 0.5,
        grad_noise: float = 0.1,
        lr: float = 0.5,
        local_steps: int = 5,
        tolerance: float = 0.1,
    ) -> None:
        if dim < 1 or num_train < 1 or local_steps < 1:
            raise ValueError("dim, num_train and local_steps must be >= 1")
        if not 0.0 < a_min <= 1.0 or not 0.0 < lr < 2.0:
            raise ValueError("need 0 < a_min <= 1 and 0 < lr < 2")
        rng = np.random.default_rng(seed)
        self.dim, self._num_train = dim, num_train
        self.a = np.exp(rng.uniform(math.log(a_min), 0.0, dim)).astype(np.float32)
        self.optimum = rng.standard_normal(dim).astype(np.float32)
        self.table = rng.standard_normal((TABLE_ROWS, dim)).astype(np.float32)
        self.data_noise, self.grad_noise = float(data_noise), float(grad_noise)
        self.lr, self.local_steps, self.tolerance = float(lr), local_steps, float(tolerance)
        self._schema: Schema = (("x", "float32", (dim,)),)

    @property
    def num_train(self) -> int:
        """Number of samples (valid lease indices are ``0 .. num_train - 1``)."""
        return self._num_train

    def schema(self) -> Schema:
        """``(("x", "float32", (dim,)),)``."""
        return self._schema

    def initial_params(self, seed: int) -> TensorDict:
        """``x0 = optimum + 2 * table[row(seed)]`` (far from the optimum, deterministic by seed)."""
        return {"x": (self.optimum + 2.0 * self.table[_row(seed, -1)]).astype(np.float32)}

    def lease_target(self, indices: Sequence[int]) -> np.ndarray:
        """The lease's local optimum: mean of its samples' targets (float32 ``[dim]``)."""
        index = np.asarray(indices, dtype=np.int64)
        if index.ndim != 1 or len(index) == 0:
            raise ValueError("indices must be a non-empty sequence of ints")
        if int(index.min()) < 0 or int(index.max()) >= self._num_train:
            raise ValueError(f"indices must lie in [0, {self._num_train})")
        return self.optimum + self.data_noise * self.table[index % TABLE_ROWS].mean(axis=0)

    def train(
        self,
        params: TensorDict,
        indices: Sequence[int],
        seed: int,
        *,
        epochs: int | None = None,
        inner_steps: int | None = None,
        state_key: object = None,
        checkpoints: int = 0,
        on_checkpoint: Callable[[int, TensorDict], None] | None = None,
    ) -> tuple[TensorDict, dict[str, float | int]]:
        """Noisy SGD steps toward the lease's target: `inner_steps` if given, else ``local_steps * epochs``
        (epochs default 1; the keywords mirror the digits workloads, `state_key` is accepted and unused — plain
        SGD has no state). Returns ``({"x": params - trained}, {"train_loss": f_lease at the start, "samples":
        len(indices)})``.

        With ``checkpoints = S > 0`` (``1 <= S <= H``, H the step count above: this workload always has inner
        steps) it calls ``on_checkpoint(j, state)`` after step ``(j * H) // S`` for ``j = 1 .. S``; `state` is
        the whole training state, ``{"x": float32 [dim]}`` (a fresh array; SGD keeps nothing else and the noise
        of step k is a function of (seed, k)), which `resume` continues from. Checkpoints change no byte.

        Raises ValueError for an empty lease, out-of-range indices, a wrong schema, a step count < 1 or
        checkpoints outside ``1 .. H``."""
        steps = inner_steps if inner_steps is not None else self.local_steps * (1 if epochs is None else epochs)
        if steps < 1:
            raise ValueError(f"need >= 1 step, got {steps}")
        if checkpoints and not 1 <= checkpoints <= steps:
            raise ValueError(f"need 1 <= checkpoints <= steps = {steps}, got {checkpoints}")
        bounds = {(j * steps) // checkpoints: j for j in range(1, checkpoints + 1)} if checkpoints else {}
        x0 = self._x(params)
        c = self.lease_target(indices)
        loss = self._lease_loss(x0, c)
        x = x0.copy()
        self._run(x, c, seed, 0, steps, bounds, on_checkpoint)
        return {"x": x0 - x}, {"train_loss": loss, "samples": len(indices)}

    def resume(self, state: TensorDict, indices: Sequence[int], seed: int, *, inner_steps: int, start: int,
               stop: int) -> TensorDict:
        """The state ``{"x"}`` after step `stop` of a `train` call with these indices, seed and `inner_steps`,
        continued from `state`, its state after step `start` (a segment audit's replay): bit for bit what
        `train` passes to ``on_checkpoint`` there. Returns a new dict. Raises ValueError for bounds outside
        ``0 <= start < stop <= inner_steps``, a state that is not ``{"x": float32 [dim]}`` or a bad lease."""
        if not 0 <= start < stop <= inner_steps:
            raise ValueError(f"need 0 <= start < stop <= inner_steps, got {start}, {stop}, {inner_steps}")
        x = self._x(state).copy()
        self._run(x, self.lease_target(indices), seed, start, stop, {}, None)
        return {"x": x}

    def _run(self, x: np.ndarray, c: np.ndarray, seed: int, start: int, stop: int, bounds: dict[int, int],
             on_checkpoint: Callable[[int, TensorDict], None] | None) -> None:
        """SGD steps ``start .. stop - 1`` on `x` in place; ``on_checkpoint(bounds[k + 1], {"x": copy})`` after
        step k when it is a boundary."""
        for k in range(start, stop):
            g = self.a * (x - c)
            g += self.grad_noise * self.table[_row(seed, k)]
            x -= self.lr * g
            if on_checkpoint is not None and k + 1 in bounds:
                on_checkpoint(bounds[k + 1], {"x": x.copy()})

    def loss(self, params: TensorDict, indices: Sequence[int]) -> float:
        """The lease objective ``f_lease(x) = 1/2 sum_j a_j (x_j - c_j)^2`` at ``params["x"]``, with ``c`` =
        `lease_target` (indices): what `train` descends and reports as ``train_loss`` (the same float for the same
        params). The per-sample objectives' mean, ``1/2 sum_j a_j mean_i (x_j - c_ij)^2``, exceeds it by a
        constant independent of ``x`` (the targets' spread), so both rank params alike. A Python float,
        deterministic; touches no state. Raises ValueError for empty or out-of-range indices or params that are
        not ``{"x": float32 [dim]}``."""
        x = self._x(params)
        return self._lease_loss(x, self.lease_target(indices))

    def _x(self, params: TensorDict) -> np.ndarray:
        x = params.get("x")
        if x is None or len(params) != 1 or np.shape(x) != (self.dim,) or np.asarray(x).dtype != np.float32:
            raise ValueError(f"params must be {self._schema}")
        return np.asarray(x)

    def _lease_loss(self, x: np.ndarray, c: np.ndarray) -> float:
        diff = x - c
        return 0.5 * float(np.dot(self.a * diff, diff))

    def evaluate(self, params: TensorDict) -> dict[str, float]:
        """``{"loss": f(x), "accuracy": fraction of coordinates with |x_j - x*_j| < tolerance}`` (a
        stand-in for accuracy so reports and plots treat every workload alike)."""
        diff = np.asarray(params["x"], np.float64) - self.optimum
        return {"loss": 0.5 * float(np.dot(self.a * diff, diff)),
                "accuracy": float(np.mean(np.abs(diff) < self.tolerance))}

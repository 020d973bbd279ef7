"""`NumpyWorkload`: a multi-layer perceptron (or softmax regression) trained with Adam in pure numpy — the
workload for peers without torch and for the simulator (spec/design.md §5).

Same interface as `peerloom.backends.torch.workload.TorchWorkload`: ``schema()``, ``initial_params(seed)``,
``train(params, indices, seed) -> (delta, {"train_loss", "samples"})``, ``loss(params, indices) -> float``
(forward only, a validator's loss check), ``evaluate(params) -> {"loss", "accuracy"}``, ``num_train``.
Parameter names and shapes follow ``torch.nn.Sequential(Linear, ReLU, Linear, ...)`` (``"0.weight"``
``[out, in]``, ``"0.bias"`` ``[out]``, ``"2.weight"``...), so a numpy peer and a torch peer share the
manifest's schema; the arithmetic differs (float32 BLAS here), so their deltas are not bit-identical — the
reduction is what must be, and it is (`peerloom.backends._robust`).

Training modes: FedAvg local epochs (``local_epochs`` passes over the lease), or DiLoCo inner steps
(``inner_steps`` = H optimizer steps per window, cycling through reshuffled passes of the lease; Douillard et
al. 2023, arXiv 2311.08105). With ``keep_optimizer_state=True`` the Adam moments and step count survive
from one `train` call to the next under the same ``state_key`` (DiLoCo keeps its inner optimizer state
across windows); otherwise each call starts from zeros.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .tensors import Schema, TensorDict, schema_of

LOSS_CHUNK = 1024
"""Rows per forward pass of `NumpyWorkload.loss` (memory only: the result is their sample-weighted mean)."""


STATE_PREFIX = "train_state."
"""Names of a checkpoint's training state beyond the params (`NumpyWorkload.train` ``on_checkpoint``)."""


def _softmax_xent(logits: np.ndarray, y: np.ndarray, grad: bool) -> tuple[float, np.ndarray | None]:
    """Mean cross-entropy of logits ``[b, C]`` against labels ``[b]``; with `grad`, d loss / d logits."""
    z = logits - logits.max(axis=1, keepdims=True)
    ez = np.exp(z)
    s = ez.sum(axis=1, keepdims=True)
    rows = np.arange(len(y))
    loss = float(np.mean(np.log(s[:, 0]) - z[rows, y]))
    if not grad:
        return loss, None
    p = ez / s
    p[rows, y] -= 1.0
    p /= len(y)
    return loss, p


def _xy(data: Any) -> tuple[Any, Any]:
    """``(x, y)`` from an ``(x, y)`` pair, or stacked from a sequence of ``(x_i, y_i)`` items."""
    if isinstance(data, tuple) and len(data) == 2:
        return data
    if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        raise TypeError(f"data must be an (x, y) pair or a sequence of (x_i, y_i) items, got {type(data).__name__}")
    items = [data[i] for i in range(len(data))]
    return np.stack([np.asarray(x) for x, _ in items]), np.asarray([np.asarray(y) for _, y in items])


class NumpyWorkload:
    """FedAvg / DiLoCo local training of an MLP ``sizes[0] -> ... -> sizes[-1]`` (ReLU between layers;
    ``sizes=(64, 10)`` is softmax regression) with Adam and cross-entropy, in float32 numpy.

    Args:
        train_data: ``(x float32 [n, sizes[0]], y int [n])``; a lease names row indices into it.
        eval_data: ``(x, y)`` for `evaluate`.
        sizes: layer widths.
        lr, betas, eps: Adam's hyper-parameters (Kingma & Ba 2015, as ``torch.optim.Adam``).
        batch_size: inner mini-batch size (samples).
        local_epochs: FedAvg's E (passes over the lease per `train`), used when `inner_steps` is None.
        inner_steps: DiLoCo's H (optimizer steps per `train`); overrides `local_epochs`.
        keep_optimizer_state: keep Adam's state across `train` calls, per ``state_key``.
        metrics: ``{name: (logits float32 [n, C], labels int64 [n]) -> float}`` computed by `evaluate` over the
            whole eval set (heads carry them as ``test_<name>``); default ``{"loss": mean cross-entropy,
            "accuracy": fraction of argmax == label}``. At most 63.

    `train_data` and `eval_data` are ``(x, y)`` arrays or any sequence of ``(x_i, y_i)`` items (e.g. a
    map-style dataset of arrays), stacked once at construction.

    Not thread-safe: one workload per thread of compute.
    """

    def __init__(
        self,
        train_data: tuple[Any, Any],
        eval_data: tuple[Any, Any],
        *,
        sizes: Sequence[int] = (64, 128, 10),
        lr: float = 5e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        batch_size: int = 32,
        local_epochs: int = 1,
        inner_steps: int | None = None,
        keep_optimizer_state: bool = False,
        metrics: Mapping[str, Callable[[np.ndarray, np.ndarray], float]] | None = None,
    ) -> None:
        if metrics is not None and not 1 <= len(metrics) <= 63:
            raise ValueError(f"metrics must name 1 to 63 metrics, got {len(metrics)}")
        if len(sizes) < 2 or min(sizes) < 1:
            raise ValueError(f"sizes must hold >= 2 positive widths, got {sizes}")
        if batch_size < 1 or local_epochs < 1 or (inner_steps is not None and inner_steps < 1):
            raise ValueError("batch_size, local_epochs and inner_steps must be >= 1")
        self.sizes = tuple(int(s) for s in sizes)
        self.lr, self.betas, self.eps = float(lr), (float(betas[0]), float(betas[1])), float(eps)
        self.batch_size = batch_size
        self.local_epochs = local_epochs
        self.inner_steps = inner_steps
        self.keep_optimizer_state = keep_optimizer_state
        self.metrics = dict(metrics) if metrics is not None else None
        train_x, train_y = _xy(train_data)
        eval_x, eval_y = _xy(eval_data)
        self.x_train = np.ascontiguousarray(train_x, dtype=np.float32)
        self.y_train = np.ascontiguousarray(train_y, dtype=np.int64)
        self.x_eval = np.ascontiguousarray(eval_x, dtype=np.float32)
        self.y_eval = np.ascontiguousarray(eval_y, dtype=np.int64)
        if len(self.x_train) != len(self.y_train) or len(self.x_eval) != len(self.y_eval):
            raise ValueError("x and y of a dataset must have the same length")
        if self.x_train.ndim != 2 or self.x_train.shape[1] != self.sizes[0]:
            raise ValueError(f"x_train must be [n, {self.sizes[0]}], got {self.x_train.shape}")
        self._layers = [(f"{2 * i}.weight", f"{2 * i}.bias") for i in range(len(self.sizes) - 1)]
        shapes: dict[str, tuple[int, ...]] = {}
        for (wn, bn), fan_in, fan_out in zip(self._layers, self.sizes, self.sizes[1:], strict=False):
            shapes[wn], shapes[bn] = (fan_out, fan_in), (fan_out,)
        self._schema: Schema = tuple((n, "float32", shapes[n]) for n in sorted(shapes))
        # Working params and Adam moments: allocated once, reused by every train call.
        self._w = {n: np.zeros(s, np.float32) for n, s in shapes.items()}
        self._m = {n: np.zeros(s, np.float32) for n, s in shapes.items()}
        self._v = {n: np.zeros(s, np.float32) for n, s in shapes.items()}
        self._saved: dict[Any, tuple[int, TensorDict, TensorDict]] = {}

    @property
    def browser(self) -> bool:
        """Whether this workload can run in a browser (spec/browser.md §2): the browser peer's kernel
        (web/src/mlp.ts) implements this MLP with Adam at the default betas and eps, a fresh optimizer each
        window, and labels that fit a byte. A subclass that trains otherwise must say False. The node's HTTP
        edge serves `/train` and the samples only for a workload that declares True."""
        return (not self.keep_optimizer_state and self.betas == (0.9, 0.999) and self.eps == 1e-8
                and (len(self.y_train) == 0 or (int(self.y_train.min()) >= 0 and int(self.y_train.max()) < 256)))

    # ---------------------------------------------------------------- interface

    @property
    def num_train(self) -> int:
        """Number of training samples (valid lease indices are ``0 .. num_train - 1``)."""
        return len(self.x_train)

    @property
    def train_labels(self) -> np.ndarray:
        """The training labels (int64 ``[num_train]``; read-only view)."""
        view = self.y_train.view()
        view.flags.writeable = False
        return view

    def with_train_labels(self, y: Any) -> NumpyWorkload:
        """A copy of this workload training on labels `y` (same length); used by label-flip attackers."""
        y = np.ascontiguousarray(y, dtype=np.int64)
        if y.shape != self.y_train.shape:
            raise ValueError(f"labels must have shape {self.y_train.shape}, got {y.shape}")
        other = NumpyWorkload.__new__(NumpyWorkload)
        other.__dict__.update(self.__dict__)
        other.y_train = y
        other._w = {n: np.zeros_like(t) for n, t in self._w.items()}
        other._m = {n: np.zeros_like(t) for n, t in self._m.items()}
        other._v = {n: np.zeros_like(t) for n, t in self._v.items()}
        other._saved = {}
        return other

    def with_train_data(self, x: Any, y: Any) -> NumpyWorkload:
        """A copy of this workload training on inputs `x` (float32 ``[n, sizes[0]]``) and labels `y` (int
        ``[n]``) instead: a private-data trainer's own samples (spec/protocol.md §10; node config key
        ``data``). Evaluation data and the model are unchanged; lease indices then name rows of `x`.
        ValueError for other shapes, an empty dataset or labels outside ``[0, sizes[-1])``."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        y = np.ascontiguousarray(y, dtype=np.int64)
        if x.ndim != 2 or x.shape[1] != self.sizes[0]:
            raise ValueError(f"x must be [n, {self.sizes[0]}], got {list(x.shape)}")
        if y.shape != (len(x),) or len(x) == 0:
            raise ValueError(f"y must be [n] with n = len(x) = {len(x)} > 0, got {list(y.shape)}")
        if y.min() < 0 or y.max() >= self.sizes[-1]:
            raise ValueError(f"labels must be in [0, {self.sizes[-1]}), got {int(y.min())}..{int(y.max())}")
        other = self.with_train_labels(self.y_train)
        other.x_train, other.y_train = x, y
        return other

    def schema(self) -> Schema:
        """``((name, "float32", shape), ...)`` of the params, sorted by name."""
        return self._schema

    def initial_params(self, seed: int) -> TensorDict:
        """PyTorch's default ``nn.Linear`` init (weights and biases uniform in ``±1/sqrt(fan_in)``) drawn
        from ``np.random.default_rng(seed)``, layer by layer (weight then bias)."""
        rng = np.random.default_rng(seed)
        out: TensorDict = {}
        for (wn, bn), fan_in, fan_out in zip(self._layers, self.sizes, self.sizes[1:], strict=False):
            bound = 1.0 / math.sqrt(fan_in)
            out[wn] = rng.uniform(-bound, bound, (fan_out, fan_in)).astype(np.float32)
            out[bn] = rng.uniform(-bound, bound, fan_out).astype(np.float32)
        return {n: out[n] for n in sorted(out)}

    def train(
        self,
        params: TensorDict,
        indices: Sequence[int],
        seed: int,
        *,
        epochs: int | None = None,
        inner_steps: int | None = None,
        state_key: Any = None,
        checkpoints: int = 0,
        on_checkpoint: Callable[[int, TensorDict], None] | None = None,
    ) -> tuple[TensorDict, dict[str, float | int]]:
        """Local training on the leased samples; returns ``(delta, metrics)``.

        Runs `inner_steps` (argument, else the workload's) Adam steps, or else `epochs` (argument, else
        `local_epochs`) passes, over ``indices`` in mini-batches of `batch_size`, reshuffled every pass by
        ``np.random.default_rng(seed)``. Same (params, indices, seed, optimizer state) -> same bytes.

        With ``checkpoints = S > 0`` (inner steps only, ``1 <= S <= H``, fresh optimizer state: a segment
        audit must rebuild step 0 from the base params, spec/protocol.md §6.3) it calls
        ``on_checkpoint(j, state)`` after step ``segment_bounds(H, S)[j]`` for ``j = 1 .. S``: `state` is the
        whole training state (`resume` continues from it), the params under their names and Adam's moments
        and step count under ``train_state.`` names; its arrays are the workload's own buffers, valid only
        during the call.

        Returns ``delta = params - trained`` (float32, DiLoCo sign convention) and ``{"train_loss":
        sample-weighted mean loss of the last pass (inner steps: of the last len(indices) samples seen),
        "samples": len(indices)}``. Raises ValueError for an empty lease, out-of-range indices, params
        of the wrong schema or checkpoints that cannot be taken.
        """
        index = self._lease(indices, params)
        steps = self.inner_steps if inner_steps is None else inner_steps
        n_epochs = self.local_epochs if epochs is None else epochs
        if (steps is not None and steps < 1) or n_epochs < 1:
            raise ValueError("epochs and inner_steps must be >= 1")
        bounds: dict[int, int] = {}
        if checkpoints:
            if steps is None or not 1 <= checkpoints <= steps or self.keep_optimizer_state:
                raise ValueError("checkpoints need inner steps, 1 <= checkpoints <= inner_steps and a fresh "
                                 "optimizer state (keep_optimizer_state=False)")
            bounds = {(j * steps) // checkpoints: j for j in range(1, checkpoints + 1)}
        for n, t in self._w.items():
            np.copyto(t, params[n], casting="no")
        t_step = self._restore_state(state_key)
        batches_per_pass = -(-len(index) // self.batch_size)
        total = steps if steps is not None else n_epochs * batches_per_pass

        def checkpoint(done: int, t: int) -> None:
            if on_checkpoint is not None and done in bounds:
                on_checkpoint(bounds[done], self._state(t))

        t_step, recent = self._run(index, np.random.default_rng(seed), 0, total, t_step, checkpoint)
        if self.keep_optimizer_state:
            self._saved[state_key] = (t_step, {k: v.copy() for k, v in self._m.items()},
                                      {k: v.copy() for k, v in self._v.items()})
        seen = sum(c for _, c in recent)
        delta = {name: np.subtract(params[name], self._w[name], dtype=np.float32) for name, _, _ in self._schema}
        return delta, {"train_loss": sum(loss * c for loss, c in recent) / seen, "samples": len(index)}

    def resume(self, state: TensorDict, indices: Sequence[int], seed: int, *, inner_steps: int, start: int,
               stop: int) -> TensorDict:
        """The training state after step `stop` of a `train` call with these indices, seed and inner steps,
        continued from `state`, its state after step `start` (a segment audit's replay, spec/protocol.md
        §6.3). At ``start = 0`` `state` may be the params alone (a fresh optimizer). Returns a new dict in the
        layout `train` passes to ``on_checkpoint``. Raises ValueError for bounds outside ``0 <= start < stop
        <= inner_steps`` or a state of another layout."""
        if not 0 <= start < stop <= inner_steps:
            raise ValueError(f"need 0 <= start < stop <= inner_steps, got {start}, {stop}, {inner_steps}")
        params = {name: state[name] for name, _, _ in self._schema if name in state}
        index = self._lease(indices, params)
        for n, t in self._w.items():
            np.copyto(t, params[n], casting="no")
        extra = set(state) - set(params)
        if not extra and start == 0:
            t_step = 0
            for t in (*self._m.values(), *self._v.values()):
                t.fill(0.0)
        elif extra == set(self._state(0)) - set(params):
            t_step = int(np.asarray(state[f"{STATE_PREFIX}step"]).reshape(()))
            for n in self._m:
                np.copyto(self._m[n], state[f"{STATE_PREFIX}m.{n}"], casting="no")
                np.copyto(self._v[n], state[f"{STATE_PREFIX}v.{n}"], casting="no")
        else:
            raise ValueError(f"state must hold the params and {sorted(set(self._state(0)) - set(params))}")
        t_step, _ = self._run(index, np.random.default_rng(seed), start, stop, t_step, None)
        return {n: np.array(t, copy=True) for n, t in self._state(t_step).items()}

    def _lease(self, indices: Sequence[int], params: TensorDict) -> np.ndarray:
        index = np.asarray(indices, dtype=np.int64)
        if index.ndim != 1 or len(index) == 0:
            raise ValueError("indices must be a non-empty sequence of ints")
        if int(index.min()) < 0 or int(index.max()) >= self.num_train:
            raise ValueError(f"indices must lie in [0, {self.num_train})")
        if schema_of(params) != self._schema:
            raise ValueError(f"params have schema {schema_of(params)}, expected {self._schema}")
        return index

    def _run(self, index: np.ndarray, rng: np.random.Generator, start: int, stop: int, t_step: int,
             after_step: Callable[[int, int], None] | None) -> tuple[int, list[tuple[float, int]]]:
        """Steps ``start .. stop - 1`` of a pass sequence over `index` (each pass a fresh ``rng.permutation``,
        drawn at its first step; the passes before `start` are drawn and skipped, so step k sees the batch it
        sees in a run from 0). Returns (Adam's step count, (loss, batch size) of the current pass's steps)."""
        n = len(index)
        batches_per_pass = -(-n // self.batch_size)
        for _ in range(start // batches_per_pass):
            rng.permutation(n)
        order = index[rng.permutation(n)] if start % batches_per_pass else index
        recent: list[tuple[float, int]] = []
        for k in range(start, stop):
            pos = k % batches_per_pass
            if pos == 0:
                order = index[rng.permutation(n)]
                recent = []
            batch = order[pos * self.batch_size : (pos + 1) * self.batch_size]
            t_step += 1
            loss = self._step(self.x_train[batch], self.y_train[batch], t_step)
            recent.append((loss, len(batch)))
            if after_step is not None:
                after_step(k + 1, t_step)
        return t_step, recent

    def _state(self, t_step: int) -> TensorDict:
        """The training state: params, Adam's moments and step count (``train_state.`` names)."""
        state: TensorDict = dict(self._w)
        for n in self._m:
            state[f"{STATE_PREFIX}m.{n}"] = self._m[n]
            state[f"{STATE_PREFIX}v.{n}"] = self._v[n]
        state[f"{STATE_PREFIX}step"] = np.array([t_step], dtype=np.float32)
        return state

    def evaluate(self, params: TensorDict) -> dict[str, float]:
        """``{"loss": mean cross-entropy, "accuracy": fraction of argmax == label}`` over the eval set, or the
        ``metrics`` given at construction (NaN each for an empty eval set)."""
        if schema_of(params) != self._schema:
            raise ValueError(f"params have schema {schema_of(params)}, expected {self._schema}")
        names = ("loss", "accuracy") if self.metrics is None else tuple(self.metrics)
        if len(self.x_eval) == 0:
            return dict.fromkeys(names, math.nan)
        logits = self._forward(params, self.x_eval)[-1]
        if self.metrics is not None:
            return {name: float(metric(logits, self.y_eval)) for name, metric in self.metrics.items()}
        loss, _ = _softmax_xent(logits, self.y_eval, grad=False)
        return {"loss": loss, "accuracy": float(np.mean(logits.argmax(axis=1) == self.y_eval))}

    def loss(self, params: TensorDict, indices: Sequence[int]) -> float:
        """Mean training loss (cross-entropy, as `train` minimizes) of `params` over the training samples
        `indices`: forward passes only, for a validator's loss check (loss before vs after an update).

        `params`: the workload's schema (float32 arrays). `indices`: ints in ``[0, num_train)``, duplicates
        allowed (each occurrence counts). The rows are taken in the given order in chunks of `LOSS_CHUNK`, and
        the result is the sample-weighted mean of the chunks' mean losses (a Python float; NaN or inf if the
        params overflow). No gradient, no optimizer state, no RNG: the working weights and kept Adam state
        are untouched, so a later `train` gives the same bytes as without this call. Deterministic: the same
        (params, indices) give the same float. Raises ValueError for empty or out-of-range indices or params
        of the wrong schema.
        """
        index = self._lease(indices, params)
        total = 0.0
        for start in range(0, len(index), LOSS_CHUNK):
            rows = index[start : start + LOSS_CHUNK]
            value, _ = _softmax_xent(self._forward(params, self.x_train[rows])[-1], self.y_train[rows], grad=False)
            total += value * len(rows)
        return total / len(index)

    def reset_optimizer_state(self, state_key: Any = None) -> None:
        """Forget the kept inner optimizer state of `state_key` (no-op if none)."""
        self._saved.pop(state_key, None)

    # ---------------------------------------------------------------- internals

    def _restore_state(self, state_key: Any) -> int:
        saved = self._saved.get(state_key) if self.keep_optimizer_state else None
        if saved is None:
            for t in (*self._m.values(), *self._v.values()):
                t.fill(0.0)
            return 0
        step, m, v = saved
        for k in self._m:
            np.copyto(self._m[k], m[k])
            np.copyto(self._v[k], v[k])
        return step

    def _forward(self, w: TensorDict, x: np.ndarray) -> list[np.ndarray]:
        acts = [x]
        last = len(self._layers) - 1
        for i, (wn, bn) in enumerate(self._layers):
            h = acts[-1] @ w[wn].T
            h += w[bn]
            if i < last:
                np.maximum(h, 0.0, out=h)
            acts.append(h)
        return acts

    def _step(self, x: np.ndarray, y: np.ndarray, t: int) -> float:
        """One Adam step on a mini-batch (``torch.optim.Adam`` update rule, no weight decay)."""
        w = self._w
        acts = self._forward(w, x)
        loss, g_or_none = _softmax_xent(acts[-1], y, grad=True)
        assert g_or_none is not None  # grad=True
        g = g_or_none
        b1, b2 = self.betas
        c1, c2 = 1.0 - b1**t, 1.0 - b2**t
        step_size = self.lr / c1
        for i in range(len(self._layers) - 1, -1, -1):
            wn, bn = self._layers[i]
            grads = ((wn, g.T @ acts[i]), (bn, g.sum(axis=0)))
            if i > 0:
                g = g @ w[wn]
                g *= acts[i] > 0  # ReLU'
            for name, grad in grads:
                m, v = self._m[name], self._v[name]
                m *= b1
                m += (1.0 - b1) * grad
                v *= b2
                v += (1.0 - b2) * grad * grad
                denom = np.sqrt(v / c2)
                denom += self.eps
                w[name] -= step_size * m / denom
        return loss


def make_digits_numpy_workload(
    seed: int = 0,
    *,
    local_epochs: int = 2,
    inner_steps: int | None = None,
    keep_optimizer_state: bool = False,
    lr: float = 5e-3,
    batch_size: int = 32,
    hidden: int = 128,
    test_fraction: float = 0.25,
) -> NumpyWorkload:
    """The bundled digits task in numpy: MLP 64-`hidden`-10 (``hidden=0``: softmax regression 64-10), Adam
    (`lr`), cross-entropy; train/eval = `load_digits_split(seed, test_fraction)` (1347 / 450 samples). The
    defaults mirror `peerloom.backends.torch.models.make_digits_workload` (same schema)."""
    from peerloom.backends.datasets import load_digits_split

    x_train, y_train, x_test, y_test = load_digits_split(seed, test_fraction)
    sizes = (64, hidden, 10) if hidden else (64, 10)
    return NumpyWorkload((x_train, y_train), (x_test, y_test), sizes=sizes, lr=lr, batch_size=batch_size,
                         local_epochs=local_epochs, inner_steps=inner_steps,
                         keep_optimizer_state=keep_optimizer_state)


def numpy_workload(
    *,
    sizes: Sequence[int],
    train_data: Any,
    eval_data: Any,
    lr: float = 5e-3,
    batch_size: int = 32,
    inner_steps: int | None = None,
    local_epochs: int = 1,
    metrics: Mapping[str, Callable[[np.ndarray, np.ndarray], float]] | None = None,
    keep_optimizer_state: bool = False,
) -> NumpyWorkload:
    """A pure-numpy workload on the user's data, shaped like `peerloom.backends.torch.workload.torch_workload`:
    an MLP ``sizes[0] -> ... -> sizes[-1]`` (ReLU between layers) trained with Adam(`lr`) on cross-entropy,
    the same schema as ``torch.nn.Sequential(Linear, ReLU, ..., Linear)``. `train_data` / `eval_data`: ``(x
    float32 [n, sizes[0]], y int [n])`` or a sequence of ``(x_i, y_i)`` items; a lease's shard ``s`` trains on
    rows ``shards[s]`` of ``shards = shards_for(len(train x), num_shards, seed)``. `metrics`: see
    `NumpyWorkload`. Raises ValueError/TypeError for bad arguments.
    """
    return NumpyWorkload(train_data, eval_data, sizes=sizes, lr=lr, batch_size=batch_size, inner_steps=inner_steps,
                         local_epochs=local_epochs, keep_optimizer_state=keep_optimizer_state, metrics=metrics)

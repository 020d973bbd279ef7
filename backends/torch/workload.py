"""`TorchWorkload`: an ordinary PyTorch model, optimizer, loss and datasets as a peerloom workload
(DESIGN §5).

A workload turns (params, lease) into a pseudo-gradient and params into metrics. Parameters cross the
boundary as numpy float32 `TensorDict`s (name -> array, the model's ``state_dict`` names), so the
protocol never sees torch objects. One model instance is kept for the workload's life; params are
loaded into it in place with ``copy_``, never reallocated.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from peerloom.backends.numpy.tensors import Schema, TensorDict, schema_of

ModelFactory = Callable[[], nn.Module]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def set_num_threads(n: int = 1) -> None:
    """Set torch's intra-op thread count for this process (``torch.set_num_threads``).

    One thread per process is the right choice when many trainer processes share a few cores; peerloom
    never calls this on import — hosts (the node runtime, the demo) call it, or pass ``num_threads``.
    """
    if n < 1:
        raise ValueError(f"num_threads must be >= 1, got {n}")
    torch.set_num_threads(n)


def _as_tensor(data: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        tensor = data.detach().cpu()
    else:
        tensor = torch.from_numpy(np.array(data, copy=True))
    if dtype is not None:
        tensor = tensor.to(dtype)
    return tensor.contiguous()


class TorchWorkload:
    """FedAvg / DiLoCo local training for a user's `nn.Module` (DESIGN §5).

    Args:
        model_factory: builds the model (called once here and once per `initial_params`).
        optimizer_factory: ``params -> torch.optim.Optimizer``; a fresh inner optimizer per `train` call.
        loss_fn: ``(outputs, targets) -> scalar mean loss`` (e.g. ``nn.functional.cross_entropy``).
        train_data: ``(x, y)`` tensors or arrays; a lease names row indices into them.
        eval_data: ``(x, y)`` for `evaluate`. Accuracy assumes class logits ``[n, C]`` and integer labels.
        batch_size: inner mini-batch size (samples).
        local_epochs: passes over the leased samples per `train` call (FedAvg's E).
        inner_steps: DiLoCo's H — optimizer steps per `train` call (mini-batches cycle through reshuffled
            passes of the lease); overrides `local_epochs` when given (Douillard et al., arXiv 2311.08105).
        keep_optimizer_state: keep the inner optimizer's state (e.g. Adam moments) from one `train` call to
            the next under the same ``state_key`` (DiLoCo keeps it across windows); default: fresh per call.
        eval_batch_size: batch size for `evaluate` (memory only; does not change results beyond float
            summation order).
        num_threads: if given, calls `set_num_threads` (process-wide) at construction.

    Params are the floating-point entries of the model's ``state_dict`` (parameters and float buffers,
    which must all be float32); integer buffers (e.g. BatchNorm's ``num_batches_tracked``) stay local.
    Not thread-safe: one workload per thread of compute.
    """

    def __init__(
        self,
        model_factory: ModelFactory,
        optimizer_factory: OptimizerFactory,
        loss_fn: LossFn,
        train_data: tuple[Any, Any],
        eval_data: tuple[Any, Any],
        *,
        batch_size: int = 32,
        local_epochs: int = 1,
        inner_steps: int | None = None,
        keep_optimizer_state: bool = False,
        eval_batch_size: int = 1024,
        num_threads: int | None = None,
    ) -> None:
        if batch_size < 1 or local_epochs < 1 or eval_batch_size < 1:
            raise ValueError("batch_size, local_epochs and eval_batch_size must be >= 1")
        if inner_steps is not None and inner_steps < 1:
            raise ValueError(f"inner_steps must be >= 1, got {inner_steps}")
        if num_threads is not None:
            set_num_threads(num_threads)
        self.model_factory = model_factory
        self.optimizer_factory = optimizer_factory
        self.loss_fn = loss_fn
        self.batch_size = batch_size
        self.local_epochs = local_epochs
        self.inner_steps = inner_steps
        self.keep_optimizer_state = keep_optimizer_state
        self._saved_optimizers: dict[Any, dict[str, Any]] = {}
        self.eval_batch_size = eval_batch_size
        self.x_train = _as_tensor(train_data[0])
        self.y_train = _as_tensor(train_data[1])
        self.x_eval = _as_tensor(eval_data[0])
        self.y_eval = _as_tensor(eval_data[1])
        if len(self.x_train) != len(self.y_train) or len(self.x_eval) != len(self.y_eval):
            raise ValueError("x and y of a dataset must have the same length")
        self.model = model_factory()
        self._state = self._state_tensors(self.model)
        self._schema = schema_of({n: t.numpy() for n, t in self._state.items()})

    @staticmethod
    def _state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
        state = {n: t for n, t in model.state_dict(keep_vars=True).items() if t.is_floating_point()}
        for name, tensor in state.items():
            if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
                raise ValueError(f"state {name!r} is {tensor.dtype} on {tensor.device}; need float32 on CPU")
        return {n: t.detach() for n, t in sorted(state.items())}

    @property
    def num_train(self) -> int:
        """Number of training samples (valid lease indices are ``0 .. num_train - 1``)."""
        return len(self.x_train)

    @property
    def train_labels(self) -> np.ndarray:
        """The training targets as a numpy array (a copy)."""
        return self.y_train.numpy().copy()

    def with_train_labels(self, y: Any) -> TorchWorkload:
        """A copy of this workload training on targets `y` (same length; used by label-flip attackers). It
        shares this workload's model object (params are loaded in place before every use) but keeps its own
        optimizer state."""
        labels = _as_tensor(y, self.y_train.dtype)
        if labels.shape != self.y_train.shape:
            raise ValueError(f"labels must have shape {tuple(self.y_train.shape)}, got {tuple(labels.shape)}")
        other = TorchWorkload.__new__(TorchWorkload)
        other.__dict__.update(self.__dict__)
        other.y_train = labels
        other._saved_optimizers = {}
        return other

    def reset_optimizer_state(self, state_key: Any = None) -> None:
        """Forget the kept inner optimizer state of `state_key` (no-op if none)."""
        self._saved_optimizers.pop(state_key, None)

    def schema(self) -> Schema:
        """``((name, "float32", shape), ...)`` of the params, sorted by name."""
        return self._schema

    def initial_params(self, seed: int) -> TensorDict:
        """Fresh float32 params from ``model_factory`` under ``torch.manual_seed(seed)``.

        The global torch RNG is forked (``torch.random.fork_rng``), so callers' random state is untouched.
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self.model_factory()
        state = self._state_tensors(model)
        return {n: t.numpy().copy() for n, t in state.items()}

    def _load(self, params: TensorDict) -> None:
        if schema_of(params) != self._schema:
            raise ValueError(f"params have schema {schema_of(params)}, expected {self._schema}")
        for name, tensor in self._state.items():
            np.copyto(tensor.numpy(), params[name], casting="no")

    def params(self) -> TensorDict:
        """A copy of the model's current params."""
        return {n: t.numpy().copy() for n, t in self._state.items()}

    def train(
        self,
        params: TensorDict,
        indices: Sequence[int],
        seed: int,
        *,
        epochs: int | None = None,
        inner_steps: int | None = None,
        state_key: Any = None,
    ) -> tuple[TensorDict, dict[str, float | int]]:
        """Local training on the leased samples; returns ``(delta, metrics)``.

        Loads `params` (copied in place) and runs either `inner_steps` optimizer steps (argument, else the
        workload's; DiLoCo's H) or `local_epochs` (or `epochs`) passes (FedAvg's E) over ``indices`` in
        mini-batches of `batch_size`, reshuffled every pass by a ``torch.Generator`` seeded with `seed`; the
        global torch RNG (dropout etc.) is forked and seeded with `seed` too, so the same (params, indices,
        seed, kept optimizer state) gives the same bytes in one process. The inner optimizer is fresh, or,
        with ``keep_optimizer_state``, restored from the state this workload saved for `state_key` at the
        end of its previous call (the host passes one key per trainer when one workload serves several).

        Returns the pseudo-gradient ``delta = params_before - params_after`` (numpy float32, same schema;
        DiLoCo sign convention, arXiv 2311.08105, so the outer step is ``params - lr * mean(delta)``) and
        ``{"train_loss": sample-weighted mean loss of the last pass (inner steps: of the batches since the
        last reshuffle), "samples": len(indices)}``.
        Raises ValueError for an empty lease, out-of-range indices or params of the wrong schema.
        """
        steps = self.inner_steps if inner_steps is None else inner_steps
        n_epochs = self.local_epochs if epochs is None else epochs
        if n_epochs < 1 or (steps is not None and steps < 1):
            raise ValueError(f"epochs and inner_steps must be >= 1, got {n_epochs}, {steps}")
        index = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        if index.ndim != 1 or len(index) == 0:
            raise ValueError("indices must be a non-empty sequence of ints")
        if int(index.min()) < 0 or int(index.max()) >= self.num_train:
            raise ValueError(f"indices must lie in [0, {self.num_train})")
        self._load(params)
        model = self.model
        model.train()
        optimizer = self.optimizer_factory(model.parameters())
        saved = self._saved_optimizers.get(state_key) if self.keep_optimizer_state else None
        if saved is not None:
            optimizer.load_state_dict(saved)
        generator = torch.Generator().manual_seed(seed)
        n = len(index)
        per_pass = -(-n // self.batch_size)
        total = steps if steps is not None else n_epochs * per_pass
        loss_sum, seen = 0.0, 0
        order = index
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for k in range(total):
                pos = k % per_pass
                if pos == 0:
                    order = index[torch.randperm(n, generator=generator)]
                    loss_sum, seen = 0.0, 0
                batch = order[pos * self.batch_size : (pos + 1) * self.batch_size]
                optimizer.zero_grad(set_to_none=True)
                loss = self.loss_fn(model(self.x_train[batch]), self.y_train[batch])
                loss.backward()
                optimizer.step()
                loss_sum += float(loss.detach()) * len(batch)
                seen += len(batch)
        if self.keep_optimizer_state:
            self._saved_optimizers[state_key] = copy.deepcopy(optimizer.state_dict())
        delta = {
            name: np.subtract(params[name], tensor.numpy(), dtype=np.float32) for name, tensor in self._state.items()
        }
        return delta, {"train_loss": loss_sum / seen, "samples": n}

    @torch.no_grad()
    def evaluate(self, params: TensorDict) -> dict[str, float]:
        """``{"loss": mean loss, "accuracy": fraction of argmax == label}`` over the eval set."""
        self._load(params)
        model = self.model
        model.eval()
        n = len(self.x_eval)
        loss_sum = 0.0
        correct = 0
        for start in range(0, n, self.eval_batch_size):
            x = self.x_eval[start : start + self.eval_batch_size]
            y = self.y_eval[start : start + self.eval_batch_size]
            out = model(x)
            loss_sum += float(self.loss_fn(out, y)) * len(x)
            correct += int((out.argmax(dim=-1) == y).sum())
        if n == 0:
            return {"loss": math.nan, "accuracy": math.nan}
        return {"loss": loss_sum / n, "accuracy": correct / n}

"""`TorchWorkload`: an ordinary PyTorch model, optimizer, loss and datasets as a peerloom workload
(spec/design.md §5; spec/protocol.md §5-6).

A workload turns (params, lease) into a pseudo-gradient and params into metrics, and (`TorchWorkload.loss`,
forward only) (params, lease) into the mean training loss a validator's loss check compares. Parameters
cross the boundary as numpy float32 `TensorDict`s (name -> array, the model's ``state_dict`` names), so the
protocol never sees torch objects. One model instance is kept for the workload's life; params are
loaded into it in place with ``copy_``, never reallocated.

`torch_workload` builds one from the user's own torch objects: a model factory, a loss, an inner-optimizer
factory and a ``torch.utils.data.Dataset`` for training and one for evaluation (or DataLoader factories),
with an LR scheduler, gradient clipping, bf16 autocast, a device and evaluation metrics of the user's
choosing. A node loads it through a ``factory(seed, num_shards) -> (workload, shards)`` named by its
config key ``workload`` (``peerloom/node.py``), the shards coming from
`peerloom.backends.sharding.shards_for`.

Determinism (what recomputation audits rely on, spec/protocol.md §6): `train` is a function of (params,
indices, seed, inner steps, kept optimizer state). It reshuffles with a ``torch.Generator`` seeded with
the seed, forks the global torch RNG (CPU, and the CUDA device it trains on) and seeds it with the seed
(dropout and other random layers), so the same inputs give the same bytes in one process on one platform.
On CUDA, `to_device` sets ``torch.backends.cudnn.deterministic = True`` and ``benchmark = False``
(process-wide); bit-for-bit repeats on a GPU also need the kernels themselves to be deterministic
(``CUBLAS_WORKSPACE_CONFIG=:4096:8``, no atomics-based ops), else audits see floating-point drift and
compare by cosine (``audit_min_cosine``).

Segment audits: ``train(..., checkpoints=S, on_checkpoint=cb)`` hands ``cb`` the whole training state
(params, optimizer state, global RNG, a ``train_loader``'s pass) after steps ``(j * H) // S``, and `resume`
replays any range of steps from such a state bit for bit (same platform), so a validator can recompute one
committed segment instead of the whole run (`TorchWorkload.resume` lists the state's names).

Differential privacy (spec/protocol.md §10): with ``privacy`` (`peerloom.privacy.DP`, or `TorchWorkload.with_privacy`)
`train` runs DP-SGD through Opacus: Poisson-sampled batches, per-sample clipping and Gaussian noise from a
generator seeded from the training seed, so its bytes replay like plain training's (`TorchWorkload.train`);
`TorchWorkload.privacy_steps` counts the steps the privacy accountant (`peerloom.privacy.epsilon`) charges.

Evaluation runs on the CPU in float32 unless ``eval_on_device``: validators compare each other's head
metrics within ``METRIC_TOLERANCE`` (1e-4, spec/agreement.md), and a GPU's arithmetic (TF32 convolutions,
other kernels, bf16) can differ from a CPU's by more than that, so validators on different devices would
refuse each other's heads.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, Subset, TensorDataset, default_collate

from peerloom.backends.devices import resolve_device
from peerloom.backends.numpy.tensors import Schema, TensorDict, schema_of
from peerloom.backends.privacy import DP, privacy_sample_rate, privacy_steps, require_opacus

ModelFactory = Callable[[], nn.Module]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[Any, Any], torch.Tensor]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
Metric = Callable[[Any, Any], "float | torch.Tensor"]
Batch = tuple[Any, Any]
TrainLoaderFactory = Callable[[Dataset, torch.Generator], Iterable[Batch]]
EvalLoaderFactory = Callable[[Dataset], Iterable[Batch]]
MAX_METRICS = 63
"""A head holds at most 64 metrics (spec/wire.md): the workload's, each as ``test_<name>``, and ``train_loss``."""
LOSS_SEED = 0
"""The seed of `TorchWorkload.loss`'s forked global RNG and of the generator it hands a ``train_loader``."""
STATE_PREFIX = "train_state."
"""Names of a checkpoint's training state beyond the params (`TorchWorkload.train` ``on_checkpoint``)."""
_STATE_VERSION = 1
"""``version`` of a checkpoint's ``train_state.meta`` (`TorchWorkload.train`)."""
_MAX_META_BYTES = 1 << 24
"""Largest ``train_state.meta`` `TorchWorkload.resume` decodes (16 MiB of JSON)."""
_NO_DP_SEGMENTS = ("segment audits do not support DP-SGD (checkpoints / resume with privacy set): "
                   "audit a DP trainer by recomputing its whole train call")
_DP_NOISE_DOMAIN = b"peerloom/dp-sgd/noise/"
"""Prefix of the hash that turns a training seed into the DP-SGD noise generator's seed (`dp_noise_seed`)."""


def dp_noise_seed(seed: int) -> int:
    """The seed of DP-SGD's noise generator for the training seed `seed`: the first 8 bytes (little-endian) of
    ``sha256(b"peerloom/dp-sgd/noise/" + decimal seed)``, so the noise stream is independent of the batch
    sampling stream (a ``torch.Generator`` seeded with `seed` itself) while both replay from `seed`."""
    return int.from_bytes(hashlib.sha256(_DP_NOISE_DOMAIN + str(int(seed)).encode()).digest()[:8], "little")


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


def _pair(data: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(x, y)`` tensors for an ``(x, y)`` tuple or a two-tensor `TensorDataset`; None for another dataset."""
    if isinstance(data, tuple) and len(data) == 2:
        return _as_tensor(data[0]), _as_tensor(data[1])
    if isinstance(data, TensorDataset) and len(data.tensors) == 2:
        return _as_tensor(data.tensors[0]), _as_tensor(data.tensors[1])
    if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        raise TypeError(f"data must be an (x, y) tuple or a map-style torch Dataset, got {type(data).__name__}")
    return None


def _batch_len(targets: Any) -> int:
    return int(targets.shape[0]) if isinstance(targets, torch.Tensor) else len(targets)


def _move(data: Any, device: torch.device) -> Any:
    """`data` (a tensor, or lists, tuples and dicts of them) on `device`; other values as they are."""
    if isinstance(data, torch.Tensor):
        return data.to(device)
    if isinstance(data, Mapping):
        return {k: _move(v, device) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(_move(v, device) for v in data)
    return data


def _float32(out: Any) -> Any:
    """Floating-point model outputs as float32 (bf16 autocast leaves them bf16)."""
    if isinstance(out, torch.Tensor) and out.is_floating_point() and out.dtype != torch.float32:
        return out.float()
    return out


def _byte_values(data: bytes) -> np.ndarray:
    """`data` as a float32 array of its byte values (0..255, exact): bytes in a one-dtype checkpoint."""
    return np.frombuffer(data, dtype=np.uint8).astype(np.float32)


def _value_bytes(array: Any, name: str, limit: int = _MAX_META_BYTES) -> bytes:
    """The bytes `_byte_values` made `array` from; ValueError unless a float32 vector of integers 0..255."""
    values = np.asarray(array)
    if values.dtype != np.float32 or values.ndim != 1 or len(values) > limit:
        raise ValueError(f"state {name!r} must be a float32 vector of byte values")
    as_bytes = values.astype(np.uint8)
    if not np.array_equal(as_bytes.astype(np.float32), values):
        raise ValueError(f"state {name!r} must hold integers 0..255")
    return as_bytes.tobytes()


def _f32(tensor: torch.Tensor) -> np.ndarray:
    """A float32 tensor as a fresh C-contiguous little-endian array on the CPU (a 0-d tensor as shape [1])."""
    array = tensor.detach().cpu().numpy().astype("<f4", copy=True)
    return array.reshape(1) if array.ndim == 0 else np.ascontiguousarray(array)


_TENSOR_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}


def _encode_value(value: Any, where: str) -> dict[str, Any]:
    """A JSON spec of a small non-float32 value of a training state: a tensor (dtype, shape, hex bytes) or a
    Python scalar. ValueError for anything else (it could not be restored exactly)."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        if dtype not in _TENSOR_DTYPES:
            raise ValueError(f"cannot checkpoint {where}: a {value.dtype} tensor")
        flat = value.detach().cpu().contiguous().reshape(-1)
        raw = flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)
        return {"dtype": dtype, "shape": list(value.shape), "hex": raw.numpy().tobytes().hex()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise ValueError(f"cannot checkpoint {where}: a {type(value).__name__}")


def _decode_value(spec: Any, where: str) -> Any:
    """The value `_encode_value` encoded (a CPU tensor or a Python scalar); ValueError for a malformed spec."""
    if isinstance(spec, dict) and set(spec) == {"value"}:
        value = spec["value"]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
    elif isinstance(spec, dict) and set(spec) == {"dtype", "shape", "hex"}:
        dtype, shape, data = _TENSOR_DTYPES.get(spec["dtype"]), spec["shape"], spec["hex"]
        if (dtype is not None and isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
                and isinstance(data, str)):
            try:
                raw = bytes.fromhex(data)
            except ValueError:
                raw = None
            count = math.prod(shape)
            if raw is not None and len(raw) == count * torch.empty((), dtype=dtype).element_size():
                if not raw:
                    return torch.empty(shape, dtype=dtype)
                values = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                if dtype == torch.bool:
                    return (values != 0).reshape(shape)
                return values.view(dtype).reshape(shape)
    raise ValueError(f"malformed state entry {where}")


def argmax_accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Fraction of rows whose argmax over the last dimension equals the integer target (class logits
    ``[n, C]`` against labels ``[n]``, or ``[n, T, C]`` against ``[n, T]``)."""
    return float((outputs.argmax(dim=-1) == targets).float().mean())


class TorchWorkload:
    """FedAvg / DiLoCo local training for a user's `nn.Module` (spec/design.md §5).

    Args:
        model_factory: builds the model with no arguments (e.g. the model's class). `initial_params` calls it
            under a forked global torch RNG seeded with its seed, so every peer building the revision's
            genesis gets the same params; it is called once more here for the working model.
        optimizer_factory: ``params -> torch.optim.Optimizer``; a fresh inner optimizer per `train` call.
        loss_fn: ``(outputs, targets) -> scalar mean loss`` (e.g. ``nn.functional.cross_entropy``).
        train_data: ``(x, y)`` tensors or arrays, or a map-style ``torch.utils.data.Dataset`` whose items are
            ``(input, target)``; a lease names item indices into it. A `TensorDataset` of two tensors is
            batched by indexing its tensors, any other dataset by ``collate_fn`` over its items.
        eval_data: the same for `evaluate`.
        batch_size: inner mini-batch size (samples).
        local_epochs: passes over the leased samples per `train` call (FedAvg's E).
        inner_steps: DiLoCo's H — optimizer steps per `train` call (mini-batches cycle through reshuffled
            passes of the lease); overrides `local_epochs` when given (Douillard et al., arXiv 2311.08105).
        keep_optimizer_state: keep the inner optimizer's state (e.g. Adam moments) and the scheduler's from
            one `train` call to the next under the same ``state_key`` (DiLoCo keeps it across windows); default:
            fresh per call. A validator's audit cannot see a trainer's kept state: audit only without it.
        eval_batch_size: batch size for `evaluate` (memory only; does not change results beyond float
            summation order).
        num_threads: if given, calls `set_num_threads` (process-wide) at construction.
        scheduler_factory: ``optimizer -> LR scheduler`` (``torch.optim.lr_scheduler``), stepped after every
            optimizer step. A schedule spans windows: each `train` call builds a fresh one and steps it to the
            run's global step first (`train`'s ``step``: ``(window - 1) * inner_steps`` from a node), so its
            learning rate at window k's first step is a central run's at step ``(k - 1) * H``; with
            ``keep_optimizer_state`` the kept scheduler state continues instead.
        clip_grad_norm: if given, ``nn.utils.clip_grad_norm_(params, clip_grad_norm)`` (global L2 norm) before
            every optimizer step.
        bf16: run the training forward pass and loss under ``torch.autocast(dtype=torch.bfloat16)`` on the
            workload's device; params, gradients and deltas stay float32 (evaluation too, unless
            ``eval_on_device``).
        metrics: ``{name: (outputs, targets) -> float}`` for `evaluate`, each a mean over its batch; `evaluate`
            reports their sample-weighted means over the eval set, and heads carry them as ``test_<name>``.
            Default: ``{"loss": loss_fn, "accuracy": argmax accuracy}`` (``test_loss``, ``test_accuracy``).
            At most `MAX_METRICS`.
        collate_fn: list of items -> batch, for datasets that are not two-tensor `TensorDataset` s (default
            ``torch.utils.data.default_collate``).
        train_loader: ``(leased subset: Dataset, generator: torch.Generator) -> iterable of (inputs, targets)``
            (e.g. a ``DataLoader(subset, batch_size=..., shuffle=True, generator=generator)``); replaces the
            built-in batching of the lease. Each pass iterates it once more; it must draw its randomness from
            `generator` (seeded with the training seed), or audits cannot reproduce it.
        eval_loader: ``eval dataset -> iterable of (inputs, targets)``; replaces the built-in eval batching.
        device: where training and evaluation run: ``"cpu"`` (default), ``"cuda"``, ``"cuda:N"``, ``"mps"``
            or ``"auto"`` (`peerloom.backends.devices.resolve_device`; DeviceError if absent). `to_device`
            moves it later (a node does, from its config key ``device``).
        eval_on_device: evaluate on the device too (under bf16 autocast if ``bf16``). Default False: `evaluate`
            runs a CPU float32 copy of the model, so validators on any devices agree on a head's metrics
            (module docstring); set it only when every validator of the revision uses the same device kind.
        privacy: a `peerloom.backends.privacy.DP` (``peerloom.privacy.DP``): `train` runs DP-SGD (see there);
            `with_privacy` sets or clears it later (a node does, from the manifest). Refused (`with_privacy`):
            with a ``train_loader``, ``bf16``, ``clip_grad_norm`` or a model Opacus cannot train per sample.

    Params are the floating-point entries of the model's ``state_dict`` (parameters and float buffers,
    which must all be float32); integer buffers (e.g. BatchNorm's ``num_batches_tracked``) stay local.
    Not thread-safe: one workload per thread of compute.
    """

    TAKES_STEP = True
    """`train` and `resume` take the run's global step (``step``), which a node passes
    (`peerloom.adapters.compute.ComputeExecutor`)."""

    def __init__(
        self,
        model_factory: ModelFactory,
        optimizer_factory: OptimizerFactory,
        loss_fn: LossFn,
        train_data: Any,
        eval_data: Any,
        *,
        batch_size: int = 32,
        local_epochs: int = 1,
        inner_steps: int | None = None,
        keep_optimizer_state: bool = False,
        eval_batch_size: int = 1024,
        num_threads: int | None = None,
        scheduler_factory: SchedulerFactory | None = None,
        clip_grad_norm: float | None = None,
        bf16: bool = False,
        metrics: Mapping[str, Metric] | None = None,
        collate_fn: Callable[[list[Any]], Batch] | None = None,
        train_loader: TrainLoaderFactory | None = None,
        eval_loader: EvalLoaderFactory | None = None,
        device: str = "cpu",
        eval_on_device: bool = False,
        privacy: DP | None = None,
    ) -> None:
        if batch_size < 1 or local_epochs < 1 or eval_batch_size < 1:
            raise ValueError("batch_size, local_epochs and eval_batch_size must be >= 1")
        if inner_steps is not None and inner_steps < 1:
            raise ValueError(f"inner_steps must be >= 1, got {inner_steps}")
        if clip_grad_norm is not None and not 0.0 < clip_grad_norm < math.inf:
            raise ValueError(f"clip_grad_norm must be a positive finite number, got {clip_grad_norm}")
        if metrics is not None:
            if not metrics or len(metrics) > MAX_METRICS:
                raise ValueError(f"metrics must name 1 to {MAX_METRICS} metrics, got {len(metrics)}")
            for name, fn in metrics.items():
                if not isinstance(name, str) or not name or not callable(fn):
                    raise ValueError(f"metrics must map non-empty names to callables, got {name!r}: {fn!r}")
        if num_threads is not None:
            set_num_threads(num_threads)
        self.model_factory = model_factory
        self.optimizer_factory = optimizer_factory
        self.loss_fn = loss_fn
        self.batch_size = batch_size
        self.local_epochs = local_epochs
        self.inner_steps = inner_steps
        self.keep_optimizer_state = keep_optimizer_state
        self.scheduler_factory = scheduler_factory
        self.clip_grad_norm = clip_grad_norm
        self.bf16 = bool(bf16)
        self.metrics = dict(metrics) if metrics is not None else None
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self.train_loader = train_loader
        self.eval_loader = eval_loader
        self._saved_optimizers: dict[Any, dict[str, Any]] = {}
        self._saved_schedulers: dict[Any, dict[str, Any]] = {}
        self._schedule_at: tuple[int, dict[str, Any], list[dict[str, Any]]] | None = None  # `_scheduler`
        self.eval_batch_size = eval_batch_size
        # (x, y) tensors when the data are two tensors (indexed directly), else the dataset itself.
        train, evals = _pair(train_data), _pair(eval_data)
        self.x_train: torch.Tensor | None
        self.y_train: torch.Tensor | None
        self.x_eval: torch.Tensor | None
        self.y_eval: torch.Tensor | None
        self.x_train, self.y_train = train if train is not None else (None, None)
        self.x_eval, self.y_eval = evals if evals is not None else (None, None)
        self.train_dataset = None if train is not None else train_data
        self.eval_dataset = None if evals is not None else eval_data
        for pair in (train, evals):
            if pair is not None and len(pair[0]) != len(pair[1]):
                raise ValueError("x and y of a dataset must have the same length")
        self.device = torch.device("cpu")
        self.eval_on_device = bool(eval_on_device)
        self._cpu_model: nn.Module | None = None  # evaluate's CPU copy while training runs elsewhere
        self.model = model_factory()
        self._state = self._state_tensors(self.model)
        self._staging: dict[str, torch.Tensor] = {}
        self._schema = schema_of({n: t.numpy() for n, t in self._state.items()})
        # The model's other state_dict entries as built (e.g. BatchNorm's num_batches_tracked): where a
        # checkpointed `train` and a `resume` from the params alone start them.
        self._built_buffers = {n: t.detach().clone() for n, t in self.model.state_dict(keep_vars=True).items()
                               if not t.is_floating_point()}
        if device != "cpu":
            self.to_device(device)
        self.privacy: DP | None = None
        self.with_privacy(privacy)

    @staticmethod
    def _state_tensors(model: nn.Module, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        device = torch.device("cpu") if device is None else device
        state = {n: t for n, t in model.state_dict(keep_vars=True).items() if t.is_floating_point()}
        for name, tensor in state.items():
            if tensor.dtype != torch.float32 or tensor.device.type != device.type:
                raise ValueError(f"state {name!r} is {tensor.dtype} on {tensor.device}; need float32 on {device}")
        return {n: t.detach() for n, t in sorted(state.items())}

    def with_privacy(self, dp: DP | None) -> None:
        """Train with DP-SGD under `dp` from now on (None: plain training again); `train` documents what it runs.

        Raises `peerloom.backends.privacy.PrivacyUnavailable` (an ImportError, one line naming ``pip install
        'peerloom[dp]'``) without opacus, TypeError for a `dp` that is not a `DP`, and ValueError in one line for
        what DP-SGD cannot train: a model Opacus refuses (``opacus.validators.ModuleValidator.validate``, e.g.
        BatchNorm, whose outputs mix a batch's samples), a ``train_loader`` (its batches cannot be Poisson-sampled
        per sample), ``bf16`` or ``clip_grad_norm`` (DP-SGD clips per sample to ``max_grad_norm`` instead). On
        an error the workload keeps the privacy it had."""
        if dp is None:
            self.privacy = None
            return
        if not isinstance(dp, DP):
            raise TypeError(f"privacy must be a peerloom.privacy.DP or None, got {type(dp).__name__}")
        require_opacus()
        from opacus.validators import ModuleValidator

        if self.train_loader is not None:
            raise ValueError("DP-SGD cannot use a train_loader: it Poisson-samples the leased samples itself")
        if self.bf16:
            raise ValueError("DP-SGD does not support bf16 autocast here: train DP workloads in float32")
        if self.clip_grad_norm is not None:
            raise ValueError("DP-SGD clips each sample's gradient to DP.max_grad_norm: drop clip_grad_norm")
        errors = ModuleValidator.validate(self.model, strict=False)
        if errors:
            reasons = "; ".join(" ".join(str(e).split()) for e in errors)
            raise ValueError(f"model cannot be trained with DP-SGD: {reasons}")
        self.privacy = dp

    def privacy_sample_rate(self, num_samples: int) -> float:
        """q, the Poisson sampling rate of DP-SGD over a lease of `num_samples` samples: ``privacy.sample_rate``,
        else ``min(1, batch_size / num_samples)``. ValueError without privacy or for ``num_samples < 1``."""
        if self.privacy is None:
            raise ValueError("this workload trains without privacy (with_privacy sets it)")
        return privacy_sample_rate(self.privacy, num_samples, self.batch_size)

    def privacy_steps(self, num_samples: int, inner_steps: int | None = None) -> int:
        """The DP-SGD steps one `train` call over `num_samples` leased samples takes (what accounting counts):
        `inner_steps` (argument, else the workload's), else ``local_epochs * ceil(1 / q)`` with q
        `privacy_sample_rate`. ValueError without privacy, for ``num_samples < 1`` or ``inner_steps < 1``."""
        steps = self.inner_steps if inner_steps is None else inner_steps
        if steps is not None and steps < 1:
            raise ValueError(f"inner_steps must be >= 1, got {steps}")
        return privacy_steps(self.privacy_sample_rate(num_samples), steps, self.local_epochs)

    def to_device(self, device: str) -> TorchWorkload:
        """Train and evaluate on `device` from now on (``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"``, ``"auto"``;
        `peerloom.backends.devices.resolve_device` raises DeviceError naming an absent one). Moves the
        working model; params and deltas stay float32 numpy arrays on the CPU, copied through reused
        staging buffers. On CUDA also sets cuDNN to deterministic, non-benchmarking mode (process-wide).
        Returns self."""
        target = torch.device(resolve_device(device))
        if target.type == "cuda":
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False
        self.model.to(target)
        self.device = target
        self._state = self._state_tensors(self.model, target)
        self._staging = {} if target.type == "cpu" else {
            n: torch.empty(t.shape, dtype=torch.float32) for n, t in self._state.items()}
        return self

    @property
    def num_train(self) -> int:
        """Number of training samples (valid lease indices are ``0 .. num_train - 1``)."""
        if self.x_train is not None:
            return len(self.x_train)
        assert self.train_dataset is not None  # set when x_train is None (__init__)
        return len(self.train_dataset)

    @property
    def train_labels(self) -> np.ndarray:
        """The training targets as a numpy array (a copy). TypeError for a dataset that is not two tensors."""
        if self.y_train is None:
            raise TypeError("train_labels needs training data given as (x, y) tensors or a two-tensor TensorDataset")
        return self.y_train.numpy().copy()

    def with_train_labels(self, y: Any) -> TorchWorkload:
        """A copy of this workload training on targets `y` (same length; used by label-flip attackers). It
        shares this workload's model object (params are loaded in place before every use) but keeps its own
        optimizer state. TypeError for a dataset that is not two tensors."""
        if self.y_train is None:
            raise TypeError("with_train_labels needs training data given as (x, y) tensors")
        labels = _as_tensor(y, self.y_train.dtype)
        if labels.shape != self.y_train.shape:
            raise ValueError(f"labels must have shape {tuple(self.y_train.shape)}, got {tuple(labels.shape)}")
        other = TorchWorkload.__new__(type(self))
        other.__dict__.update(self.__dict__)
        other.y_train = labels
        other._saved_optimizers = {}
        other._saved_schedulers = {}
        return other

    def with_train_data(self, x: Any, y: Any) -> TorchWorkload:
        """A copy of this workload training on inputs `x` and targets `y` instead (a private-data trainer's own
        samples, spec/protocol.md §10; node config key ``data``), sharing the model like `with_train_labels`;
        evaluation data are unchanged and lease indices then name rows of `x`. `x` must have this workload's
        per-sample input shape and dtype, `y` its target dtype and one row per sample. TypeError for a
        workload whose training data are not two tensors; ValueError for other shapes or an empty dataset."""
        if self.x_train is None or self.y_train is None:
            raise TypeError("with_train_data needs training data given as (x, y) tensors")
        inputs, targets = _as_tensor(x, self.x_train.dtype), _as_tensor(y, self.y_train.dtype)
        if tuple(inputs.shape[1:]) != tuple(self.x_train.shape[1:]) or len(inputs) == 0:
            raise ValueError(f"x must be [n, {', '.join(map(str, self.x_train.shape[1:]))}] with n > 0, "
                             f"got {list(inputs.shape)}")
        if tuple(targets.shape) != (len(inputs), *self.y_train.shape[1:]):
            raise ValueError(f"y must be [{len(inputs)}{''.join(f', {d}' for d in self.y_train.shape[1:])}], "
                             f"got {list(targets.shape)}")
        other = self.with_train_labels(self.y_train)
        other.x_train, other.y_train = inputs, targets
        return other

    def reset_optimizer_state(self, state_key: Any = None) -> None:
        """Forget the kept inner optimizer (and scheduler) state of `state_key` (no-op if none)."""
        self._saved_optimizers.pop(state_key, None)
        self._saved_schedulers.pop(state_key, None)

    def schema(self) -> Schema:
        """``((name, "float32", shape), ...)`` of the params, sorted by name."""
        return self._schema

    def initial_params(self, seed: int) -> TensorDict:
        """Fresh float32 params from ``model_factory`` under ``torch.manual_seed(seed)``, built on the CPU
        whatever the workload's device (so they are the same on every peer).

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
            if self._staging:
                np.copyto(self._staging[name].numpy(), params[name], casting="no")
                tensor.copy_(self._staging[name])
            else:
                np.copyto(tensor.numpy(), params[name], casting="no")

    def _host(self, name: str) -> np.ndarray:
        """The working param `name` as a CPU float32 array (a view on the CPU; the staging buffer otherwise)."""
        tensor = self._state[name]
        if not self._staging:
            return tensor.numpy()
        return self._staging[name].copy_(tensor).numpy()

    def params(self) -> TensorDict:
        """A copy of the model's current params."""
        return {n: self._host(n).copy() for n in self._state}

    def _forked_rng(self) -> Any:
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        return torch.random.fork_rng(devices=devices)

    def _autocast(self) -> Any:
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def _train_dataset(self) -> Dataset:
        if self.train_dataset is not None:
            return self.train_dataset
        assert self.x_train is not None and self.y_train is not None  # set together, when there is no dataset
        return TensorDataset(self.x_train, self.y_train)

    def _train_batch(self, batch: torch.Tensor) -> Batch:
        if self.x_train is not None:
            assert self.y_train is not None  # set with x_train
            return self.x_train[batch], self.y_train[batch]
        dataset = self.train_dataset
        assert dataset is not None  # no (x, y) tensors: a dataset (__init__)
        return self.collate_fn([dataset[i] for i in batch.tolist()])

    def _train_batches(self, index: torch.Tensor, generator: torch.Generator, steps: int | None, epochs: int,
                       start: int = 0, on_pass: Callable[[int], None] | None = None,
                       at_start: Callable[[], None] | None = None) -> Iterator[tuple[bool, Batch]]:
        """``(first of a pass, (inputs, targets))`` for the optimizer steps ``start ..`` of one `train` call.

        Built-in batching draws the permutations of the passes before `start` and skips them, so step k sees
        the batch it sees from step 0. A ``train_loader`` is iterated from the call's first pass, the batches
        before `start` fetched and dropped (a loader's position cannot be set; fetching is cheap next to
        training). ``on_pass(steps done)`` runs right before each pass of a ``train_loader`` is started
        (``iter``), ``at_start()`` right before the batch of step `start` is drawn (a checkpoint restores the
        global RNG there, `resume`)."""
        n = len(index)
        if self.train_loader is None:
            per_pass = -(-n // self.batch_size)
            total = steps if steps is not None else epochs * per_pass
            for _ in range(start // per_pass):
                torch.randperm(n, generator=generator)
            order = index[torch.randperm(n, generator=generator)] if start % per_pass else index
            for k in range(start, total):
                if k == start and at_start is not None:
                    at_start()
                pos = k % per_pass
                if pos == 0:
                    order = index[torch.randperm(n, generator=generator)]
                yield pos == 0, self._train_batch(order[pos * self.batch_size : (pos + 1) * self.batch_size])
            return
        loader = self.train_loader(Subset(self._train_dataset(), index.tolist()), generator)
        done = passes = 0
        while True:
            if on_pass is not None:
                on_pass(done)
            batches = iter(loader)
            first = True
            while True:
                if done == start and at_start is not None:
                    at_start()
                    at_start = None
                try:
                    batch = next(batches)
                except StopIteration:
                    break
                if done >= start:
                    yield first, batch
                first = False
                done += 1
                if steps is not None and done >= steps:
                    return
            if first:
                raise ValueError("train_loader yielded no batch for a non-empty lease")
            passes += 1
            if steps is None and passes >= epochs:
                return

    def _lease_index(self, indices: Sequence[int]) -> torch.Tensor:
        """`indices` as an int64 tensor; ValueError unless a non-empty 1-D sequence in ``[0, num_train)``."""
        index = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        if index.ndim != 1 or len(index) == 0:
            raise ValueError("indices must be a non-empty sequence of ints")
        if int(index.min()) < 0 or int(index.max()) >= self.num_train:
            raise ValueError(f"indices must lie in [0, {self.num_train})")
        return index

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
        step: int = 0,
    ) -> tuple[TensorDict, dict[str, float | int]]:
        """Local training on the leased samples; returns ``(delta, metrics)``.

        Loads `params` (copied in place) and runs either `inner_steps` optimizer steps (argument, else the
        workload's; DiLoCo's H) or `local_epochs` (or `epochs`) passes (FedAvg's E) over ``indices`` in
        mini-batches of `batch_size`, reshuffled every pass by a ``torch.Generator`` seeded with `seed` (or
        the batches of ``train_loader``, given that generator); the global torch RNG (dropout etc.) is forked
        and seeded with `seed` too, so the same (params, indices, seed, kept optimizer state) gives the same
        bytes in one process. Each step: forward and loss (under bf16 autocast if set), backward, gradient
        clipping (if set), optimizer step, scheduler step (if set). The inner optimizer is fresh, or, with
        ``keep_optimizer_state``, restored from the state this workload saved for `state_key` at the end of its
        previous call (the host passes one key per trainer when one workload serves several).

        `step` is the run's global step, the optimizer steps the whole run took before this call (a node
        passes ``(window - 1) * inner_steps``, spec/protocol.md §5.1): a fresh scheduler is stepped that many times
        before training (`_scheduler`), so a schedule spans windows as in a central run. A kept scheduler
        state (``keep_optimizer_state``) continues where it stopped instead.

        With ``checkpoints = S > 0`` (inner steps only, ``1 <= S <= H``, fresh optimizer state: a segment audit
        must rebuild step 0 from the base params) it calls ``on_checkpoint(j, state)`` after step ``(j * H) //
        S`` for ``j = 1 .. S``; `state` is the whole training state, which `resume` continues from (see there
        for its names), as fresh float32 arrays the callee may keep. The callback must not use this workload
        (it would move the working model); checkpoints change nothing in the training's bytes, but for one
        thing: a checkpointed call starts the model's non-float ``state_dict`` entries (BatchNorm's
        ``num_batches_tracked``, which otherwise carries over from call to call) from their values as built,
        as `resume` from the params alone does, so its states are a function of (params, lease, seed). Only
        a ``BatchNorm(momentum=None)`` (cumulative average) reads that counter.

        Returns the pseudo-gradient ``delta = params_before - params_after`` (numpy float32 on the CPU, same
        schema; DiLoCo sign convention, arXiv 2311.08105, so the outer step is ``params - lr * mean(delta)``)
        and ``{"train_loss": sample-weighted mean loss of the last pass (inner steps: of the batches since the
        last reshuffle), "samples": len(indices)}``.

        With ``privacy`` (a `DP`: sigma, C, q) it runs DP-SGD instead (Abadi et al. 2016, arXiv:1607.00133,
        Algorithm 1, through Opacus, arXiv:2109.12298). Steps: `inner_steps` (argument, else the workload's)
        when set, else ``epochs * ceil(1 / q)`` (`privacy_steps`); q is ``privacy.sample_rate``, else
        ``min(1, batch_size / n)`` for a lease of n samples. Each step Poisson-samples the lease (each index
        independently with probability q: ``torch.rand(n, generator) < q`` with the training generator, seeded
        with `seed`, kept in lease order), computes per-sample gradients (``GradSampleModule``), clips each to
        L2 norm C over all parameters, sums them, adds N(0, (sigma C)^2) per coordinate drawn from a second
        ``torch.Generator`` on the training device seeded with `dp_noise_seed` (seed) — independent of the
        sampling stream, replayed from the same seed — and divides by the expected batch size q n (exactly
        ``min(batch_size, n)`` without ``sample_rate``; ``DPOptimizer``, ``loss_reduction="mean"``); then the inner
        optimizer's step and the scheduler's, as above. An empty batch still takes a step (the noise alone), as
        the accounting assumes. So the same (params, indices, seed, privacy, kept optimizer state) gives the same
        bytes in one process, noise included, and a validator's recomputation audit checks the clipping and the
        noise. Metrics gain ``"privacy_steps"`` (the steps taken); ``train_loss`` averages the batches of the
        last ``ceil(1 / q)`` steps (NaN if the whole call sampled nothing). ``keep_optimizer_state`` works as
        without privacy (the kept state is post-processing of noised gradients). Segment audits do not support
        DP-SGD: ``checkpoints`` (and `resume`) raise ValueError with privacy set.
        Raises ValueError for an empty lease, out-of-range indices, params of the wrong schema or checkpoints
        that cannot be taken (also: optimizer state that is not tensors and Python scalars).
        """
        steps = self.inner_steps if inner_steps is None else inner_steps
        n_epochs = self.local_epochs if epochs is None else epochs
        if n_epochs < 1 or (steps is not None and steps < 1):
            raise ValueError(f"epochs and inner_steps must be >= 1, got {n_epochs}, {steps}")
        if self.privacy is not None:
            if checkpoints:
                raise ValueError(_NO_DP_SEGMENTS)
            return self._train_private(params, self._lease_index(indices), seed, steps, n_epochs, state_key, step)
        bounds: dict[int, int] = {}
        if checkpoints:
            if steps is None or not 1 <= checkpoints <= steps or self.keep_optimizer_state:
                raise ValueError("checkpoints need inner steps, 1 <= checkpoints <= inner_steps and a fresh "
                                 "optimizer state (keep_optimizer_state=False)")
            if on_checkpoint is not None:
                bounds = {(j * steps) // checkpoints: j for j in range(1, checkpoints + 1)}
        index = self._lease_index(indices)
        self._load(params)
        if checkpoints:
            self._reset_buffers()
        model = self.model
        model.train()
        optimizer, scheduler = self._inner_optimizer(state_key, step)
        generator = torch.Generator().manual_seed(seed)
        loss_sum, seen = 0.0, 0
        current: list[Any] = [0, None]  # a train_loader's current pass: (steps done at its start, RNG state then)

        def on_pass(done: int) -> None:
            current[:] = [done, self._rng_states()]

        with self._forked_rng():
            torch.manual_seed(seed)
            batches = self._train_batches(index, generator, steps, n_epochs,
                                          on_pass=on_pass if bounds and self.train_loader is not None else None)
            for done, (first, (inputs, targets)) in enumerate(batches, 1):
                if first:
                    loss_sum, seen = 0.0, 0
                loss, count = self._train_step(optimizer, scheduler, inputs, targets)
                loss_sum += float(loss.detach()) * count
                seen += count
                if done in bounds:
                    assert on_checkpoint is not None  # bounds are set only with a callback
                    rng = self._rng_states()
                    on_checkpoint(bounds[done], self._training_state(optimizer, done, current))
                    self._set_rng_states(rng)  # whatever the callback drew, training draws as without it
        self._keep_optimizer(state_key, optimizer, scheduler)
        return self._delta(params), {"train_loss": loss_sum / seen, "samples": len(index)}

    def _train_private(self, params: TensorDict, index: torch.Tensor, seed: int, steps: int | None, epochs: int,
                       state_key: Any, step: int) -> tuple[TensorDict, dict[str, float | int]]:
        """`train` with DP-SGD (Abadi et al. 2016, arXiv:1607.00133, Algorithm 1) through Opacus's
        ``GradSampleModule`` and ``DPOptimizer``; see `train`."""
        dp = self.privacy
        assert dp is not None
        require_opacus()
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        n = len(index)
        rate = privacy_sample_rate(dp, n, self.batch_size)
        expected = min(self.batch_size, n) if dp.sample_rate is None else rate * n
        total = privacy_steps(rate, steps, epochs)
        per_pass = math.ceil(1.0 / rate)  # steps whose batches hold n samples on average: train_loss's window
        self._load(params)
        model = self.model
        model.train()
        optimizer, scheduler = self._inner_optimizer(state_key, step)
        sampler = torch.Generator().manual_seed(seed)
        noise = torch.Generator(device=self.device).manual_seed(dp_noise_seed(seed))
        wrapped = GradSampleModule(model, loss_reduction="mean")
        loss_sum, seen, call_sum, call_seen = 0.0, 0, 0.0, 0
        try:
            private = DPOptimizer(optimizer, noise_multiplier=dp.noise_multiplier, max_grad_norm=dp.max_grad_norm,
                                  expected_batch_size=expected, loss_reduction="mean", generator=noise)
            with self._forked_rng():
                torch.manual_seed(seed)
                for k in range(total):
                    if k % per_pass == 0:
                        loss_sum, seen = 0.0, 0
                    batch = index[torch.rand(n, generator=sampler) < rate]
                    private.zero_grad(set_to_none=True)
                    if len(batch):
                        inputs, targets = self._train_batch(batch)
                        inputs, targets = _move(inputs, self.device), _move(targets, self.device)
                        loss = self.loss_fn(wrapped(inputs), targets)
                        with warnings.catch_warnings():  # Opacus's hooks on a first layer whose input needs no grad
                            warnings.filterwarnings("ignore", message="Full backward hook is firing")
                            loss.backward()
                        value, count = float(loss.detach()), _batch_len(targets)
                        loss_sum, seen = loss_sum + value * count, seen + count
                        call_sum, call_seen = call_sum + value * count, call_seen + count
                    else:  # an empty Poisson batch still takes a step: the noise alone, as the accounting assumes
                        for p in private.params:
                            p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
                    private.step()
                    if scheduler is not None:
                        scheduler.step()
        finally:
            wrapped.to_standard_module()  # removes Opacus's hooks and per-sample attributes from the model
        self._keep_optimizer(state_key, optimizer, scheduler)
        if seen == 0:
            loss_sum, seen = call_sum, call_seen
        train_loss = loss_sum / seen if seen else math.nan
        return self._delta(params), {"train_loss": train_loss, "samples": n, "privacy_steps": total}

    def _inner_optimizer(self, state_key: Any, step: int) -> tuple[torch.optim.Optimizer, Any]:
        """`train`'s inner optimizer and scheduler: fresh from the factories, the scheduler at global step `step`,
        or, with ``keep_optimizer_state``, restored from what `_keep_optimizer` saved for `state_key`."""
        optimizer = self.optimizer_factory(self.model.parameters())
        kept = self.keep_optimizer_state and state_key in self._saved_schedulers
        scheduler = self._scheduler(optimizer, 0 if kept else step)
        if self.keep_optimizer_state:
            # The scheduler first: building one writes the learning rate that the saved state then restores.
            if (saved := self._saved_optimizers.get(state_key)) is not None:
                optimizer.load_state_dict(saved)
            if scheduler is not None and (saved := self._saved_schedulers.get(state_key)) is not None:
                scheduler.load_state_dict(saved)
        return optimizer, scheduler

    def _keep_optimizer(self, state_key: Any, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        """With ``keep_optimizer_state``, save the optimizer's and scheduler's state for `state_key`'s next call."""
        if self.keep_optimizer_state:
            self._saved_optimizers[state_key] = copy.deepcopy(optimizer.state_dict())
            if scheduler is not None:
                self._saved_schedulers[state_key] = copy.deepcopy(scheduler.state_dict())

    def _delta(self, params: TensorDict) -> TensorDict:
        """``params - working params`` (the pseudo-gradient), float32 numpy on the CPU."""
        return {name: np.subtract(params[name], self._host(name), dtype=np.float32) for name in self._state}

    def _scheduler(self, optimizer: torch.optim.Optimizer, steps: int) -> Any:
        """A fresh ``scheduler_factory`` scheduler on the fresh `optimizer`, stepped `steps` times (None without
        a factory): where a schedule stands after `steps` optimizer steps of a run. ValueError for ``steps < 0``.

        The position is a function of `steps` alone, so it is remembered: the scheduler's ``state_dict`` and
        the optimizer's hyper-parameters (everything of its param groups but the params) after the last
        fast-forward, from which a later call with at least as many steps goes on, stepping only the
        difference (a node's trainer steps ``inner_steps`` per window, not the whole run's count).
        Restoring them and stepping on computes what stepping from 0 computes, bit for bit."""
        if steps < 0:
            raise ValueError(f"step must be >= 0, got {steps}")
        if self.scheduler_factory is None:
            return None
        scheduler = self.scheduler_factory(optimizer)
        if steps == 0:
            return scheduler
        done = 0
        if self._schedule_at is not None and self._schedule_at[0] <= steps \
                and len(self._schedule_at[2]) == len(optimizer.param_groups):
            done, saved, groups = self._schedule_at
            scheduler.load_state_dict(copy.deepcopy(saved))
            for group, values in zip(optimizer.param_groups, groups, strict=True):
                group.update(copy.deepcopy(values))
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": on purpose
            warnings.simplefilter("ignore")
            for _ in range(steps - done):
                scheduler.step()
        self._schedule_at = (steps, copy.deepcopy(scheduler.state_dict()),
                             [copy.deepcopy({k: v for k, v in g.items() if k != "params"})
                              for g in optimizer.param_groups])
        return scheduler

    def _train_step(self, optimizer: torch.optim.Optimizer, scheduler: Any, inputs: Any,
                    targets: Any) -> tuple[torch.Tensor, int]:
        """One optimizer step of `train` (and `resume`) on a batch; returns (its loss, its sample count)."""
        inputs, targets = _move(inputs, self.device), _move(targets, self.device)
        optimizer.zero_grad(set_to_none=True)
        with self._autocast():
            loss = self.loss_fn(self.model(inputs), targets)
        loss.backward()
        if self.clip_grad_norm is not None:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        return loss, _batch_len(targets)

    def resume(self, state: TensorDict, indices: Sequence[int], seed: int, *, inner_steps: int, start: int,
               stop: int, step: int = 0) -> TensorDict:
        """The training state after step `stop` of a checkpointed `train` call with these indices, seed and
        inner steps, continued from `state`, its state after step `start` (a segment audit's replay); at
        ``start = 0`` `state` may be the params alone (a fresh optimizer and the seeded RNG, as `train` starts).
        Bit for bit what that call passes to ``on_checkpoint`` after step `stop`, on the same platform (GPU
        kernels permitting, as for `train`). Returns a new dict in that layout:

        - the params (the schema's names, float32);
        - ``train_state.step``: steps done (float32 ``[1]``; `resume` requires it to equal `start`);
        - ``train_state.optimizer.<param name>.<key>``: each float32 tensor of the optimizer's per-parameter
          state (e.g. Adam's ``exp_avg``, ``exp_avg_sq`` and ``step``, SGD's ``momentum_buffer``; a 0-d tensor
          as shape ``[1]``); parameters the optimizer holds no state for (no step yet) have none;
        - ``train_state.meta``: UTF-8 JSON as float32 byte values (0..255): ``{"version", "optimizer":
          {param name: {key: {"shape": [...]} (the array above) | {"value": Python scalar or null} |
          {"dtype", "shape", "hex"} (another tensor's bytes)}}, "buffers": {name: {"dtype", "shape", "hex"}}}``
          (the model's non-float ``state_dict`` entries, e.g. BatchNorm's ``num_batches_tracked``);
        - ``train_state.rng.cpu`` (and ``.cuda`` / ``.mps`` when training there): the global torch RNG's state
          (``torch.get_rng_state()``) as float32 byte values, which dropout and other random layers draw from;
        - with a ``train_loader`` only: ``train_state.pass_start`` (float32 ``[1]``: steps done when the pass
          holding the last step began) and ``train_state.rng.pass_cpu`` (``.pass_cuda`` ...): the global RNG
          when that pass's loader iterator was started (a loader without a generator draws its order there).

        Not in the state, rebuilt instead: the optimizer's hyper-parameters (``optimizer_factory``), the learning
        rate schedule (a fresh ``scheduler_factory`` scheduler stepped ``step + start`` times: a function of the
        step count, `step` being the `train` call's global step) and the data order (a ``torch.Generator``
        seeded with `seed`: the permutations of the earlier passes are drawn and dropped; a ``train_loader`` is
        iterated from the first pass and its batches before `start` fetched and dropped, its current pass started
        under ``rng.pass_*``). Raises ValueError for bounds outside ``0 <= start < stop <= inner_steps``, a state
        of another layout (missing or extra names, wrong step count or schema, malformed meta, a pass start the
        loader's passes do not have), a negative `step`, or bad indices; and for any call with ``privacy`` set
        (segment audits do not support DP-SGD: `train`).
        """
        if self.privacy is not None:
            raise ValueError(_NO_DP_SEGMENTS)
        if not 0 <= start < stop <= inner_steps:
            raise ValueError(f"need 0 <= start < stop <= inner_steps, got {start}, {stop}, {inner_steps}")
        index = self._lease_index(indices)
        params = {name: state[name] for name, _, _ in self._schema if name in state}
        if schema_of(params) != self._schema:
            raise ValueError(f"state params have schema {schema_of(params)}, expected {self._schema}")
        restored = None if start == 0 and set(state) == set(params) else self._parse_training_state(state, start)
        self._load(params)
        model = self.model
        model.train()
        optimizer = self.optimizer_factory(model.parameters())
        if restored is not None:
            self._restore_training_state(optimizer, restored)
        else:
            self._reset_buffers()
        scheduler = self._scheduler(optimizer, step + start)
        generator = torch.Generator().manual_seed(seed)
        current: list[Any] = [0, None]

        def on_pass(done: int) -> None:
            if restored is not None and done == restored["pass_start"]:
                self._set_rng_states(restored["pass_rng"])
            current[:] = [done, self._rng_states()]

        def at_start() -> None:
            if restored is None:
                return
            if self.train_loader is not None and current[0] != restored["pass_start"]:
                raise ValueError(f"state's pass_start {restored['pass_start']} is not where the train_loader's "
                                 f"pass holding step {start} began ({current[0]})")
            self._set_rng_states(restored["rng"])

        with self._forked_rng():
            torch.manual_seed(seed)
            batches = self._train_batches(index, generator, stop, 1, start=start,
                                          on_pass=on_pass if self.train_loader is not None else None,
                                          at_start=at_start)
            for _, (inputs, targets) in batches:
                self._train_step(optimizer, scheduler, inputs, targets)
            return self._training_state(optimizer, stop, current)

    def _reset_buffers(self) -> None:
        """The model's non-float state_dict entries back to their values as built."""
        current = self.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, value in self._built_buffers.items():
                current[name].copy_(value)

    def _rng_devices(self) -> dict[str, Any]:
        """``{name: device}`` of the global RNGs training draws from: ``cpu``, and the accelerator's."""
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            return {"cpu": None, "cuda": index}
        if self.device.type == "mps":
            return {"cpu": None, "mps": None}
        return {"cpu": None}

    def _rng_states(self) -> dict[str, torch.Tensor]:
        """The global RNGs' states (uint8 CPU tensors), by `_rng_devices` name."""
        out = {}
        for name, index in self._rng_devices().items():
            if name == "cuda":
                out[name] = torch.cuda.get_rng_state(index)
            elif name == "mps":
                out[name] = torch.mps.get_rng_state()
            else:
                out[name] = torch.get_rng_state()
        return out

    def _set_rng_states(self, states: Mapping[str, torch.Tensor]) -> None:
        for name, index in self._rng_devices().items():
            if name == "cuda":
                torch.cuda.set_rng_state(states[name], index)
            elif name == "mps":
                torch.mps.set_rng_state(states[name])
            else:
                torch.set_rng_state(states[name])

    def _rng_arrays(self, state: TensorDict, prefix: str) -> dict[str, torch.Tensor]:
        """RNG states from a training state's ``train_state.rng.<prefix><device>`` byte arrays; ValueError
        for a missing one or one of another size than this process's RNG state."""
        out = {}
        for name, current in self._rng_states().items():
            key = f"{STATE_PREFIX}rng.{prefix}{name}"
            if key not in state:
                raise ValueError(f"state lacks {key!r}")
            data = _value_bytes(state[key], key, limit=len(current))
            if len(data) != len(current):
                raise ValueError(f"state {key!r} holds {len(data)} bytes, the RNG state has {len(current)}")
            out[name] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return out

    def _param_names(self) -> dict[int, str]:
        return {id(p): n for n, p in self.model.named_parameters()}

    def _training_state(self, optimizer: torch.optim.Optimizer, done: int, current: list[Any]) -> TensorDict:
        """The whole training state after `done` steps, in `resume`'s layout (fresh arrays)."""
        state: TensorDict = {name: self._host(name).copy() for name in self._state}
        names = self._param_names()
        specs: dict[str, dict[str, Any]] = {}
        for param, entries in optimizer.state.items():
            name = names.get(id(param))
            if name is None:
                raise ValueError("cannot checkpoint an optimizer holding a tensor that is not a model parameter")
            spec: dict[str, Any] = {}
            for key, value in entries.items():
                if not isinstance(key, str):
                    raise ValueError(f"cannot checkpoint optimizer state key {key!r} of {name!r}")
                if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                    state[f"{STATE_PREFIX}optimizer.{name}.{key}"] = _f32(value)
                    spec[key] = {"shape": list(value.shape)}
                else:
                    spec[key] = _encode_value(value, f"optimizer state {key!r} of {name!r}")
            specs[name] = spec
        buffers = {name: _encode_value(t, f"buffer {name!r}")
                   for name, t in self.model.state_dict(keep_vars=True).items() if not t.is_floating_point()}
        meta = {"version": _STATE_VERSION, "optimizer": specs, "buffers": buffers}
        state[f"{STATE_PREFIX}meta"] = _byte_values(
            json.dumps(meta, sort_keys=True, separators=(",", ":")).encode())
        state[f"{STATE_PREFIX}step"] = np.array([done], dtype=np.float32)
        for name, tensor in self._rng_states().items():
            state[f"{STATE_PREFIX}rng.{name}"] = tensor.numpy().astype(np.float32)
        if self.train_loader is not None:
            state[f"{STATE_PREFIX}pass_start"] = np.array([current[0]], dtype=np.float32)
            for name, tensor in current[1].items():
                state[f"{STATE_PREFIX}rng.pass_{name}"] = tensor.numpy().astype(np.float32)
        return state

    def _parse_training_state(self, state: TensorDict, start: int) -> dict[str, Any]:
        """`resume`'s reading of a full training state after step `start`; ValueError for another layout."""
        key = f"{STATE_PREFIX}meta"
        if key not in state:
            raise ValueError(f"state must hold the params alone (at start 0) or a training state with {key!r}")
        try:
            meta = json.loads(_value_bytes(state[key], key).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"state {key!r} is not JSON: {exc}") from None
        if (not isinstance(meta, dict) or set(meta) != {"version", "optimizer", "buffers"}
                or meta["version"] != _STATE_VERSION or not isinstance(meta["optimizer"], dict)
                or not isinstance(meta["buffers"], dict)):
            raise ValueError(f"state {key!r} is not a version {_STATE_VERSION} training state")
        params = dict(self.model.named_parameters())
        expected = {name for name, _, _ in self._schema} | {key, f"{STATE_PREFIX}step"}
        expected |= {f"{STATE_PREFIX}rng.{name}" for name in self._rng_devices()}
        if self.train_loader is not None:
            expected.add(f"{STATE_PREFIX}pass_start")
            expected |= {f"{STATE_PREFIX}rng.pass_{name}" for name in self._rng_devices()}
        optimizer: dict[str, dict[str, Any]] = {}
        for name, spec in meta["optimizer"].items():
            if name not in params or not isinstance(spec, dict):
                raise ValueError(f"state's optimizer entry {name!r} names no model parameter")
            entries: dict[str, Any] = {}
            for item, value in spec.items():
                where = f"{STATE_PREFIX}optimizer.{name}.{item}"
                if isinstance(value, dict) and set(value) == {"shape"}:
                    shape = value["shape"]
                    array = state.get(where)
                    if (array is None or not isinstance(shape, list) or not all(type(d) is int and d >= 0
                                                                                for d in shape)
                            or np.asarray(array).dtype != np.float32
                            or np.asarray(array).size != math.prod(shape)):
                        raise ValueError(f"state {where!r} is missing or does not match its shape {shape}")
                    expected.add(where)
                    entries[item] = torch.from_numpy(np.array(array, dtype=np.float32, copy=True).reshape(shape))
                else:
                    entries[item] = _decode_value(value, where)
            optimizer[name] = entries
        buffers = {name: t for name, t in self.model.state_dict(keep_vars=True).items() if not t.is_floating_point()}
        if set(meta["buffers"]) != set(buffers):
            raise ValueError(f"state's buffers {sorted(meta['buffers'])} are not the model's {sorted(buffers)}")
        values = {}
        for name, spec in meta["buffers"].items():
            value = _decode_value(spec, f"buffer {name!r}")
            if not isinstance(value, torch.Tensor) or value.dtype != buffers[name].dtype or \
                    value.shape != buffers[name].shape:
                raise ValueError(f"state's buffer {name!r} does not match the model's")
            values[name] = value
        if set(state) != expected:
            raise ValueError(f"state names {sorted(set(state) - expected)} unexpected, "
                             f"{sorted(expected - set(state))} missing")
        out: dict[str, Any] = {"optimizer": optimizer, "buffers": values, "rng": self._rng_arrays(state, "")}
        for name, want in ((f"{STATE_PREFIX}step", start), (f"{STATE_PREFIX}pass_start", None)):
            if name not in state:
                continue
            value = np.asarray(state[name])
            if value.dtype != np.float32 or value.shape != (1,) or not float(value[0]).is_integer():
                raise ValueError(f"state {name!r} must be a float32 [1] step count")
            count = int(value[0])
            if want is not None and count != want:
                raise ValueError(f"state {name!r} is {count}, resuming at step {want}")
            if want is None and not 0 <= count < max(start, 1):
                raise ValueError(f"state {name!r} is {count}: need 0 <= pass_start < start = {start}")
            out["pass_start"] = count
        if self.train_loader is not None:
            out["pass_rng"] = self._rng_arrays(state, "pass_")
        return out

    def _restore_training_state(self, optimizer: torch.optim.Optimizer, restored: dict[str, Any]) -> None:
        """Load a parsed training state's optimizer entries and integer buffers into the fresh `optimizer` and
        the model; ValueError when the optimizer refuses them."""
        indices: dict[int, int] = {}
        for p in (p for group in optimizer.param_groups for p in group["params"]):
            indices.setdefault(id(p), len(indices))
        params = dict(self.model.named_parameters())
        packed: dict[int, dict[str, Any]] = {}
        for name, entries in restored["optimizer"].items():
            position = indices.get(id(params[name]))
            if position is None:
                raise ValueError(f"state holds optimizer state for {name!r}, which the optimizer does not train")
            packed[position] = entries
        try:
            optimizer.load_state_dict({"state": packed, "param_groups": optimizer.state_dict()["param_groups"]})
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"the optimizer refuses the state's entries: {exc}") from None
        buffers = self.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, value in restored["buffers"].items():
                buffers[name].copy_(value)

    def _loss_batches(self, index: torch.Tensor) -> Iterable[Batch]:
        """`loss`'s ``(inputs, targets)`` batches of the samples `index`: consecutive slices of the given order,
        ``max(batch_size, eval_batch_size)`` samples each, or one pass of ``train_loader`` over the leased subset
        with a generator seeded with `LOSS_SEED`."""
        if self.train_loader is not None:
            generator = torch.Generator().manual_seed(LOSS_SEED)
            yield from self.train_loader(Subset(self._train_dataset(), index.tolist()), generator)
            return
        size = max(self.batch_size, self.eval_batch_size)
        for start in range(0, len(index), size):
            yield self._train_batch(index[start : start + size])

    def loss(self, params: TensorDict, indices: Sequence[int]) -> float:
        """Mean training loss of `params` over the training samples `indices` — forward passes only, for a
        validator's loss check (an update's loss before vs after, on the trainer's leased samples).

        `params`: the workload's schema (numpy float32). `indices`: ints in ``[0, num_train)`` (each occurrence
        of a duplicate counts). Computes the training loss as `train` does — ``loss_fn(model(inputs), targets)`` on
        the workload's device, under bf16 autocast if ``bf16`` — but in ``model.eval()`` (no dropout; BatchNorm
        uses and keeps its running statistics) and under ``torch.no_grad()``: no backward, no optimizer or
        scheduler, kept optimizer state untouched. Batches: consecutive slices of `indices` in the given order,
        ``max(batch_size, eval_batch_size)`` samples each; with a ``train_loader``, one pass of
        ``train_loader(Subset(train set, indices), generator)`` with the generator seeded with `LOSS_SEED` (the
        loss then covers the samples that pass yields: a ``drop_last`` loader leaves some out). Returns the
        sample-weighted mean of the batches' losses (a Python float, which may be NaN or inf for diverged
        params), i.e. the mean over the samples for a ``loss_fn`` that averages over its batch.

        Leaves no trace: the global torch RNG is forked (and seeded with `LOSS_SEED` inside, so random layers
        or loader transforms are reproducible), the model's weights are restored to what they were before the
        call and every module's train/eval mode is put back. Deterministic: the same (params, indices) give the
        same float in one process on one platform (GPU kernels permitting, as for `train`). Raises ValueError
        for empty or out-of-range indices, params of the wrong schema, or a ``train_loader`` yielding no batch.
        """
        index = self._lease_index(indices)
        if schema_of(params) != self._schema:
            raise ValueError(f"params have schema {schema_of(params)}, expected {self._schema}")
        model = self.model
        before = self.params()
        modes = [(module, module.training) for module in model.modules()]
        total, seen = 0.0, 0
        try:
            self._load(params)
            model.eval()
            with self._forked_rng(), torch.no_grad():
                torch.manual_seed(LOSS_SEED)
                for inputs, targets in self._loss_batches(index):
                    inputs, targets = _move(inputs, self.device), _move(targets, self.device)
                    with self._autocast():
                        value = self.loss_fn(model(inputs), targets)
                    count = _batch_len(targets)
                    total += float(value) * count
                    seen += count
        finally:
            self._load(before)
            for module, mode in modes:
                module.training = mode
        if seen == 0:
            raise ValueError("train_loader yielded no batch for the given indices")
        return total / seen

    def _eval_batches(self) -> Iterable[Batch]:
        if self.eval_loader is not None:
            dataset = self.eval_dataset
            if dataset is None:
                assert self.x_eval is not None and self.y_eval is not None  # set together, without a dataset
                dataset = TensorDataset(self.x_eval, self.y_eval)
            yield from self.eval_loader(dataset)
            return
        size = self.eval_batch_size
        if self.x_eval is not None:
            assert self.y_eval is not None  # set with x_eval
            for start in range(0, len(self.x_eval), size):
                yield self.x_eval[start : start + size], self.y_eval[start : start + size]
            return
        dataset = self.eval_dataset
        assert dataset is not None  # set when x_eval is None (__init__)
        for start in range(0, len(dataset), size):
            yield self.collate_fn([dataset[i] for i in range(start, min(start + size, len(dataset)))])

    def _eval_model(self, params: TensorDict) -> tuple[nn.Module, torch.device, bool]:
        """(model holding `params`, its device, autocast on) for `evaluate`."""
        if self.device.type == "cpu" or self.eval_on_device:
            self._load(params)
            return self.model, self.device, self.bf16 and self.eval_on_device
        if schema_of(params) != self._schema:
            raise ValueError(f"params have schema {schema_of(params)}, expected {self._schema}")
        if self._cpu_model is None:
            with torch.random.fork_rng(devices=[]):
                self._cpu_model = self.model_factory()
        state = self._state_tensors(self._cpu_model)
        for name, tensor in state.items():
            np.copyto(tensor.numpy(), params[name], casting="no")
        return self._cpu_model, torch.device("cpu"), False

    @torch.no_grad()
    def evaluate(self, params: TensorDict) -> dict[str, float]:
        """Metrics of `params` over the eval set, in eval mode, on the CPU in float32 (unless
        ``eval_on_device``): by default ``{"loss": mean loss, "accuracy": fraction of argmax == label}``; with
        ``metrics``, each one's sample-weighted mean over the eval batches (floats; NaN for an empty eval set).
        Outputs are cast to float32 before loss and metrics. ValueError for params of the wrong schema."""
        model, device, autocast = self._eval_model(params)
        model.eval()
        names = ("loss", "accuracy") if self.metrics is None else tuple(self.metrics)
        sums = dict.fromkeys(names, 0.0)
        correct = n = 0
        for inputs, targets in self._eval_batches():
            inputs, targets = _move(inputs, device), _move(targets, device)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
                out = model(inputs)
            out = _float32(out)
            count = _batch_len(targets)
            n += count
            if self.metrics is None:
                sums["loss"] += float(self.loss_fn(out, targets)) * count
                correct += int((out.argmax(dim=-1) == targets).sum())
            else:
                for name, metric in self.metrics.items():
                    sums[name] += float(metric(out, targets)) * count
        if n == 0:
            return dict.fromkeys(names, math.nan)
        if self.metrics is None:
            return {"loss": sums["loss"] / n, "accuracy": correct / n}
        return {name: total / n for name, total in sums.items()}


def torch_workload(
    *,
    model: ModelFactory,
    loss: LossFn,
    optimizer: OptimizerFactory,
    train_data: Any,
    eval_data: Any,
    batch_size: int = 32,
    inner_steps: int | None = None,
    local_epochs: int = 1,
    scheduler: SchedulerFactory | None = None,
    clip_grad_norm: float | None = None,
    bf16: bool = False,
    metrics: Mapping[str, Metric] | None = None,
    collate_fn: Callable[[list[Any]], Batch] | None = None,
    train_loader: TrainLoaderFactory | None = None,
    eval_loader: EvalLoaderFactory | None = None,
    eval_batch_size: int = 1024,
    keep_optimizer_state: bool = False,
    device: str = "cpu",
    eval_on_device: bool = False,
    num_threads: int | None = None,
    privacy: DP | None = None,
) -> TorchWorkload:
    """A workload from the user's own torch objects: `TorchWorkload` with keyword names.

    ``model``: zero-argument callable returning the ``nn.Module`` (e.g. its class), called under a seeded,
    forked global RNG for the initial params; all floating-point state float32. ``loss``: ``(outputs,
    targets) -> scalar tensor``. ``optimizer``: ``params -> torch.optim.Optimizer``. ``train_data`` /
    ``eval_data``: map-style ``torch.utils.data.Dataset`` s of ``(input, target)`` items (or ``(x, y)``
    tuples); a lease's shard ``s`` trains on the items ``shards[s]`` where the factory returns ``shards =
    shards_for(len(train_data), num_shards, seed)``. The rest: `TorchWorkload`'s arguments (``scheduler`` is
    its ``scheduler_factory``: ``optimizer -> LR scheduler``, at the run's global step in every window;
    ``privacy``: a `peerloom.privacy.DP` to train with DP-SGD, see `TorchWorkload.train`).
    Raises ValueError/TypeError for bad arguments, DeviceError for an absent device and
    `peerloom.privacy.PrivacyUnavailable` for ``privacy`` without opacus.
    """
    return TorchWorkload(
        model, optimizer, loss, train_data, eval_data, batch_size=batch_size, local_epochs=local_epochs,
        inner_steps=inner_steps, keep_optimizer_state=keep_optimizer_state, eval_batch_size=eval_batch_size,
        num_threads=num_threads, scheduler_factory=scheduler, clip_grad_norm=clip_grad_norm, bf16=bf16,
        metrics=metrics, collate_fn=collate_fn, train_loader=train_loader, eval_loader=eval_loader, device=device,
        eval_on_device=eval_on_device, privacy=privacy,
    )

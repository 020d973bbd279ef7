"""What a workload is, as types (spec/embedding.md, "Workloads"): the `Workload` protocol every workload implements,
and one protocol per optional capability, checked with ``isinstance`` (each is ``runtime_checkable``) where a node,
the compute executor or the simulator needs it, never by probing attribute names.

| protocol | adds | needed by |
|---|---|---|
| `Workload` | ``schema``, ``initial_params``, ``train``, ``evaluate`` | every task (`ComputeExecutor`) |
| `LossCheckable` | ``loss``: forward passes on training samples | the loss check (spec/protocol.md §6.1) |
| `Resumable` | ``resume``: replay a segment from a checkpoint | segment audits (spec/protocol.md §6.3) |
| `TakesStep` | ``TAKES_STEP``: ``train`` takes ``step``, the global step | LR schedules spanning windows (§5.1) |
| `StreamsDelta` | ``STREAMS_DELTA``: ``train`` takes ``sink`` | sharded trainer pools (spec/pools.md §6) |
| `Placeable` | ``to_device`` | node config key ``device`` |
| `Private` | ``with_privacy`` | manifests with ``privacy`` (DP-SGD, spec/protocol.md §10) |
| `LocalData` | ``with_train_data`` | private-data trainers (node config key ``data``) |
| `Relabelable` | ``train_labels``, ``with_train_labels`` | the label-flip attack (`attacks.label_flipped`) |
| `BrowserTrainable` | ``browser`` and the MLP's settings and arrays | the browser peer (`/train`, spec/browser.md) |

`NumpyWorkload` (numpy), `TorchWorkload` (torch) and `QuadraticWorkload` (synthetic) implement `Workload`; which
capabilities each has is its own (tests/backends/test_workload.py checks the bundled ones). A wrapper that
forwards unknown attributes to the workload it wraps (``__getattr__``: `backends.behaviours.ByzantineWorkload`,
`adapters.pool.PoolWorkload`, `peerloom.loop`'s) names it ``inner`` (`Wrapper`) and has its capabilities, the flags
included unless its class sets them (`ByzantineWorkload` sets ``TAKES_STEP`` False, `PoolWorkload` both): ask
with `has`, not ``isinstance``. Tensors are float32 numpy arrays by
name (`TensorDict`); a schema is ``((name, dtype, shape), ...)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeGuard, TypeVar, runtime_checkable

import numpy as np

TensorDict = dict[str, np.ndarray]
Schema = tuple[tuple[str, str, tuple[int, ...]], ...]
C = TypeVar("C")


@runtime_checkable
class Workload(Protocol):
    """A model, its data and how it trains: what every compute task runs on.

    - ``schema()``: the params' names, dtypes and shapes (a manifest's ``schema``);
    - ``initial_params(seed)``: the genesis params from a seed;
    - ``train(params, indices, seed, **options) -> (delta, metrics)``: local training on the training samples
      `indices` from `params`, the pseudo-gradient ``params - trained`` and metrics with ``train_loss``;
      options ``inner_steps`` (H optimizer steps), ``epochs``, ``checkpoints`` / ``on_checkpoint`` (segment
      audits), ``step`` (`TakesStep`), ``sink`` (`StreamsDelta`); same inputs, same bytes;
    - ``evaluate(params)``: 1 to 63 metrics by name (``loss``, ``accuracy``...) on held-out data.
    """

    def schema(self) -> Schema: ...
    def initial_params(self, seed: int) -> TensorDict: ...
    # `*args: Any, **options: Any`: each workload names the options it takes (type checkers accept any keywords)
    def train(self, params: Any, indices: Sequence[int], seed: int, *args: Any,
              **options: Any) -> tuple[Any, Mapping[str, Any]]: ...
    def evaluate(self, params: TensorDict) -> Mapping[str, float]: ...


@runtime_checkable
class LossCheckable(Protocol):
    """``loss(params, indices)``: the mean training loss on samples `indices` (forward passes only, a float)."""

    def loss(self, params: TensorDict, indices: Sequence[int]) -> float: ...


@runtime_checkable
class Resumable(Protocol):
    """``resume(state, indices, seed, inner_steps=H, start=a, stop=b)``: the training state after step `b` of
    the ``train`` call with these arguments, continued from `state`, its state after step `a`."""

    def resume(self, state: TensorDict, indices: Sequence[int], seed: int, *, inner_steps: int, start: int,
               stop: int) -> TensorDict: ...


@runtime_checkable
class TakesStep(Protocol):
    """``TAKES_STEP`` True: ``train`` takes ``step=``, the run's global step when the window starts (spec/protocol.md
    §5.1), so a learning-rate schedule spans windows as every replay of it does."""

    TAKES_STEP: bool


@runtime_checkable
class StreamsDelta(Protocol):
    """``STREAMS_DELTA`` True: ``train`` takes ``sink(name, array)`` and params read from the store block by block
    (a sharded trainer pool, spec/pools.md §6): the node never holds the whole model."""

    STREAMS_DELTA: bool


@runtime_checkable
class Placeable(Protocol):
    """``to_device(device)``: train and evaluate on `device` (a resolved name such as ``cuda:0``) from now on."""

    def to_device(self, device: str) -> Any: ...


@runtime_checkable
class Private(Protocol):
    """``with_privacy(dp)``: train with DP-SGD under `dp` (a `peerloom.backends.privacy.DP`; None: plainly)."""

    def with_privacy(self, dp: Any) -> None: ...


@runtime_checkable
class LocalData(Protocol):
    """``with_train_data(x, y)``: a copy training on the arrays `x`, `y` instead (TypeError or ValueError when
    they do not fit the model)."""

    def with_train_data(self, x: Any, y: Any) -> Any: ...


@runtime_checkable
class Relabelable(Protocol):
    """A classification workload: ``train_labels`` (an int array) and ``with_train_labels(y)``, a copy training on
    the labels `y`."""

    @property
    def train_labels(self) -> np.ndarray: ...
    def with_train_labels(self, y: Any) -> Any: ...


@runtime_checkable
class BrowserTrainable(Protocol):
    """``browser``: whether the browser peer's hand-written MLP kernel trains exactly as this workload does
    (spec/browser.md §2), with what that kernel needs: the layer ``sizes``, Adam's ``lr``, ``batch_size``,
    ``local_epochs`` and the training arrays ``x_train`` (float32 ``[n, sizes[0]]``) and ``y_train``."""

    @property
    def browser(self) -> bool: ...
    sizes: tuple[int, ...]
    lr: float
    batch_size: int
    local_epochs: int
    x_train: np.ndarray
    y_train: np.ndarray


@runtime_checkable
class Wrapper(Protocol):
    """A workload wrapping another (``inner``), forwarding what it does not define itself (``__getattr__``)."""

    @property
    def inner(self) -> Any: ...


def has(workload: object, capability: type[C]) -> TypeGuard[C]:
    """Whether `workload` is a `capability` (`Workload` or a capability protocol above), itself or through the
    wrappers it sits in (`Wrapper`), whose own members come first.

    Not a plain ``isinstance``: since Python 3.12 a protocol's members are looked up statically
    (``inspect.getattr_static``), so what a wrapper forwards through ``__getattr__`` is invisible to it."""
    seen: object | None = workload
    while seen is not None:
        if isinstance(seen, capability):
            return True
        seen = seen.inner if isinstance(seen, Wrapper) else None
    return False


def takes_step(workload: object) -> bool:
    """Whether `workload`'s ``train`` takes the global step (`TakesStep` with ``TAKES_STEP`` True)."""
    return has(workload, TakesStep) and bool(workload.TAKES_STEP)


def streams_delta(workload: object) -> bool:
    """Whether `workload`'s ``train`` streams (`StreamsDelta` with ``STREAMS_DELTA`` True)."""
    return has(workload, StreamsDelta) and bool(workload.STREAMS_DELTA)

"""FedAvg weighted mean and SGD outer step on torch CPU tensors, bit-identical to the numpy reference
(`peerloom.backends.numpy.reduce`, whose module docstring fixes the recipe; DESIGN §4, §5).

Every step mirrors the reference one for one: widen to float64 with ``copy_`` (exact), multiply by a
Python-float coefficient in place (one IEEE double multiply), add or subtract in place (``add_`` with the
default alpha of 1 — torch may evaluate it as ``fma(b, 1, a)``, which rounds exactly like ``a + b``; no
other alpha is ever used), and round once to the input dtype with ``Tensor.to`` (round to nearest even).
The tests check the bytes against numpy on random cohorts.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from peerloom.backends.numpy.reduce import SUPPORTED_DTYPES, check_weights

TorchTensorDict = dict[str, torch.Tensor]
Schema = tuple[tuple[str, str, tuple[int, ...]], ...]

ACCUMULATION_DTYPE = torch.float64


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the numpy spelling used in schemas and digests)."""
    return str(dtype).removeprefix("torch.")


def schema_of(tensors: TorchTensorDict) -> Schema:
    """``((name, dtype, shape), ...)`` sorted by name, as `peerloom.backends.numpy.tensors.schema_of`."""
    return tuple(
        (name, dtype_name(tensors[name].dtype), tuple(int(d) for d in tensors[name].shape)) for name in sorted(tensors)
    )


def check_schema(members: Sequence[TorchTensorDict], what: str) -> Schema:
    """The common schema of `members`; ValueError if they differ, hold a non-float dtype or live off-CPU."""
    if not members:
        raise ValueError("empty cohort")
    schema = schema_of(members[0])
    for i, member in enumerate(members[1:], start=1):
        other = schema_of(member)
        if other != schema:
            raise ValueError(f"{what} {i} has schema {other}, expected {schema}")
    for name, dtype, _shape in schema:
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {dtype}; reductions take {SUPPORTED_DTYPES}")
    for member in members:
        for name, tensor in member.items():
            if tensor.device.type != "cpu":
                raise ValueError(f"tensor {name!r} is on {tensor.device}; reductions run on CPU tensors")
    return schema


class Reducer:
    """Torch twin of `peerloom.backends.numpy.reduce.Reducer`: float64 buffers kept between calls.

    Buffers are keyed by the schema of the last call. Not thread-safe: one `Reducer` per thread.
    """

    def __init__(self) -> None:
        self._schema: Schema | None = None
        self._scratch: dict[str, torch.Tensor] = {}
        self._acc: dict[str, torch.Tensor] = {}

    def _buffers(self, schema: Schema) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        if schema != self._schema:
            sizes = {n: _numel(shape) for n, _, shape in schema}
            flat = torch.empty(max(sizes.values(), default=0), dtype=ACCUMULATION_DTYPE)
            self._scratch = {n: flat[: sizes[n]].view(shape) for n, _, shape in schema}
            self._acc = {n: torch.empty(shape, dtype=ACCUMULATION_DTYPE) for n, _, shape in schema}
            self._schema = schema
        return self._scratch, self._acc

    @staticmethod
    def _result(schema: Schema, acc: dict[str, torch.Tensor], out: TorchTensorDict | None) -> TorchTensorDict:
        if out is None:
            return {n: acc[n].to(getattr(torch, dtype)) for n, dtype, _ in schema}
        if schema_of(out) != schema:
            raise ValueError(f"out has schema {schema_of(out)}, expected {schema}")
        for n, _, _ in schema:
            out[n].copy_(acc[n])
        return out

    @torch.no_grad()
    def weighted_mean(
        self, deltas: Sequence[TorchTensorDict], weights: Sequence[int], *, out: TorchTensorDict | None = None
    ) -> TorchTensorDict:
        """Sample-weighted mean of same-schema dicts of CPU tensors (FedAvg, McMahan et al. 2017,
        arXiv 1602.05629). Same contract, errors and bytes as the numpy reference: float32/float64 in,
        float64 accumulation in the given order, one rounding to the input dtype at the end.
        """
        ws = check_weights(weights, len(deltas))
        schema = check_schema(deltas, "delta")
        total = sum(ws)
        coeffs = [w / total for w in ws]
        scratch, acc = self._buffers(schema)
        for name, _, _ in schema:
            a, s = acc[name], scratch[name]
            a.fill_(0.0)
            for delta, c in zip(deltas, coeffs, strict=True):
                s.copy_(delta[name])
                s.mul_(c)
                a.add_(s)
        return self._result(schema, acc, out)

    @torch.no_grad()
    def outer_sgd_step(
        self,
        params: TorchTensorDict,
        pseudo_gradient: TorchTensorDict,
        lr: float,
        *,
        out: TorchTensorDict | None = None,
    ) -> TorchTensorDict:
        """``params - lr * pseudo_gradient`` in float64, rounded once to the params dtype; bit-identical
        to the numpy reference (FedAvg outer SGD, lr 1; DiLoCo sign convention, arXiv 2311.08105).
        """
        schema = check_schema([params, pseudo_gradient], "pseudo-gradient")
        lr = float(lr)
        scratch, acc = self._buffers(schema)
        for name, _, _ in schema:
            a, s = acc[name], scratch[name]
            s.copy_(pseudo_gradient[name])
            s.mul_(lr)
            a.copy_(params[name])
            a.sub_(s)
        return self._result(schema, acc, out)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


_local = threading.local()


def _reducer() -> Reducer:
    reducer = getattr(_local, "reducer", None)
    if reducer is None:
        reducer = _local.reducer = Reducer()
    return reducer


def weighted_mean(deltas: Sequence[TorchTensorDict], weights: Sequence[int]) -> TorchTensorDict:
    """`Reducer.weighted_mean` with this thread's reusable buffers."""
    return _reducer().weighted_mean(deltas, weights)


def outer_sgd_step(params: TorchTensorDict, pseudo_gradient: TorchTensorDict, lr: float) -> TorchTensorDict:
    """`Reducer.outer_sgd_step` with this thread's reusable buffers."""
    return _reducer().outer_sgd_step(params, pseudo_gradient, lr)

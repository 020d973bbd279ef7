"""Torch tensor dicts: their schema, in the numpy reference's spelling, and the reductions' input check
(the torch twin of `peerloom.backends.numpy.tensors`' schema helpers)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from peerloom.backends import _reduce

TorchTensorDict = dict[str, torch.Tensor]
Schema = tuple[tuple[str, str, tuple[int, ...]], ...]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the numpy spelling used in schemas and digests)."""
    return str(dtype).removeprefix("torch.")


def schema_of(tensors: TorchTensorDict) -> Schema:
    """``((name, dtype, shape), ...)`` sorted by name, as `peerloom.backends.numpy.tensors.schema_of`."""
    return tuple(
        (name, dtype_name(tensors[name].dtype), tuple(int(d) for d in tensors[name].shape)) for name in sorted(tensors)
    )


def check_schema(members: Sequence[TorchTensorDict], what: str) -> Schema:
    """`peerloom.backends._reduce.check_schema` for torch tensor dicts; also ValueError for a tensor that
    lives off the CPU (reductions run on CPU tensors, where their bytes are fixed)."""
    schema = _reduce.check_schema(members, what, schema_of)
    for member in members:
        for name, tensor in member.items():
            if tensor.device.type != "cpu":
                raise ValueError(f"tensor {name!r} is on {tensor.device}; reductions run on CPU tensors")
    return schema

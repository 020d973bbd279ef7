"""Which device a torch workload's inner training runs on (node config key ``device``).

Names: ``"cpu"``, ``"cuda"`` (the current CUDA device), ``"cuda:N"`` (CUDA device N), ``"mps"`` (Apple
silicon) and ``"auto"`` (cuda if available, else mps if available, else cpu). Only training and
evaluation run there: parameters, pseudo-gradients and every tensor the protocol hashes, encodes,
screens or reduces stay float32 numpy arrays on the CPU (spec/protocol.md §6-7).

This module imports torch only to answer for a device other than ``"cpu"``, so a node without torch
can check ``device = "cpu"`` (and ``"auto"``, which is then the CPU).
"""

from __future__ import annotations

import re

DEVICE_NAMES = ("cpu", "cuda", "cuda:N", "mps", "auto")
"""The accepted spellings (``N`` a device index, 0 or more)."""

_SPELLING = re.compile(r"cpu|cuda|cuda:(0|[1-9][0-9]*)|mps|auto")


class DeviceError(ValueError):
    """A device name that is misspelt or names a device this machine does not have; the message names it."""


def check_device_name(name: str) -> None:
    """Raise `DeviceError` unless `name` is one of `DEVICE_NAMES` (spelling only: imports nothing)."""
    if not isinstance(name, str) or _SPELLING.fullmatch(name) is None:
        raise DeviceError(f"device {name!r} is not one of cpu, cuda, cuda:N, mps, auto")


def resolve_device(name: str) -> str:
    """The device `name` stands for on this machine, as a torch device string.

    ``"cpu"`` -> ``"cpu"`` (torch is not imported); ``"auto"`` -> ``"cuda"`` if ``torch.cuda.is_available()``,
    else ``"mps"`` if ``torch.backends.mps.is_available()``, else ``"cpu"`` (also ``"cpu"`` when torch is not
    installed); ``"cuda"``, ``"cuda:N"``, ``"mps"`` -> themselves if present. Raises `DeviceError` naming the
    device if it is misspelt, absent (no CUDA, N at least the number of CUDA devices, no MPS), or needs torch
    and torch is not installed.
    """
    check_device_name(name)
    if name == "cpu":
        return "cpu"
    try:
        import torch
    except ImportError:
        if name == "auto":
            return "cpu"
        raise DeviceError(f"device {name!r} needs torch: pip install 'peerloom[torch]'") from None
    if name == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "mps" if _mps_available(torch) else "cpu"
    if name == "mps":
        if not _mps_available(torch):
            raise DeviceError("device 'mps' is not available on this machine (torch.backends.mps.is_available() "
                              "is False)")
        return name
    if not torch.cuda.is_available():
        raise DeviceError(f"device {name!r} is not available on this machine: torch {torch.__version__} sees no "
                          "CUDA device (torch.cuda.is_available() is False)")
    index = int(name.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"device {name!r} is not available on this machine: it has {count} CUDA device(s)")
    return name


def _mps_available(torch: object) -> bool:
    mps = getattr(getattr(torch, "backends", None), "mps", None)
    return bool(mps is not None and mps.is_available())

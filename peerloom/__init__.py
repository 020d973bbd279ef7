"""peerloom: decentralized training over untrusted peers with a signed, verifiable history.

The engine and the protocol objects are re-exported here; adapters (transports, storage, the node
runtime), backends (numpy, torch) and the simulator are imported from their own packages.
`load_head` (a certified head's weights, verified; peerloom/export.py) is imported on first use, and so
are the trainer-pool collectives `all_reduce`, `broadcast` and `all_gather` (peerloom/workloads.py;
spec/pools.md), which need torch, and `join` (a trainer whose training is your own loop;
peerloom/loop.py).
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING

from peerloom.core import *  # noqa: F403 - the public engine surface
from peerloom.core import __all__ as _core_all

if _TYPE_CHECKING:
    from peerloom.export import load_head
    from peerloom.loop import join
    from peerloom.workloads import all_gather, all_reduce, broadcast

__version__ = "0.1.0"
__all__ = ["__version__", "all_gather", "all_reduce", "broadcast", "join", "load_head", *_core_all]
_COLLECTIVES = frozenset({"all_gather", "all_reduce", "broadcast"})


def __getattr__(name: str) -> object:
    """`load_head` (peerloom/export.py) and `join` (peerloom/loop.py) on first use, so that ``import peerloom``
    loads neither numpy nor torch."""
    if name == "load_head":
        from peerloom.export import load_head

        globals()[name] = load_head
        return load_head
    if name == "join":
        from peerloom.loop import join

        globals()[name] = join
        return join
    if name in _COLLECTIVES:
        from peerloom import workloads

        value = getattr(workloads, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'peerloom' has no attribute {name!r}")

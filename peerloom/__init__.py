"""peerloom: decentralized training over untrusted peers with a signed, verifiable history.

The engine and the protocol objects are re-exported here; adapters (transports, storage, the node
runtime), backends (numpy, torch) and the simulator are imported from their own packages.
`load_head` (a certified head's weights, verified; peerloom/export.py) is imported on first use.
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING

from peerloom.core import *  # noqa: F403 - the public engine surface
from peerloom.core import __all__ as _core_all

if _TYPE_CHECKING:
    from peerloom.export import load_head

__version__ = "0.1.0"
__all__ = ["__version__", "load_head", *_core_all]


def __getattr__(name: str) -> object:
    """`load_head` (peerloom/export.py) on first use, so that ``import peerloom`` loads neither numpy nor torch."""
    if name == "load_head":
        from peerloom.export import load_head

        globals()[name] = load_head
        return load_head
    raise AttributeError(f"module 'peerloom' has no attribute {name!r}")

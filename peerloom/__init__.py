"""peerloom: decentralized training over untrusted peers with a signed, verifiable history.

The engine and the protocol objects are re-exported here; adapters (transports, storage, the node
runtime), backends (numpy, torch) and the simulator are imported from their own packages.
"""

from peerloom.core import *  # noqa: F403 - the public engine surface
from peerloom.core import __all__ as _core_all

__version__ = "0.1.0"
__all__ = ["__version__", *_core_all]

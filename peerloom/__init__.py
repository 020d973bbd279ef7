"""peerloom: decentralized training over untrusted peers with a signed, verifiable history.

``import peerloom`` gives what a user trains with:

- `Experiment` (an experiment directory: manifest, keys, node configs), `Fleet` (its nodes as local
  processes) and `run_up` (`peerloom up`: run the fleet, print each certified window); peerloom/experiment.py.
- `torch_workload`, `numpy_workload` and `shards_for`: your own model and data as a workload
  (peerloom/workloads.py); `all_reduce`, `broadcast` and `all_gather` inside a trainer pool (spec/pools.md).
- `join`: one trainer of a fleet whose training is your own loop (peerloom/loop.py; spec/protocol.md §5.1).
- `verify`: a chain checked from genesis, as `peerloom verify` does (peerloom/verify.py); `load_head`: a
  certified head's weights, verified, into your model (peerloom/export.py).
- `testing`: simulator scenarios, a deterministic cluster and Hypothesis strategies for testing a
  deployment's settings (peerloom/testing.py); `PeerloomError`, the base of every error peerloom raises.

The protocol engine and its objects (events, effects, `Engine`, `Head`, `Manifest`, ...) are
`peerloom.core` (spec/embedding.md); adapters, backends and the simulator are `peerloom.adapters`,
`peerloom.backends` and `peerloom.sim`. Everything but `verify` and `PeerloomError` is imported on first use,
so ``import peerloom`` loads neither numpy nor torch.
"""

from importlib import import_module as _import_module
from typing import TYPE_CHECKING as _TYPE_CHECKING

from peerloom.core.errors import PeerloomError

# The function, not the module: importing peerloom.verify here, before anything else can, makes the
# function the package's `verify` attribute for good (a submodule is set on its package only when first
# loaded). `from peerloom.verify import run_verify` still reads the module from sys.modules.
from peerloom.verify import verify

if _TYPE_CHECKING:
    from peerloom import testing
    from peerloom.experiment import Experiment, Fleet, run_up
    from peerloom.export import load_head
    from peerloom.loop import join
    from peerloom.workloads import all_gather, all_reduce, broadcast, numpy_workload, shards_for, torch_workload

__version__ = "0.1.0"
__all__ = [
    "Experiment", "Fleet", "PeerloomError", "__version__", "all_gather", "all_reduce", "broadcast", "join",
    "load_head", "numpy_workload", "run_up", "shards_for", "testing", "torch_workload", "verify",
]
# name -> the module that defines it, imported on first use (PEP 562)
_LAZY = {
    "Experiment": "peerloom.experiment", "Fleet": "peerloom.experiment", "run_up": "peerloom.experiment",
    "load_head": "peerloom.export", "join": "peerloom.loop",
    **dict.fromkeys(("all_gather", "all_reduce", "broadcast", "numpy_workload", "shards_for", "torch_workload"),
                    "peerloom.workloads"),
}


def __getattr__(name: str) -> object:
    """The user API's names on first use, so that ``import peerloom`` loads neither numpy nor torch."""
    if name == "testing":
        return _import_module("peerloom.testing")  # a submodule: importing it binds it here
    if name in _LAZY:
        value = getattr(_import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'peerloom' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

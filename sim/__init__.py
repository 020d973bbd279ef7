"""Deterministic discrete-event simulator (spec/design.md §7, spec/simulator.md).

Public surface: `run_scenario` / `load_scenario` for TOML scenarios, `Simulation` for building runs by
hand, `Checkers` for the invariants, `LinkSpec` / `Latency` for the network model, and the named
adversaries in `peerloom.sim.adversary`. `peerloom.testing.Cluster` runs a few engines on this kernel with a plain
network, for engine tests.
"""

from .invariants import Checkers
from .kernel import Behaviour, Simulation, Trace, derive_seed
from .network import Latency, LinkSpec
from .scenario import Result, ScenarioError, load_scenario, run_scenario

__all__ = ["Behaviour", "Checkers", "Latency", "LinkSpec", "Result", "ScenarioError", "Simulation", "Trace",
           "derive_seed", "load_scenario", "run_scenario"]

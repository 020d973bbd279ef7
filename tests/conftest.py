import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests.serial_lock import turn

# "quick" runs in CI; "long" is for fuzzing by hand: HYPOTHESIS_PROFILE=long pytest tests/...
settings.register_profile("quick", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=20000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
# "fuzz" is what `make fuzz` runs over the decoder fuzz tests (many more examples; minutes, by hand).
settings.register_profile("fuzz", max_examples=5000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "quick"))

_SCRATCH = pytest.StashKey[Path]()
_LOCK_DIR = "PEERLOOM_TEST_LOCKS"


def pytest_configure(config: pytest.Config) -> None:
    """Caches the session's processes share, in a scratch directory removed at the end (os.environ, so every
    node, CLI and bench process the tests start inherits them):

    - the digits split's cache (backends/datasets.py), unless PEERLOOM_CACHE_DIR is set: every run starts
      from an empty cache, so what a test sees never depends on an earlier run; the first process pays the
      scikit-learn import, the hundreds after it read the cached split;
    - compiled bytecode, where the environment turns bytecode caching off (PYTHONDONTWRITEBYTECODE) and names
      no PYTHONPYCACHEPREFIX: without it every fresh interpreter compiles peerloom's ~100 modules again
      (0.3 s of each node's start-up here). The prefix keeps the .pyc files out of the source tree, which is
      what the variable is usually set for.
    """
    scratch = Path(tempfile.mkdtemp(prefix="peerloom-tests-"))
    config.stash[_SCRATCH] = scratch
    # `make test` runs the suite on two pytest-xdist workers; each is started with this environment, so the
    # controller's scratch directory (and its lock files, `tests.serial_lock`) is theirs too
    os.environ.setdefault(_LOCK_DIR, str(scratch))
    os.environ.setdefault("PEERLOOM_CACHE_DIR", str(scratch / "cache"))
    if os.environ.get("PYTHONDONTWRITEBYTECODE") and not os.environ.get("PYTHONPYCACHEPREFIX"):
        del os.environ["PYTHONDONTWRITEBYTECODE"]
        os.environ["PYTHONPYCACHEPREFIX"] = str(scratch / "pycache")


def pytest_unconfigure(config: pytest.Config) -> None:
    scratch = config.stash.get(_SCRATCH, None)
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture(autouse=True)
def _alone_or_shared(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test marked ``serial`` (it asserts a wall-clock bound) runs while no other test runs on any pytest-xdist
    worker; every other test runs beside the others (`tests.serial_lock.turn`). Without xdist nothing waits."""
    folder = Path(os.environ.get(_LOCK_DIR, tempfile.gettempdir()))
    with turn(folder, alone=request.node.get_closest_marker("serial") is not None):
        yield


@pytest.fixture
def first_proposer():
    """`first_proposer(scenario, seed)`: the name of the validator that proposes round 0 of window 1 of a
    simulator scenario under `seed`. It is a hash of the genesis head, which the seed fixes (identities,
    manifest) whatever the validators then do, so a test can make that validator its adversary and see
    the attack on every seed instead of hoping a seed gives the adversary a turn."""
    from peerloom.core.validator import proposer_of
    from peerloom.sim.scenario import run_scenario

    def find(scenario: dict, seed: int) -> str:
        probe = dict(scenario, adversaries=[], stop_window=1, liveness={})
        result = run_scenario(probe, seed=seed, trace=False)
        genesis = result.checkers.final[1].parent
        names = {node.identity.peer_id: name for name, node in result.sim.nodes.items()}
        return names[proposer_of(genesis, 1, 0, result.sim.revision.manifest.validators)]

    return find

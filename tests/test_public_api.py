"""`import peerloom` is the user API and nothing else: what a user trains, runs, verifies and tests with. The
engine's API (events, effects, `Engine`, `Role`, the protocol objects) is `peerloom.core`."""

import subprocess
import sys

import pytest

import peerloom
import peerloom.core

USER_API = {
    "__version__",
    "Experiment", "Fleet", "run_up",  # peerloom/experiment.py
    "torch_workload", "numpy_workload", "shards_for", "all_reduce", "broadcast", "all_gather",  # workloads.py
    "join",  # peerloom/loop.py
    "verify", "load_head",  # peerloom/verify.py, peerloom/export.py
    "testing",  # peerloom/testing.py
    "PeerloomError",
}


def test_all_is_the_user_api():
    assert set(peerloom.__all__) == USER_API
    assert len(peerloom.__all__) == len(USER_API)


@pytest.mark.parametrize("name", sorted(USER_API))
def test_every_name_resolves(name):
    assert getattr(peerloom, name) is not None


def test_no_engine_internal_is_exported():
    engine = set(peerloom.core.__all__) - {"PeerloomError"}
    assert {"Engine", "Event", "Effect", "Role", "Send", "TimerDue"} <= engine
    assert not engine & set(peerloom.__all__)
    assert not engine & set(dir(peerloom))
    for name in ("Engine", "Role", "TimerDue", "Send"):
        assert not hasattr(peerloom, name), name


def test_names_are_what_their_modules_define():
    from peerloom import experiment, export, loop, workloads

    assert peerloom.Experiment is experiment.Experiment and peerloom.run_up is experiment.run_up
    assert peerloom.load_head is export.load_head and peerloom.join is loop.join
    assert peerloom.numpy_workload is workloads.numpy_workload and peerloom.shards_for is workloads.shards_for
    assert peerloom.PeerloomError is peerloom.core.PeerloomError


def test_verify_is_the_function_not_its_module():
    """peerloom/verify.py is also a module name: the package binds the function, and the module's other
    names are still imported from it."""
    from peerloom.verify import VerifiedChain, run_verify

    assert callable(peerloom.verify) and peerloom.verify.__name__ == "verify"
    assert run_verify.__module__ == "peerloom.verify" and VerifiedChain._fields == ("revision", "entries", "checked")


def test_import_peerloom_loads_neither_numpy_nor_torch():
    code = ("import sys, peerloom, peerloom.verify; from peerloom.verify import run_verify; "
            "heavy = {'numpy', 'torch'} & set(sys.modules); assert not heavy, heavy; "
            "assert callable(peerloom.verify), peerloom.verify; print(len(peerloom.__all__))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == len(USER_API)


"""Who runs beside whom when `make test` runs the suite on several pytest-xdist workers: a test marked ``serial``
(it asserts a wall-clock bound, which another test's load beside it could break) runs alone; every other test
runs beside the others.

A readers-writer lock on two files in one folder, with flock (so it holds across the worker processes and is
let go if one dies): every test first takes the turnstile (exclusive, held only until it has the main lock),
then holds the main lock shared, or exclusive when alone. A test waiting to run alone holds the turnstile
meanwhile, so tests that come after it queue behind it instead of starving it."""

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def turn(folder: Path, *, alone: bool) -> Iterator[None]:
    """Hold the main lock of `folder` (shared, or exclusive with `alone`) for the body; blocks until it is free."""
    with open(folder / "peerloom-tests.turnstile", "a") as turnstile, \
            open(folder / "peerloom-tests.lock", "a") as main:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(main, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(main, fcntl.LOCK_UN)

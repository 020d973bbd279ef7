"""A full disk is a state of the node, not a crash (spec/transport.md §15).

What every write path of the store shares: `DiskFullError`, the one error a write raises when the
file system is out of space (ENOSPC or EDQUOT from the OS, ``SQLITE_FULL`` from SQLite); `is_disk_full`,
which recognises it in whatever form a library raised it; and `space_available`, the probe a node in the
``disk-full`` state runs until it may resume.

Test-only fault injection: when the environment variable named by `TEST_FAULT_ENV` holds a path, every
write of the artifact store, the node database and the event log raises ENOSPC while a file exists at that
path (`inject`). Tests and live test fleets use it to fill "the disk" of one node process without a real
small file system; nothing else sets it, and with it unset `inject` is a no-op.
"""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path

TEST_FAULT_ENV = "PEERLOOM_TEST_DISK_FULL"
"""Test-only: the path of a flag file; while it exists every store write raises ENOSPC (module docstring)."""

RESUME_FREE_BYTES = 64 << 20
"""Free bytes the store's file system must have before a node in the ``disk-full`` state resumes writing:
enough for several windows of records and logs, so that a disk freed by a few bytes does not make the
node flap between the two states."""

PROBE_BYTES = 64 << 10
"""Bytes the probe writes (and fsyncs, then removes) to learn that writes succeed again."""

_SQLITE_FULL = 13  # SQLITE_FULL: "database or disk is full"
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class DiskFullError(OSError):
    """A write failed because the file system is full. An OSError with errno ENOSPC, so a command-line
    user sees one line (`peerloom.cli.user_error`)."""

    def __init__(self, where: str | Path, detail: str = "no space left on device") -> None:
        super().__init__(errno.ENOSPC, detail, str(where))


def is_disk_full(exc: BaseException) -> bool:
    """True if `exc` (or the one exception inside an exception group) says the disk is full."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, OSError):
        return exc.errno in _FULL_ERRNOS
    if isinstance(exc, sqlite3.OperationalError):
        code = getattr(exc, "sqlite_errorcode", None)
        return (code is not None and code & 0xFF == _SQLITE_FULL) or "database or disk is full" in str(exc)
    return False


def _fault_flag() -> Path | None:
    value = os.environ.get(TEST_FAULT_ENV)
    return Path(value) if value else None


def inject(where: str | Path) -> None:
    """Test-only seam: raise ENOSPC for a write to `where` while the `TEST_FAULT_ENV` flag file exists."""
    flag = _fault_flag()
    if flag is not None and flag.exists():
        raise DiskFullError(where)


def space_available(root: str | Path, *, need: int = RESUME_FREE_BYTES) -> bool:
    """True when the file system of `root` has at least `need` free bytes and a small durable write there
    succeeds (written, fsynced, removed). Never raises for a full disk."""
    root = Path(root)
    try:
        stat = os.statvfs(root)
        if stat.f_bavail * stat.f_frsize < need:
            return False
        probe = root / ".space-probe"
        inject(probe)
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view = memoryview(bytes(PROBE_BYTES))
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            probe.unlink(missing_ok=True)
        return True
    except OSError as exc:
        if is_disk_full(exc):
            return False
        raise

"""Pending work as plain data (spec/design.md §2).

The engine never holds a callable for work in flight. A role that starts a compute task (`Engine.run_task`),
a fetch (`Engine.fetch`) or a write (`Engine.persist_then`) hands over an attrs frozen record saying what
to do next, with its plain inputs (window, slot, keys, ids), and the name of its owner. When the work ends
the engine calls the owner's `resume(work, outcome)` with one of the outcomes below. Two engines fed the
same events therefore hold equal pending state, and a test can snapshot and compare it by value.
"""

from __future__ import annotations

from typing import Any

import attrs

from .objects import ArtifactRef
from .tasks import TaskResult

OWNERS = ("engine", "validator", "reducer", "trainer")
"""Who resumes a pending record: the engine itself, or one of its roles."""


@attrs.frozen(kw_only=True)
class Pending:
    """What the engine holds for one piece of work in flight: `owner` (one of `OWNERS`) resumes `work`, an
    attrs frozen record of its own (no callables, no engine references)."""

    owner: str
    work: Any


@attrs.frozen(kw_only=True)
class Done:
    """The work succeeded: a compute task's result (`result`, the `core.tasks` result class of its kind), or None
    for a fetch (the artifact is now stored) and a write (the record is durable)."""

    result: TaskResult | None = None


@attrs.frozen(kw_only=True)
class Failed:
    """The work failed: a task's reason, or a fetch's ("no-provider", "too-many-failures", "ref-mismatch",
    "corrupt-artifact")."""

    reason: str


Outcome = Done | Failed


@attrs.frozen(kw_only=True)
class PendingState:
    """An engine's work in flight, by value (`Engine.pending()`): ids, tokens and times are left out, so two
    engines fed the same events - one of them restarted from a snapshot before them - compare equal.

    `tasks`: compute tasks, in the order they were started; `fetches`: each artifact being fetched and what
    waits on it, in the order the fetches began; `writes`: (record key, what then) of each record not yet
    durable, in the order it was written."""

    tasks: tuple[Pending, ...]
    fetches: tuple[tuple[ArtifactRef, tuple[Pending, ...]], ...]
    writes: tuple[tuple[str, Pending], ...]

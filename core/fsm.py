"""Transition tables for the engine's state machines (spec/design.md §2).

Each role module holds its table as data: ``{(state, input): next_state}``. `step` applies one input; a
pair that is not in the table is a bug in the engine, never a peer's fault, so it raises
LocalProtocolError. `spec/gen_diagrams.py` draws spec/state-machines.md from these tables.
"""

from __future__ import annotations

from collections.abc import Mapping

from .errors import LocalProtocolError

Table = Mapping[tuple[str, str], str]


def step(machine: str, table: Table, state: str, event: str) -> str:
    try:
        return table[(state, event)]
    except KeyError:
        raise LocalProtocolError(f"{machine}: no transition from {state!r} on {event!r}") from None

"""The contract between the engine and its role state machines (spec/state-machines.md).

A node runs one role object per role it holds (`validator`, `reducer`, `trainer`). The engine keeps what
they share (peers, timers, persist-then-send, fetching, compute tasks, heads) and calls these hooks; a role
acts only through the engine's services (`send`, `set_timer`, `persist_then`, `run_task`, `fetch`,
`reject`, `adopt`, ...). Each role and each part of one is typed against a Protocol of just the members it
uses, declared beside it (`trainer.TrainerServices`, `deadlines.ClockServices`, ...; a role's Protocol
inherits those of the parts it hands the engine to), or gets a single callable (`Log`); the engine
implements them all, which mypy checks where it builds its roles. A role module imports these, never the
engine, so core's import graph has no cycle (tests/test_layers.py). Every hook runs inside `Engine.handle`,
so it must not raise for peer input: misbehaviour becomes `engine.reject(...)`.
"""

from __future__ import annotations

from typing import Any, Protocol

from .envelope import SignedEnvelope
from .identity import PeerId
from .objects import Head, SignedBody
from .pending import Outcome

TimerKey = tuple[Any, ...]
"""A role's timer key: its first item names the timer (``"window"``, ``"claim"``, ...), the rest says which
one (a window number, a peer). The engine hands every due key it does not own itself to every role."""


class Role(Protocol):
    """The hooks the engine calls on each of its roles, in the order the engine saw the inputs."""

    def on_head(self, head: Head) -> None:
        """A window opens: `head` (window `head.window`) is now canonical here, and the next window is
        `head.window + 1`. Called once per promoted head (not after `stop_after_window`)."""

    def on_timer(self, key: TimerKey) -> None:
        """A timer armed with `engine.set_timer(key, ...)` is due. Keys of other roles arrive too: ignore
        them."""

    def on_signed(self, peer: PeerId, envelope: SignedEnvelope, body: SignedBody) -> None:
        """A greeted peer sent a signed envelope, whose body the engine decoded once by its kind into `body`
        (`core.bodies.decode_body`; its signature is not yet checked: `peer` is the sender, `envelope.signer`
        the claimed author). A role matches on `body` and ignores the kinds it does not handle."""

    def on_undecodable(self, peer: PeerId, envelope: SignedEnvelope) -> bool:
        """A greeted peer sent a signed envelope whose body does not decode (or of a kind no peer sends):
        True if this role charges `peer` for it. The engine then rejects it once, with the decoding's
        reason, however many roles say so."""

    def on_peer_ready(self, peer: PeerId, roles: tuple[str, ...]) -> None:
        """`peer` greeted us with a Hello of this revision, holding `roles`."""

    def on_head_source(self, peer: PeerId, head: Head) -> None:
        """`peer` sent us the certified `head` we just adopted (it holds that window's artifacts)."""

    def resume(self, work: Any, outcome: Outcome) -> None:
        """Work this role handed the engine (`run_task`, `fetch`, `persist_then`: `work` is its frozen record)
        ended with `outcome` (core/pending.py)."""


class RoleBase:
    """No-op defaults of every `Role` hook: a role overrides the ones it needs."""

    def on_head(self, head: Head) -> None:
        pass

    def on_timer(self, key: TimerKey) -> None:
        pass

    def on_signed(self, peer: PeerId, envelope: SignedEnvelope, body: SignedBody) -> None:
        pass

    def on_undecodable(self, peer: PeerId, envelope: SignedEnvelope) -> bool:
        return False

    def on_peer_ready(self, peer: PeerId, roles: tuple[str, ...]) -> None:
        pass

    def on_head_source(self, peer: PeerId, head: Head) -> None:
        pass

    def resume(self, work: Any, outcome: Outcome) -> None:
        raise TypeError(f"{type(self).__name__} started no work {work!r}")


class Log(Protocol):
    """The engine's `log`, handed alone to a part that needs nothing else of it."""

    def __call__(self, event: str, **fields: Any) -> None: ...

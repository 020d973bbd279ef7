"""A validator engine driven by hand for the validator-role unit tests (tests/test_validator_*.py).

`Lone` is one validator (quorum 1 unless told otherwise) with stored genesis params and trainer deltas:
the test feeds events with explicit `now`, compute tasks are answered with synthetic results, and every
`Persist` is made durable at once (like a host), unless `hold_persists` is set.
"""

from __future__ import annotations

import random
from typing import Any

import attrs

from peerloom.core import effects as fx
from peerloom.core import events as ev
from peerloom.core.encoding import content_id
from peerloom.core.engine import Engine, EngineConfig
from peerloom.core.identity import Identity
from peerloom.core.leases import leases_of
from peerloom.core.messages import Hello, Message, Signed, encode_message
from peerloom.core.objects import ArtifactRef, Revision, UpdateAnnouncement, make_artifact_ref, seal
from peerloom.core.tasks import EvaluateResult, Outlier, ReduceResult, ReduceTask, ScreenResult, TaskResult
from peerloom.core.validator import ValidatorRole

from .helpers import ident, make_revision

GENESIS = bytes(range(256)) * 16  # 4096 bytes, one chunk
VALIDATOR = ident(1)


def delta_of(trainer: Identity) -> ArtifactRef:
    return make_artifact_ref(b"delta of " + trainer.peer_id.to_bytes() * 20, 4096)


def reduced_params(tag: bytes = b"p") -> tuple[ArtifactRef, bytes]:
    """A synthetic reduce result's params and their tensor digest."""
    return make_artifact_ref(b"reduced params " + tag, 4096), content_id(b"tensors " + tag)


class Lone:
    """One validator engine and the effects it emitted since the last `take()`."""

    def __init__(self, *, trainers: int = 2, me: Identity = VALIDATOR, validators: tuple[Identity, ...] | None = None,
                 quorum: int = 1, hold_persists: bool = False, manifest: dict[str, Any] | None = None,
                 config: dict[str, Any] | None = None, roles: frozenset[str] = frozenset({"validator"}),
                 **revision: Any) -> None:
        """`revision`: keywords of `helpers.make_revision`; `manifest`: other manifest fields to set;
        `config`: other `EngineConfig` fields; `roles`: the node's roles (the validator's first)."""
        self.trainers = [ident(10 + i) for i in range(trainers)]
        rev = make_revision(validators=validators or (me,), quorum=quorum, trainers=self.trainers,
                            genesis=GENESIS, chunk_size=4096, **revision)
        if manifest:
            authority = ident(200)  # make_revision's
            rev = Revision.verify(attrs.evolve(rev.manifest, **manifest).seal(authority), authority.peer_id)
        self.revision = rev
        self.me = me
        stored = [make_artifact_ref(GENESIS, 4096), *(delta_of(t) for t in self.trainers)]
        self.config = EngineConfig(roles=set(roles), revision=self.revision, **(config or {}))
        self.engine = Engine(self.config, me, random.Random(0), stored=stored)
        self.hold_persists = hold_persists
        self.now = 0.0
        self.effects: list[fx.Effect] = []
        self.tasks: dict[str, fx.RunTask] = {}  # asked for and not answered yet
        self.persists: list[fx.Persist] = []  # held (hold_persists)

    def restarted(self, now: float) -> Lone:
        """A copy of this node restarted from `engine.snapshot()` (in-flight work is not in it), started at
        `now`; the original is left as it is."""
        other = object.__new__(Lone)
        other.__dict__.update(self.__dict__)
        other.engine = Engine.restore(self.engine.snapshot(), self.config, self.me, random.Random(1))
        other.effects, other.tasks, other.persists = [], {}, []
        other.start(now)
        return other

    @property
    def role(self) -> ValidatorRole:
        role = self.engine.roles[0]
        assert isinstance(role, ValidatorRole)
        return role

    def handle(self, event: ev.Event) -> None:
        self.engine.handle(event)
        self.drain()

    def drain(self) -> None:
        """Take the effects the engine emitted (after a direct call into a role, too)."""
        while (effect := self.engine.next_effect()) is not None:
            self.effects.append(effect)
            if isinstance(effect, fx.RunTask):
                self.tasks[effect.task_id] = effect
            elif isinstance(effect, fx.Persist):
                if self.hold_persists:
                    self.persists.append(effect)
                else:
                    self.engine.handle(ev.Persisted(now=self.now, token=effect.token))

    def take(self) -> list[fx.Effect]:
        out, self.effects = self.effects, []
        return out

    def start(self, now: float = 0.0) -> None:
        self.now = now
        self.handle(ev.Start(now=now))

    def at(self, now: float) -> None:
        """Let the clock reach `now` and fire what is due."""
        self.now = now
        self.handle(ev.TimerDue(now=now))

    def promoted(self) -> list[Any]:
        return [e.head for e in self.effects if isinstance(e, fx.HeadPromoted)]

    def until_head(self, limit: float) -> None:
        """Fire timers in deadline order until a head is promoted or the clock would pass `limit`."""
        while not self.promoted():
            deadline = self.engine.next_deadline()
            if deadline is None or deadline > limit:
                return
            self.at(deadline)

    def start_with_trainers(self, now: float = 0.0) -> None:
        """`start`, then a hello from each of `trainers` as a trainer."""
        self.start(now)
        for trainer in self.trainers:
            self.greet(trainer, ("trainer",))

    def greet(self, peer: Identity, roles: tuple[str, ...]) -> None:
        self.handle(ev.PeerConnected(now=self.now, peer=peer.peer_id))
        self.deliver(peer, Hello(revision=self.revision.id, roles=roles, head_window=0))

    def signed(self, peer: Identity, body: Any, signer: Identity | None = None) -> None:
        """`peer` sends `body` sealed by `signer` (default: `peer` itself)."""
        self.deliver(peer, Signed(envelope=seal(signer or peer, body)))

    def deliver(self, peer: Identity, message: Message) -> None:
        self.handle(ev.MessageReceived(now=self.now, peer=peer.peer_id, data=encode_message(message)))

    def announcement(self, trainer: Identity, *, train_loss: float = 0.5, **fields: Any) -> Any:
        """`trainer`'s signed update for the current window; `fields`: other `UpdateAnnouncement` fields."""
        head = self.engine.head
        delta = delta_of(trainer)
        return seal(trainer, UpdateAnnouncement(
            revision=self.revision.id, window=head.window + 1, base=head.id,
            shards=leases_of(head, self.revision.manifest)[trainer.peer_id], delta=delta,
            delta_digest=delta.digest, train_loss=train_loss, **fields))

    def announce(self, trainer: Identity, **kw: Any) -> None:
        """`trainer` sends its update for the current window; the screen task it causes is not answered."""
        self.deliver(trainer, Signed(envelope=self.announcement(trainer, **kw)))

    def pending(self, kind: str) -> list[fx.RunTask]:
        return [t for t in self.tasks.values() if t.kind == kind]

    def finish(self, task: fx.RunTask, result: TaskResult) -> None:
        del self.tasks[task.task_id]
        self.handle(ev.TaskFinished(now=self.now, task_id=task.task_id, result=result))

    def fail(self, task: fx.RunTask, reason: str = "boom") -> None:
        del self.tasks[task.task_id]
        self.handle(ev.TaskFailed(now=self.now, task_id=task.task_id, reason=reason))

    def screen_all(self, ok: bool = True) -> None:
        for task in self.pending("screen"):
            self.finish(task, ScreenResult(ok=ok, reason="" if ok else "norm", norm=1.0))

    def reduce(self, kept: tuple[int, ...] | None = None, outliers: tuple[tuple[Any, ...], ...] = (),
               tag: bytes = b"p") -> None:
        """Answer the one pending reduce task: keep `kept` (default: every candidate); `outliers` are
        (candidate index, reason, detail)."""
        (task,) = self.pending("reduce")
        params, digest = reduced_params(tag)
        assert isinstance(task.task, ReduceTask)
        n = len(task.task.deltas)
        self.finish(task, ReduceResult(params=params, params_digest=digest,
                                       outliers=tuple(Outlier(index=i, reason=r, detail=d) for i, r, d in outliers),
                                       kept=tuple(range(n)) if kept is None else tuple(kept)))

    def evaluate(self, loss: float = 1.0, accuracy: float = 0.5) -> None:
        (task,) = self.pending("evaluate")
        self.finish(task, EvaluateResult(metrics={"loss": loss, "accuracy": accuracy}))

    def logs(self, event: str) -> list[dict[str, Any]]:
        return [e.fields for e in self.effects if isinstance(e, fx.Log) and e.event == event]

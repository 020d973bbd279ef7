"""The driver: the whole engine contract in one place, shared by every host (the trio node runtime
`adapters/runtime.py`, the simulator `sim/kernel.py`, `bench/engine.py` and a user's own loop:
`examples/embed_engine_*.py`).

A host supplies I/O primitives only (`Host`): a clock, one timer, sending bytes, closing and refusing
connections, writing records and chunks, committing artifacts, running a compute task. `Driver` does the rest
of spec/design.md §2, in this order (quinn-proto's `Connection` states its order the same way):

1. `Driver.handle(event)` feeds the engine one event (`Driver.start` and `Driver.timer_due` build theirs);
2. it drains `Engine.next_effect()` until None and, in order, executes each command (`core.effects.Command`) on
   the host (`_execute`) and hands each notification (`core.effects.Notification`) to the observer (`_notify`):
   each a `match` over its union ending in `typing.assert_never`, so a new effect fails type checking here,
   `make typecheck`, and tests/adapters/test_driver.py fails at run time;
3. it re-arms the host's one timer at `Engine.next_deadline()` (aioquic's `transmit()`): `Host.arm_timer`.

What the engine must hear back is built here, never in a host: a primitive that completes work (a record
written, an artifact committed, a task run) calls the `done` callback it was given, at once or later, and the
driver feeds `Persisted`, `ArtifactStored` / `ArtifactCorrupt`, `TaskFinished` / `TaskFailed`, stamped with
`Host.clock()`. A `done` called inside a primitive (a synchronous write) is fed at once and the running drain
goes on with the effects it adds; one called later runs a whole handle -> drain -> re-arm itself. Each `done`
is single-use: a second call raises `HostContractError` here, before anything reaches the engine.

Notifications a host may ignore (a promoted head, a rejection, discovered addresses, a `SubmitReply`, a log
line) go to an `Observer`, whose methods do nothing unless a host overrides them; without one they are dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, Protocol, assert_never

from peerloom.core import effects as fx
from peerloom.core import events as ev
from peerloom.core.engine import Engine
from peerloom.core.errors import LocalProtocolError, VerificationError
from peerloom.core.identity import PeerId
from peerloom.core.messages import Chunk, ChunkMissing, encode_message
from peerloom.core.objects import ArtifactRef, Head, QuorumCertificate
from peerloom.core.records import ClaimRecord, Record
from peerloom.core.tasks import TaskResult

TaskOutcome = TaskResult | Exception
"""What a compute task gives its `done` callback: the result class of its kind (`core.tasks`), or the exception
it raised (fed back as `TaskFailed` with its repr)."""

DoneArgs = ParamSpec("DoneArgs")


class HostContractError(LocalProtocolError):
    """A host broke the `Host` contract: it called a primitive's `done` a second time. Names the primitive
    and the work's token (a `Persist` token, a task id, an artifact digest)."""

    def __init__(self, primitive: str, token: object) -> None:
        super().__init__(f"Host.{primitive} called its done twice for {token!r}: each done is single-use")
        self.primitive = primitive
        self.token = token


def _once(primitive: str, token: object, done: Callable[DoneArgs, None]) -> Callable[DoneArgs, None]:
    """`done`, callable once: a second call raises `HostContractError` and reaches nothing."""
    called = False

    def single_use(*args: DoneArgs.args, **kwargs: DoneArgs.kwargs) -> None:
        nonlocal called
        if called:
            raise HostContractError(primitive, token)
        called = True
        done(*args, **kwargs)
    return single_use


class Host(Protocol):
    """The I/O primitives a `Driver` needs. None of them feeds the engine: the driver does, when `done` is
    called. Each is called on the engine's thread; `done` must be called there too, exactly once (a second
    call raises `HostContractError`)."""

    def clock(self) -> float:
        """Seconds on the host's monotonic clock (the `now` of every event the driver builds)."""

    def arm_timer(self, deadline: float | None) -> None:
        """Keep the one timer at `deadline` (None: none pending) and call `Driver.timer_due` once it passes.
        Called after every handled event; an early or repeated `timer_due` does nothing."""

    def send(self, peer: PeerId, data: bytes) -> None:
        """Queue one whole wire message for the connected `peer`; drop it if there is no connection."""

    def hang_up(self, peer: PeerId, reason: str) -> None:
        """Close the connection to `peer` (if any); feed `PeerDisconnected` once it is gone."""

    def ban(self, peer: PeerId, until: float) -> None:
        """Refuse `peer`, inbound or dialed, until `until` (this clock). The engine hangs up on it next."""

    def write_record(self, record: Record, done: Callable[[], None]) -> None:
        """Write `record.data` under `record.key` (`core.records`: the class says which record it is) durably
        (fsync), then, not before, call `done()`. A `ClaimRecord`'s `artifacts` are made durable first
        (`ArtifactStore.make_durable`), and records are written in the order they come."""

    def run_task(self, task: fx.RunTask, done: Callable[[TaskOutcome], None]) -> None:
        """Run the compute task `task.task` (a `core.tasks` class) off the engine; call `done(result)` with its
        kind's result class, or `done(exception)` if it failed."""

    def read_chunk(self, ref: ArtifactRef, index: int) -> bytes:
        """Chunk `index` of the stored artifact `ref` (the driver sends it as a `Chunk` message). Raises OSError
        or KeyError if the store no longer holds it (the driver then answers `chunk-missing`)."""

    def write_chunk(self, ref: ArtifactRef, index: int, data: bytes | memoryview) -> None:
        """Write a verified chunk of an artifact being fetched to temporary storage."""

    def commit_artifact(self, ref: ArtifactRef, durable: bool, done: Callable[[bool], None]) -> None:
        """Assemble the chunks written for `ref`, check the whole against `ref.digest` and make it visible
        (durable first unless `durable` is False: `core.effects.CommitArtifact`); then call `done(True)`, or
        `done(False)` if the bytes do not hash to the digest (`commit` does it for an `ArtifactStore`)."""

    def remove_artifacts(self, digests: tuple[bytes, ...]) -> None:
        """Delete these stored artifacts (retention: spec/protocol.md §8.1)."""


class Observer:
    """Notifications a host may ignore: each method does nothing here; override the ones you need."""

    def head_promoted(self, head: Head, certificate: QuorumCertificate) -> None:
        """A new certified head is canonical at this node."""

    def rejected(self, peer: PeerId | None, reason: str, detail: str) -> None:
        """The engine refused (and charged) a peer's input; `reason` is a stable code."""

    def peers_discovered(self, peers: tuple[tuple[PeerId, str], ...]) -> None:
        """Listen addresses of peers not connected to: a host may dial them."""

    def submit_reply(self, request_id: int, accepted: bool, reason: str) -> None:
        """The verdict on the `events.Submit` this host fed with `request_id` (a host feeding none gets none)."""

    def log(self, event: str, fields: dict[str, Any]) -> None:
        """A structured log line."""


class Driver:
    """One engine driven through one host's primitives (module docstring). Not thread-safe: call it from
    the engine's thread (one trio or asyncio task at a time)."""

    def __init__(self, engine: Engine, host: Host, observer: Observer | None = None) -> None:
        self.engine = engine
        self.host = host
        self.observer = observer if observer is not None else Observer()
        self._draining = False

    def start(self) -> None:
        """Feed `Start` (first, exactly once)."""
        self.handle(ev.Start(now=self.host.clock()))

    def timer_due(self) -> None:
        """The host's timer passed: feed `TimerDue`."""
        self.handle(ev.TimerDue(now=self.host.clock()))

    def handle(self, event: ev.Event) -> None:
        """Feed `event`, carry out every effect it causes in order, then re-arm the timer. Called from inside
        a primitive (a `done` at once), it only feeds the event: the drain under way executes what it adds."""
        if self._draining:
            self.engine.handle(event)
            return
        self._draining = True
        try:
            self.engine.handle(event)
            while (effect := self.engine.next_effect()) is not None:
                self._dispatch(effect)
        finally:
            self._draining = False
        self.host.arm_timer(self.engine.next_deadline())

    def _dispatch(self, effect: fx.Effect) -> None:
        match effect:
            case fx.HeadPromoted() | fx.Rejected() | fx.PeersDiscovered() | fx.SubmitReply() | fx.Log():
                self._notify(effect)
            case _:
                self._execute(effect)

    def _execute(self, effect: fx.Command) -> None:
        host = self.host
        match effect:
            case fx.Send():
                host.send(effect.peer, effect.data)
            case fx.HangUp():
                host.hang_up(effect.peer, effect.reason)
            case fx.Ban():
                host.ban(effect.peer, effect.until)
            case fx.Persist():
                host.write_record(effect.record, self._persisted(effect.token))
            case fx.RunTask():
                host.run_task(effect, self._task_done(effect.task_id))
            case fx.ServeChunk():
                self._serve_chunk(effect)
            case fx.StoreChunk():
                host.write_chunk(effect.ref, effect.index, effect.data)
            case fx.CommitArtifact():
                host.commit_artifact(effect.ref, effect.durable, self._committed(effect.ref))
            case fx.DropArtifacts():
                host.remove_artifacts(effect.digests)
            case _:
                assert_never(effect)

    def _serve_chunk(self, effect: fx.ServeChunk) -> None:
        """Send the chunk; if the store lost it behind the engine's back (a file deleted or cut short), answer
        `chunk-missing` instead, which costs the asker nothing and sends it to another provider: neither a
        crash of this node nor a bad chunk charged to it (spec/wire.md §4)."""
        ref, index, host = effect.ref, effect.index, self.host
        try:
            data = host.read_chunk(ref, index)
            problem = "" if len(data) == ref.chunk_length(index) else \
                f"{len(data)} bytes, not {ref.chunk_length(index)}"
        except (OSError, KeyError) as exc:
            data, problem = b"", f"{type(exc).__name__}: {exc}"
        if problem:
            self.observer.log("chunk-unreadable", {"artifact": ref.digest.hex()[:16], "index": index,
                                                   "problem": problem[:200]})
            host.send(effect.peer, encode_message(ChunkMissing(artifact=ref.digest, index=index)))
            return
        host.send(effect.peer, encode_message(Chunk(artifact=ref.digest, index=index, data=data)))

    def _notify(self, effect: fx.Notification) -> None:
        observer = self.observer
        match effect:
            case fx.HeadPromoted():
                observer.head_promoted(effect.head, effect.certificate)
            case fx.Rejected():
                observer.rejected(effect.peer, effect.reason, effect.detail)
            case fx.PeersDiscovered():
                observer.peers_discovered(effect.peers)
            case fx.SubmitReply():
                observer.submit_reply(effect.request_id, effect.accepted, effect.reason)
            case fx.Log():
                observer.log(effect.event, effect.fields)
            case _:
                assert_never(effect)

    # --- what the engine hears back ------------------------------------------------------------------

    def _persisted(self, token: int) -> Callable[[], None]:
        def done() -> None:
            self.handle(ev.Persisted(now=self.host.clock(), token=token))
        return _once("write_record", token, done)

    def _task_done(self, task_id: str) -> Callable[[TaskOutcome], None]:
        def done(outcome: TaskOutcome) -> None:
            now = self.host.clock()
            if isinstance(outcome, Exception):
                self.handle(ev.TaskFailed(now=now, task_id=task_id, reason=repr(outcome)))
            else:
                self.handle(ev.TaskFinished(now=now, task_id=task_id, result=outcome))
        return _once("run_task", task_id, done)

    def _committed(self, ref: ArtifactRef) -> Callable[[bool], None]:
        def done(ok: bool) -> None:
            now = self.host.clock()
            self.handle(ev.ArtifactStored(now=now, ref=ref) if ok else ev.ArtifactCorrupt(now=now, ref=ref))
        return _once("commit_artifact", ref.digest.hex(), done)


# --- primitives that do not differ between hosts ------------------------------------------------------


def outcome(fn: Callable[..., TaskResult], *args: Any) -> TaskOutcome:
    """`fn(*args)`, or the exception it raised: what a task's `done` takes (a failed task is an event for the
    engine, not a crash of the host)."""
    try:
        return fn(*args)
    except Exception as exc:
        return exc


def durable_first(record: Record) -> tuple[bytes, ...]:
    """The artifacts a host makes durable before it writes `record` (`Host.write_record`): a claim's delta and
    trajectory, which the trainer stored without fsync (spec/design.md §6, Storage); none for other records."""
    return record.artifacts if isinstance(record, ClaimRecord) else ()


class Store(Protocol):
    """What `StoreOnDisk` uses: an `adapters.storage.ArtifactStore` (or a `sim.disk.SimDisk`)."""

    def put_record(self, key: str, record: bytes) -> None: ...
    def make_durable(self, digest: bytes) -> bool: ...
    def read_chunk(self, ref: ArtifactRef, index: int) -> bytes: ...
    def write_chunk(self, ref: ArtifactRef, index: int, data: bytes | memoryview) -> None: ...
    def commit(self, ref: ArtifactRef, *, durable: bool = True) -> None: ...
    def remove(self, digests: Sequence[bytes]) -> int: ...


def commit(store: Store, ref: ArtifactRef, durable: bool = True) -> bool:
    """Commit a fetched artifact in `store`: True, or False where the bytes do not hash to the ref's digest
    (`VerificationError`: a hostile ref must never stop the host)."""
    try:
        store.commit(ref, durable=durable)
    except VerificationError:
        return False
    return True


class StoreOnDisk:
    """The storage primitives of `Host` over `self.store`, synchronous: each `done` is called before the
    primitive returns (`ArtifactStore.put_record` commits to SQLite, synchronous=FULL, before it returns)."""

    store: Store

    def write_record(self, record: Record, done: Callable[[], None]) -> None:
        for digest in durable_first(record):
            self.store.make_durable(digest)
        self.store.put_record(record.key, record.data)
        done()

    def read_chunk(self, ref: ArtifactRef, index: int) -> bytes:
        return self.store.read_chunk(ref, index)

    def write_chunk(self, ref: ArtifactRef, index: int, data: bytes | memoryview) -> None:
        self.store.write_chunk(ref, index, data)

    def commit_artifact(self, ref: ArtifactRef, durable: bool, done: Callable[[bool], None]) -> None:
        done(commit(self.store, ref, durable))

    def remove_artifacts(self, digests: tuple[bytes, ...]) -> None:
        self.store.remove(digests)

"""The driver (`adapters/host.py`, spec/embedding.md §2): every member of the `Effect` union reaches a host that
implements only the primitives (or its observer), in the engine's order; the driver, not the host, feeds back
`Persisted`, `TaskFinished` / `TaskFailed` and `ArtifactStored` / `ArtifactCorrupt`, and re-arms the timer
after every handled event. No other module of the library pulls or matches effects."""

import inspect
import re
import typing
from collections import deque
from pathlib import Path

import attrs
import pytest

from peerloom.adapters.host import Driver, Host, HostContractError, Observer, outcome
from peerloom.core import effects as fx
from peerloom.core import events as ev
from peerloom.core.errors import LocalProtocolError
from peerloom.core.messages import Chunk, ChunkMissing, encode_message
from peerloom.core.objects import make_artifact_ref
from peerloom.core.records import LockRecord, VoteRecord
from peerloom.core.tasks import ScreenTask, TrainResult, TrainTask
from tests.helpers import ident

MEMBERS = typing.get_args(fx.Effect)
PEER = ident(1).peer_id
REF = make_artifact_ref(b"artifact bytes", 4)
TRAIN = TrainTask(params=REF, shards=(0,), seed=1)
TRAINED = TrainResult(delta=REF, delta_digest=REF.digest, train_loss=0.5)
SAMPLES: dict[type, object] = {
    fx.Send: fx.Send(peer=PEER, data=b"hello"),
    fx.HangUp: fx.HangUp(peer=PEER, reason="penalty-limit"),
    fx.Persist: fx.Persist(token=7, record=VoteRecord(window=1, round=0, step="prevote", data=b"r")),
    fx.RunTask: fx.RunTask(task_id="t1", task=TRAIN),
    fx.ServeChunk: fx.ServeChunk(peer=PEER, ref=REF, index=1),
    fx.StoreChunk: fx.StoreChunk(ref=REF, index=0, data=b"arti"),
    fx.CommitArtifact: fx.CommitArtifact(ref=REF, durable=False),
    fx.DropArtifacts: fx.DropArtifacts(digests=(b"d",)),
    fx.HeadPromoted: fx.HeadPromoted(head=object(), certificate=object()),  # type: ignore[arg-type]
    fx.PeersDiscovered: fx.PeersDiscovered(peers=((PEER, "10.0.0.1:4001"),)),
    fx.Rejected: fx.Rejected(peer=PEER, reason="bad-signature", detail="x"),
    fx.Ban: fx.Ban(peer=PEER, until=30.0),
    fx.SubmitReply: fx.SubmitReply(request_id=3, accepted=False, reason="stale"),
    fx.Log: fx.Log(event="vote", fields={"window": 1}),
}


class FakeEngine:
    """Hands out queued effects; records what it was fed; its deadline is settable."""

    def __init__(self, effects=()):
        self.effects = deque(effects)
        self.fed: list[ev.Event] = []
        self.deadline: float | None = 12.5
        self.on_handle = lambda event: None

    def handle(self, event):
        self.fed.append(event)
        self.on_handle(event)

    def next_effect(self):
        return self.effects.popleft() if self.effects else None

    def next_deadline(self):
        return self.deadline


class PrimitivesOnly:
    """A host with only the `Host` primitives: records each call; completes work at once unless `later`."""

    def __init__(self, *, later: bool = False):
        self.calls: list[tuple] = []
        self.later = later
        self.pending: list = []  # completions held back when `later`
        self.now = 5.0

    def _complete(self, done, *value):
        if self.later:
            self.pending.append(lambda: done(*value))
        else:
            done(*value)

    def clock(self):
        return self.now

    def arm_timer(self, deadline):
        self.calls.append(("arm_timer", deadline))

    def send(self, peer, data):
        self.calls.append(("send", peer, data))

    def hang_up(self, peer, reason):
        self.calls.append(("hang_up", peer, reason))

    def ban(self, peer, until):
        self.calls.append(("ban", peer, until))

    def write_record(self, record, done):
        self.calls.append(("write_record", record.key, record.data))
        self._complete(done)

    def run_task(self, task, done):
        self.calls.append(("run_task", task.kind, task.task))
        self._complete(done, TRAINED if task.task_id == "t1" else ValueError("boom"))

    def read_chunk(self, ref, index):
        self.calls.append(("read_chunk", ref, index))
        return b"artifact bytes"[index * 4:index * 4 + 4]

    def write_chunk(self, ref, index, data):
        self.calls.append(("write_chunk", ref, index, data))

    def commit_artifact(self, ref, durable, done):
        self.calls.append(("commit_artifact", ref, durable))
        self._complete(done, True)

    def remove_artifacts(self, digests):
        self.calls.append(("remove_artifacts", digests))


class Recording(Observer):
    def __init__(self):
        self.calls: list[tuple] = []

    def head_promoted(self, head, certificate):
        self.calls.append(("head_promoted", head, certificate))

    def rejected(self, peer, reason, detail):
        self.calls.append(("rejected", peer, reason, detail))

    def peers_discovered(self, peers):
        self.calls.append(("peers_discovered", peers))

    def submit_reply(self, request_id, accepted, reason):
        self.calls.append(("submit_reply", request_id, accepted, reason))

    def log(self, event, fields):
        self.calls.append(("log", event, fields))


def test_every_effect_class_is_a_member_of_the_union_and_has_a_sample():
    defined = {obj for obj in vars(fx).values() if inspect.isclass(obj) and attrs.has(obj)
               and obj.__module__ == fx.__name__}
    assert defined == set(MEMBERS)
    assert set(SAMPLES) == set(MEMBERS), "a new effect needs a sample here, and a case in the Driver"


def test_commands_and_notifications_are_separate_unions_that_make_up_effect():
    commands, notifications = set(typing.get_args(fx.Command)), set(typing.get_args(fx.Notification))
    assert commands and notifications and not commands & notifications
    assert commands | notifications == set(MEMBERS)
    observed = {n for n, _ in inspect.getmembers(Observer, inspect.isfunction) if not n.startswith("_")}
    assert len(observed) == len(notifications)  # one observer method per notification


def test_the_host_protocol_is_primitives_and_the_observer_notifications():
    primitives = {n for n, _ in inspect.getmembers(Host, inspect.isfunction) if not n.startswith("_")}
    assert primitives == {"clock", "arm_timer", "send", "hang_up", "ban", "write_record", "run_task",
                          "read_chunk", "write_chunk", "commit_artifact", "remove_artifacts"}
    assert primitives <= set(dir(PrimitivesOnly))


def test_every_effect_reaches_a_primitives_only_host_and_what_it_completes_is_fed_back():
    engine = FakeEngine([SAMPLES[cls] for cls in MEMBERS])
    host, observer = PrimitivesOnly(), Recording()
    Driver(engine, host, observer).handle(ev.Start(now=5.0))  # type: ignore[arg-type]
    expected_host = {
        fx.Send: ("send", PEER, b"hello"),
        fx.HangUp: ("hang_up", PEER, "penalty-limit"),
        fx.Persist: ("write_record", "vote/1/0/prevote", b"r"),
        fx.RunTask: ("run_task", "train", TRAIN),
        fx.ServeChunk: ("read_chunk", REF, 1),
        fx.StoreChunk: ("write_chunk", REF, 0, b"arti"),
        fx.CommitArtifact: ("commit_artifact", REF, False),
        fx.DropArtifacts: ("remove_artifacts", (b"d",)),
        fx.Ban: ("ban", PEER, 30.0),
    }
    expected_observer = {
        fx.HeadPromoted: ("head_promoted", SAMPLES[fx.HeadPromoted].head, SAMPLES[fx.HeadPromoted].certificate),
        fx.PeersDiscovered: ("peers_discovered", ((PEER, "10.0.0.1:4001"),)),
        fx.Rejected: ("rejected", PEER, "bad-signature", "x"),
        fx.SubmitReply: ("submit_reply", 3, False, "stale"),
        fx.Log: ("log", "vote", {"window": 1}),
    }
    assert set(expected_host) | set(expected_observer) == set(MEMBERS)
    assert set(expected_host) == set(typing.get_args(fx.Command))  # commands reach the host, nothing else
    assert set(expected_observer) == set(typing.get_args(fx.Notification))
    chunk = encode_message(Chunk(artifact=REF.digest, index=1, data=b"fact"))
    in_order = [call for cls in MEMBERS if cls in expected_host
                for call in [expected_host[cls]] + ([("send", PEER, chunk)] if cls is fx.ServeChunk else [])]
    assert host.calls == [*in_order, ("arm_timer", 12.5)]  # in the engine's order, then one re-arm
    assert observer.calls == [expected_observer[c] for c in MEMBERS if c in expected_observer]
    assert engine.fed[1:] == [ev.Persisted(now=5.0, token=7),
                              ev.TaskFinished(now=5.0, task_id="t1", result=TRAINED),
                              ev.ArtifactStored(now=5.0, ref=REF)]


def test_without_an_observer_notifications_are_dropped():
    engine = FakeEngine([SAMPLES[fx.Log], SAMPLES[fx.HeadPromoted], SAMPLES[fx.Send]])
    host = PrimitivesOnly()
    Driver(engine, host).handle(ev.Start(now=0.0))  # type: ignore[arg-type]
    assert host.calls == [("send", PEER, b"hello"), ("arm_timer", 12.5)]


def test_a_completion_inside_the_drain_is_fed_at_once_and_its_effects_follow_in_order():
    persist, send = fx.Persist(token=1, record=LockRecord(window=2, data=b"r")), fx.Send(peer=PEER, data=b"held")
    log = fx.Log(event="e", fields={})
    engine = FakeEngine([persist, log])
    engine.on_handle = lambda event: engine.effects.append(send) if isinstance(event, ev.Persisted) else None
    host, observer = PrimitivesOnly(), Recording()
    Driver(engine, host, observer).handle(ev.Start(now=0.0))  # type: ignore[arg-type]
    assert host.calls == [("write_record", "lock/2", b"r"), ("send", PEER, b"held"), ("arm_timer", 12.5)]
    assert observer.calls == [("log", "e", {})]


def test_a_later_completion_is_a_whole_handle_drain_rearm_with_the_host_clock():
    engine = FakeEngine([SAMPLES[fx.Persist], SAMPLES[fx.CommitArtifact],
                         fx.RunTask(task_id="t2", task=ScreenTask(delta=REF, delta_digest=REF.digest))])
    host = PrimitivesOnly(later=True)
    driver = Driver(engine, host)  # type: ignore[arg-type]
    driver.start()
    assert engine.fed == [ev.Start(now=5.0)] and len(host.pending) == 3
    host.now, engine.deadline = 9.0, None
    engine.on_handle = lambda event: (engine.effects.append(SAMPLES[fx.Send]) if isinstance(event, ev.TaskFailed)
                                      else None)
    for complete in host.pending:
        complete()
    assert engine.fed[1:] == [ev.Persisted(now=9.0, token=7), ev.ArtifactStored(now=9.0, ref=REF),
                              ev.TaskFailed(now=9.0, task_id="t2", reason="ValueError('boom')")]
    assert host.calls[-4:] == [("arm_timer", None), ("arm_timer", None), ("send", PEER, b"hello"), ("arm_timer", None)]
    driver.timer_due()
    assert engine.fed[-1] == ev.TimerDue(now=9.0)


def test_a_corrupt_commit_is_fed_back_as_artifact_corrupt():
    engine = FakeEngine([SAMPLES[fx.CommitArtifact]])

    class Corrupting(PrimitivesOnly):
        def commit_artifact(self, ref, durable, done):
            done(False)

    Driver(engine, Corrupting()).handle(ev.Start(now=1.0))  # type: ignore[arg-type]
    assert engine.fed[1:] == [ev.ArtifactCorrupt(now=5.0, ref=REF)]


@pytest.mark.parametrize(("effect", "primitive", "token", "fed"), [
    (SAMPLES[fx.Persist], "write_record", 7, ev.Persisted(now=5.0, token=7)),
    (SAMPLES[fx.RunTask], "run_task", "t1", ev.TaskFinished(now=5.0, task_id="t1", result=TRAINED)),
    (SAMPLES[fx.CommitArtifact], "commit_artifact", REF.digest.hex(), ev.ArtifactStored(now=5.0, ref=REF)),
], ids=["write_record", "run_task", "commit_artifact"])
def test_a_done_called_twice_is_refused_before_it_reaches_the_engine(effect, primitive, token, fed):
    """Each `done` a primitive gets is single-use: a second call is the host's bug, named here, not an unknown
    token for the engine to puzzle over."""
    engine, host = FakeEngine([effect]), PrimitivesOnly(later=True)
    Driver(engine, host).handle(ev.Start(now=0.0))  # type: ignore[arg-type]
    [complete] = host.pending
    complete()
    assert engine.fed[1:] == [fed]
    with pytest.raises(HostContractError, match=f"Host.{primitive} called its done twice for {token!r}") as raised:
        complete()
    assert isinstance(raised.value, LocalProtocolError)
    assert (raised.value.primitive, raised.value.token) == (primitive, token)
    assert engine.fed[1:] == [fed]  # nothing more reached the engine

    class Twice(PrimitivesOnly):  # the same bug inside the primitive, during the drain
        def _complete(self, done, *value):
            done(*value)
            done(*value)

    engine = FakeEngine([effect])
    with pytest.raises(HostContractError):
        Driver(engine, Twice()).handle(ev.Start(now=0.0))  # type: ignore[arg-type]
    assert engine.fed[1:] == [fed]


def test_outcome_returns_the_result_or_the_exception():
    assert outcome(lambda x: {"x": x}, 1) == {"x": 1}
    assert isinstance(outcome(lambda: 1 / 0), ZeroDivisionError)


def test_dispatch_refuses_what_is_not_an_effect():
    with pytest.raises(AssertionError):
        Driver(FakeEngine([object()]), PrimitivesOnly()).handle(ev.Start(now=0.0))  # type: ignore[arg-type]


def test_no_other_module_pulls_or_matches_effects():
    """The runtime, the simulator, the examples and the benchmark all go through `Driver`: no second interpreter
    of effects anywhere outside the engine and the tests."""
    root = Path(__file__).resolve().parents[2]
    pattern = re.compile(r"next_effect\(|case fx\.|isinstance\([^)]*, fx\.")
    offenders = sorted(str(p.relative_to(root)) for folder in ("adapters", "sim", "peerloom", "backends", "examples",
                                                                 "bench")
                       for p in (root / folder).rglob("*.py") if pattern.search(p.read_text()))
    assert offenders == ["adapters/host.py"]


class LostStore(PrimitivesOnly):
    """A store that lost an artifact behind the engine's back: its file deleted (`gone`), or cut short."""

    def __init__(self, gone: bool):
        super().__init__()
        self.gone = gone

    def read_chunk(self, ref, index):
        self.calls.append(("read_chunk", ref, index))
        if self.gone:
            raise FileNotFoundError(2, "No such file or directory", "store/artifacts/1220ab")
        return b"ar"  # the file was truncated: 2 of the chunk's 4 bytes


@pytest.mark.parametrize("gone", [True, False], ids=["deleted", "truncated"])
def test_a_chunk_the_store_lost_is_answered_chunk_missing_and_logged_not_raised_or_sent_short(gone):
    """The engine serves what it was told is stored; a store that lost the file since must neither end the
    node (the read used to raise out of the driver) nor send a short chunk, which the asker would charge to
    this node as a bad chunk."""
    engine = FakeEngine([fx.ServeChunk(peer=PEER, ref=REF, index=0), SAMPLES[fx.Send]])
    host, observer = LostStore(gone), Recording()
    Driver(engine, host, observer).handle(ev.Start(now=5.0))  # type: ignore[arg-type]
    missing = encode_message(ChunkMissing(artifact=REF.digest, index=0))
    assert host.calls == [("read_chunk", REF, 0), ("send", PEER, missing), ("send", PEER, b"hello"),
                          ("arm_timer", 12.5)]
    (log,) = observer.calls
    assert log[:2] == ("log", "chunk-unreadable") and log[2]["index"] == 0
    assert ("FileNotFoundError" if gone else "2 bytes, not 4") in log[2]["problem"]

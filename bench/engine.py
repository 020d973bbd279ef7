"""Engine benchmark: how many events per second one validator's pure-Python engine handles, and how
that scales with the cohort; one JSON object on the last line.

    python bench/engine.py [--trainers 10,100,1000] [--windows 4] [--validators 4] [--quick]

A validator `Engine` (core/engine.py, role "validator") is driven by hand on a virtual clock, with no
network and no compute: for each cohort size N the revision rosters N trainers with one shard each
(``min_updates`` N/2), and `--validators` validators (Byzantine quorum). Each window the driver delivers,
as wire messages from connected peers (every one decoded, signature-checked and judged by the engine):

- a signed update announcement from every leaseholder (its delta artifact marked stored beforehand, so the
  engine starts no fetch: the cost measured is the protocol's, not the transport's);
- `--joins` signed join requests from new peers (admission "open");
- for every vote the engine signs, the same vote signed by each of the other validators (quorum - 1 of
  them suffice and are sent): prevotes and precommits, so rounds where another validator proposes time out
  and pass as they would in a fleet whose proposer is slow;

and completes every compute task at once (screen ok; reduce: a fresh params artifact; evaluate: a loss),
every `Persist` at once, and every timer when nothing else is pending (the clock jumps to it). The engine runs
under the shared `Driver` (adapters/host.py); this file supplies its I/O primitives, each queueing its work for
after the timed call.

Reported per N (windows after the first, which warms up): ``events`` (calls of `Engine.handle`),
``engine_s`` (seconds inside `Driver.handle`: the engine and the driver's dispatch; the primitives only
queue, and signing the mirrored votes is excluded), ``events_per_s`` = events / engine_s, ``us_per_event``,
``events_per_window``, ``ms_per_window`` (engine time per certified window) and ``rejections`` (none expected).
Output (last line): ``{"validators", "results": [{"trainers", ...}]}``. ``--quick``: N = 10 and 100, 2 windows.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from peerloom.adapters.host import Driver, Observer
from peerloom.core import effects as fx
from peerloom.core import events as ev
from peerloom.core.encoding import decode
from peerloom.core.engine import Engine, EngineConfig
from peerloom.core.identity import Identity
from peerloom.core.leases import leases_of
from peerloom.core.messages import Hello, Signed, decode_message, encode_message
from peerloom.core.objects import (
    VOTE_KIND,
    JoinRequest,
    Manifest,
    Revision,
    UpdateAnnouncement,
    byzantine_quorum,
    make_artifact_ref,
    seal,
    sign_vote,
)
from peerloom.core.tasks import (
    EvaluateResult,
    EvaluateTask,
    ReduceResult,
    ReduceTask,
    ScreenResult,
    ScreenTask,
    TaskResult,
)


def _identity(n: int) -> Identity:
    return Identity(n.to_bytes(4, "big") * 8)


class Bench(Observer):
    """One validator engine with `trainers` rostered trainers and `validators` validators in all; the
    `Driver`'s host and observer."""

    def __init__(self, trainers: int, validators: int, joins: int, seed: int = 0) -> None:
        self.validators = [_identity(1_000_000 + i) for i in range(validators)]
        self.trainers = [_identity(1 + i) for i in range(trainers)]
        self.joiners = [_identity(2_000_000 + i) for i in range(joins * 64)]
        self.joins_per_window = joins
        self.identities = {t.peer_id: t for t in self.trainers}
        authority = _identity(3_000_000)
        genesis = make_artifact_ref(b"genesis params", 1 << 20)
        manifest = Manifest(
            experiment="bench-engine", workload="digits-mlp", workload_seed=0, schema=(("w", "float32", (2,)),),
            shards=(10,) * trainers, validators=tuple(v.peer_id for v in self.validators),
            quorum=byzantine_quorum(validators), window_s=5.0, min_updates=max(1, trainers // 2), max_capacity=4,
            aggregation="mean", outer_optimizer="fedavg", outer_lr=1.0, chunk_size=1 << 20, genesis_params=genesis,
            genesis_params_digest=genesis.digest, roster=tuple(sorted((t.peer_id, 1) for t in self.trainers)))
        self.revision = Revision.verify(manifest.seal(authority), authority.peer_id)
        self.me = self.validators[0]
        self.engine = Engine(EngineConfig(roles={"validator"}, revision=self.revision), self.me,
                             random.Random(seed), stored=[genesis])
        self.driver = Driver(self.engine, self, self)
        self.deadline: float | None = None
        self.now = 0.0
        self.events = 0
        self.engine_s = 0.0
        self.serial = 0
        self.pending: list[tuple[Any, ...]] = []  # messages to deliver: (peer, bytes)
        self.sent: list[bytes] = []  # what the engine sent, mirrored after the timed call (`_mirror_vote`)
        self.completions: list[Callable[[], None]] = []  # records written and tasks run, fed back in order
        self.rejections = 0

    # --- the engine's side, timed -------------------------------------------------------------------------

    def handle(self, event: ev.Event) -> None:
        self._timed(self.driver.handle, event)

    def _timed(self, call: Callable[..., None], *args: Any) -> None:
        started = time.perf_counter()
        call(*args)
        self.engine_s += time.perf_counter() - started
        self.events += 1
        while self.sent:
            self._mirror_vote(self.sent.pop(0))

    # --- the driver's I/O primitives (adapters/host.py `Host`): each only queues ---------------------------

    def clock(self) -> float:
        return self.now

    def arm_timer(self, deadline: float | None) -> None:
        self.deadline = deadline

    def send(self, peer: Any, data: bytes) -> None:
        self.sent.append(data)

    def write_record(self, record: Any, done: Callable[[], None]) -> None:
        self.completions.append(lambda: self._timed(done))

    def run_task(self, task: fx.RunTask, done: Callable[[Any], None]) -> None:
        self.completions.append(lambda: self._timed(done, self._result(task)))

    def hang_up(self, peer: Any, reason: str) -> None:
        pass  # every peer is an honest identity of this benchmark: a hang-up shows as `rejections` below

    def ban(self, peer: Any, until: float) -> None:
        pass  # likewise (a ban follows rejections)

    def remove_artifacts(self, digests: tuple[bytes, ...]) -> None:
        pass  # retention: nothing is on disk here (artifacts are only marked stored)

    def read_chunk(self, ref: Any, index: int) -> bytes:
        raise RuntimeError("no peer of this benchmark requests chunks")

    def write_chunk(self, ref: Any, index: int, data: bytes) -> None:
        raise RuntimeError("the engine fetched an artifact: every delta here is marked stored beforehand")

    def commit_artifact(self, ref: Any, durable: bool, done: Callable[[bool], None]) -> None:
        raise RuntimeError("the engine fetched an artifact: every delta here is marked stored beforehand")

    def rejected(self, peer: Any, reason: str, detail: str) -> None:
        self.rejections += 1  # reported: a correct benchmark has none

    def _result(self, effect: fx.RunTask) -> TaskResult:
        match effect.task:
            case ScreenTask():
                return ScreenResult(ok=True, reason="", norm=1.0)
            case EvaluateTask():
                return EvaluateResult(metrics={"loss": 0.5})
            case ReduceTask() as task:
                self.serial += 1
                params = make_artifact_ref(b"params %d" % self.serial, 1 << 20)
                self.driver.handle(ev.ArtifactAdded(now=self.now, ref=params))  # untimed, as before
                return ReduceResult(params=params, params_digest=params.digest, kept=tuple(range(len(task.deltas))))
        raise ValueError(f"task {effect.kind}")

    def _mirror_vote(self, data: bytes) -> None:
        """Each vote the engine signs comes back signed by the other validators (enough for a quorum)."""
        message = decode_message(data, max_bytes=len(data))
        if not isinstance(message, Signed) or message.envelope.kind != VOTE_KIND:
            return
        if message.envelope.signer != self.me.peer_id:
            return
        body = decode(message.envelope.body, max_bytes=len(message.envelope.body))
        head = body.get("head")
        key = (body["window"], body["round"], body["step"], head)
        if key in getattr(self, "_mirrored", set()):
            return
        self._mirrored = getattr(self, "_mirrored", set()) | {key}
        for other in self.validators[1:self.revision.manifest.quorum]:
            vote = sign_vote(other, self.revision.id, body["window"], body["round"], body["step"], head)
            self.pending.append((other.peer_id, encode_message(Signed(envelope=vote))))

    # --- the world's side --------------------------------------------------------------------------------

    def deliver(self, peer: Any, data: bytes) -> None:
        self.handle(ev.MessageReceived(now=self.now, peer=peer, data=data))

    def connect(self, identity: Identity, roles: tuple[str, ...]) -> None:
        self.handle(ev.PeerConnected(now=self.now, peer=identity.peer_id))
        head_window = self.engine.head.window
        self.deliver(identity.peer_id, encode_message(Hello(revision=self.revision.id, roles=roles,
                                                            head_window=head_window)))

    def settle(self) -> None:
        """Feed task results, persisted records and queued messages until nothing is left."""
        while self.completions or self.pending:
            while self.completions:
                self.completions.pop(0)()
            while self.pending:
                self.deliver(*self.pending.pop(0))

    def start(self) -> None:
        self.handle(ev.Start(now=self.now))
        for v in self.validators[1:]:
            self.connect(v, ("validator",))
        for t in self.trainers:
            self.connect(t, ("trainer",))
        self.settle()

    def window(self) -> None:
        """Drive one window until the engine promotes its head."""
        engine = self.engine
        head = engine.head
        leases = leases_of(head, self.revision.manifest)
        by_peer = self.identities
        messages = []
        for peer, shards in sorted(leases.items()):
            self.serial += 1
            delta = make_artifact_ref(b"delta %d" % self.serial, 1 << 20)
            self.driver.handle(ev.ArtifactAdded(now=self.now, ref=delta))  # untimed: set-up, not engine work
            ann = seal(by_peer[peer], UpdateAnnouncement(revision=self.revision.id, window=head.window + 1,
                                                         base=head.id, shards=shards, delta=delta,
                                                         delta_digest=delta.digest, train_loss=0.1))
            messages.append((peer, encode_message(Signed(envelope=ann))))
        for _ in range(self.joins_per_window):
            if not self.joiners:
                break
            joiner = self.joiners.pop()
            self.identities[joiner.peer_id] = joiner  # rostered by the next head: it then holds leases
            self.connect(joiner, ("trainer",))
            join = seal(joiner, JoinRequest(revision=self.revision.id, window=head.window + 1, capacity=1))
            messages.append((joiner.peer_id, encode_message(Signed(envelope=join))))
        for peer, data in messages:
            self.deliver(peer, data)
            self.settle()
        while engine.head.window == head.window:
            self.settle()
            if engine.head.window != head.window:
                break
            if self.deadline is None:
                raise RuntimeError(f"window {head.window + 1} stalled with no timer")
            self.now = max(self.now, self.deadline)
            self._timed(self.driver.timer_due)
        self.settle()
        if engine.head.skipped:
            raise RuntimeError(f"window {engine.head.window} was skipped")


def run(trainers: int, validators: int, windows: int, joins: int) -> dict[str, Any]:
    driver = Bench(trainers, validators, joins)
    driver.start()
    driver.window()  # warm-up
    events, engine_s = driver.events, driver.engine_s
    for _ in range(windows - 1):
        driver.window()
    events, engine_s = driver.events - events, driver.engine_s - engine_s
    measured = windows - 1
    return {"trainers": trainers, "windows": measured, "events": events, "engine_s": round(engine_s, 4),
            "events_per_s": round(events / engine_s, 1), "us_per_event": round(1e6 * engine_s / events, 2),
            "events_per_window": events // measured, "ms_per_window": round(1e3 * engine_s / measured, 2),
            "head_window": driver.engine.head.window, "rejections": driver.rejections}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainers", default="10,100,1000", help="comma-separated cohort sizes")
    parser.add_argument("--windows", type=int, default=4, help="windows per size (the first warms up)")
    parser.add_argument("--validators", type=int, default=4)
    parser.add_argument("--joins", type=int, default=2, help="join requests per window")
    parser.add_argument("--quick", action="store_true", help="10 and 100 trainers, 2 windows")
    args = parser.parse_args()
    sizes = [10, 100] if args.quick else [int(n) for n in args.trainers.split(",")]
    windows = 2 if args.quick else max(2, args.windows)
    results = []
    for n in sizes:
        result = run(n, args.validators, windows, args.joins)
        print(json.dumps(result), file=sys.stderr, flush=True)
        results.append(result)
    print(json.dumps({"validators": args.validators, "results": results}))


if __name__ == "__main__":
    main()

"""Drive the sans-IO engine from a hand-written loop: no event-loop library, no sockets, no threads.

Three engines (one validator, two trainers) live in this process, each behind a `Driver`
(`peerloom.adapters.host`, spec/embedding.md), which feeds the engine, carries out its effects in order and feeds
back what the contract needs. The loop below supplies only the I/O: delivering bytes, a store on disk
(`StoreOnDisk`), compute run at once, and a virtual clock. Messages and compute take no time, and when nothing
is in flight the clock jumps to the earliest timer any driver armed. That is a tiny discrete-event simulator;
`peerloom.sim` is the full one, with a network, disks and compute that take time.
"""

import random
from collections import deque
from pathlib import Path

from _experiment import digits_experiment

from peerloom.adapters.compute import ComputeExecutor
from peerloom.adapters.host import Driver, Observer, StoreOnDisk, outcome
from peerloom.adapters.storage import ArtifactStore
from peerloom.core import events as ev
from peerloom.core.engine import Engine, EngineConfig


class Node(StoreOnDisk, Observer):
    """One engine with its store and its compute: the driver's `Host` (its storage primitives come from
    `StoreOnDisk`) and `Observer` (it keeps the certified heads)."""

    def __init__(self, loop, name, roles, identity, revision, workload, shards, root: Path):
        self.loop, self.peer = loop, identity.peer_id
        self.store = ArtifactStore(root / name, chunk_size=revision.manifest.chunk_size)
        self.executor = ComputeExecutor(self.store, revision.manifest, workload, shards)
        engine = Engine(EngineConfig(roles=frozenset(roles), revision=revision), identity,
                        random.Random(name), stored=self.store.refs(), records=self.store.records())
        self.driver = Driver(engine, self, self)
        self.deadline: float | None = None  # the timer the driver armed
        self.heads: list[tuple[int, float]] = []  # (window, test accuracy) of each certified head

    def clock(self):
        return self.loop.now

    def arm_timer(self, deadline):
        self.deadline = deadline

    def send(self, peer, data):
        delivery = ev.MessageReceived(now=self.loop.now, peer=self.peer, data=data)
        self.loop.inbox.append((self.loop.nodes[peer], delivery))

    def run_task(self, task, done):
        done(outcome(self.executor.run, task.task))  # synchronously: compute takes no virtual time

    def hang_up(self, peer, reason):
        pass  # honest peers, all linked from the start: nobody to hang up on

    def ban(self, peer, until):
        pass  # nobody to refuse either

    def head_promoted(self, head, certificate):
        self.heads.append((head.window, head.metrics.get("test_accuracy", float("nan"))))


class Loop:
    """A queue of (node, event) to feed, and a virtual clock."""

    def __init__(self):
        self.nodes = {}
        self.inbox: deque = deque()
        self.now = 0.0

    def link(self, a: Node, b: Node) -> None:
        self.inbox.append((a, ev.PeerConnected(now=self.now, peer=b.peer)))
        self.inbox.append((b, ev.PeerConnected(now=self.now, peer=a.peer)))

    def run_until(self, done) -> None:
        while not done():
            if self.inbox:
                node, event = self.inbox.popleft()
                node.driver.handle(event)
                continue
            armed = [n for n in self.nodes.values() if n.deadline is not None]
            if not armed:
                raise RuntimeError("nothing in flight and no timer armed")
            self.now = max(self.now, min(n.deadline for n in armed))  # idle: jump to the next deadline
            for node in armed:
                if node.deadline <= self.now:
                    node.driver.timer_due()


def main() -> None:
    root, revision, ids, workload, shards = digits_experiment("loop")  # examples/_experiment.py
    loop = Loop()
    validator = Node(loop, "validator", {"validator"}, ids["validator"], revision, workload, shards, root)
    trainers = [Node(loop, t, {"trainer"}, ids[t], revision, workload, shards, root)
                for t in ("trainer-1", "trainer-2")]
    for node in (validator, *trainers):
        loop.nodes[node.peer] = node
        node.driver.start()
    for trainer in trainers:
        loop.link(validator, trainer)
    loop.run_until(lambda: len(validator.heads) >= 3)
    for window, accuracy in validator.heads[:3]:
        print(f"window {window} certified: test accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()

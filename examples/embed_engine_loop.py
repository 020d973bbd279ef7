"""Drive the sans-IO engine from a hand-written loop: no event-loop library, no sockets, no threads.

Three engines (one validator, two trainers) live in this process. The loop below is their whole host
(spec/embedding.md): it feeds each engine its events, executes every effect the engine returns with one
`match` that covers the `Effect` union (`assert_never` makes a forgotten effect a type error), and keeps
time itself. Its clock is virtual: messages and compute take no time, and when nothing is in flight the
clock jumps to the earliest `next_deadline()` of any engine. That is a tiny discrete-event simulator;
`peerloom.sim` is the full one, with a network, disks and compute that take time.
"""

import random
from collections import deque
from pathlib import Path
from typing import assert_never

from _experiment import digits_experiment

from peerloom.adapters.compute import ComputeExecutor
from peerloom.adapters.host import chunk_message, stored_event
from peerloom.adapters.storage import ArtifactStore
from peerloom.core import effects as fx
from peerloom.core import events as ev
from peerloom.core.engine import Engine, EngineConfig


class Node:
    """One engine with its store and its compute."""

    def __init__(self, name, roles, identity, revision, workload, shards, root: Path):
        self.peer = identity.peer_id
        self.store = ArtifactStore(root / name, chunk_size=revision.manifest.chunk_size)
        self.executor = ComputeExecutor(self.store, revision.manifest, workload, shards)
        self.engine = Engine(EngineConfig(roles=frozenset(roles), revision=revision), identity,
                             random.Random(name), stored=self.store.refs(), records=self.store.records())
        self.heads: list[tuple[int, float]] = []  # (window, test accuracy) of each certified head


class Loop:
    """The host: a queue of (node, event) to feed, and a virtual clock."""

    def __init__(self, nodes: list[Node]):
        self.nodes = {node.peer: node for node in nodes}
        self.inbox: deque[tuple[Node, object]] = deque()
        self.now = 0.0

    def feed(self, node: Node, event) -> None:
        node.engine.handle(event)
        while (effect := node.engine.next_effect()) is not None:
            self.execute(node, effect)

    def execute(self, node: Node, effect: fx.Effect) -> None:
        """Carry out one effect; what the engine must hear back goes to the inbox, fed in order."""
        match effect:
            case fx.Send(peer=peer, data=data):
                self.deliver(node, peer, data)
            case fx.ServeChunk(peer=peer):
                self.deliver(node, peer, chunk_message(node.store, effect))
            case fx.Persist(key=key, record=record, token=token):
                node.store.put_record(key, record)  # durable (SQLite, synchronous=FULL) when it returns
                self.inbox.append((node, ev.Persisted(now=self.now, token=token)))
            case fx.StoreChunk(ref=ref, index=index, data=data):
                node.store.write_chunk(ref, index, data)
            case fx.CommitArtifact():
                self.inbox.append((node, stored_event(node.store, effect, self.now)))
            case fx.DropArtifacts(digests=digests):
                node.store.remove(digests)
            case fx.RunTask(task_id=task_id, kind=kind, args=args):
                try:  # synchronously: compute takes no virtual time here
                    result = node.executor.run(kind, args)
                    self.inbox.append((node, ev.TaskFinished(now=self.now, task_id=task_id, result=result)))
                except Exception as exc:  # a failed task is an event for the engine, not a crash of the host
                    self.inbox.append((node, ev.TaskFailed(now=self.now, task_id=task_id, reason=repr(exc))))
            case fx.HeadPromoted(head=head):
                node.heads.append((head.window, head.metrics.get("test_accuracy", float("nan"))))
            case fx.HangUp() | fx.Ban() | fx.PeersDiscovered():
                pass  # honest peers, all linked from the start: nobody to hang up on, refuse or dial
            case fx.Rejected() | fx.SubmitReply() | fx.Log():
                pass  # nothing to count, no Submit was fed, logs are not kept here
            case _:
                assert_never(effect)

    def deliver(self, sender: Node, peer, data: bytes) -> None:
        self.inbox.append((self.nodes[peer], ev.MessageReceived(now=self.now, peer=sender.peer, data=data)))

    def link(self, a: Node, b: Node) -> None:
        self.inbox.append((a, ev.PeerConnected(now=self.now, peer=b.peer)))
        self.inbox.append((b, ev.PeerConnected(now=self.now, peer=a.peer)))

    def run_until(self, done) -> None:
        while not done():
            if self.inbox:
                self.feed(*self.inbox.popleft())
                continue
            deadlines = [(d, n) for n in self.nodes.values() if (d := n.engine.next_deadline()) is not None]
            if not deadlines:
                raise RuntimeError("nothing in flight and no timer armed")
            self.now = max(self.now, min(d for d, _ in deadlines))  # idle: jump to the next deadline
            for deadline, node in deadlines:
                if deadline <= self.now:
                    self.inbox.append((node, ev.TimerDue(now=self.now)))


def main() -> None:
    root, revision, ids, workload, shards = digits_experiment("loop")  # examples/_experiment.py
    validator = Node("validator", {"validator"}, ids["validator"], revision, workload, shards, root)
    trainers = [Node(t, {"trainer"}, ids[t], revision, workload, shards, root) for t in ("trainer-1", "trainer-2")]
    loop = Loop([validator, *trainers])
    for node in (validator, *trainers):
        loop.inbox.append((node, ev.Start(now=loop.now)))
    for trainer in trainers:
        loop.link(validator, trainer)
    loop.run_until(lambda: len(validator.heads) >= 3)
    for window, accuracy in validator.heads[:3]:
        print(f"window {window} certified: test accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()

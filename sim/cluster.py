"""Deterministic discrete-event cluster: real engines over the memory transport on a virtual clock.

One `Cluster` owns the event heap (time, sequence) - the sequence number makes ties deterministic - and
executes every node's effects: messages arrive after `latency_s`, records persist after `persist_s`,
compute tasks run for real (synchronously) and finish after a modelled duration. No wall clock is read.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from peerloom.adapters.compute import ComputeExecutor
from peerloom.adapters.host import apply_storage_effect, chunk_message, stored_event
from peerloom.adapters.memory import MemoryTransport
from peerloom.adapters.storage import ArtifactStore
from peerloom.core import effects as fx
from peerloom.core import events as ev
from peerloom.core.engine import Engine, EngineConfig
from peerloom.core.identity import Identity, PeerId
from peerloom.core.objects import Head, QuorumCertificate, Revision

DEFAULT_TASK_S = {"train": 0.5, "screen": 0.01, "reduce": 0.05, "evaluate": 0.05}


@attrs.define
class SimNode:
    name: str
    identity: Identity
    roles: frozenset[str]
    store: ArtifactStore
    executor: ComputeExecutor
    engine: Engine | None = None
    armed: float | None = None
    incarnation: int = 0  # bumped on crash: events addressed to an older incarnation are lost with it
    heads: list[tuple[float, Head, QuorumCertificate]] = attrs.Factory(list)


class Cluster:
    """Build nodes with `add_node`, link them with `connect`, then `start()` and `run_until(...)`."""

    def __init__(self, revision: Revision, *, seed: int = 0, latency_s: float = 0.005,
                 persist_s: float = 0.001, task_s: dict[str, float] | None = None) -> None:
        self.revision = revision
        self.seed = seed
        self.latency_s = latency_s
        self.persist_s = persist_s
        self.task_s = dict(DEFAULT_TASK_S, **(task_s or {}))
        self.now = 0.0
        self.transport = MemoryTransport()
        self.nodes: dict[str, SimNode] = {}
        self.by_peer: dict[PeerId, SimNode] = {}
        self.logs: list[tuple[float, str, str, dict[str, Any]]] = []
        self._heap: list[tuple[float, int, str, int, Any]] = []
        self._seq = 0

    def add_node(self, name: str, identity: Identity, roles: set[str], store_dir: Path,
                 workload: Any, shards: list[list[int]], *, compute: str = "numpy") -> SimNode:
        """A node with its own store; `compute` is its backend for screening and reduction (node config key
        ``compute``: numpy or torch)."""
        store = ArtifactStore(store_dir, chunk_size=self.revision.manifest.chunk_size)
        node = SimNode(name=name, identity=identity, roles=frozenset(roles), store=store,
                       executor=ComputeExecutor(store, self.revision.manifest, workload, shards, compute=compute))
        self.nodes[name] = node
        self.by_peer[identity.peer_id] = node
        return node

    def _boot(self, node: SimNode) -> None:
        rng = random.Random(f"{self.seed}/{node.name}")
        node.engine = Engine(EngineConfig(roles=node.roles, revision=self.revision), node.identity, rng,
                             stored=node.store.refs(), records=node.store.records())
        node.armed = None
        self._push(self.now, node.name, ev.Start(now=self.now))

    def start(self) -> None:
        for node in self.nodes.values():
            self._boot(node)

    def connect(self, a: str, b: str) -> None:
        pa, pb = self.nodes[a].identity.peer_id, self.nodes[b].identity.peer_id
        self.transport.connect(pa, pb)
        self._push(self.now, a, ev.PeerConnected(now=self.now, peer=pb))
        self._push(self.now, b, ev.PeerConnected(now=self.now, peer=pa))

    def crash(self, name: str) -> None:
        """Kill a node (its disk survives); its peers see the connections drop."""
        node = self.nodes[name]
        node.engine = None
        node.incarnation += 1
        me = node.identity.peer_id
        for other in self.transport.neighbours(me):
            self.transport.disconnect(me, other)
            self._push(self.now, self.by_peer[other].name, ev.PeerDisconnected(now=self.now, peer=me))

    def restart(self, name: str, links: list[str]) -> None:
        self._boot(self.nodes[name])
        for other in links:
            self.connect(name, other)

    def _push(self, t: float, name: str, event: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, name, self.nodes[name].incarnation, event))

    def run_until(self, done: Callable[[Cluster], bool], *, max_time: float) -> bool:
        """Process events in time order until `done(self)` or virtual `max_time`; True iff done."""
        while self._heap and not done(self):
            t, seq, name, incarnation, event = heapq.heappop(self._heap)
            if t > max_time:
                heapq.heappush(self._heap, (t, seq, name, incarnation, event))
                return False
            self.now = t
            node = self.nodes[name]
            if node.engine is None or incarnation != node.incarnation:
                continue
            if isinstance(event, ev.TimerDue):
                node.armed = None
            node.engine.handle(event)
            self._drain(node)
        return done(self)

    def _drain(self, node: SimNode) -> None:
        engine = node.engine
        assert engine is not None
        me = node.identity.peer_id
        while (effect := engine.next_effect()) is not None:
            if isinstance(effect, fx.CommitArtifact):
                self._push(self.now, node.name, stored_event(node.store, effect, self.now))
                continue
            if apply_storage_effect(node.store, effect):
                if isinstance(effect, fx.Persist):
                    self._push(self.now + self.persist_s, node.name, ev.Persisted(now=self.now + self.persist_s,
                                                                                  token=effect.token))
                continue
            match effect:
                case fx.Send():
                    self._send(me, effect.peer, effect.data)
                case fx.ServeChunk():
                    self._send(me, effect.peer, chunk_message(node.store, effect))
                case fx.RunTask():
                    t = self.now + self.task_s[effect.kind]
                    try:
                        result = node.executor.run(effect.kind, effect.args)
                        self._push(t, node.name, ev.TaskFinished(now=t, task_id=effect.task_id, result=result))
                    except Exception as exc:  # a failing task is an event, not a crash of the cluster
                        self._push(t, node.name, ev.TaskFailed(now=t, task_id=effect.task_id, reason=repr(exc)))
                case fx.HangUp():
                    self.transport.disconnect(me, effect.peer)
                    other = self.by_peer[effect.peer]
                    self._push(self.now, node.name, ev.PeerDisconnected(now=self.now, peer=effect.peer))
                    self._push(self.now, other.name, ev.PeerDisconnected(now=self.now, peer=me))
                case fx.HeadPromoted():
                    node.heads.append((self.now, effect.head, effect.certificate))
                case fx.Log():
                    self.logs.append((self.now, node.name, effect.event, effect.fields))
        deadline = engine.next_deadline()
        if deadline is not None and deadline != node.armed:
            node.armed = deadline
            t = max(deadline, self.now)
            self._push(t, node.name, ev.TimerDue(now=t))

    def _send(self, src: PeerId, dst: PeerId, data: bytes) -> None:
        if self.transport.send(src, dst, data):
            popped = self.transport.pop()
            assert popped is not None
            t = self.now + self.latency_s
            self._push(t, self.by_peer[dst].name, ev.MessageReceived(now=t, peer=src, data=data))

"""Adversaries as named behaviours (spec/design.md §7, spec/simulator.md §6).

Each behaviour wraps a real engine from the outside: it rewrites the node's compute results (a trainer's
delta, a reducer's aggregate), filters or forges what the node sends (votes, proposals, announcements
signed with the node's own key), or injects messages when a head arrives. Core is never patched, so
what the simulator shows is what honest peers running the real engine do against these attacks.

Trainer attacks that change the update use `peerloom.backends.attacks.craft_update` (one shared
definition with the robustness bench); the references an attack may read are the honest deltas the
simulator saw trained in the same window (the omniscient colluding setting of ALIE / IPM; ``free-rider-noise``
aims its cosine at their mean, and sends a plain random direction when no honest trainer of the window has
trained yet). The training-level attacks (`peerloom.backends.attacks.TRAINING_ATTACKS`: ``lazy``,
``replayer``, ``lazy-1-in-5``) wrap the node's compute workload in the same
`peerloom.backends.behaviours.ByzantineWorkload` real nodes use (`TrainingAttack`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from peerloom.backends import attacks
from peerloom.backends.behaviours import ByzantineWorkload
from peerloom.backends.numpy.tensors import from_safetensors, tensor_digest, to_safetensors
from peerloom.backends.workload import Relabelable, has
from peerloom.core import events as ev
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.leases import leases_of
from peerloom.core.messages import Signed, decode_message, encode_message
from peerloom.core.objects import (
    PROTOCOL_VERSION,
    VOTE_KIND,
    Head,
    HeadProposal,
    UpdateAnnouncement,
    seal,
    sign_vote,
)
from peerloom.core.screening import head_metrics
from peerloom.core.tasks import EvaluateResult, EvaluateTask, ReduceResult, Task, TaskResult, TrainResult, TrainTask
from peerloom.core.validator import ValidatorRole

from .kernel import Behaviour, derive_seed

if TYPE_CHECKING:
    from .kernel import SimNode, Simulation

TRAINER_BEHAVIOURS = (*attacks.ATTACKS, *attacks.TRAINING_ATTACKS, "replay", "lease-squatting", "sybil",
                      "sybil-silent")
SYBIL_BEHAVIOURS = ("sybil", "sybil-silent")  # extra nodes that join during the run
REDUCER_BEHAVIOURS = ("wrong-aggregate", "silent")
VALIDATOR_BEHAVIOURS = ("equivocation", "vote-withholding", "late-votes", "announcement-withholding")
BEHAVIOURS = TRAINER_BEHAVIOURS + REDUCER_BEHAVIOURS + VALIDATOR_BEHAVIOURS
MAX_REFERENCES = 32


def _signed_kind(data: bytes) -> tuple[str, SignedEnvelope | None]:
    """('signed', envelope) for a Signed message, (message kind, None) otherwise. Cheap pre-check first."""
    if b"signed" not in data[:16]:
        return "", None
    message = decode_message(data, max_bytes=1 << 24)
    return ("signed", message.envelope) if isinstance(message, Signed) else ("", None)


class Withholding(Behaviour):
    """A node that never sends signed envelopes of kind `withheld` (and sends everything else)."""

    withheld = ""
    byzantine = True

    def on_send(self, sim: Simulation, node: SimNode, dst: str, data: bytes) -> list[tuple[float, bytes]]:
        _, envelope = _signed_kind(data)
        return [] if envelope is not None and envelope.kind == self.withheld else [(0.0, data)]


class ModelAttack(Behaviour):
    """A trainer that sends `craft_update(attack, honest, references, rng, **params)` instead of its delta."""

    byzantine = True

    def __init__(self, attack: str, **params: Any) -> None:
        if attack not in attacks.ATTACKS:
            raise ValueError(f"unknown attack {attack!r}")
        self.name = attack
        self.params = params
        self.previous: dict[str, np.ndarray] | None = None

    def attach(self, sim: Simulation, node: SimNode) -> None:
        sim.keep_honest_deltas = True
        if self.name in attacks.DATA_ATTACKS:
            if not has(sim.workload, Relabelable):
                raise ValueError("label-flip needs a classification workload (digits), not the synthetic one")
            node.executor.workload = attacks.label_flipped(sim.workload)

    def on_task(self, sim: Simulation, node: SimNode, task: Task, result: TaskResult) -> TaskResult:
        if not isinstance(task, TrainTask) or not isinstance(result, TrainResult):
            return result
        window = task.window or 0
        honest = from_safetensors(node.disk.get(result.delta.digest))
        refs = [from_safetensors(sim.honest_delta_bytes(entry))
                for entry in sim.honest_deltas.get(window, [])[:MAX_REFERENCES]]
        rng = np.random.default_rng(derive_seed(sim.seed, f"adversary/{node.name}/{window}"))
        params = dict(self.params)
        if self.name == "free-rider":
            params.setdefault("previous", self.previous)
        crafted = attacks.craft_update(self.name, honest, refs, rng, **params)
        self.previous = honest
        ref = node.disk.put(to_safetensors(crafted))
        return attrs.evolve(result, delta=ref, delta_digest=tensor_digest(crafted))


class TrainingAttack(Behaviour):
    """A trainer running one of `attacks.TRAINING_ATTACKS` (``lazy``, ``replayer``, ``lazy-1-in-5``,
    ``dp-skip-noise``; table in `peerloom.backends.attacks`): its compute executor's workload is wrapped in a
    `ByzantineWorkload`, so the executor's ``train`` task gets the attacker's delta and stores and digests it
    like an honest one. Each train task leaves an ``adversary`` trace line with the wrapper's call number and
    what it sent (``honest``, ``lazy``, ``replay`` or ``no-noise``). Calls are counted over the node's life
    (restarts included), one per train task."""

    byzantine = True

    def __init__(self, attack: str, **params: Any) -> None:
        if attack not in attacks.TRAINING_ATTACKS:
            raise ValueError(f"unknown training attack {attack!r}")
        self.name = attack
        self.params = attacks.check_training_params(attack, params)
        self.workload: ByzantineWorkload | None = None

    def attach(self, sim: Simulation, node: SimNode) -> None:
        self.workload = ByzantineWorkload(node.executor.workload, self.name, params=self.params,
                                          seed=derive_seed(sim.seed, f"adversary/{node.name}"))
        node.executor.workload = self.workload

    def on_task(self, sim: Simulation, node: SimNode, task: Task, result: TaskResult) -> TaskResult:
        if isinstance(task, TrainTask) and self.workload is not None:
            sim.record(node.name, "adversary", behaviour=self.name, window=task.window or 0,
                       call=self.workload.calls - 1, action=self.workload.last_action)
        return result


class Replay(Behaviour):
    """A trainer that trains once and then re-sends that first delta in every later window."""

    name = "replay"
    byzantine = True

    def __init__(self) -> None:
        self.first: TrainResult | None = None
        self.first_bytes = b""  # its own copy: a crash that wipes its disk must not leave it replaying a ref it lacks

    def on_task(self, sim: Simulation, node: SimNode, task: Task, result: TaskResult) -> TaskResult:
        if not isinstance(result, TrainResult):
            return result
        if self.first is None:
            self.first, self.first_bytes = result, node.disk.get(result.delta.digest)
            return result
        if not node.disk.has(self.first.delta.digest):
            node.disk.put(self.first_bytes)  # what it announces it must serve: the host serves only what it holds
        return attrs.evolve(result, delta=self.first.delta, delta_digest=self.first.delta_digest)


class LeaseSquatting(Behaviour):
    """A trainer that, every window, also announces an update for a shard leased to someone else."""

    name = "lease-squatting"
    byzantine = True

    def on_head(self, sim: Simulation, node: SimNode, head: Head) -> None:
        leases = leases_of(head, sim.manifest)
        mine = set(leases.get(node.peer_id, ()))
        others = sorted(s for shards in leases.values() for s in shards if s not in mine)
        if not others:
            return
        shard = others[(head.window * 7919) % len(others)]
        delta = {n: np.zeros(shape, dtype=dtype) for n, dtype, shape in sim.manifest.schema}
        ref = node.disk.put(to_safetensors(delta))
        ann = UpdateAnnouncement(revision=sim.revision.id, window=head.window + 1, base=head.id, shards=(shard,),
                                 delta=ref, delta_digest=tensor_digest(delta), train_loss=0.0)
        envelope = seal(node.identity, ann)
        sim.register_update(envelope)
        sim.record(node.name, "adversary", behaviour=self.name, window=head.window + 1, shard=shard)
        data = encode_message(Signed(envelope=envelope))
        for other in sim.links_of(node.name):
            if sim.nodes[other].role in ("validator", "reducer"):
                sim.send(node.name, other, data)
        if node.driver is not None:
            node.driver.handle(ev.ArtifactAdded(now=sim.now, ref=ref))


class Sybil(Behaviour):
    """One of many fresh identities that join the roster at once and free-ride (zero updates)."""

    name = "sybil"
    byzantine = True

    def on_task(self, sim: Simulation, node: SimNode, task: Task, result: TaskResult) -> TaskResult:
        if not isinstance(result, TrainResult):
            return result
        delta = {n: np.zeros(shape, dtype=dtype) for n, dtype, shape in sim.manifest.schema}
        return attrs.evolve(result, delta=node.disk.put(to_safetensors(delta)), delta_digest=tensor_digest(delta))


class SilentSybil(Withholding):
    """One of many fresh identities that join the roster and then never deliver an update: every lease it
    is given goes unserved (the Sybil stall, spec/protocol.md §4.1). It still sends its joins and
    heartbeats, so idle expiry alone never removes it."""

    name = "sybil-silent"
    withheld = "update"


class WrongAggregate(Behaviour):
    """A reducer whose proposed aggregate is off by `offset` in every coordinate (still well-formed)."""

    name = "wrong-aggregate"
    byzantine = True

    def __init__(self, offset: float = 1.0) -> None:
        self.offset = offset

    def on_task(self, sim: Simulation, node: SimNode, task: Task, result: TaskResult) -> TaskResult:
        if not isinstance(result, ReduceResult):
            return result
        params = from_safetensors(node.disk.get(result.params.digest))
        bad = {n: (t + np.asarray(self.offset, t.dtype)).astype(t.dtype) for n, t in params.items()}
        return attrs.evolve(result, params=node.disk.put(to_safetensors(bad)), params_digest=tensor_digest(bad))


class SilentReducer(Withholding):
    """A reducer that never sends its proposal (the missing-aggregate case)."""

    name = "silent"
    withheld = "proposal"


class VoteWithholding(Behaviour):
    """A validator that never sends its votes or head proposals (it still receives and computes)."""

    name = "vote-withholding"
    byzantine = True

    def on_send(self, sim: Simulation, node: SimNode, dst: str, data: bytes) -> list[tuple[float, bytes]]:
        _, envelope = _signed_kind(data)
        if envelope is not None and envelope.kind in (VOTE_KIND, "head-proposal"):
            return []
        return [(0.0, data)]


class AnnouncementWithholding(Behaviour):
    """A validator whose head proposals name the cohort's announcements by id only and that never sends an
    announcement (so it answers no `updates-get`): a data-withholding proposer. Announcements only it heard
    cannot be checked by anyone else, so its proposals must time out, not stall the window."""

    name = "announcement-withholding"
    byzantine = True

    def on_send(self, sim: Simulation, node: SimNode, dst: str, data: bytes) -> list[tuple[float, bytes]]:
        _, envelope = _signed_kind(data)
        if envelope is None:
            return [(0.0, data)]
        if envelope.kind == "update":
            return []
        if envelope.kind == HeadProposal.KIND:
            proposal = HeadProposal.from_cbor(envelope.open(HeadProposal.KIND, PROTOCOL_VERSION))
            if proposal.updates or proposal.rejected:
                stripped = seal(node.identity, attrs.evolve(proposal, updates=(), rejected=()))
                return [(0.0, encode_message(Signed(envelope=stripped)))]
        return [(0.0, data)]


class LateVotes(Behaviour):
    """A validator whose votes leave `delay_s` late (slow or deliberately lagging)."""

    name = "late-votes"
    byzantine = True

    def __init__(self, delay_s: float = 3.0) -> None:
        self.delay_s = delay_s

    def on_send(self, sim: Simulation, node: SimNode, dst: str, data: bytes) -> list[tuple[float, bytes]]:
        _, envelope = _signed_kind(data)
        if envelope is not None and envelope.kind == VOTE_KIND:
            return [(self.delay_s, data)]
        return [(0.0, data)]


class Equivocation(Behaviour):
    """A validator that signs two different things for one slot and shows each half of the honest
    validators a different one (the classic fork attempt against a BFT protocol):

    - as the round's proposer it proposes its head A to one half and a *different valid* head B (the same
      cohort less its last update, honestly reduced and evaluated, so B passes recomputation) to the other;
    - every non-nil vote for A goes to the second half as a vote for B (or for nil when there is no B).

    Every equivocating validator shares the forks it built, so two of them collude. With f < n/3 of them
    Tendermint stays safe (no half can reach a quorum alone); with more, two final heads appear.
    `byzantine=False` counts the node as honest: the "broken engine" variant the safety checker must
    catch (spec/simulator.md §7).
    """

    name = "equivocation"

    def __init__(self, *, byzantine: bool = True) -> None:
        self.byzantine = byzantine

    def _second_half(self, sim: Simulation, node: SimNode) -> list[str]:
        honest = sorted(n for n in sim.links_of(node.name)
                        if sim.nodes[n].role == "validator" and not isinstance(sim.nodes[n].behaviour, Equivocation))
        return honest[len(honest) // 2:]

    def on_send(self, sim: Simulation, node: SimNode, dst: str, data: bytes) -> list[tuple[float, bytes]]:
        _, envelope = _signed_kind(data)
        if envelope is None or envelope.kind not in (VOTE_KIND, HeadProposal.KIND) or \
                dst not in self._second_half(sim, node):
            return [(0.0, data)]
        forks: dict[bytes, tuple[Head, tuple[SignedEnvelope, ...]]] = sim.__dict__.setdefault("forks", {})
        if envelope.kind == HeadProposal.KIND:
            proposal = HeadProposal.from_cbor(envelope.open(HeadProposal.KIND, PROTOCOL_VERSION))
            fork = forks.get(proposal.head.id) or self._fork(sim, node, proposal)
            if fork is None:
                return [(0.0, data)]
            forks[proposal.head.id] = fork
            other = seal(node.identity, attrs.evolve(proposal, head=fork[0], updates=fork[1], valid_round=None,
                                                     rejected=proposal.rejected))
            sim.record(node.name, "adversary", behaviour=self.name, window=proposal.window, to=dst, fork=True)
            return [(0.0, encode_message(Signed(envelope=other)))]
        body = envelope.open(VOTE_KIND, PROTOCOL_VERSION)
        if body["head"] is None:
            return [(0.0, data)]
        fork = forks.get(body["head"])
        head_id = fork[0].id if fork is not None else None
        vote = sign_vote(node.identity, body["revision"], body["window"], body["round"], body["step"], head_id)
        return [(0.0, encode_message(Signed(envelope=vote)))]

    def _fork(self, sim: Simulation, node: SimNode,
              proposal: HeadProposal) -> tuple[Head, tuple[SignedEnvelope, ...]] | None:
        """A second valid head for the proposal's window: its cohort less the last update, built with the
        node's own validator code (reduce arguments, head records) so that it passes recomputation."""
        head, m = proposal.head, sim.manifest
        engine = node.engine
        if head.skipped or len(head.cohort) <= m.min_updates or engine is None or engine.head.id != head.parent:
            return None
        role = next((r for r in engine.roles if isinstance(r, ValidatorRole)), None)
        collector = getattr(role, "collector", None)
        if role is None or collector is None:
            return None
        cohort = set(head.cohort)
        members = sorted((u for u in proposal.updates if u.id in cohort), key=lambda u: u.id)[:-1]
        entries = [collector.entry_for(u) for u in members]
        if any(x is None for x in entries):
            return None
        try:
            reduced = node.executor.run(collector.reduce_task(entries))
            assert isinstance(reduced, ReduceResult)
            if reduced.outliers:
                return None
            evaluated = node.executor.run(EvaluateTask(params=reduced.params))
            assert isinstance(evaluated, EvaluateResult)
        except (KeyError, ValueError):
            return None
        assert node.driver is not None
        node.driver.handle(ev.ArtifactAdded(now=sim.now, ref=reduced.params))
        if reduced.outer_state is not None:
            node.driver.handle(ev.ArtifactAdded(now=sim.now, ref=reduced.outer_state))
        kept = [members[i] for i in reduced.kept]
        result = {"params": reduced.params, "params_digest": reduced.params_digest,
                  "kept": [u.id for u in kept], "candidates": tuple(kept), "outer_state": reduced.outer_state,
                  "outer_state_digest": reduced.outer_state_digest,
                  "metrics": head_metrics(evaluated.metrics, sum(entries[i].announcement.train_loss
                                                                 for i in reduced.kept) / len(kept))}
        other = role.screening.make_head(result, proposal.rejected, head.evidence)
        fork = role.voting.head_proposal(proposal.window, proposal.round, None, other, tuple(kept) + proposal.rejected)
        return other, fork.updates


def make_behaviour(name: str, **params: Any) -> Behaviour:
    """The behaviour named `name` (one of BEHAVIOURS) with its parameters. ValueError if unknown."""
    if name in attacks.ATTACKS:
        return ModelAttack(name, **params)
    if name in attacks.TRAINING_ATTACKS:
        return TrainingAttack(name, **params)
    simple: dict[str, Any] = {
        "replay": Replay, "lease-squatting": LeaseSquatting, "sybil": Sybil, "sybil-silent": SilentSybil,
        "wrong-aggregate": WrongAggregate,
        "silent": SilentReducer, "equivocation": Equivocation, "vote-withholding": VoteWithholding,
        "late-votes": LateVotes, "announcement-withholding": AnnouncementWithholding,
    }
    if name not in simple:
        raise ValueError(f"unknown behaviour {name!r}; known: {', '.join(BEHAVIOURS)}")
    return simple[name](**params)


def role_of_behaviour(name: str) -> str:
    if name in TRAINER_BEHAVIOURS:
        return "trainer"
    if name in REDUCER_BEHAVIOURS:
        return "reducer"
    if name in VALIDATOR_BEHAVIOURS:
        return "validator"
    raise ValueError(f"unknown behaviour {name!r}")

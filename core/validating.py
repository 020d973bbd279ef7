"""What a validator's parts (`screening`, `voting`, `proposals`) see of the validator (core/validator.py): a
Protocol of the members they use, so that each part imports this module and never the role that holds it, and
core's import graph has no cycle (tests/test_layers.py)."""

from __future__ import annotations

from typing import Protocol

from .admission import Admission
from .agreement import WindowAgreement
from .auditing import SampledAudits
from .collector import Collector
from .envelope import SignedEnvelope
from .identity import PeerId
from .objects import Head, HeadProposal, Vote


class ScreeningView(Protocol):
    """Of `screening.Screening`: its verdict on each head it judged (head id -> valid)."""

    verdicts: dict[bytes, bool]


class VotingView(Protocol):
    """Of `voting.Voting`: the equivocation evidence a head records and whether a quorum backs a head."""

    def pending_evidence(self, parent: Head) -> tuple[tuple[SignedEnvelope, SignedEnvelope], ...]: ...
    def quorum_backs(self, head_id: bytes) -> bool: ...


class ProposalsView(Protocol):
    """Of `proposals.ProposalTracker`: who proposed a head, and taking our own proposal."""

    def proposer_of_head(self, head: Head) -> PeerId: ...
    def on_proposal(self, peer: PeerId, envelope: SignedEnvelope, proposal: HeadProposal) -> None: ...


class ValidatorParts(Protocol):
    """Of `validator.ValidatorRole`: the window being collected and the parts that judge it. Each part gets
    the engine apart, typed against a Protocol of the members it uses."""

    @property
    def window(self) -> int: ...
    @property
    def collector(self) -> Collector | None: ...
    @property
    def agreement(self) -> WindowAgreement | None: ...
    @property
    def admission(self) -> Admission: ...
    @property
    def audits(self) -> SampledAudits: ...
    @property
    def screening(self) -> ScreeningView: ...
    @property
    def voting(self) -> VotingView: ...
    @property
    def proposals(self) -> ProposalsView: ...

    def hold(self, peer: PeerId, envelope: SignedEnvelope, body: Vote | HeadProposal) -> bool: ...
    def proposer(self, round_: int) -> PeerId: ...

"""Private data and the privacy ledger (spec/protocol.md §10).

Two things a manifest may turn on, each derived in every head from its parent and the window's inputs, so
that every validator recomputes the same head and `peerloom verify` the same chain:

- ``private_data``: trainers whose join declared data only they hold are listed in the head's `private`
  (`next_private`). Their updates get no recomputation audit (nobody else can load their samples).
- ``privacy`` (`PrivacyParams`): every update carries the DP-SGD steps it took (`privacy_steps`), and the
  head's `privacy` ledger keeps each trainer's total steps and the epsilon that the RDP accountant gives for
  them at the manifest's noise multiplier, sampling rate and delta (`next_ledger`). An update that would take
  its author past the manifest's `epsilon_budget` is refused as ``privacy-budget`` (`budget_fault`).

Core stays pure: the accountant is a function the host injects (`EngineConfig.accountant`; the node passes
`peerloom.privacy.epsilon`, Opacus's RDP accountant: Mironov 2017, arXiv 1702.07476; Mironov, Talwar and
Zhang 2019, arXiv 1908.10530). Epsilon is rounded to 1e-9 before it enters a head, so validators whose
floating point differs in the last bit still agree.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

from .identity import PeerId
from .objects import Head, Manifest, PrivacyParams, PrivacyRecord, RosterEntry

Accountant = Callable[[float, float, int, float], float]
"""``(noise_multiplier, sample_rate, steps, delta) -> epsilon`` for `steps` DP-SGD steps of the subsampled
Gaussian mechanism; deterministic, 0.0 for 0 steps."""

EPSILON_DECIMALS = 9


def ledger_epsilon(accountant: Accountant, params: PrivacyParams, steps: int) -> float:
    """The epsilon a head records for `steps` total DP-SGD steps under `params` (rounded to 1e-9)."""
    if steps <= 0:
        return 0.0
    return round(float(accountant(params.noise_multiplier, params.sample_rate, steps, params.delta)), EPSILON_DECIMALS)


def spent_steps(head: Head, peer: PeerId) -> int:
    """`peer`'s DP-SGD steps in `head`'s ledger (0 if absent)."""
    for p, steps, _ in head.privacy:
        if p == peer:
            return steps
    return 0


def next_ledger(parent: Head, spends: Mapping[PeerId, int], params: PrivacyParams,
                accountant: Accountant) -> tuple[PrivacyRecord, ...]:
    """The ledger of the head after `parent` whose cohort's authors spent `spends` (peer -> steps of its
    cohort update): each author's steps grow by its spend and its epsilon is recomputed; everyone else's
    entry is carried over unchanged. Sorted by peer."""
    records = {p: (steps, eps) for p, steps, eps in parent.privacy}
    for peer, steps in spends.items():
        if steps:
            total = records.get(peer, (0, 0.0))[0] + steps
            records[peer] = (total, ledger_epsilon(accountant, params, total))
    return tuple((p, s, e) for p, (s, e) in sorted(records.items()))


def budget_fault(manifest: Manifest, parent: Head, peer: PeerId, steps: int | None,
                 accountant: Accountant | None) -> str:
    """Why an update of `peer` spending `steps` on top of `parent`'s ledger is refused, or "":
    ``bad-privacy-steps`` (no spend, or not the manifest's `inner_steps`) or ``privacy-budget`` (its
    epsilon would pass `epsilon_budget`). "" when the manifest has no `privacy`."""
    params = manifest.privacy
    if params is None:
        return "" if steps is None else "bad-privacy-steps"
    if steps != manifest.inner_steps:
        return "bad-privacy-steps"
    assert accountant is not None, "a privacy manifest needs an accountant (EngineConfig.accountant)"
    if ledger_epsilon(accountant, params, spent_steps(parent, peer) + steps) > params.epsilon_budget:
        return "privacy-budget"
    return ""


def next_private(parent: Head, roster: Sequence[RosterEntry], private_joins: Collection[PeerId]) -> tuple[PeerId, ...]:
    """The `private` list of the head after `parent` with `roster`: a trainer already in `parent`'s roster
    keeps its flag; a trainer new to the roster has the flag of the join that added it (`private_joins`)."""
    was_private, before = frozenset(parent.private), parent.roster_peers
    return tuple(sorted(p for p, _ in roster if (p in was_private if p in before else p in private_joins)))

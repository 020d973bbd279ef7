"""DP-SGD fleets, live (spec/protocol.md §10): real `peerloom node` processes over TCP+Noise on
127.0.0.1, started from `Experiment` directories as `peerloom up` starts them, train mnist1d with DP-SGD under
one `privacy` manifest each (sigma 1, C 1, q 0.1, delta 1e-5, H = 4 DP-SGD steps a window, a budget none
reaches here). Two fleets run side by side, each 1 validator (inline audits: it replays every update it
can) and 1 reducer:

- *private*: 3 trainers, each holding its own part of a second MNIST-1D draw that no other peer can load
  (`Experiment.trainer_data`, node config ``data``): they join as private, train DP-SGD on their own
  samples with secret seeds, and nobody audits them. Asserted: every window of the chain is certified (none
  skipped), every trainer is in the heads' ``private`` and the ledger, each ledger epsilon equals what
  Opacus's ``RDPAccountant`` gives for its steps to 1e-6, and ``peerloom verify`` accepts the chain,
  recomputing every epsilon.
- *audited*: 2 trainers on the shared data. ``trainer-1`` trains DP-SGD honestly: the validator's replay
  reproduces its noise and its updates pass. ``trainer-2`` runs ``dp-skip-noise`` (the same clipping without
  the noise): the replay with the noise disagrees (cosine far below ``audit_min_cosine``), so its updates
  are struck and it is quarantined, and no one else is.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from peerloom.backends.mnist1d import make_mnist1d
from peerloom.core.objects import Head, PrivacyParams
from peerloom.experiment import Experiment, Fleet
from peerloom.verify import run_verify, verified_chain
from tests.e2e.test_cheaters_live import _names, _quarantined, _summary, run_fleets

pytestmark = pytest.mark.slow
pytest.importorskip("opacus")

H = 4
PARAMS = PrivacyParams(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, sample_rate=0.1, epsilon_budget=50.0)
PRIVATE = ("trainer-1", "trainer-2", "trainer-3")
HONEST, SKIPPER = "trainer-1", "trainer-2"
WINDOWS = 6  # certified heads each fleet runs for
TIMEOUT_S = 240.0  # 11 processes with torch and opacus on 2 loaded cores


def _experiment(root: Path, name: str) -> Experiment:
    nodes = ("validator-1", "reducer-1", *(f"trainer-{i}" for i in (1, 2, 3)))
    options = {node: {"threads": 1} for node in nodes}
    data = {}
    if name == "private":
        x, y = make_mnist1d(3000, seed=4321)  # another draw than the manifest's dataset: no other peer has it
        for i, trainer in enumerate(PRIVATE):
            path = root / f"{trainer}.npz"
            np.savez(path, x=x[i::3], y=y[i::3])
            data[trainer] = str(path)
    else:
        options[SKIPPER]["behaviour"] = "dp-skip-noise"
    return Experiment(workload="mnist1d-mlp", name=name, trainers=3 if name == "private" else 2, validators=1,
                      reducers=1, shards=12, window_s=10.0, inner_steps=H, audit=True, aggregation="mean",
                      outer_optimizer="fedavg", outer_lr=1.0, base_port=0, manifest_options={"privacy": PARAMS},
                      trainer_data=data, node_options={k: v for k, v in options.items()
                                                       if k != "trainer-3" or name == "private"})


def _done(label: str, fleet: Fleet, heads: list[Head]) -> bool:
    if label == "private":
        return len(heads) >= WINDOWS and len(heads[-1].private) == len(PRIVATE)
    return len(heads) >= WINDOWS and SKIPPER in _quarantined(fleet, heads)


def _verified(fleet: Fleet) -> list[Head]:
    """The chain of `fleet`'s validator, after `peerloom verify` accepted it (privacy ledger included)."""
    store = fleet.node_dir("validator-1") / "store"
    lines: list[str] = []
    assert run_verify(store, fleet.layout["authority"], echo=lines.append) == 0, "\n".join(lines)
    assert any("privacy ledger" in line for line in lines), "\n".join(lines)
    return [h for h, _ in verified_chain(store, fleet.layout["authority"])[1]]


def test_dp_fleets_private_trainers_certify_every_window_and_a_noise_skipper_is_caught(tmp_path):
    from opacus.accountants import RDPAccountant

    fleets = {label: Fleet.open(_experiment(tmp_path, label).write(tmp_path / label))
              for label in ("private", "audited")}
    run_fleets(fleets, _done, TIMEOUT_S, preload="torch,opacus")

    private = fleets["private"]
    heads = _verified(private)
    report = _summary(private, heads)
    print(report)
    names = _names(private)
    assert not any(h.skipped for h in heads), report  # every window certified
    last = heads[-1]
    assert {names[p.to_text()] for p in last.private} == set(PRIVATE), report
    ledger = {names[p.to_text()]: (steps, eps) for p, steps, eps in last.privacy}
    assert set(ledger) == set(PRIVATE), report  # every private trainer's updates made it into cohorts
    for name, (steps, eps) in ledger.items():
        accountant = RDPAccountant()
        accountant.history = [(PARAMS.noise_multiplier, PARAMS.sample_rate, steps)]
        assert steps % H == 0 and abs(eps - accountant.get_epsilon(delta=PARAMS.delta)) <= 1e-6, (name, steps, eps)
        assert 0 < eps <= PARAMS.epsilon_budget
    assert not any(h.strikes or h.quarantine for h in heads), report

    audited = fleets["audited"]
    heads = _verified(audited)
    report = _summary(audited, heads)
    print(report)
    names = _names(audited)
    assert _quarantined(audited, heads) == {SKIPPER}, report
    # the honest DP trainer's replays (noise included) reproduced: audited every window, never struck
    assert {names[p.to_text()] for h in heads for p, _, _ in h.strikes} == {SKIPPER}, report
    assert HONEST in {names[p.to_text()] for p, _, _ in heads[-1].privacy}, report

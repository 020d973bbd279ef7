"""Issue 32's fleet, live (spec/protocol.md §10): real `peerloom node` processes over TCP+Noise on 127.0.0.1,
started from an `Experiment` directory as `peerloom up` starts them, train mnist1d with DP-SGD.

The fleet: 1 validator (inline audits: it replays every update it can), 1 reducer, and 4 trainers under one
`privacy` manifest (sigma 1, C 1, q 0.1, delta 1e-5, H = 4 DP-SGD steps a window, a budget none reaches
here):

- ``trainer-1`` and ``trainer-2`` each hold their own part of a second MNIST-1D draw that no other peer can
  load (`Experiment.trainer_data`, node config ``data``): they join as private, train DP-SGD on their own
  samples with secret seeds, and nobody audits them;
- ``trainer-3`` trains DP-SGD on the shared data: the validator replays its noise, and its updates pass;
- ``trainer-4`` runs ``dp-skip-noise``: the same clipping without the noise. The replay with the noise
  disagrees (cosine far below ``audit_min_cosine``), so its updates are struck and it is quarantined.

Asserted: every window of the chain is certified (none skipped); both private trainers are in the heads'
``private`` and their updates in cohorts; the ledger's epsilon of every trainer equals what Opacus's
``RDPAccountant`` gives for its steps, to 1e-6; ``peerloom verify`` accepts the chain, recomputing every
epsilon; ``trainer-4`` is quarantined and no one else is.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from peerloom.backends.mnist1d import make_mnist1d
from peerloom.core.objects import Head, PrivacyParams
from peerloom.experiment import Experiment, Fleet
from peerloom.verify import run_verify, verified_chain
from tests.e2e.test_cheaters_live import _heads, _names, _quarantined, _stop, _summary, _terminate
from tests.node_zygote import forked_popen

pytestmark = pytest.mark.slow
pytest.importorskip("opacus")

PRIVATE = ("trainer-1", "trainer-2")
PUBLIC, SKIPPER = "trainer-3", "trainer-4"
H = 4
PARAMS = PrivacyParams(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, sample_rate=0.1, epsilon_budget=50.0)
WINDOWS = 8  # certified heads the fleet runs for
TIMEOUT_S = 240.0  # 7 processes with torch and opacus on 2 loaded cores


def _experiment(root: Path) -> Experiment:
    x, y = make_mnist1d(2000, seed=4321)  # another draw than the manifest's dataset: no other peer has it
    data = {}
    for i, name in enumerate(PRIVATE):
        path = root / f"{name}.npz"
        np.savez(path, x=x[i::2], y=y[i::2])
        data[name] = str(path)
    nodes = ("validator-1", "reducer-1", *PRIVATE, PUBLIC, SKIPPER)
    options = {name: {"threads": 1} for name in nodes}
    options[SKIPPER]["behaviour"] = "dp-skip-noise"
    return Experiment(workload="mnist1d-mlp", name="dp", trainers=4, validators=1, reducers=1, shards=12,
                      window_s=10.0, inner_steps=H, audit=True, aggregation="mean", outer_optimizer="fedavg",
                      outer_lr=1.0, base_port=0, manifest_options={"privacy": PARAMS}, trainer_data=data,
                      node_options=options)


def _run(fleet: Fleet) -> list[Head]:
    deadline = time.monotonic() + TIMEOUT_S
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PEERLOOM_ZYGOTE_PRELOAD": "torch,opacus"}
    try:
        with forked_popen(**env):
            fleet.start()
        while True:
            heads = _heads(fleet)
            if len(heads) >= WINDOWS and SKIPPER in _quarantined(fleet, heads):
                return heads
            exited = [name for name, p in fleet.processes.items() if p.poll() is not None]
            assert not exited, f"{exited[0]} exited: {fleet.last_log_line(exited[0])}"
            assert time.monotonic() < deadline, f"{len(heads)} heads after {TIMEOUT_S} s\n{_summary(fleet, heads)}"
            time.sleep(0.2)
    finally:
        _terminate(fleet)
        _stop(fleet)


def test_a_dp_fleet_with_private_trainers_certifies_every_window_and_catches_a_noise_skipper(tmp_path):
    from opacus.accountants import RDPAccountant

    fleet = Fleet.open(_experiment(tmp_path).write(tmp_path / "dp"))
    _run(fleet)
    store = fleet.node_dir("validator-1") / "store"
    lines: list[str] = []
    assert run_verify(store, fleet.layout["authority"], echo=lines.append) == 0, "\n".join(lines)
    assert any("privacy ledger" in line for line in lines), "\n".join(lines)
    _, entries = verified_chain(store, fleet.layout["authority"])
    heads = [h for h, _ in entries]
    report = _summary(fleet, heads)
    print(report)
    names = _names(fleet)

    assert not any(h.skipped for h in heads), report  # every window certified
    last = heads[-1]
    assert {names[p.to_text()] for p in last.private} == set(PRIVATE), report
    ledger = {names[p.to_text()]: (steps, eps) for p, steps, eps in last.privacy}
    assert set(PRIVATE) | {PUBLIC} <= set(ledger), report  # their updates made it into cohorts
    for name, (steps, eps) in ledger.items():
        accountant = RDPAccountant()
        accountant.history = [(PARAMS.noise_multiplier, PARAMS.sample_rate, steps)]
        assert steps % H == 0 and abs(eps - accountant.get_epsilon(delta=PARAMS.delta)) <= 1e-6, (name, steps, eps)
        assert eps <= PARAMS.epsilon_budget
    assert _quarantined(fleet, heads) == {SKIPPER}, report
    # the honest public DP trainer's replays (noise included) reproduced: audited every window, never struck
    assert {names[p.to_text()] for h in heads for p, _, _ in h.strikes} == {SKIPPER}, report

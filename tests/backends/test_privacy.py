"""DP-SGD in the torch workload and the privacy accountant (spec/protocol.md §10): `peerloom.privacy` and
`TorchWorkload(privacy=...)`."""

from __future__ import annotations

import math
import subprocess
import sys

import attrs
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")

from opacus.accountants import RDPAccountant  # noqa: E402
from opacus.accountants.utils import get_noise_multiplier  # noqa: E402
from torch import nn  # noqa: E402

from peerloom.backends.attacks import TRAINING_ATTACKS  # noqa: E402
from peerloom.backends.behaviours import ByzantineWorkload, wrap_workload  # noqa: E402
from peerloom.backends.mnist1d import make_mnist1d_workload  # noqa: E402
from peerloom.backends.torch.workload import TorchWorkload, dp_noise_seed  # noqa: E402
from peerloom.privacy import (  # noqa: E402
    DP,
    INSTALL_HINT,
    PrivacyUnavailable,
    epsilon,
    noise_multiplier_for,
    require_opacus,
)
from peerloom.workloads import torch_workload  # noqa: E402

SIGMA = DP(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5)


def flat(delta: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([delta[k].ravel() for k in sorted(delta)]).astype(np.float64)


def cosine(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    x, y = flat(a), flat(b)
    return float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)


def data(n: int = 24, dim: int = 3, classes: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, dim, generator=g), torch.randint(0, classes, (n,), generator=g)


def linear(lr: float = 0.5, **options) -> TorchWorkload:
    train = data()
    return TorchWorkload(lambda: nn.Linear(3, 2), lambda p: torch.optim.SGD(p, lr=lr), nn.functional.cross_entropy,
                         train, data(8, seed=1), batch_size=8, **options)


# --- DP and the accountant --------------------------------------------------------------------------------


def test_dp_validates_its_fields():
    dp = DP(noise_multiplier=1, max_grad_norm=2, delta=1e-5, sample_rate=0.25)
    assert (dp.noise_multiplier, dp.max_grad_norm, dp.delta, dp.sample_rate) == (1.0, 2.0, 1e-5, 0.25)
    assert DP(noise_multiplier=0.0, max_grad_norm=1.0, delta=0.5).sample_rate is None
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        dp.noise_multiplier = 2.0  # type: ignore[misc]  # frozen: the assignment must raise
    with pytest.raises(TypeError):
        DP(1.0, 1.0, 1e-5)  # type: ignore[misc]  # keyword-only: must raise
    bad = [({"noise_multiplier": -0.1}, "noise_multiplier"), ({"noise_multiplier": math.inf}, "noise_multiplier"),
           ({"noise_multiplier": True}, "noise_multiplier"), ({"max_grad_norm": 0.0}, "max_grad_norm"),
           ({"max_grad_norm": math.nan}, "max_grad_norm"), ({"delta": 0.0}, "delta"), ({"delta": 1.0}, "delta"),
           ({"sample_rate": 0.0}, "sample_rate"), ({"sample_rate": 1.5}, "sample_rate"),
           ({"max_grad_norm": "1"}, "max_grad_norm")]
    for change, name in bad:
        with pytest.raises(ValueError, match=name):
            DP(**{"noise_multiplier": 1.0, "max_grad_norm": 1.0, "delta": 1e-5, **change})


@pytest.mark.parametrize(("sigma", "q", "steps", "delta"), [
    (1.0, 0.01, 100, 1e-5), (0.7, 0.25, 37, 1e-6), (2.5, 1.0, 5, 1e-3), (1.1, 0.004, 10_000, 1e-5)])
def test_epsilon_is_opacus_rdp_accountant(sigma, q, steps, delta):
    accountant = RDPAccountant()
    accountant.history = [(sigma, q, steps)]
    want = accountant.get_epsilon(delta=delta)
    got = epsilon(noise_multiplier=sigma, sample_rate=q, steps=steps, delta=delta)
    assert isinstance(got, float) and got == pytest.approx(want, abs=1e-12, rel=0)
    assert epsilon(noise_multiplier=sigma, sample_rate=q, steps=steps, delta=delta) == got  # deterministic


def test_epsilon_edges_and_errors():
    assert epsilon(noise_multiplier=1.0, sample_rate=0.1, steps=0, delta=1e-5) == 0.0
    assert epsilon(noise_multiplier=0.0, sample_rate=0.1, steps=1, delta=1e-5) == math.inf
    more = epsilon(noise_multiplier=1.0, sample_rate=0.1, steps=200, delta=1e-5)
    assert epsilon(noise_multiplier=1.0, sample_rate=0.1, steps=100, delta=1e-5) < more
    for bad in ({"steps": -1}, {"steps": 1.5}, {"sample_rate": 0.0}, {"delta": 1.0}, {"noise_multiplier": -1.0}):
        with pytest.raises(ValueError):
            epsilon(**{"noise_multiplier": 1.0, "sample_rate": 0.1, "steps": 10, "delta": 1e-5, **bad})


def test_noise_multiplier_for_is_opacus_and_meets_the_budget():
    sigma = noise_multiplier_for(epsilon=2.0, delta=1e-5, sample_rate=0.02, steps=500)
    assert sigma == get_noise_multiplier(target_epsilon=2.0, target_delta=1e-5, sample_rate=0.02, steps=500,
                                         accountant="rdp")
    assert epsilon(noise_multiplier=sigma, sample_rate=0.02, steps=500, delta=1e-5) <= 2.0
    with pytest.raises(ValueError):
        noise_multiplier_for(epsilon=0.0, delta=1e-5, sample_rate=0.02, steps=500)


def test_without_opacus_one_line_names_the_extra(monkeypatch):
    workload = linear()
    monkeypatch.setitem(sys.modules, "opacus", None)
    with pytest.raises(PrivacyUnavailable) as caught:
        require_opacus()
    assert str(caught.value) == INSTALL_HINT == "differential privacy needs opacus: pip install 'peerloom[dp]'"
    assert isinstance(caught.value, ImportError)
    with pytest.raises(PrivacyUnavailable, match="peerloom\\[dp\\]"):
        epsilon(noise_multiplier=1.0, sample_rate=0.1, steps=1, delta=1e-5)
    with pytest.raises(PrivacyUnavailable):
        workload.with_privacy(SIGMA)
    assert workload.privacy is None
    DP(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5)  # the parameters need no opacus


def test_importing_peerloom_privacy_loads_neither_opacus_nor_torch():
    code = "import sys, peerloom.privacy; print([m for m in ('opacus', 'torch') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


# --- DP-SGD in TorchWorkload ------------------------------------------------------------------------------


def per_sample_clipped_sum(workload: TorchWorkload, params, indices, clip: float) -> dict[str, np.ndarray]:
    """sum_i clip_C(grad of sample i's loss), computed one sample at a time."""
    model = nn.Linear(3, 2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(params[name]))
    total = {name: np.zeros_like(params[name], dtype=np.float64) for name in params}
    for i in indices:
        model.zero_grad()
        nn.functional.cross_entropy(model(workload.x_train[i : i + 1]), workload.y_train[i : i + 1]).backward()
        grads = {name: p.grad.detach().numpy().astype(np.float64) for name, p in model.named_parameters()}
        norm = math.sqrt(sum(float((g**2).sum()) for g in grads.values()))
        factor = min(1.0, clip / (norm + 1e-6))
        for name, g in grads.items():
            total[name] += factor * g
    return total


def test_one_step_clips_each_sample_and_adds_the_seeded_noise():
    indices, seed, lr, clip, sigma = list(range(10)), 5, 0.5, 0.3, 0.8
    workload = linear(lr=lr, inner_steps=1)
    params = workload.initial_params(0)
    workload.with_privacy(DP(noise_multiplier=0.0, max_grad_norm=clip, delta=1e-5, sample_rate=1.0))
    clean, metrics = workload.train(params, indices, seed)
    assert metrics["privacy_steps"] == 1 and metrics["samples"] == 10
    summed = per_sample_clipped_sum(workload, params, indices, clip)
    for name in params:  # q = 1: every sample, divided by the expected batch q * n = 10
        np.testing.assert_allclose(clean[name], lr * summed[name] / 10, atol=1e-6)
    workload.with_privacy(DP(noise_multiplier=sigma, max_grad_norm=clip, delta=1e-5, sample_rate=1.0))
    noisy, _ = workload.train(params, indices, seed)
    generator = torch.Generator().manual_seed(dp_noise_seed(seed))
    for name, p in workload.model.named_parameters():  # the optimizer's parameter order
        noise = torch.normal(mean=0, std=sigma * clip, size=p.shape, generator=generator).numpy()
        np.testing.assert_allclose((noisy[name] - clean[name]) * 10 / lr, noise, atol=1e-4)


def test_dp_training_replays_bit_for_bit_on_another_instance():
    a, b = make_mnist1d_workload(0, inner_steps=6), make_mnist1d_workload(0, inner_steps=6)
    a.with_privacy(SIGMA)
    b.with_privacy(SIGMA)
    params, lease = a.initial_params(1), list(range(0, 300, 2))
    first, metrics = a.train(params, lease, 11)
    again, _ = a.train(params, lease, 11)
    replay, replay_metrics = b.train(params, lease, 11)
    assert same(first, again) and same(first, replay) and metrics == replay_metrics
    assert metrics["privacy_steps"] == 6 == a.privacy_steps(len(lease))
    other, _ = a.train(params, lease, 12)
    assert not same(first, other)


def test_steps_without_inner_steps_are_epochs_times_ceil_one_over_q():
    workload = linear(local_epochs=2)
    workload.with_privacy(DP(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, sample_rate=0.3))
    params = workload.initial_params(0)
    assert workload.privacy_sample_rate(20) == 0.3
    assert workload.privacy_steps(20) == 2 * 4 and workload.privacy_steps(20, inner_steps=3) == 3
    assert workload.train(params, list(range(20)), 0)[1]["privacy_steps"] == 8
    assert workload.train(params, list(range(20)), 0, inner_steps=3)[1]["privacy_steps"] == 3
    workload.with_privacy(SIGMA)  # q = batch_size / n = 8 / 20
    assert workload.privacy_sample_rate(20) == 0.4 and workload.privacy_steps(20) == 2 * 3
    assert workload.privacy_sample_rate(5) == 1.0 and workload.privacy_steps(5) == 2
    workload.with_privacy(None)
    with pytest.raises(ValueError, match="without privacy"):
        workload.privacy_steps(20)


def test_empty_poisson_batches_still_step_with_the_noise_alone():
    workload = linear(inner_steps=3)
    params = workload.initial_params(0)
    workload.with_privacy(DP(noise_multiplier=0.0, max_grad_norm=1.0, delta=1e-5, sample_rate=1e-9))
    quiet, metrics = workload.train(params, list(range(10)), 0)
    assert all(not v.any() for v in quiet.values()) and math.isnan(metrics["train_loss"])
    assert metrics["privacy_steps"] == 3
    workload.with_privacy(DP(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, sample_rate=1e-9))
    noise, _ = workload.train(params, list(range(10)), 0)
    assert all(v.all() for v in noise.values())


def test_plain_training_is_unchanged_and_loss_and_evaluate_use_plain_params():
    plain, private = make_mnist1d_workload(0, inner_steps=4), make_mnist1d_workload(0, inner_steps=4)
    params, lease = plain.initial_params(2), list(range(64))
    before, metrics = plain.train(params, lease, 3)
    private.with_privacy(SIGMA)
    dp_delta, _ = private.train(params, lease, 3)
    assert not same(before, dp_delta)
    assert private.loss(params, lease) == plain.loss(params, lease)
    assert private.evaluate(params) == plain.evaluate(params)
    assert not any(hasattr(p, "grad_sample") for p in private.model.parameters())  # Opacus's hooks are gone
    private.with_privacy(None)
    after, again = private.train(params, lease, 3)
    assert same(before, after) and again == metrics and "privacy_steps" not in again


def test_keep_optimizer_state_works_with_dp():
    workload = make_mnist1d_workload(0, inner_steps=2, keep_optimizer_state=True)
    workload.with_privacy(SIGMA)
    params, lease = workload.initial_params(0), list(range(50))
    first, _ = workload.train(params, lease, 1, state_key="t")
    second, _ = workload.train(params, lease, 1, state_key="t")
    assert not same(first, second)  # Adam's kept moments changed the second call
    workload.reset_optimizer_state("t")
    assert same(first, workload.train(params, lease, 1, state_key="t")[0])


def test_torch_workload_takes_privacy_and_refuses_what_dp_sgd_cannot_train():
    x, y = data()
    kwargs = {"loss": nn.functional.cross_entropy, "optimizer": lambda p: torch.optim.SGD(p, lr=0.1),
              "train_data": (x, y), "eval_data": (x, y), "batch_size": 4}
    workload = torch_workload(model=lambda: nn.Linear(3, 2), privacy=SIGMA, **kwargs)
    assert workload.privacy == SIGMA
    with pytest.raises(ValueError) as caught:
        torch_workload(model=lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)),
                       privacy=SIGMA, **kwargs)
    message = str(caught.value)
    assert message.startswith("model cannot be trained with DP-SGD: BatchNorm cannot support") and "\n" not in message
    refusals = [({"bf16": True}, "bf16"), ({"clip_grad_norm": 1.0}, "clip_grad_norm"),
                ({"train_loader": lambda subset, g: [subset[0]]}, "train_loader")]
    for extra, name in refusals:
        with pytest.raises(ValueError, match=name):
            torch_workload(model=lambda: nn.Linear(3, 2), privacy=SIGMA, **kwargs, **extra)
    with pytest.raises(TypeError):
        workload.with_privacy({"noise_multiplier": 1.0})  # type: ignore[arg-type]  # the wrong type on purpose
    assert workload.privacy == SIGMA  # a refused change keeps what was set


def test_segment_audits_refuse_dp():
    workload = linear(inner_steps=4, privacy=SIGMA)
    params = workload.initial_params(0)
    with pytest.raises(ValueError, match="segment audits do not support DP-SGD"):
        workload.train(params, list(range(10)), 0, checkpoints=2, on_checkpoint=lambda j, s: None)
    with pytest.raises(ValueError, match="segment audits do not support DP-SGD"):
        workload.resume(params, list(range(10)), 0, inner_steps=4, start=0, stop=2)


# --- the dp-skip-noise behaviour --------------------------------------------------------------------------


def test_dp_skip_noise_fails_a_recomputation_audit():
    assert "dp-skip-noise" in TRAINING_ATTACKS
    cheat = make_mnist1d_workload(0, inner_steps=5)
    cheat.with_privacy(SIGMA)
    attacker = wrap_workload(cheat, "dp-skip-noise")
    assert isinstance(attacker, ByzantineWorkload)
    params, lease, seed = cheat.initial_params(0), list(range(0, 400, 4)), 21
    sent, metrics = attacker.train(params, lease, seed, inner_steps=5)
    assert attacker.last_action == "no-noise" and cheat.privacy == SIGMA
    validator = make_mnist1d_workload(0, inner_steps=5)
    validator.with_privacy(SIGMA)
    replay, replay_metrics = validator.train(params, lease, seed, inner_steps=5)
    assert set(metrics) == set(replay_metrics) and metrics["privacy_steps"] == replay_metrics["privacy_steps"] == 5
    assert cosine(sent, replay) < 0.99  # the audit's min cosine
    honest, _ = make_mnist1d_workload(0, inner_steps=5).train(params, lease, seed)  # no privacy anywhere
    plain = wrap_workload(make_mnist1d_workload(0, inner_steps=5), "dp-skip-noise")
    assert same(plain.train(params, lease, seed)[0], honest) and plain.last_action == "honest"

"""Byzantine trainer behaviours (backends/attacks.py): each attack's definition, determinism, validation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from peerloom.backends.attacks import (
    ATTACKS,
    DATA_ATTACKS,
    alie_z,
    craft_update,
    flip_labels,
    label_flipped,
    local_references,
)


def cohort(seed: int = 0, n: int = 8) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    base = {"w": rng.standard_normal((4, 3)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}
    return [{k: (v + 0.1 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in base.items()}
            for _ in range(n)]


def flat(d: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([d[k].ravel().astype(np.float64) for k in sorted(d)])


@pytest.mark.parametrize("attack", ATTACKS)
def test_every_attack_returns_new_float32_tensors_of_the_schema(attack: str) -> None:
    honest, *refs = cohort()
    before = {k: v.copy() for k, v in honest.items()}
    out = craft_update(attack, honest, refs, np.random.default_rng(1))
    assert set(out) == set(honest)
    for k in honest:
        assert out[k].shape == honest[k].shape and out[k].dtype == np.float32
        assert not np.shares_memory(out[k], honest[k])
        assert np.array_equal(honest[k], before[k])  # inputs never written
    again = craft_update(attack, honest, refs, np.random.default_rng(1))
    assert all(np.array_equal(out[k], again[k]) for k in out)  # replays by seed


def test_sign_flip_and_scaling() -> None:
    honest, *refs = cohort()
    rng = np.random.default_rng(0)
    h = flat(honest)
    assert np.allclose(flat(craft_update("sign-flip", honest, refs, rng)), -h)
    assert np.allclose(flat(craft_update("scaling", honest, refs, rng)), 10 * h, rtol=1e-6)
    assert np.allclose(flat(craft_update("sign-flip-scale", honest, refs, rng)), -10 * h, rtol=1e-6)
    assert np.allclose(flat(craft_update("scaling", honest, refs, rng, scale=3.0)), 3 * h, rtol=1e-6)


def test_gaussian_noise_has_the_asked_sigma_and_ignores_the_honest_direction() -> None:
    honest = {"w": np.full(20000, 0.5, np.float32)}
    out = flat(craft_update("gaussian-noise", honest, [], np.random.default_rng(3), sigma=2.0))
    assert abs(out.std() - 2.0) < 0.05 and abs(out.mean()) < 0.05
    rel = flat(craft_update("gaussian-noise", honest, [], np.random.default_rng(3), sigma=2.0, relative=True))
    assert abs(rel.std() - 1.0) < 0.03  # sigma x RMS(honest) = 2 x 0.5
    other = flat(craft_update("gaussian-noise", honest, [], np.random.default_rng(4), sigma=2.0))
    assert not np.array_equal(out, other)


def test_alie_is_mean_minus_z_std_and_z_max_matches_the_paper() -> None:
    honest, *refs = cohort()
    stack = np.stack([flat(d) for d in [honest, *refs]])
    out = flat(craft_update("alie", honest, refs, np.random.default_rng(0), z=1.5))
    assert np.allclose(out, stack.mean(0) - 1.5 * stack.std(0), atol=1e-6)
    # Baruch et al. 2019: n=50, f=12 -> s = 14, z = Phi^-1(36/50) ~ 0.58; n=10, f=2 -> Phi^-1(0.6)
    assert math.isclose(alie_z(50, 12), 0.5828, abs_tol=1e-3)
    assert math.isclose(alie_z(10, 2), 0.2533, abs_tol=1e-3)
    by_n = flat(craft_update("alie", honest, refs, np.random.default_rng(0), num_workers=10, num_byzantine=2))
    assert np.allclose(by_n, stack.mean(0) - alie_z(10, 2) * stack.std(0), atol=1e-6)
    # every coordinate stays inside the honest range for small z: that is the point of ALIE
    assert np.all(by_n >= stack.min(0) - 1e-6) and np.all(by_n <= stack.max(0) + 1e-6)
    # a lone attacker with no references sends its honest delta (sigma 0)
    assert np.allclose(flat(craft_update("alie", honest, [], np.random.default_rng(0))), flat(honest))


@pytest.mark.parametrize("epsilon", [0.1, 100.0])
def test_ipm_has_negative_inner_product_with_the_honest_mean(epsilon: float) -> None:
    honest, *refs = cohort()
    mean = np.stack([flat(d) for d in [honest, *refs]]).mean(0)
    out = flat(craft_update("ipm", honest, refs, np.random.default_rng(0), epsilon=epsilon))
    assert np.allclose(out, -epsilon * mean, rtol=1e-5, atol=1e-6)
    assert float(out @ mean) < 0


def test_free_rider_replays_the_previous_aggregate_or_sends_zeros() -> None:
    honest, *refs = cohort()
    rng = np.random.default_rng(0)
    assert not flat(craft_update("free-rider", honest, refs, rng)).any()
    prev = refs[0]
    assert np.array_equal(flat(craft_update("free-rider", honest, refs, rng, previous=prev)), flat(prev))
    noisy = flat(craft_update("free-rider", honest, refs, rng, previous=prev, sigma=0.01))
    assert 0 < np.abs(noisy - flat(prev)).max() < 0.1


def test_label_flip_is_a_data_attack() -> None:
    assert DATA_ATTACKS == {"label-flip"}
    y = np.array([0, 3, 9, 5], np.int64)
    assert flip_labels(y, 10).tolist() == [9, 6, 0, 4]
    assert np.array_equal(flip_labels(flip_labels(y, 10), 10), y)
    with pytest.raises(ValueError):
        flip_labels(np.array([10]), 10)
    with pytest.raises(ValueError):
        flip_labels(np.array([0.5]), 10)
    honest, *refs = cohort()
    assert np.array_equal(flat(craft_update("label-flip", honest, refs, np.random.default_rng(0))), flat(honest))


def test_label_flipped_workload_trains_against_the_honest_direction() -> None:
    from peerloom.backends.numpy.workload import make_digits_numpy_workload

    wl = make_digits_numpy_workload(0, local_epochs=1)
    bad = label_flipped(wl, 10)
    assert np.array_equal(bad.train_labels, 9 - wl.train_labels)
    assert np.array_equal(wl.train_labels, make_digits_numpy_workload(0).train_labels)  # original untouched
    params = wl.initial_params(0)
    good_delta, _ = wl.train(params, range(200), 1)
    bad_delta, _ = bad.train(params, range(200), 1)
    g, b = flat(good_delta), flat(bad_delta)
    assert float(g @ b) / (np.linalg.norm(g) * np.linalg.norm(b)) < 0.5
    refs = local_references(wl, params, list(range(200)), seed=5, parts=4)
    assert len(refs) == 4 and all(set(r) == set(params) for r in refs)
    assert not np.array_equal(flat(refs[0]), flat(refs[1]))


def test_validation() -> None:
    honest, *refs = cohort()
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="unknown attack"):
        craft_update("nope", honest, refs, rng)
    with pytest.raises(TypeError):
        craft_update("sign-flip", honest, refs, rng, scale=2.0)
    with pytest.raises(ValueError):
        craft_update("scaling", honest, refs, rng, scale=-1.0)
    with pytest.raises(ValueError):
        craft_update("ipm", honest, refs, rng, epsilon=float("nan"))
    with pytest.raises(ValueError, match="references"):
        craft_update("alie", honest, [{"w": np.zeros((4, 3), np.float32)}], rng)
    with pytest.raises(ValueError):
        alie_z(4, 4)

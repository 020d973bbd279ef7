"""Adversaries that try to pass the validators' cheap checks (backends/attacks.py, backends/behaviours.py):
lazy, replayer, free-rider-noise, lazy-1-in-5."""

from __future__ import annotations

import numpy as np
import pytest

from peerloom.backends.attacks import (
    ATTACKS,
    TRAINING_ATTACKS,
    craft_update,
    global_norm,
    is_lazy_call,
    lazy_work,
    perturb,
    random_with_cosine,
    scale_to_norm,
    tensor_cosine,
)
from peerloom.backends.behaviours import ByzantineWorkload, wrap_workload
from peerloom.backends.numpy.tensors import tensor_digest
from peerloom.backends.registry import build_workload

H = 8


@pytest.fixture(scope="module")
def digits():
    workload, shards = build_workload("digits-numpy", 0, 8, inner_steps=H)
    return workload, shards, workload.initial_params(0)


def cohort(seed: int = 0, n: int = 6) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    base = {"w": rng.standard_normal((40, 30)).astype(np.float32), "b": rng.standard_normal(30).astype(np.float32)}
    return [{k: (v + 0.7 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in base.items()}
            for _ in range(n)]


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)


# --- pure tensor parts -------------------------------------------------------------------------------


def test_names_are_new_and_separate():
    assert "free-rider-noise" in ATTACKS
    assert TRAINING_ATTACKS == ("lazy", "replayer", "lazy-1-in-5", "dp-skip-noise")
    assert not set(TRAINING_ATTACKS) & set(ATTACKS)
    with pytest.raises(ValueError, match="unknown attack"):
        craft_update("lazy", *cohort()[:1], [], np.random.default_rng(0))


def test_scale_to_norm_keeps_the_direction_and_sets_the_norm():
    d = cohort()[0]
    out = scale_to_norm(d, 3.5)
    assert np.isclose(global_norm(out), 3.5, rtol=1e-6)
    assert tensor_cosine(out, d) > 1 - 1e-6
    assert all(out[k].dtype == np.float32 and not np.shares_memory(out[k], d[k]) for k in d)
    zeros = {"w": np.zeros(3, np.float32)}
    assert not scale_to_norm(zeros, 2.0)["w"].any()
    with pytest.raises(ValueError):
        scale_to_norm(d, -1.0)


@pytest.mark.parametrize("c", [-0.9, -0.2, 0.0, 0.35, 0.99, 1.0])
def test_random_with_cosine_has_the_asked_norm_and_cosine(c):
    honest, *refs = cohort()
    out = random_with_cosine(honest, 2.0, np.random.default_rng(1), direction=refs[0], cosine=c)
    assert np.isclose(global_norm(out), 2.0, rtol=1e-5)
    assert abs(tensor_cosine(out, refs[0]) - c) < 1e-5
    again = random_with_cosine(honest, 2.0, np.random.default_rng(1), direction=refs[0], cosine=c)
    assert same(out, again)
    with pytest.raises(ValueError):
        random_with_cosine(honest, 1.0, np.random.default_rng(1), direction=refs[0], cosine=1.5)


def test_perturb_changes_the_digest_but_not_the_direction():
    d = cohort()[0]
    out = perturb(d)
    assert tensor_digest(out) != tensor_digest(d)
    assert tensor_cosine(out, d) > 0.999999
    changed = sum(int((out[k] != d[k]).sum()) for k in d)
    assert changed == 1
    zero = {"w": np.zeros((2, 2), np.float32)}
    assert tensor_digest(perturb(zero)) != tensor_digest(zero)
    with pytest.raises(ValueError):
        perturb({"w": np.zeros(2, np.float64)})


def test_lazy_work_and_lazy_calls():
    assert lazy_work(range(10), 8) == (list(range(10)), 2)
    assert lazy_work(range(10), 3) == (list(range(10)), 1)
    assert lazy_work(range(10), None) == ([0, 1], None)
    assert lazy_work([7, 8, 9], None) == ([7], None)
    assert [k for k in range(12) if is_lazy_call(k)] == [0, 5, 10]
    assert [k for k in range(12) if is_lazy_call(k, 5, 2)] == [2, 7]
    with pytest.raises(ValueError):
        lazy_work([], 8)
    with pytest.raises(ValueError):
        is_lazy_call(0, 5, 5)


def test_free_rider_noise_imitates_the_honest_norm_and_cosine_to_the_references_mean():
    honest, *refs = cohort()
    mean = {k: np.mean([r[k].astype(np.float64) for r in refs], axis=0) for k in honest}
    out = craft_update("free-rider-noise", honest, refs, np.random.default_rng(2))
    assert np.isclose(global_norm(out), global_norm(honest), rtol=1e-5)
    assert abs(tensor_cosine(out, mean) - tensor_cosine(honest, mean)) < 1e-4
    assert tensor_cosine(out, honest) < tensor_cosine(honest, mean)  # not its own training
    alone = craft_update("free-rider-noise", honest, [], np.random.default_rng(2))
    assert np.isclose(global_norm(alone), global_norm(honest), rtol=1e-5)
    assert abs(tensor_cosine(alone, honest)) < 0.1  # a random direction in 1230 dimensions


# --- the workload wrapper on the numpy digits workload -------------------------------------------------


def test_lazy_sends_a_quarter_of_the_steps_scaled_to_the_honest_norm(digits):
    workload, shards, params = digits
    indices = shards[0]
    honest, honest_metrics = workload.train(params, indices, 5)
    lazy = wrap_workload(workload, "lazy")
    sent, metrics = lazy.train(params, indices, 5)
    assert np.isclose(global_norm(sent), global_norm(honest), rtol=1e-5)
    assert not same(sent, honest)
    short, _ = workload.train(params, indices, 5, inner_steps=H // 4)
    expected = scale_to_norm(short, global_norm(honest))
    assert all(np.allclose(sent[k], expected[k], rtol=1e-6, atol=1e-9) for k in sent)
    assert metrics["train_loss"] == honest_metrics["train_loss"]  # reports the honest loss
    assert lazy.last_action == "lazy" and lazy.num_train == workload.num_train
    # the inner_steps option wins over the workload's H
    sent3, _ = lazy.train(params, indices, 5, inner_steps=12)
    short3, _ = workload.train(params, indices, 5, inner_steps=3)
    honest12, _ = workload.train(params, indices, 5, inner_steps=12)
    assert same(sent3, scale_to_norm(short3, global_norm(honest12)))


def test_lazy_without_inner_steps_trains_a_quarter_of_the_lease():
    workload, shards = build_workload("digits-numpy", 0, 8, local_epochs=1)
    params = workload.initial_params(0)
    indices = shards[1]
    honest, _ = workload.train(params, indices, 3)
    sent, _ = ByzantineWorkload(workload, "lazy").train(params, indices, 3, epochs=2)
    honest2, _ = workload.train(params, indices, 3, epochs=2)
    quarter, _ = workload.train(params, indices[:len(indices) // 4], 3, epochs=2)
    assert same(sent, scale_to_norm(quarter, global_norm(honest2)))
    assert not same(sent, honest)


def test_replayer_resends_its_delta_of_age_windows_ago_with_a_new_digest(digits):
    workload, shards, params = digits
    replayer = ByzantineWorkload(workload, "replayer")  # age 2
    honest_by_window, sent_by_window = [], []
    for k in range(5):
        indices = shards[k % len(shards)]
        honest, _ = workload.train(params, indices, 100 + k)
        sent, _ = replayer.train(params, indices, 100 + k)
        honest_by_window.append(honest)
        sent_by_window.append(sent)
    for k in range(2):
        assert same(sent_by_window[k], honest_by_window[k])
    for k in range(2, 5):
        original = honest_by_window[k - 2]
        assert tensor_digest(sent_by_window[k]) != tensor_digest(original)
        assert tensor_cosine(sent_by_window[k], original) > 0.999999
        assert tensor_cosine(sent_by_window[k], honest_by_window[k]) < 0.99
    assert replayer.last_action == "replay"
    one = ByzantineWorkload(workload, "replayer", params={"age": 1})
    first, _ = one.train(params, shards[0], 1)
    second, _ = one.train(params, shards[1], 2)
    assert tensor_cosine(second, first) > 0.999999 and tensor_digest(second) != tensor_digest(first)


def test_lazy_one_in_five_is_lazy_exactly_in_calls_0_5_10(digits):
    workload, shards, params = digits
    attacker = ByzantineWorkload(workload, "lazy-1-in-5")
    lazy_calls = []
    for k in range(11):
        indices = shards[k % len(shards)]
        honest, _ = workload.train(params, indices, k)
        sent, _ = attacker.train(params, indices, k, inner_steps=H)
        if attacker.last_action == "lazy":
            lazy_calls.append(k)
            short, _ = workload.train(params, indices, k, inner_steps=H // 4)
            assert same(sent, scale_to_norm(short, global_norm(honest)))
        else:
            assert attacker.last_action == "honest" and same(sent, honest)
    assert lazy_calls == [0, 5, 10]


def test_free_rider_noise_through_the_wrapper_is_a_random_direction_with_the_honest_norm(digits):
    workload, shards, params = digits
    honest, _ = workload.train(params, shards[2], 9)
    sent, _ = wrap_workload(workload, "free-rider-noise", seed=4).train(params, shards[2], 9)
    again, _ = wrap_workload(workload, "free-rider-noise", seed=4).train(params, shards[2], 9)
    assert np.isclose(global_norm(sent), global_norm(honest), rtol=1e-5)
    assert abs(tensor_cosine(sent, honest)) < 0.1 and same(sent, again)


def test_training_attack_parameters_are_checked():
    workload = object()
    with pytest.raises(TypeError):
        ByzantineWorkload(workload, "lazy", params={"age": 3})
    with pytest.raises(ValueError):
        ByzantineWorkload(workload, "replayer", params={"age": 0})
    with pytest.raises(ValueError):
        ByzantineWorkload(workload, "lazy-1-in-5", params={"period": 5, "phase": 7})
    assert ByzantineWorkload(workload, "replayer", params={"age": 3}).history.maxlen == 3

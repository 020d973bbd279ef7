"""Robust aggregation rules: numpy ≡ torch bytes, permutation invariance, weight semantics (spec/design.md §5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from peerloom.backends import _robust
from peerloom.backends.numpy import reduce as npr
from peerloom.backends.numpy.aggregate import RULES
from peerloom.backends.numpy.aggregate import aggregate as np_agg
from peerloom.backends.torch.aggregate import aggregate as torch_agg

SETTINGS = settings(max_examples=40, deadline=None)
f32 = st.floats(-1e6, 1e6, width=32)


@st.composite
def cohorts(draw: st.DrawFn, min_size: int = 1, max_size: int = 9) -> tuple[list[dict], list[int]]:
    shapes = draw(st.dictionaries(st.sampled_from("abc"), hnp.array_shapes(min_dims=0, max_dims=2, max_side=6),
                                  min_size=1, max_size=3))
    n = draw(st.integers(min_size, max_size))
    deltas = [{k: draw(hnp.arrays(np.float32, s, elements=f32)) for k, s in shapes.items()} for _ in range(n)]
    if n > 1 and draw(st.booleans()):
        deltas[-1] = {k: v.copy() for k, v in deltas[0].items()}  # a duplicate: Krum near-tie path
    return deltas, draw(st.lists(st.integers(1, 1000), min_size=n, max_size=n))


def to_torch(d: dict) -> dict:
    return {k: torch.from_numpy(v.copy()) for k, v in d.items()}


def raw(d: dict) -> list:
    return [(k, np.asarray(d[k]).dtype.name, np.asarray(d[k]).shape, np.asarray(d[k]).tobytes()) for k in sorted(d)]


@SETTINGS
@given(cohorts(), st.sampled_from(RULES))
def test_numpy_equals_torch_bytes(cohort, rule) -> None:
    deltas, weights = cohort
    a = np_agg(rule, deltas, weights)
    b = torch_agg(rule, [to_torch(d) for d in deltas], weights)
    assert raw(a) == raw({k: v.numpy() for k, v in b.items()})


@pytest.mark.parametrize("n", [3, 16, 33])
@pytest.mark.parametrize("rule", RULES)
def test_large_cohorts_numpy_equals_torch(n: int, rule: str) -> None:
    rng = np.random.default_rng(n)
    deltas = [{"w": rng.standard_normal(_robust.BLOCK + 7, dtype=np.float32), "b": rng.standard_normal((3, 4),
              dtype=np.float32)} for _ in range(n)]
    deltas[1]["w"][:5] = -0.0
    weights = [int(w) for w in rng.integers(1, 100, n)]
    a = np_agg(rule, deltas, weights)
    b = torch_agg(rule, [to_torch(d) for d in deltas], weights)
    assert raw(a) == raw({k: v.numpy() for k, v in b.items()})


@SETTINGS
@given(cohorts(min_size=2), st.randoms(use_true_random=False),
       st.sampled_from(["median", "trimmed_mean", "krum", "multi_krum"]))
def test_order_statistics_are_permutation_invariant(cohort, rnd, rule) -> None:
    deltas, weights = cohort
    if rule in ("krum", "multi_krum"):
        weights = [1] * len(deltas)  # the selected mean is summed in cohort order; equal weights: same set
        if rule == "multi_krum":
            return
    order = list(range(len(deltas)))
    rnd.shuffle(order)
    a = np_agg(rule, deltas, weights)
    b = np_agg(rule, [deltas[i] for i in order], [weights[i] for i in order])
    if rule == "krum":
        # the selected member may be another copy of an equal-scored duplicate; values must be a member
        # (compared by value: the rule writes +0.0 for -0.0)
        assert any(all(np.array_equal(b[k], d[k]) for k in d) for d in deltas)
    else:
        assert raw(a) == raw(b)


def test_mean_is_the_reference_weighted_mean() -> None:
    rng = np.random.default_rng(0)
    deltas = [{"w": rng.standard_normal(70_001).astype(np.float32)} for _ in range(5)]
    assert raw(np_agg("mean", deltas, [1, 2, 3, 4, 5])) == raw(npr.weighted_mean(deltas, [1, 2, 3, 4, 5]))


def test_true_median_for_even_counts_and_trim() -> None:
    deltas = [{"w": np.array([v], np.float32)} for v in (1.0, 2.0, 10.0, 100.0)]
    assert np_agg("median", deltas, [1] * 4)["w"].tolist() == [6.0]
    assert torch_agg("median", [to_torch(d) for d in deltas], [1] * 4)["w"].tolist() == [6.0]
    assert np_agg("trimmed_mean", deltas, [1] * 4, trim_fraction=0.25)["w"].tolist() == [6.0]
    # median and trimmed mean ignore weights (a weight buys no votes)
    assert np_agg("median", deltas, [1, 1, 1, 1000])["w"].tolist() == [6.0]


def test_robust_rules_resist_one_outlier() -> None:
    rng = np.random.default_rng(1)
    honest = [{"w": (1.0 + 0.01 * rng.standard_normal(100)).astype(np.float32)} for _ in range(8)]
    cohort = [*honest, {"w": np.full(100, 1e6, np.float32)}]
    for rule in ("median", "trimmed_mean", "krum", "multi_krum", "centered_clip", "norm_clip"):
        got = np_agg(rule, cohort, [1] * 9, **({"f": 1} if "krum" in rule else {}))["w"]
        assert np.abs(got - 1.0).max() < 0.2, rule
    assert np_agg("mean", cohort, [1] * 9)["w"].min() > 1e5


def test_multi_krum_weights_the_selected() -> None:
    a, b = {"w": np.zeros(4, np.float32)}, {"w": np.full(4, 4.0, np.float32)}
    got = np_agg("multi_krum", [a, b, a, b], [3, 1, 3, 1], f=0, m=4)["w"]
    assert got.tolist() == [1.0] * 4


@pytest.mark.parametrize("agg", [np_agg, torch_agg])
def test_bad_arguments(agg) -> None:
    d = {"w": np.ones(3, np.float32)}
    d = d if agg is np_agg else to_torch(d)
    with pytest.raises(ValueError, match="unknown"):
        agg("average", [d], [1])
    with pytest.raises(TypeError):
        agg("median", [d], [1], tau=1.0)
    with pytest.raises(ValueError):
        agg("trimmed_mean", [d], [1], trim_fraction=0.5)
    with pytest.raises(ValueError):
        agg("mean", [d], [0])
    with pytest.raises(ValueError, match="empty"):
        agg("mean", [], [])


def test_batcher_network_sorts() -> None:
    rng = np.random.default_rng(2)
    for n in range(1, 20):
        for _ in range(20):
            v = list(rng.integers(0, 5, n))
            for a, b in _robust.batcher_network(n):
                if v[a] > v[b]:
                    v[a], v[b] = v[b], v[a]
            assert v == sorted(v)


def test_screening_stats_numpy_equals_torch_and_values() -> None:
    from peerloom.backends.numpy.aggregate import screening_stats as np_stats
    from peerloom.backends.torch.aggregate import screening_stats as torch_stats

    rng = np.random.default_rng(3)
    d, r, c = ({"w": rng.standard_normal(40_000).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}
               for _ in range(3))
    a = np_stats(d, reference=r, centre=c)
    b = torch_stats(to_torch(d), reference=to_torch(r), centre=to_torch(c))
    assert a == b and a["finite"]
    w64 = {k: v.astype(np.float64) for k, v in d.items()}
    assert a["global_norm"] == pytest.approx(np.sqrt(sum((v**2).sum() for v in w64.values())), rel=1e-12)
    assert a["norms"]["b"] == pytest.approx(np.linalg.norm(w64["b"]), rel=1e-12)
    assert np_stats(d, reference=d)["cosine"] == pytest.approx(1.0)
    assert np_stats(d, centre=d)["distance"] == 0.0
    bad = {"w": np.array([np.nan], np.float32)}
    assert not np_stats(bad)["finite"] and not torch_stats(to_torch(bad))["finite"]


def test_quantized_gram_does_not_depend_on_the_blas_order(monkeypatch) -> None:
    """Centered clipping's Gram is exact per block, so a BLAS that sums in another order gives the same bits."""
    from peerloom.backends.numpy import aggregate as npa

    rng = np.random.default_rng(5)
    deltas = [{"w": (rng.standard_normal(_robust.CC_BLOCK * 2 + 3) * 10.0 ** rng.integers(-3, 3)).astype(np.float32)}
              for _ in range(6)]
    weights = [3, 1, 4, 1, 5, 9]
    schema = (("w", "float32", (_robust.CC_BLOCK * 2 + 3,)),)
    rows = {"w": [d["w"] for d in deltas]}
    ws = npa.workspace()
    g = _robust.quantized_gram(npa.NUMPY_OPS, ws, schema, rows)
    exact = np.array([[float(np.dot(a["w"].astype(np.float64), b["w"].astype(np.float64))) for b in deltas]
                      for a in deltas])
    np.testing.assert_allclose(np.array(g), exact, rtol=1e-4, atol=1e-5 * np.abs(exact).max())
    expected = np_agg("centered_clip", deltas, weights)

    def reversed_gram(self, x, out) -> None:  # another summation order: columns reversed, float64 pairwise
        y = np.ascontiguousarray(x[:, ::-1])
        out[...] = np.einsum("ik,jk->ij", y, y)

    monkeypatch.setattr(type(npa.NUMPY_OPS), "gram", reversed_gram)
    assert _robust.quantized_gram(npa.NUMPY_OPS, ws, schema, rows) == g
    assert raw(np_agg("centered_clip", deltas, weights)) == raw(expected)


def test_centered_clip_with_a_large_radius_is_the_weighted_mean() -> None:
    rng = np.random.default_rng(2)
    deltas = [{"w": rng.standard_normal(1000, dtype=np.float32)} for _ in range(5)]
    weights = [1, 2, 3, 4, 5]
    cc = np_agg("centered_clip", deltas, weights, tau=1e9)["w"]
    np.testing.assert_allclose(cc, np_agg("mean", deltas, weights)["w"], rtol=0, atol=1e-6)
    centre = {"w": rng.standard_normal(1000, dtype=np.float32)}
    tiny = np_agg("centered_clip", deltas, weights, tau=1e-9, center=centre)["w"]  # clipped: barely moves
    np.testing.assert_allclose(tiny, centre["w"], rtol=0, atol=1e-6)

"""Cohort screening's norm bound (spec/protocol.md §6): the larger of `norm_ratio` and the cohort's spread of
norms to the power `norm_mads`, times the median norm (`peerloom.adapters.compute.cohort_outliers`)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerloom.adapters.compute import (
    MIN_SCREEN_COHORT,
    NumpyCompute,
    cohort_outliers,
    compute_backend,
    norm_spread,
)

NUMPY = NumpyCompute()


def cohort(norms: list[float], seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Deltas of the given global norms around one shared direction (honest-looking: cosines near 1)."""
    rng = np.random.default_rng(seed)
    common = rng.standard_normal(16)
    out = []
    for n in norms:
        v = common + 0.3 * rng.standard_normal(16)
        out.append({"w": (v * (n / np.linalg.norm(v))).astype(np.float32)})
    return out


def test_a_scaled_update_among_tight_honest_ones_is_an_outlier():
    honest = [1.0 + 0.03 * i for i in range(7)]
    deltas = cohort([*honest, 10.0 * honest[-1]])  # x10 of the largest honest update: 10.6 x the median
    outliers = cohort_outliers(NUMPY, deltas, 10.0, -1.0, 6)
    assert [o[:2] for o in outliers] == [[7, "norm-outlier"]]
    assert "from norm_ratio 10" in outliers[0][2]  # a tight cohort: the ratio binds, as before norm_mads


def test_an_honest_spread_is_kept_that_the_fixed_ratio_cut():
    norms = [1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 45.0]  # median 4: the largest is 11.25 x the median
    deltas = cohort(norms)
    assert [o[:2] for o in cohort_outliers(NUMPY, deltas, 10.0, -1.0, 0)] == [[7, "norm-outlier"]]
    assert cohort_outliers(NUMPY, deltas, 10.0, -1.0, 6) == []
    # the same cohort with an update far beyond its spread: out, and the detail names the spread bound
    deltas.append(cohort([1e5])[0])  # the 9 candidates' median is 5 and spread 2.5: their bound 5 x 2.5^6 = 1221
    outliers = cohort_outliers(NUMPY, deltas, 10.0, -1.0, 6)
    assert [o[:2] for o in outliers] == [[8, "norm-outlier"]] and "** norm_mads 6" in outliers[0][2]


def test_deterministic_and_the_same_on_torch():
    deltas = cohort([1.0, 1.2, 0.8, 3.0, 9.0, 40.0], seed=3)
    first = cohort_outliers(NUMPY, deltas, 10.0, 0.5, 6)
    assert first == cohort_outliers(NumpyCompute(), [dict(d) for d in deltas], 10.0, 0.5, 6)
    pytest.importorskip("torch")
    assert cohort_outliers(compute_backend("torch"), deltas, 10.0, 0.5, 6) == first


def test_no_rejection_below_the_minimum_cohort():
    assert MIN_SCREEN_COHORT == 3
    tiny = cohort([1.0, 1000.0])
    assert cohort_outliers(NUMPY, tiny, 1.5, 0.99, 6) == [] == cohort_outliers(NUMPY, tiny, 1.5, 0.99, 0)
    # one more candidate and the same update is out
    assert [o[:2] for o in cohort_outliers(NUMPY, cohort([1.0, 1.1, 1000.0]), 10.0, -1.0, 6)] == \
        [[2, "norm-outlier"]]


def test_norm_spread_is_the_median_multiplicative_deviation():
    assert norm_spread([2.0, 2.0, 2.0], 2.0) == 1.0
    assert norm_spread([1.0, 2.0, 8.0], 2.0) == 2.0  # deviations 2, 1, 4
    assert norm_spread([1.0, 2.0, 2.0, 8.0], 2.0) == pytest.approx(2 ** 0.5)  # 1, 1, 2, 4: sqrt(1 * 2)
    assert norm_spread([0.0, 0.0, 3.0], 0.0) == 1.0  # a zero median: only zeros deviate by nothing


@settings(max_examples=40, deadline=None)
@given(norms=st.lists(st.floats(0.01, 1000.0), min_size=MIN_SCREEN_COHORT, max_size=9),
       mads=st.integers(0, 8), ratio=st.sampled_from([0.0, 2.0, 10.0]), min_cosine=st.sampled_from([-1.0, 0.9]),
       data=st.data())
def test_invariant_under_permutation_of_the_candidates(norms, mads, ratio, min_cosine, data):
    deltas = cohort(norms, seed=len(norms))
    order = data.draw(st.permutations(range(len(deltas))))
    before = {i: (reason, detail) for i, reason, detail in cohort_outliers(NUMPY, deltas, ratio, min_cosine, mads)}
    after = {order[k]: (reason, detail)
             for k, reason, detail in cohort_outliers(NUMPY, [deltas[i] for i in order], ratio, min_cosine, mads)}
    assert after == before

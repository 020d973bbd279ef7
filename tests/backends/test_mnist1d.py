"""MNIST-1D (backends/mnist1d.py): generated locally and deterministically, harder than digits, and the
plain mean visibly suffers under attack on it."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from peerloom.backends.mnist1d import load_mnist1d_split, make_mnist1d
from peerloom.backends.registry import build_workload

ROOT = Path(__file__).resolve().parents[2]


def test_samples_are_a_pure_function_of_the_seed_and_balanced():
    x, y = make_mnist1d(200, seed=3)
    again, labels = make_mnist1d(200, seed=3)
    assert x.shape == (200, 40) and x.dtype == np.float32 and y.dtype == np.int64
    assert np.array_equal(x, again) and np.array_equal(y, labels)
    assert not np.array_equal(x, make_mnist1d(200, seed=4)[0])
    assert np.bincount(y, minlength=10).tolist() == [20] * 10
    x_train, _, x_test, _ = load_mnist1d_split(0)
    assert len(x_train) == 4000 and len(x_test) == 1000


def test_it_is_harder_than_digits_but_learnable():
    from sklearn.linear_model import LogisticRegression

    x_train, y_train, x_test, y_test = load_mnist1d_split(0)
    linear = LogisticRegression(max_iter=300).fit(x_train, y_train).score(x_test, y_test)
    assert 0.15 < linear < 0.45  # a linear model cannot read shifted, sheared templates
    workload, shards = build_workload("mnist1d-numpy", 0, 4)
    params = workload.initial_params(0)
    for step in range(6):  # plain SGD on the whole train split with the workload's own training
        delta = workload.train(params, list(range(workload.num_train)), step)[0]
        params = {k: params[k] - delta[k] for k in params}
    assert workload.evaluate(params)["accuracy"] > linear + 0.1
    assert sum(len(s) for s in shards) == 4000


def test_the_plain_mean_collapses_under_ipm_where_a_robust_rule_holds():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "robustness.py"), "--workload", "mnist1d",
                          "--windows", "12", "--epochs", "2", "--attacks", "none,ipm-100",
                          "--rules", "mean,multi_krum"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    by = {(c["attack"], c["rule"]): c["accuracy"] for c in report["cells"]}
    assert report["workload"] == "mnist1d"
    assert by[("ipm-100", "mean")] < 0.5 * by[("none", "mean")]
    assert by[("ipm-100", "multi_krum")] > 0.8 * by[("none", "mean")]

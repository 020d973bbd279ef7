"""MNIST-1D: a small classification task that is harder than digits, generated locally (no download).

Greydanus, "Scaling Down Deep Learning" (2020, arXiv:2011.14439): ten 12-point template curves, one per
class, each placed at a random offset in a longer signal, scaled, sheared, blurred with correlated noise,
given white noise, and resampled to 40 points. An MLP reaches about 60-75% test accuracy where it reaches
97% on digits, so an attack that costs a few points on digits costs many here, and the gap between an
undefended mean and a robust rule shows. This is a re-implementation of the generation procedure with its
default constants, seeded by numpy's PCG64; the samples are not the reference dataset's.

`load_mnist1d_split(seed)` gives float32 ``[n, 40]`` inputs and int64 labels 0..9 (4000 train, 1000 test).
"""

from __future__ import annotations

from typing import Any

import numpy as np

# The ten class templates of MNIST-1D (12 points each), centred on 0.
TEMPLATES = np.array([
    [5, 6, 6.5, 6.75, 7, 7, 7, 7, 6.75, 6.5, 6, 5],
    [5, 3, 3, 3.4, 3.8, 4.2, 4.6, 5, 5.4, 5.8, 5, 5],
    [5, 6, 6.5, 6.5, 6, 5.25, 4.75, 4, 3.5, 3.5, 4, 5],
    [5, 6, 6.5, 6.5, 6, 5, 5, 6, 6.5, 6.5, 6, 5],
    [5, 4.4, 3.8, 3.2, 2.6, 2.6, 5, 5, 5, 5, 5, 5],
    [5, 3, 3, 3, 3, 5, 6, 6.5, 6.5, 6, 4.5, 5],
    [5, 4, 3.5, 3.25, 3, 3, 3, 3, 3.25, 3.5, 4, 5],
    [5, 7, 7, 6.6, 6.2, 5.8, 5.4, 5, 4.6, 4.2, 5, 5],
    [5, 4, 3.5, 3.5, 4, 5, 5, 4, 3.5, 3.5, 4, 5],
    [5, 4, 3.5, 3.5, 4, 5, 5, 5, 5, 4.7, 4.3, 5],
]) - 5.0
TEMPLATE_LEN, SIGNAL_LEN, FINAL_LEN = 12, 36, 40
SCALE_COEFF, MAX_TRANSLATION, CORR_NOISE, IID_NOISE, SHEAR_SCALE = 0.4, 48, 0.25, 2e-2, 0.75


def _blur(x: np.ndarray, sigma: float = 2.0) -> np.ndarray:
    """Gaussian blur along the last axis (correlated noise)."""
    radius = int(3 * sigma)
    kernel = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2)
    kernel /= kernel.sum()
    return np.apply_along_axis(lambda row: np.convolve(row, kernel, mode="same"), -1, x)


def make_mnist1d(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`n` samples: (x float32 ``[n, 40]``, y int64 ``[n]``), balanced over the ten classes, a pure function
    of (`n`, `seed`)."""
    rng = np.random.default_rng(seed)
    y = np.arange(n, dtype=np.int64) % 10
    rng.shuffle(y)
    # Pad each template into a longer signal (the original pads to 36-60 points) ...
    pad = rng.integers(0, SIGNAL_LEN - TEMPLATE_LEN + 1, size=n)
    signal = np.zeros((n, SIGNAL_LEN))
    for i in range(n):
        signal[i, pad[i]:pad[i] + TEMPLATE_LEN] = TEMPLATES[y[i]]
    # ... shift it circularly, scale it, shear it ...
    shift = rng.integers(0, MAX_TRANSLATION, size=n)
    signal = np.stack([np.roll(s, k) for s, k in zip(signal, shift, strict=True)])
    signal *= 1.0 + SCALE_COEFF * (rng.random((n, 1)) - 0.5)
    t = np.linspace(-1.0, 1.0, SIGNAL_LEN)
    signal += SHEAR_SCALE * (2 * rng.random((n, 1)) - 1) * t
    # ... add correlated and white noise, and resample to the final length.
    signal += CORR_NOISE * _blur(rng.standard_normal((n, SIGNAL_LEN))) * 5.0
    grid = np.linspace(0, SIGNAL_LEN - 1, FINAL_LEN)
    x = np.stack([np.interp(grid, np.arange(SIGNAL_LEN), s) for s in signal])
    x += IID_NOISE * rng.standard_normal(x.shape)
    return x.astype(np.float32), y


def load_mnist1d_split(seed: int = 0, num_train: int = 4000,
                       num_test: int = 1000) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, y_train, x_test, y_test)``: disjoint draws for train and test, from `seed`."""
    x, y = make_mnist1d(num_train + num_test, seed)
    return x[:num_train], y[:num_train], x[num_train:], y[num_train:]


def make_mnist1d_numpy_workload(seed: int = 0, *, hidden: int = 100, **options: Any) -> Any:
    """The numpy MLP 40-`hidden`-10 on MNIST-1D (`NumpyWorkload` options pass through: lr, local_epochs...)."""
    from peerloom.backends.numpy.workload import NumpyWorkload

    x_train, y_train, x_test, y_test = load_mnist1d_split(seed)
    return NumpyWorkload((x_train, y_train), (x_test, y_test), sizes=(FINAL_LEN, hidden, 10), **options)


def make_mnist1d_workload(seed: int = 0, *, hidden: int = 100, local_epochs: int = 2, lr: float = 5e-3,
                          batch_size: int = 32, inner_steps: int | None = None,
                          keep_optimizer_state: bool = False, num_threads: int | None = None) -> Any:
    """The torch MLP 40-`hidden`-10 on MNIST-1D, Adam(`lr`), cross-entropy (`TorchWorkload`; the same
    schema as `make_mnist1d_numpy_workload`)."""
    import torch
    from torch import nn

    from peerloom.backends.torch.models import mlp
    from peerloom.backends.torch.workload import TorchWorkload

    x_train, y_train, x_test, y_test = load_mnist1d_split(seed)
    return TorchWorkload(lambda: mlp((FINAL_LEN, hidden, 10)), lambda params: torch.optim.Adam(params, lr=lr),
                         nn.functional.cross_entropy, (x_train, y_train), (x_test, y_test), batch_size=batch_size,
                         local_epochs=local_epochs, inner_steps=inner_steps,
                         keep_optimizer_state=keep_optimizer_state, num_threads=num_threads)

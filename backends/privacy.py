"""Differential privacy for a trainer's leased data: DP-SGD's parameters and its privacy accountant
(spec/protocol.md §10, spec/privacy.md).

`DP` names what a DP-SGD run needs: the Gaussian noise multiplier sigma, the per-sample clipping norm C, the
target delta and the Poisson sampling rate q. `TorchWorkload` runs DP-SGD with it (Abadi et al. 2016,
"Deep Learning with Differential Privacy", arXiv:1607.00133) through Opacus (Yousefpour et al. 2021,
arXiv:2109.12298): every step samples each leased example independently with probability q, clips each
per-sample gradient to L2 norm C, sums them, adds N(0, (sigma C)^2) noise per coordinate and divides by the
expected batch size q n.

`epsilon` is the privacy those steps spend, by Rényi differential privacy (Mironov 2017, "Rényi Differential
Privacy", arXiv:1702.07476) of the subsampled Gaussian mechanism (Mironov, Talwar, Zhang 2019, "Rényi
Differential Privacy of the Sampled Gaussian Mechanism", arXiv:1908.10530), converted to (epsilon, delta)-DP:
exactly what Opacus's ``RDPAccountant`` returns for the same parameters (its default orders). RDP composes
by addition, so steps of one (sigma, q) add up: the epsilon of a trainer's k windows of H steps each is
``epsilon(steps=k * H)``, not k times the epsilon of H steps.

This module imports only attrs: opacus (the ``[dp]`` extra) is imported inside the functions that need it,
and `require_opacus` turns its absence into `PrivacyUnavailable` with a one-line install hint.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

import attrs

from peerloom.core.objects import Manifest, PrivacyParams

INSTALL_HINT = "differential privacy needs opacus: pip install 'peerloom[dp]'"


class PrivacyUnavailable(ImportError):
    """Opacus is not installed (``pip install 'peerloom[dp]'``); the message is that one line."""


def require_opacus() -> ModuleType:
    """The ``opacus`` module; `PrivacyUnavailable` (an ImportError) with `INSTALL_HINT` when it cannot be
    imported."""
    try:
        import opacus
    except ImportError:
        raise PrivacyUnavailable(INSTALL_HINT) from None
    return opacus


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


# attrs converters: the value as a float; ValueError naming the field for a bool or a non-number. (Named
# functions, not a factory's lambdas: mypy's attrs plugin reads only those.)
def _noise_multiplier(value: Any) -> float:
    return _number("noise_multiplier", value)


def _max_grad_norm(value: Any) -> float:
    return _number("max_grad_norm", value)


def _delta_value(value: Any) -> float:
    return _number("delta", value)


def _sample_rate(value: Any) -> float | None:
    return None if value is None else _number("sample_rate", value)


def _noise(_: Any, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 <= _number(attribute.name, value) < math.inf:
        raise ValueError(f"noise_multiplier must be a finite number >= 0, got {value!r}")


def _clip(_: Any, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 < _number(attribute.name, value) < math.inf:
        raise ValueError(f"max_grad_norm must be a finite number > 0, got {value!r}")


def _delta(_: Any, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 < _number(attribute.name, value) < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {value!r}")


def _rate(_: Any, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and not 0.0 < _number(attribute.name, value) <= 1.0:
        raise ValueError(f"sample_rate must lie in (0, 1] or be None, got {value!r}")


@attrs.frozen(kw_only=True)
class DP:
    """DP-SGD's parameters for a workload's `train` (Abadi et al. 2016, arXiv:1607.00133, Algorithm 1).

    Args:
        noise_multiplier: sigma, the Gaussian noise's standard deviation in units of `max_grad_norm` (finite,
            >= 0; 0 adds no noise and spends infinite epsilon).
        max_grad_norm: C, the L2 norm each per-sample gradient is clipped to (finite, > 0; in the loss's
            gradient units, over all the model's trainable parameters together).
        delta: the delta of the (epsilon, delta)-DP guarantee the accountant reports (0 < delta < 1; usually
            below 1 / the number of samples).
        sample_rate: q, the probability with which each leased sample joins a step's batch (Poisson sampling;
            0 < q <= 1). None: ``min(1, batch_size / number of leased samples)``, so batches average
            ``batch_size`` samples.

    Raises ValueError for a value outside those ranges (or not a number). Frozen and keyword-only.
    """

    noise_multiplier: float = attrs.field(converter=_noise_multiplier, validator=_noise)
    max_grad_norm: float = attrs.field(converter=_max_grad_norm, validator=_clip)
    delta: float = attrs.field(converter=_delta_value, validator=_delta)
    sample_rate: float | None = attrs.field(default=None, converter=_sample_rate,
                                            validator=_rate)


def _check_accounting(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> None:
    _noise(None, attrs.fields(DP).noise_multiplier, noise_multiplier)
    _rate(None, attrs.fields(DP).sample_rate, sample_rate)
    _delta(None, attrs.fields(DP).delta, delta)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")


def epsilon(*, noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """The epsilon (natural-log units) of `steps` DP-SGD steps with noise multiplier sigma and Poisson sampling
    rate q at `delta`: Opacus's ``RDPAccountant`` with history ``[(sigma, q, steps)]``, ``get_epsilon(delta)``
    (RDP of the subsampled Gaussian mechanism at Opacus's default orders, Mironov, Talwar, Zhang 2019,
    arXiv:1908.10530; converted to (epsilon, delta)-DP as Opacus does). 0.0 for ``steps == 0``; inf for
    ``noise_multiplier == 0`` and ``steps > 0``. Deterministic: a pure function of its arguments.

    Raises ValueError for sigma < 0 or not finite, q outside (0, 1], delta outside (0, 1) or steps not an
    int >= 0; `PrivacyUnavailable` without opacus (for ``steps > 0``).
    """
    _check_accounting(noise_multiplier, sample_rate, steps, delta)
    if steps == 0:
        return 0.0
    require_opacus()
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = [(float(noise_multiplier), float(sample_rate), int(steps))]
    return float(accountant.get_epsilon(delta=float(delta)))


@functools.lru_cache(maxsize=4096)
def accountant(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """`epsilon` with positional arguments, memoised: the ``core.privacy.Accountant`` a node injects
    (`EngineConfig.accountant`) and `peerloom verify` uses for the privacy ledger (spec/protocol.md §10).
    Same errors as `epsilon`."""
    return epsilon(noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=steps, delta=delta)


def privacy_accountant(manifest: Manifest) -> Callable[[float, float, int, float], float] | None:
    """What a node gives its engine as `EngineConfig.accountant` for `manifest`: `accountant` when the manifest
    has `privacy`, else None. Raises `PrivacyUnavailable` (one line naming the ``[dp]`` extra) for a privacy
    manifest without opacus, so a node fails at start rather than at its first head."""
    if manifest.privacy is None:
        return None
    require_opacus()
    return accountant


def dp_of(params: PrivacyParams) -> DP:
    """The `DP` a workload trains with under a manifest's `privacy` (its sigma, C, delta and fixed q)."""
    return DP(noise_multiplier=params.noise_multiplier, max_grad_norm=params.max_grad_norm, delta=params.delta,
              sample_rate=params.sample_rate)


def noise_multiplier_for(*, epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """The smallest noise multiplier sigma (to Opacus's tolerance, 0.01 in epsilon) whose `steps` steps at rate
    q spend at most `epsilon` at `delta` under the RDP accountant (`epsilon` above):
    ``opacus.accountants.utils.get_noise_multiplier(..., accountant="rdp")``. For benches and for choosing a
    manifest's sigma from a budget. Raises ValueError for epsilon not finite and > 0, steps < 1 or the other
    arguments out of `epsilon`'s ranges; `PrivacyUnavailable` without opacus."""
    _check_accounting(0.0, sample_rate, steps, delta)
    if not 0.0 < _number("epsilon", epsilon) < math.inf or steps < 1:
        raise ValueError(f"need a finite epsilon > 0 and steps >= 1, got {epsilon!r}, {steps!r}")
    require_opacus()
    from opacus.accountants.utils import get_noise_multiplier

    return float(get_noise_multiplier(target_epsilon=float(epsilon), target_delta=float(delta),
                                      sample_rate=float(sample_rate), steps=int(steps), accountant="rdp"))


def privacy_sample_rate(dp: DP, num_samples: int, batch_size: int) -> float:
    """q for a lease of `num_samples`: ``dp.sample_rate``, else ``min(1, batch_size / num_samples)``.
    ValueError for ``num_samples < 1`` or ``batch_size < 1``."""
    if num_samples < 1 or batch_size < 1:
        raise ValueError(f"need num_samples >= 1 and batch_size >= 1, got {num_samples}, {batch_size}")
    if dp.sample_rate is not None:
        return dp.sample_rate
    return min(1.0, batch_size / num_samples)


def privacy_steps(sample_rate: float, inner_steps: int | None, epochs: int) -> int:
    """DP-SGD steps of one `train` call: `inner_steps` when given, else ``epochs * ceil(1 / q)`` (an "epoch"
    of Poisson sampling: its batches hold n samples on average)."""
    if inner_steps is not None:
        return int(inner_steps)
    return int(epochs) * math.ceil(1.0 / sample_rate)

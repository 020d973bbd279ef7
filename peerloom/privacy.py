"""Differential privacy for trainers' data (spec/protocol.md §10, spec/privacy.md): DP-SGD's parameters and
the privacy accountant.

=========================== ================================================================================
name                        what
=========================== ================================================================================
`DP`                        DP-SGD's parameters: ``noise_multiplier`` (sigma), ``max_grad_norm`` (C),
                            ``delta``, ``sample_rate`` (q, Poisson; None: batch_size / leased samples);
                            give it to ``torch_workload(..., privacy=DP(...))`` or
                            ``TorchWorkload.with_privacy``
`epsilon`                   ``(noise_multiplier, sample_rate, steps, delta) -> epsilon``: Opacus's RDP
                            accountant (Mironov 2017; Mironov, Talwar, Zhang 2019)
`accountant`                `epsilon` with positional arguments, memoised: the ``core.privacy.Accountant`` a
                            node gives its engine and `peerloom verify` checks the ledger with (§10)
`dp_of`                     the `DP` of a manifest's ``privacy`` (``PrivacyParams``)
`privacy_accountant`        ``manifest -> accountant | None``: what a node's engine gets (None without privacy;
                            `PrivacyUnavailable` for a privacy manifest without opacus)
`noise_multiplier_for`      ``(epsilon, delta, sample_rate, steps) -> sigma``: the noise a budget needs
`PrivacyUnavailable`        the ImportError raised without opacus: "differential privacy needs opacus:
                            pip install 'peerloom[dp]'"
`require_opacus`            the opacus module, or `PrivacyUnavailable`
=========================== ================================================================================

Importing this module imports neither opacus nor torch (the functions load opacus when called). The
implementation is `peerloom.backends.privacy`; sources: DP-SGD, Abadi et al. 2016 (arXiv:1607.00133);
Rényi DP, Mironov 2017 (arXiv:1702.07476); the subsampled Gaussian's RDP, Mironov, Talwar, Zhang 2019
(arXiv:1908.10530); Opacus, Yousefpour et al. 2021 (arXiv:2109.12298).
"""

from peerloom.backends.privacy import (
    DP,
    INSTALL_HINT,
    PrivacyUnavailable,
    accountant,
    dp_of,
    epsilon,
    noise_multiplier_for,
    privacy_accountant,
    require_opacus,
)

__all__ = ["DP", "INSTALL_HINT", "PrivacyUnavailable", "accountant", "dp_of", "epsilon", "noise_multiplier_for",
           "privacy_accountant", "require_opacus"]

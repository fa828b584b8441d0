"""dpcore/accountants/moments.py: the moments accountant reproduces Abadi et al. 2016 (ε ≈ 1.26 at
q = 0.01, σ = 4, T = 10,000, δ = 1e-5, beside RDP's and PLD's tighter values), and our independently
written log moments match dp_accounting's RDP at the same integer orders under the classic
conversion."""

import math

import dp_accounting
import numpy as np
import pytest

import dpcore
from dpcore.accounting import POISSON_GAUSSIAN, PrivacyEvent


def test_abadi_moments_accountant_reproduces_1_26():
    # Abadi et al. 2016: q=0.01, σ=4, T=10,000, δ=1e-5 gives ε≈1.26 with the moments accountant.
    eps = dpcore.dpsgd_epsilon(4.0, 0.01, 10_000, 1e-5, accountant="moments")
    assert round(eps, 2) == 1.26
    # The modern RDP conversion gives ≈1.04 and PLD ≈0.95.
    assert dpcore.dpsgd_epsilon(4.0, 0.01, 10_000, 1e-5, accountant="rdp") == pytest.approx(1.04, abs=0.01)
    assert dpcore.dpsgd_epsilon(4.0, 0.01, 10_000, 1e-5, accountant="pld") == pytest.approx(0.95, abs=0.01)


@pytest.mark.parametrize("q, sigma", [(0.01, 4.0), (0.05, 1.1), (0.3, 2.5), (1.0, 3.0)])
def test_independent_moments_implementation_matches_dp_accounting_rdp(q, sigma):
    """Our log moments (exact binomial sum, written independently) against dp_accounting's RDP
    at the same integer orders, both converted with the classic bound
    ε = min_α RDP(α) + log(1/δ)/(α−1)."""
    delta, steps = 1e-5, 500
    orders = list(range(2, 65))
    ev = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    acc = dp_accounting.rdp.RdpAccountant(orders=[float(o) for o in orders])
    acc.compose(ev)
    rdp = np.asarray(acc._rdp)  # dp_accounting keeps the composed RDP curve here (no public getter)
    classic_dpa = float(np.min(rdp + math.log(1 / delta) / (np.asarray(orders) - 1)))
    ours = dpcore.moments_epsilon(
        [(PrivacyEvent(POISSON_GAUSSIAN, sigma, q), steps)], delta, orders=[o - 1 for o in orders]
    )
    assert ours == pytest.approx(classic_dpa, rel=1e-8)

"""dpcore/accountants/analytic.py: the closed form of unsampled Gaussian releases (μ-GDP) is the
exact ε, never above dp_accounting's PLD and within 1e-6 of it; it lets a DP-PCA prior that alone
spends the budget be refused at once, without the accountant; and its log Φ matches scipy far
into the tail where Φ underflows."""

import math

import dp_accounting
import pytest

from dpcore.accounting import GAUSSIAN, POISSON_GAUSSIAN, PrivacyEvent


@pytest.mark.parametrize(
    "sigmas, delta",
    [([1.0], 1e-5), ([0.5], 1e-5), ([2.0, 2.0, 2.0], 1e-6), ([0.3], 1e-5), ([8.0], 1e-5), ([4.0, 1.5], 1e-7)],
)
def test_closed_form_gaussian_epsilon_is_tight_beside_dp_accountings_pld(sigmas, delta):
    """The closed form of unsampled Gaussian releases (μ-GDP composition, Balle & Wang's profile)
    against dp_accounting's own PLD of the same releases: never above it (it is the exact ε,
    PLD's a pessimistic discretisation), and within 1e-6 of it."""
    from dpcore.accountants import analytic

    groups = [(PrivacyEvent(GAUSSIAN, s, 1.0), 1) for s in sigmas]
    mu = analytic.gaussian_mu(groups)
    assert mu == pytest.approx(math.sqrt(sum(1 / s**2 for s in sigmas)), rel=1e-15)
    exact = analytic.gaussian_epsilon(mu, delta)
    acc = dp_accounting.pld.PLDAccountant()
    for s in sigmas:
        acc.compose(dp_accounting.GaussianDpEvent(s))
    reference = acc.get_epsilon(delta)
    assert exact <= reference <= exact * (1 + 1e-6), (exact, reference)
    assert analytic.gaussian_delta(mu, exact) <= delta
    assert analytic.gaussian_mu([(PrivacyEvent(POISSON_GAUSSIAN, 1.0, 0.5), 1)]) is None  # sampled: not covered


def test_a_pca_prior_that_spends_the_budget_is_refused_without_the_accountant(monkeypatch):
    """pca_noise_multiplier=0.01 spends ε≈5,426 at δ=1e-5. The PLD accountant would take minutes
    to say so (its cost grows as 1/σ²); the closed form refuses at once, with its exact ε."""
    import dpcore.engine
    from dpcore.pca import pca_event

    def no_accountant(*a, **k):
        raise AssertionError("the accountant was asked for the prior's ε")

    monkeypatch.setattr(dpcore.engine, "epsilon", no_accountant)
    with pytest.raises(dpcore.DPConfigError, match=r"alone spend ε=5426 ≥ target_epsilon=3"):
        dpcore.plan(
            dataset_size=1000,
            lot_size=100,
            epochs=1,
            target_epsilon=3.0,
            target_delta=1e-5,
            prior_groups=[(pca_event(0.01), 1)],
        )


def test_the_closed_forms_normal_tail_matches_scipy_where_the_cdf_underflows():
    """log Φ(x) by erfc down to −30 and by its asymptotic series below (Φ underflows near −37):
    within 1e-12 of scipy's log_ndtr at both sides of the switch and far into the tail."""
    from scipy.special import log_ndtr

    from dpcore.accountants.analytic import _log_normal_cdf

    for x in (-0.01, -1.0, -5.0, -29.99, -30.0, -30.01, -37.0, -50.03, -100.0, -1e4):
        assert _log_normal_cdf(x) == pytest.approx(float(log_ndtr(x)), rel=1e-12), x

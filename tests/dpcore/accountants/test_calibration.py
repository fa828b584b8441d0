"""dpcore/accountants/calibration.py: the calibrated σ meets its target within 1 % and within 0.5 %
of a plain PLD bisection; max_steps is the exact inverse, respects its limit exactly, and equals a
fine-grid-only search; the galloping count search is exact whatever its guess; the search hands the
accountant the ledger's canonical form; and the one-release precheck agrees with dp_accounting's
full accountants, refusing a tiny σ at once."""

import subprocess
import sys

import dp_accounting
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dpcore

from .._common import _dpa_pld


@pytest.mark.parametrize(
    "eps, q, steps",
    # 1e-6: the coarse PLD search rounds ε to 0 at large σ (it raised a math domain error)
    [(2.0, 4096 / 50000, 915), (1.0, 0.01, 1000), (8.0, 0.1, 300), (0.5, 0.004, 5000), (1e-6, 0.05, 100)],
)
def test_calibrated_sigma_meets_target_within_one_percent(eps, q, steps):
    sigma = dpcore.calibrate_noise_multiplier(eps, 1e-5, q, steps)
    ev = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    got = _dpa_pld(ev, 1e-5)
    assert got <= eps
    assert got >= 0.99 * eps
    # Smallest: 2 % less noise already overspends.
    ev_less = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma * 0.98)), steps
    )
    assert _dpa_pld(ev_less, 1e-5) > eps


def test_calibrated_sigma_is_within_half_a_percent_above_a_plain_pld_bisection():
    """Issue P's setting: ε=2, δ=1e-5, q=4096/50000, 915 steps. The reference is a bisection
    on σ with dp_accounting's PLDAccountant evaluated from scratch at every trial."""
    import dp_accounting
    from dp_accounting import pld

    q, steps = 4096 / 50000, 915

    def eps(sigma):
        acc = pld.PLDAccountant()
        acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
        return acc.get_epsilon(1e-5)

    lo, hi = 1.0, 20.0
    while hi / lo > 1.0001:
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if eps(mid) > 2.0 else (lo, mid)
    ours = dpcore.calibrate_noise_multiplier(2.0, 1e-5, q, steps)
    assert hi <= ours <= hi * 1.005, (ours, hi)
    assert eps(ours) <= 2.0


def test_max_steps_is_the_exact_inverse():
    sigma, q, eps, delta = 1.0, 0.05, 3.0, 1e-5
    t = dpcore.max_steps(sigma, q, eps, delta)
    assert t > 0

    def mk(n):
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), n
        )

    assert _dpa_pld(mk(t), delta) <= eps < _dpa_pld(mk(t + 1), delta)


def test_max_steps_respects_its_limit_exactly():
    sigma, q, eps, delta = 1.0, 0.05, 3.0, 1e-5
    t = dpcore.max_steps(sigma, q, eps, delta)
    assert dpcore.max_steps(sigma, q, eps, delta, limit=t + 9) == t  # the limit is not returned unchecked
    assert dpcore.max_steps(sigma, q, eps, delta, limit=t - 3) == t - 3
    assert dpcore.max_steps(sigma, q, eps, delta, limit=t) == t


@given(st.integers(0, 500), st.integers(-50, 600), st.integers(1, 520))
@settings(max_examples=300, deadline=None)
def test_galloping_search_is_exact_whatever_the_guess(answer, guess, limit):
    """The count search started from a (coarse-grid) guess returns exactly what the plain
    doubling-and-bisection search returns, for any monotone predicate, guess and limit."""
    from dpcore.accounting import _largest_count, _largest_count_near

    calls = []

    def fits(t):
        calls.append(t)
        assert 1 <= t <= limit  # never asks outside [1, limit]
        return t <= answer

    assert _largest_count_near(fits, guess, limit) == _largest_count(lambda t: t <= answer, limit) == min(answer, limit)


def test_max_steps_on_the_fine_grid_equals_a_fine_only_search():
    """The coarse-then-fine search gives the same count as a search on the fine grid alone,
    at counts where the coarse and fine grids straddle the boundary differently or not."""
    from dpcore.accounting import PLD_VALUE_DISCRETIZATION, PrivacyEvent, _largest_count, epsilon

    for sigma, q, eps in [(0.6457, 0.0095, 3.0), (1.1, 0.02, 1.0), (4.05, 0.1365, 3.0)]:
        ev = PrivacyEvent.dpsgd_step(sigma, q)
        fine = _largest_count(
            lambda t, ev=ev, eps=eps: epsilon([(ev, t)], 1e-5, "pld", PLD_VALUE_DISCRETIZATION) <= eps, 10**6
        )
        assert dpcore.max_steps(sigma, q, eps, 1e-5) == fine


def test_the_budget_check_composes_the_canonical_form_the_ledger_does(monkeypatch):
    """The allowance search (the step event after the others) and the ledger's ε (events as
    first seen) hand the accountant the same canonical form, so they agree to the bit at the
    boundary (the review of the day's diff: the search called the accountant directly)."""
    from dpcore.accountants import calibration, pld

    seen = []
    real = pld.PLD.epsilon

    def spy(self, groups, delta, *, coarse=False):
        seen.append(list(groups))
        return real(self, groups, delta, coarse=coarse)

    monkeypatch.setattr(pld.PLD, "epsilon", spy)
    a, b = dpcore.PrivacyEvent.dpsgd_step(1.1, 0.01), dpcore.PrivacyEvent.dpsgd_step(1.3, 0.02)
    assert dpcore.events.positive_groups([(b, 1), (a, 1)])[0][0] == a  # the canonical order is not the search's
    calibration.max_steps(1.1, 0.01, 2.0, 1e-5, prior_groups=[(b, 50), (a, 0)], event=a)
    calibration.calibrate_noise_multiplier(3.0, 1e-5, 0.01, 100, prior_groups=[(b, 5)])
    assert seen and all(g == dpcore.events.positive_groups(g) for g in seen)


@pytest.mark.parametrize("z", [0.3, 0.55, 0.9, 1.4])
@pytest.mark.parametrize("q", [0.05, 0.3, 1.0])
def test_the_one_release_precheck_agrees_with_the_full_accountants(z, q):
    """max_steps refuses at once when one release alone exceeds (ε, δ), from dp_accounting's
    closed-form δ at ε (helper-42: a tiny σ built its PLD for minutes first). The precheck says
    "exceeds" exactly where dp_accounting's own PLD and RDP accountants give one release an ε
    above the target (away from the boundary), and never where they fit it."""
    from dpcore.accountants.calibration import one_release_exceeds

    event = dpcore.PrivacyEvent.dpsgd_step(z, q)
    for eps, delta in ((1.0, 1e-5), (4.0, 1e-5), (8.0, 1e-3)):
        pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
        pld.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)))
        exact = pld.get_epsilon(delta)
        if abs(exact - eps) < 1e-3 * eps:
            continue  # at the boundary the full computation decides
        assert one_release_exceeds(event, eps, delta) == (exact > eps), (z, q, eps, delta, exact)
        fits = dpcore.max_steps(z, q, eps, delta, "pld") >= 1
        assert fits == (exact <= eps)


def test_a_tiny_noise_multiplier_is_refused_at_once():
    """σ = 0.01 (a typo for 1.0): without the precheck this ran for more than 400 s (helper-42)."""
    code = "import dpcore; print(dpcore.max_steps(0.01, 0.3, 8.0, 1e-3, 'pld', limit=10**6))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.split()[-1] == "0", res.stderr[-2000:]

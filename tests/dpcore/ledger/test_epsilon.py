"""The ledger's ε readout (dpcore/ledger/ledger.py, dpcore/readout.py): ε from the ledger alone equals
dp_accounting's own value (PLD and RDP, mixed events, Laplace events, rolled-back steps counted);
per-entry ε is cumulative and exact where computed; by default ε is composed only when asked while
the budget check stays exact; and ε is shown rounded up, never below the ledger's value."""

import math

import dp_accounting
import pytest

import dpcore
from dpcore import accounting
from dpcore.accounting import GAUSSIAN, PrivacyEvent

from .._common import _dpa_pld, _dpa_rdp


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_ledger_epsilon_equals_dp_accountings_own_value(accountant):
    ledger = dpcore.PrivacyLedger(None, 1e-6, accountant=accountant, epsilon_every=50)
    for step in range(1, 121):
        ledger.append(PrivacyEvent.dpsgd_step(1.1, 0.02), step=step, clip_norm=1.0)
    for _ in range(3):  # e.g. DP-PCA releases, composed with a count (helper-6: a count of 1 left σ/√k unchecked)
        ledger.append(PrivacyEvent(GAUSSIAN, 6.0), step=121, clip_norm=1.0)
    for step in range(122, 152):
        ledger.append(PrivacyEvent.dpsgd_step(0.9, 0.05), step=step, clip_norm=1.0)
    ours = ledger.epsilon()
    independent = dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.1)), 120
            ),
            dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(6.0), 3),
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(0.9)), 30
            ),
        ]
    )
    ref = _dpa_pld(independent, 1e-6) if accountant == "pld" else _dpa_rdp(independent, 1e-6)
    assert ours == pytest.approx(ref, rel=1e-9)
    assert ledger.entries[-1].epsilon == ours


def test_per_entry_epsilon_is_cumulative_and_exact_where_computed():
    ledger = dpcore.PrivacyLedger(None, 1e-5, epsilon_every=10)
    ev = PrivacyEvent.dpsgd_step(1.0, 0.05)
    for step in range(1, 31):
        ledger.append(ev, step=step, clip_norm=0.5)
    computed = [(e.step, e.epsilon) for e in ledger.entries if e.epsilon is not None]
    assert [s for s, _ in computed] == [1, 10, 20, 30]
    for s, eps in computed:
        ref = _dpa_pld(dp_accounting.SelfComposedDpEvent(ev.to_dp_event(), s), 1e-5)
        assert eps == pytest.approx(ref, rel=1e-9)
    assert all(a < b for (_, a), (_, b) in zip(computed, computed[1:]))
    cols = ledger.to_columns()
    assert len(cols["step"]) == 30 and math.isnan(cols["epsilon"][1]) and cols["accountant"][0] == "pld"


def test_by_default_the_ledger_composes_only_when_asked_and_the_budget_check_stays_exact(monkeypatch):
    """epsilon_every=None (the default, also make_private's): no fresh composition per
    release. ε is composed on the first release of each kind and on request; the budget check
    refuses exactly the first release past the target."""
    from dpcore import accountants

    ev = PrivacyEvent.dpsgd_step(1.5, 0.05)
    fit = dpcore.max_steps(1.5, 0.05, 1.0, 1e-5)
    ledger = dpcore.PrivacyLedger(1.0, 1e-5)
    assert ledger.allowance(ev) == fit  # the budget check's bound: found once, by bisection
    calls = []
    real = accountants.epsilon
    monkeypatch.setattr(accountants, "epsilon", lambda *a, **k: calls.append(a) or real(*a, **k))
    for step in range(1, fit + 1):
        ledger.append(ev, step=step, clip_norm=1.0)
    assert len(calls) == 1 and ledger.entries[0].epsilon is not None and ledger.entries[-1].epsilon is None
    with pytest.raises(dpcore.BudgetExceededError):
        ledger.append(ev, step=fit + 1, clip_norm=1.0)
    eps = ledger.epsilon()
    assert eps == pytest.approx(_dpa_pld(dp_accounting.SelfComposedDpEvent(ev.to_dp_event(), fit), 1e-5), rel=1e-9)
    assert eps <= 1.0 and ledger.entries[-1].epsilon == eps and len(ledger) == fit
    other = PrivacyEvent.dpsgd_step(3.0, 0.05)  # a new kind of event: composed at once
    ledger.append(other, step=fit + 1, clip_norm=1.0, check_budget=False)
    assert ledger.entries[-1].epsilon is not None
    with pytest.raises(dpcore.DPConfigError, match="None \\(only when asked\\) or an integer ≥ 1"):
        dpcore.PrivacyLedger(None, 1e-5, epsilon_every=0)


def test_rolled_back_steps_stay_marked_and_are_counted():
    ev = PrivacyEvent.dpsgd_step(1.0, 0.05)
    ledger = dpcore.PrivacyLedger(None, 1e-5)
    for s in range(1, 21):
        ledger.append(ev, step=s, clip_norm=1.0)
    assert ledger.mark_rolled_back(after_step=15) == 5
    for s in range(16, 21):  # the restart re-runs steps 16..20
        ledger.append(ev, step=s, clip_norm=1.0)
    assert sorted(ledger.committed_steps()) == list(range(1, 21))
    assert sum(e.status == "rolled_back" for e in ledger.entries) == 5
    ref = _dpa_pld(dp_accounting.SelfComposedDpEvent(ev.to_dp_event(), 25), 1e-5)
    assert ledger.epsilon() == pytest.approx(ref, rel=1e-9)


def test_laplace_events_are_accounted_by_dp_accounting():
    ledger = dpcore.PrivacyLedger(None, 1e-5)
    ev = PrivacyEvent(accounting.POISSON_LAPLACE, 2.0, 0.1)
    for s in range(1, 11):
        ledger.append(ev, step=s, clip_norm=1.0)
    ref = _dpa_pld(dp_accounting.SelfComposedDpEvent(ev.to_dp_event(), 10), 1e-5)
    assert ledger.epsilon() == pytest.approx(ref, rel=1e-9)
    with pytest.raises(dpcore.DPConfigError, match="Gaussian events only"):
        dpcore.epsilon([(ev, 3)], 1e-5, accountant="moments")


def test_epsilon_is_shown_rounded_up_never_below_the_ledgers_value():
    """helper-29/31: ``f"{1.00499:.2f}"`` reads 1.00, below the ledger's ε; what is shown rounds up."""
    import random

    from dpcore.readout import epsilon_text

    assert epsilon_text(1.00499, ".2f") == "1.01" and epsilon_text(1.99499, ".2f") == "2.00"
    assert epsilon_text(2.98701) == "2.98701" and epsilon_text(2.9870100001) == "2.98702"  # .6g
    assert epsilon_text(9.99991, ".4g") == "10" and epsilon_text(3.0, ".2f") == "3.00"
    assert epsilon_text(float("inf"), ".2f") == "inf"
    assert epsilon_text(1e30, ".4f") == "1000000000000000000000000000000.0000"  # past Decimal's 28 digits (helper-35)
    assert epsilon_text(3.0, "6.2f") == "  3.00" and epsilon_text(0.0, ".4g") == "0"  # other specs: as format()
    rng = random.Random(0)
    for _ in range(2000):
        eps = 10 ** rng.uniform(-3, 3)
        for spec, unit in ((".2f", 1e-2), (".4f", 1e-4), (".4g", None), (".6g", None)):
            shown = float(epsilon_text(eps, spec))
            step = unit if unit else 10 ** (math.floor(math.log10(eps)) - int(spec[1]) + 1)
            assert eps <= shown < eps + step * (1 + 1e-9), (eps, spec, shown)

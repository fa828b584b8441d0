"""The ledger's budget check and allowances (dpcore/ledger/ledger.py): the ledger refuses exactly the
release that would exceed its budget, before anything is released, and an allowance primed from the
driver's plan equals the one the ledger computes itself."""

import dp_accounting
import pytest

import dpcore
from dpcore.accounting import PrivacyEvent

from .._common import _dpa_pld


def test_ledger_refuses_the_step_that_would_exceed_the_budget():
    ev = PrivacyEvent.dpsgd_step(1.2, 0.05)
    ledger = dpcore.PrivacyLedger(2.0, 1e-5)
    appended = 0
    with pytest.raises(dpcore.BudgetExceededError, match="Nothing was released"):
        while True:
            ledger.check(ev)
            ledger.append(ev, step=appended + 1, clip_norm=1.0)
            appended += 1
    assert len(ledger) == appended > 0
    assert ledger.epsilon() <= 2.0
    over = dp_accounting.SelfComposedDpEvent(ev.to_dp_event(), appended + 1)
    assert _dpa_pld(over, 1e-5) > 2.0
    # append() re-checks on its own as well.
    with pytest.raises(dpcore.BudgetExceededError):
        ledger.append(ev, step=appended + 1, clip_norm=1.0)
    assert len(ledger) == appended


@pytest.mark.parametrize("same", [False, True], ids=["pca-apart", "pca-same-as-a-step"])
def test_a_primed_allowance_equals_the_computed_one(same):
    """The driver's plan seeds the budget check with max_steps (steps beyond the prior releases);
    the ledger's allowance is then the one it would compute itself, also where a prior release
    is the step's own event (a DP-PCA release sampled at the step's q and σ): it was one short."""
    ev = dpcore.PrivacyEvent.dpsgd_step(1.1, 0.05)
    prior_event = ev if same else dpcore.PrivacyEvent.of("gaussian", 4.0, 1.0)
    prior = [(prior_event, 1)]
    k = dpcore.max_steps(1.1, 0.05, 3.0, 1e-5, "pld", prior_groups=prior, event=ev)
    primed, computed = dpcore.PrivacyLedger(3.0, 1e-5), dpcore.PrivacyLedger(3.0, 1e-5)
    primed.prime_allowance(ev, prior, k)
    for ledger in (primed, computed):
        ledger.append(prior_event, step=0, clip_norm=1.0)
        for s in range(1, 4):
            ledger.append(ev, step=s, clip_norm=1.0)
    assert primed.allowance(ev) == computed.allowance(ev) == k - 3


def test_a_primed_allowance_over_the_budget_is_refused_and_not_cached():
    """The budget check reads a primed count from its cache, so the count is checked once
    against the ledger's own accountant: one release more than max_steps is refused (helper-3:
    a count of 10**6 was taken as it was), and the ledger then computes its own allowance."""
    ev = dpcore.PrivacyEvent.dpsgd_step(1.1, 0.05)
    prior = [(dpcore.PrivacyEvent.of("gaussian", 4.0, 1.0), 1)]
    k = dpcore.max_steps(1.1, 0.05, 3.0, 1e-5, "pld", prior_groups=prior, event=ev)
    ledger = dpcore.PrivacyLedger(3.0, 1e-5)
    for wrong in (k + 1, 10**6):
        with pytest.raises(dpcore.DPConfigError, match="does not fit this ledger's budget"):
            ledger.prime_allowance(ev, prior, wrong)
    rdp_k = dpcore.max_steps(1.1, 0.05, 3.0, 1e-5, "rdp", prior_groups=prior, event=ev)
    assert rdp_k < k  # a count planned with another accountant fits the other way round only
    with pytest.raises(dpcore.DPConfigError):
        dpcore.PrivacyLedger(3.0, 1e-5, "rdp").prime_allowance(ev, prior, k)
    ledger.append(prior[0][0], step=0, clip_norm=1.0)
    assert ledger.allowance(ev) == k  # computed afresh: nothing wrong was cached
    ledger.prime_allowance(ev, prior, k)  # the plan's own count is accepted
    assert ledger.allowance(ev) == k


def test_a_prior_listed_in_pieces_primes_the_allowance_the_ledger_looks_up(monkeypatch):
    """The ledger keeps one count per event; a plan's prior given as pieces of one event (two
    DP-PCA releases listed apart) primes the entry that history looks up (helper-5: it was
    cached under a key no history makes, and the search ran again)."""
    from dpcore.accountants import calibration

    ev = dpcore.PrivacyEvent.dpsgd_step(1.1, 0.05)
    pca = dpcore.PrivacyEvent.of("gaussian", 6.0, 1.0)
    k = dpcore.max_steps(1.1, 0.05, 3.0, 1e-5, "pld", prior_groups=[(pca, 2)], event=ev)
    ledger = dpcore.PrivacyLedger(3.0, 1e-5)
    ledger.prime_allowance(ev, [(pca, 1), (pca, 1)], k)
    ledger.append(pca, step=0, clip_norm=1.0)
    ledger.append(pca, step=0, clip_norm=1.0)
    searched = []
    real = calibration.max_steps
    monkeypatch.setattr(calibration, "max_steps", lambda *a, **kw: searched.append(1) or real(*a, **kw))
    assert ledger.allowance(ev) == k and not searched  # read from the primed entry

"""Invariants 6 and 8: ε from the ledger alone, equal to dp_accounting's own value; the
moments accountant reproduces Abadi et al.; calibration; the budget; state_dict round trips
and rolled-back steps."""

import io
import json
import math
import subprocess
import sys

import dp_accounting
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dpcore
from dpcore import accounting
from dpcore.accounting import GAUSSIAN, POISSON_GAUSSIAN, PrivacyEvent


def _dpa_pld(event, delta):
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(event)
    return acc.get_epsilon(delta)


def _dpa_rdp(event, delta, orders=None):
    acc = dp_accounting.rdp.RdpAccountant(orders=orders) if orders else dp_accounting.rdp.RdpAccountant()
    acc.compose(event)
    return acc.get_epsilon(delta)


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


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_ledger_epsilon_equals_dp_accountings_own_value(accountant):
    ledger = dpcore.PrivacyLedger(None, 1e-6, accountant=accountant, epsilon_every=50)
    for step in range(1, 121):
        ledger.append(PrivacyEvent.dpsgd_step(1.1, 0.02), step=step, clip_norm=1.0)
    ledger.append(PrivacyEvent(GAUSSIAN, 6.0), step=121, clip_norm=1.0)  # e.g. a DP-PCA release
    for step in range(122, 152):
        ledger.append(PrivacyEvent.dpsgd_step(0.9, 0.05), step=step, clip_norm=1.0)
    ours = ledger.epsilon()
    independent = dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.1)), 120
            ),
            dp_accounting.GaussianDpEvent(6.0),
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


def test_the_readable_ledger_has_one_row_per_run_of_identical_releases():
    """ledger.runs() (the MLflow UI's table): runs of consecutive identical releases, rolled-back
    ones apart, each with the cumulative ε after it, checked against dp_accounting."""
    a, b = PrivacyEvent.dpsgd_step(2.0, 0.02), PrivacyEvent.dpsgd_step(4.0, 0.05)
    ledger = dpcore.PrivacyLedger(None, 1e-5)
    for step in range(1, 11):
        ledger.append(a, step=step, clip_norm=1.0)
    ledger.mark_rolled_back(after_step=7)  # a restart from the step-7 checkpoint
    for step in range(8, 12):
        ledger.append(a, step=step, clip_norm=1.0)
    for step in range(12, 14):
        ledger.append(b, step=step, clip_norm=0.5)
    rows = ledger.runs()
    assert [(r["kind"], r["status"], r["count"], r["first_step"], r["last_step"], r["clip_norm"]) for r in rows] == [
        ("poisson_gaussian", "committed", 7, 1, 7, 1.0),
        ("poisson_gaussian", "rolled_back", 3, 8, 10, 1.0),
        ("poisson_gaussian", "committed", 4, 8, 11, 1.0),
        ("poisson_gaussian", "committed", 2, 12, 13, 0.5),
    ]
    assert sum(r["count"] for r in rows) == len(ledger) == 16
    prefix = [(7, 0), (10, 0), (14, 0), (14, 2)]  # releases of a and b up to the end of each row
    for r, (na, nb) in zip(rows, prefix):
        events = [dp_accounting.SelfComposedDpEvent(a.to_dp_event(), na)]
        if nb:
            events.append(dp_accounting.SelfComposedDpEvent(b.to_dp_event(), nb))
        assert r["epsilon_after"] == pytest.approx(_dpa_pld(dp_accounting.ComposedDpEvent(events), 1e-5), rel=1e-9)
    assert rows[-1]["epsilon_after"] == ledger.epsilon()


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


def test_max_steps_is_the_exact_inverse():
    sigma, q, eps, delta = 1.0, 0.05, 3.0, 1e-5
    t = dpcore.max_steps(sigma, q, eps, delta)
    assert t > 0

    def mk(n):
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), n
        )

    assert _dpa_pld(mk(t), delta) <= eps < _dpa_pld(mk(t + 1), delta)


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


def test_ledger_survives_a_state_dict_round_trip_through_a_checkpoint():
    ledger = dpcore.PrivacyLedger(4.0, 1e-5, epsilon_every=7)
    ev = PrivacyEvent.dpsgd_step(1.0, 0.03)
    for s in range(1, 40):
        ledger.append(ev, step=s, clip_norm=1.0)
    ledger.mark_rolled_back(after_step=30)
    buf = io.BytesIO()
    torch.save({"ledger": ledger.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)["ledger"]
    restored = dpcore.PrivacyLedger(4.0, 1e-5)
    restored.load_state_dict(state)
    assert _cols_equal(restored.to_columns(), ledger.to_columns())
    assert restored.epsilon() == ledger.epsilon()
    assert restored.allowance(ev) == ledger.allowance(ev)
    # A resumed ledger must keep its budget, δ and accountant.
    with pytest.raises(dpcore.DPConfigError, match="budget"):
        dpcore.PrivacyLedger(8.0, 1e-5).load_state_dict(state)
    with pytest.raises(dpcore.DPConfigError, match="δ"):
        dpcore.PrivacyLedger(4.0, 1e-6).load_state_dict(state)


def _ledger_of(ev, releases: int, journal=None) -> dpcore.PrivacyLedger:
    """A ledger at ε = 4, δ = 1e-5 holding ``releases`` of ``ev`` (steps 1, 2, …)."""
    ledger = dpcore.PrivacyLedger(4.0, 1e-5, journal=journal)
    for s in range(1, releases + 1):
        ledger.append(ev, step=s, clip_norm=1.0)
    return ledger


def test_a_state_loaded_into_a_journalled_ledger_is_written_to_its_journal(tmp_path):
    """A state whose releases the journal lacks (a checkpoint of a ledger kept without one) is
    written to the journal before it is taken: a restart, which reads only the journal, counts
    every release and allows no more steps than the budget. A state from another history (its
    releases do not begin with the journal's) is refused."""
    ev = dpcore.PrivacyEvent.dpsgd_step(1.0, 0.05)
    plain = _ledger_of(ev, 30)
    journal = tmp_path / "ledger.journal.jsonl"
    ledger = dpcore.PrivacyLedger(4.0, 1e-5, journal=journal)
    ledger.load_state_dict(plain.state_dict())
    for s in range(31, 36):
        ledger.append(ev, step=s, clip_norm=1.0)
    reopened = dpcore.PrivacyLedger(4.0, 1e-5, journal=journal)
    assert len(reopened) == len(ledger) == 35
    assert reopened.epsilon() == ledger.epsilon() == pytest.approx(dpcore.epsilon([(ev, 35)], 1e-5), rel=1e-12)
    assert reopened.allowance(ev) == ledger.allowance(ev)
    # Loading the same history again, or a later state of it, is fine; another history is not.
    reopened.load_state_dict(ledger.state_dict())
    other = dpcore.PrivacyLedger(4.0, 1e-5)
    for s in range(1, 41):
        other.append(dpcore.PrivacyEvent.dpsgd_step(2.0, 0.05), step=s, clip_norm=1.0)
    with pytest.raises(dpcore.DPConfigError, match="another history"):
        reopened.load_state_dict(other.state_dict())
    assert len(dpcore.PrivacyLedger(4.0, 1e-5, journal=journal)) == 35
    # A checkpoint taken before the journal's rollback: the releases' status differs.
    checkpoint = reopened.state_dict()
    reopened.mark_rolled_back(after_step=30)
    with pytest.raises(dpcore.DPConfigError, match="status .* differs.*mark_rolled_back"):
        dpcore.PrivacyLedger(4.0, 1e-5, journal=journal).load_state_dict(checkpoint)
    # A state this version cannot read is refused before anything is written or taken.
    bad = reopened.state_dict()
    bad["entries"].append({**bad["entries"][-1], "index": 35, "step": 36, "unknown_field": 1})
    with pytest.raises(dpcore.DPConfigError, match="cannot read"):
        reopened.load_state_dict(bad)
    bad["entries"][-1] = {**bad["entries"][-2], "index": 7}
    with pytest.raises(dpcore.DPConfigError, match="malformed"):
        reopened.load_state_dict(bad)
    after = dpcore.PrivacyLedger(4.0, 1e-5, journal=journal)
    assert len(after) == len(reopened) == 35 and after.epsilon() == reopened.epsilon()


def test_a_journal_write_that_fails_while_a_state_loads_leaves_the_ledger_as_it_was(tmp_path, monkeypatch):
    """The state's releases go to the journal before the ledger takes them: when a write fails
    part-way (a full disk), the ledger still holds only what it held, and the journal holds
    those and the releases written before the failure, so a restart counts at least as many
    releases as any ledger in memory ever did."""
    from dpcore.ledger.journal import Journal

    ev = dpcore.PrivacyEvent.dpsgd_step(1.0, 0.05)
    plain = _ledger_of(ev, 20)
    journal = tmp_path / "ledger.journal.jsonl"
    ledger = _ledger_of(ev, 5, journal=journal)
    before = (len(ledger), ledger.epsilon(), ledger.allowance(ev))
    write, written = Journal.write, []

    def fails_on_the_fourth(self, record):
        if len(written) == 3:
            raise OSError(28, "No space left on device")
        write(self, record)
        written.append(record)

    monkeypatch.setattr(Journal, "write", fails_on_the_fourth)
    with pytest.raises(OSError, match="No space"):
        ledger.load_state_dict(plain.state_dict())
    monkeypatch.setattr(Journal, "write", write)
    assert (len(ledger), ledger.epsilon(), ledger.allowance(ev)) == before
    assert [r["step"] for r in written] == [6, 7, 8]
    reopened = dpcore.PrivacyLedger(4.0, 1e-5, journal=journal)
    assert len(reopened) == 8 and reopened.epsilon() == pytest.approx(dpcore.epsilon([(ev, 8)], 1e-5), rel=1e-12)
    reopened.load_state_dict(plain.state_dict())  # with the disk back, the rest is written and taken
    assert len(reopened) == len(dpcore.PrivacyLedger(4.0, 1e-5, journal=journal)) == 20


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


def _cols_equal(a, b):
    for k in a:
        for x, y in zip(a[k], b[k]):
            if not (x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))):
                return False
    return True


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


def test_ledger_columns_load_into_arrow():
    pa = pytest.importorskip("pyarrow")
    ledger = dpcore.PrivacyLedger(None, 1e-5, epsilon_every=2)
    for s in range(1, 6):
        ledger.append(PrivacyEvent.dpsgd_step(1.0, 0.1), step=s, clip_norm=1.0)
    table = pa.table(ledger.to_columns())
    assert table.num_rows == 5
    assert table.column("step").to_pylist() == [1, 2, 3, 4, 5]
    assert table.schema.field("epsilon").type == pa.float64()
    assert table.schema.field("kind").type == pa.string()


def test_max_steps_respects_its_limit_exactly():
    sigma, q, eps, delta = 1.0, 0.05, 3.0, 1e-5
    t = dpcore.max_steps(sigma, q, eps, delta)
    assert dpcore.max_steps(sigma, q, eps, delta, limit=t + 9) == t  # the limit is not returned unchecked
    assert dpcore.max_steps(sigma, q, eps, delta, limit=t - 3) == t - 3
    assert dpcore.max_steps(sigma, q, eps, delta, limit=t) == t


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


def test_events_are_typed_values_and_the_old_untyped_form_builds_them():
    from dpcore import events

    ev = PrivacyEvent("poisson_gaussian", 1.5, 0.05)
    assert type(ev) is events.PoissonGaussian and ev == PrivacyEvent.dpsgd_step(1.5, 0.05)
    # the type is part of the value
    assert PrivacyEvent.of("laplace", 2.0) == events.Laplace(2.0) != events.Gaussian(2.0)
    assert len({events.Gaussian(2.0), events.Gaussian(2.0), events.Laplace(2.0)}) == 2
    for kind, cls in events.EVENTS.items():  # what a journal stores (the kind) rebuilds the same event
        ev = cls(3.0, 1.0 if not cls.sampled else 0.1)
        assert PrivacyEvent.of(ev.kind, ev.noise_multiplier, ev.sample_rate) == ev and ev.kind == kind
    with pytest.raises(dpcore.DPConfigError, match="whole dataset"):
        events.Gaussian(2.0, 0.5)
    with pytest.raises(dpcore.DPConfigError, match="unknown"):
        PrivacyEvent.of("exponential", 1.0)


def test_an_accountant_added_to_the_registry_is_used_by_calibration_and_the_ledger_budget():
    """One class meeting the protocol plus one register() call: the ledger, calibration and
    max_steps use it by name. This one doubles RDP's ε, so everything must come out exactly as
    RDP at half the target."""
    from dpcore import accountants
    from dpcore.accountants.rdp import RDP

    class DoubleRDP(RDP):
        name = "double_rdp"

        def epsilon(self, groups, delta, *, coarse=False):
            return 2.0 * super().epsilon(groups, delta, coarse=coarse)

    accountants.register(DoubleRDP())
    try:
        ev = PrivacyEvent.dpsgd_step(1.2, 0.02)
        fit = dpcore.max_steps(1.2, 0.02, 4.0, 1e-5, accountant="double_rdp")
        assert fit == dpcore.max_steps(1.2, 0.02, 2.0, 1e-5, accountant="rdp") > 0
        ledger = dpcore.PrivacyLedger(4.0, 1e-5, accountant="double_rdp")
        for step in range(1, fit + 1):
            ledger.append(ev, step=step, clip_norm=1.0)
        with pytest.raises(dpcore.BudgetExceededError):
            ledger.check(ev)
        assert ledger.epsilon() == pytest.approx(2.0 * dpcore.epsilon([(ev, fit)], 1e-5, "rdp"))
        sigma = dpcore.calibrate_noise_multiplier(4.0, 1e-5, 0.02, 500, accountant="double_rdp")
        assert sigma == pytest.approx(
            dpcore.calibrate_noise_multiplier(2.0, 1e-5, 0.02, 500, accountant="rdp"), rel=0.01
        )
    finally:
        del accountants.ACCOUNTANTS["double_rdp"]
    with pytest.raises(dpcore.DPConfigError, match="unknown"):
        dpcore.PrivacyLedger(1.0, 1e-5, accountant="double_rdp")


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


def test_a_pld_handed_to_another_process_gives_its_ledger_the_same_epsilon_without_building_it(tmp_path):
    """The driver hands its workers the PLDs it built while planning (export_base_plds); a
    worker's ledger then records the same ε as dp_accounting, bit for bit the driver's, and
    builds nothing (here the construction raises)."""
    import pickle
    import subprocess
    import sys

    from dpcore.accountants.pld import export_base_plds

    step = dpcore.PrivacyEvent.dpsgd_step(0.7968, 0.0379)
    pca = PrivacyEvent(GAUSSIAN, 6.0, 1.0)  # a Gaussian event: composed directly, never handed
    handed = export_base_plds([pca, step])
    assert [e for e, _, _ in handed] == [step]
    (tmp_path / "plds.pkl").write_bytes(pickle.dumps(handed))
    here = [dpcore.epsilon([(step, 1)], 1e-5), dpcore.epsilon([(pca, 1), (step, 26)], 1e-5)]
    code = f"""
import json, pickle
import dp_accounting.pld.privacy_loss_distribution as built
import dpcore
from dpcore.accountants.pld import import_base_plds
from dpcore.accounting import GAUSSIAN, PrivacyEvent

def refuse(*args, **kwargs):
    raise AssertionError("built a subsampled PLD")

real = built.from_gaussian_mechanism
built.from_gaussian_mechanism = lambda *a, **k: refuse() if k.get("sampling_prob", 1.0) < 1 else real(*a, **k)
import_base_plds(pickle.load(open({str(tmp_path / "plds.pkl")!r}, "rb")))
step = dpcore.PrivacyEvent.dpsgd_step(0.7968, 0.0379)
ledger = dpcore.PrivacyLedger(3.0, 1e-5)
first = ledger.append(step, step=1, clip_norm=1.0, check_budget=False).epsilon
many = dpcore.epsilon([(PrivacyEvent(GAUSSIAN, 6.0, 1.0), 1), (step, 26)], 1e-5)
print(json.dumps([first, many]))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    there = json.loads(res.stdout.strip().splitlines()[-1])
    assert there == here
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(0.0379, dp_accounting.GaussianDpEvent(0.7968)), 1)
    assert there[0] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)


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


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_epsilon_does_not_depend_on_the_order_or_grouping_of_the_releases(accountant):
    """helper-29: PLD composition in another order gave ε 5e-12 apart, so the budget check (the
    step event last) and the ledger (events as first seen) could disagree at the boundary. Every
    accountant now composes one canonical form: equal events merged, in a fixed order."""
    import itertools

    from dpcore.accountants import epsilon

    a = dpcore.PrivacyEvent.dpsgd_step(1.1, 0.01)
    b = dpcore.PrivacyEvent.dpsgd_step(0.9, 0.02)
    c = dpcore.PrivacyEvent.of(dpcore.events.GAUSSIAN, 5.0)
    groups = [(a, 300), (b, 200), (c, 1)]
    values = {epsilon(list(p), 1e-5, accountant) for p in itertools.permutations(groups)}
    assert len(values) == 1  # to the bit
    split = [(a, 100), (b, 200), (c, 1), (a, 200), (b, 0)]  # a's releases in two groups, an empty one
    assert epsilon(split, 1e-5, accountant) == values.pop()


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


def test_the_lazily_imported_dp_accounting_survives_copy_and_pickle():
    """dpcore._lazy.LazyModule (helper-38: copy recursed, pickle refused the module)."""
    import copy
    import pickle

    from dpcore._lazy import LazyModule

    lazy = LazyModule("dp_accounting")
    for other in (copy.copy(lazy), copy.deepcopy(lazy), pickle.loads(pickle.dumps(lazy))):
        assert other.GaussianDpEvent(2.0) == lazy.GaussianDpEvent(2.0)


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

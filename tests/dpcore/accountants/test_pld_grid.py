"""dpcore/accountants/pld.py's grid: a σ so small that one release's privacy loss spans more than
2²⁰ points of dp_accounting's 1e-4 grid is composed on a coarser one (its PLD took 140 s and
3.7 GB to build at σ = 0.02, 38 GiB at 10⁻³), whose ε still bounds the exact one; a σ too small
for any grid is refused before the noise is drawn, with or without a budget."""

import dp_accounting
import pytest
import torch
from dp_accounting.pld import privacy_loss_mechanism as plm

import dpcore
from dpcore.accountants import pld
from dpcore.release import release


def exact_single_release_epsilon(sigma: float, q: float, delta: float) -> float:
    """The tight ε of one Poisson-subsampled Gaussian release under add/remove, from
    dp_accounting's closed-form δ(ε) of each adjacency (no discretisation), by bisection."""

    def worst_delta(eps):
        return max(
            plm.GaussianPrivacyLoss(sigma, sensitivity=1.0, sampling_prob=q, adjacency_type=a).get_delta_for_epsilon(
                eps
            )
            for a in (plm.AdjacencyType.ADD, plm.AdjacencyType.REMOVE)
        )

    lo, hi = 0.0, 1.0
    while worst_delta(hi) > delta:
        lo, hi = hi, 2 * hi
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if worst_delta(mid) > delta else (lo, mid)
    return hi


def release_noting_draws(event, ledger, drawn: list) -> None:
    """One release of a small sum through :func:`release`, appending to ``drawn`` if its noise is drawn."""
    release(
        [torch.zeros(3, dtype=torch.float64)],
        event=event,
        ledger=ledger,
        noise=lambda: drawn.append(1) or [torch.ones(3, dtype=torch.float64)],
        expected_size=1.0,
        step=1,
        clip_norm=1.0,
    )


def test_a_typical_sigma_keeps_dp_accountings_grid():
    step = dpcore.PrivacyEvent.dpsgd_step(1.0, 0.01)
    assert pld.grid([(step, 10_000)], pld.VALUE_DISCRETIZATION) == pld.VALUE_DISCRETIZATION


def test_a_small_sigma_is_composed_on_a_coarser_grid_whose_epsilon_still_bounds_the_exact_one():
    sigma, q, delta = 0.05, 0.01, 1e-5  # 3.9M points on the 1e-4 grid (15 s, 0.8 GB to build)
    step = dpcore.PrivacyEvent.dpsgd_step(sigma, q)
    g = pld.grid([(step, 1)], pld.VALUE_DISCRETIZATION)
    assert g > 3 * pld.VALUE_DISCRETIZATION
    built = pld.composed([(step, 1)], pld.VALUE_DISCRETIZATION)
    assert max(built._pmf_remove.size, built._pmf_add.size) <= pld.MAX_GRID_POINTS + 2

    ledger = dpcore.PrivacyLedger(None, delta)  # no budget: ε at the first release of its kind
    first = ledger.append(step, step=1, clip_norm=1.0).epsilon
    exact = exact_single_release_epsilon(sigma, q, delta)
    assert exact <= first <= exact * (1 + 1e-4), (exact, first)

    for i in range(2, 21):
        ledger.append(step, step=i, clip_norm=1.0)
    rdp = dp_accounting.rdp.RdpAccountant()
    rdp.compose(dp_accounting.SelfComposedDpEvent(step.to_dp_event(), 20))
    assert first < ledger.epsilon() <= rdp.get_epsilon(delta)


@pytest.mark.parametrize("target_epsilon", [None, 8.0])
def test_a_sigma_too_small_for_any_grid_is_refused_before_the_noise_is_drawn(target_epsilon):
    ledger = dpcore.PrivacyLedger(target_epsilon, 1e-5)
    tiny = dpcore.PrivacyEvent.dpsgd_step(1e-5, 0.01)  # one release spans 5·10⁹ nats
    drawn = []
    expected = dpcore.DPConfigError if target_epsilon is None else dpcore.BudgetExceededError
    with pytest.raises(expected, match="too small for the pld accountant" if target_epsilon is None else "Refused"):
        release_noting_draws(tiny, ledger, drawn)
    assert not drawn and len(ledger) == 0


def test_the_refusal_names_an_accountant_that_composes_it():
    ledger = dpcore.PrivacyLedger(None, 1e-5, accountant="rdp")
    tiny = dpcore.PrivacyEvent.dpsgd_step(1e-5, 0.01)
    entry = ledger.append(tiny, step=1, clip_norm=1.0)
    assert entry.epsilon > 1e9


def test_a_sampled_laplace_too_small_for_the_grid_is_refused_before_the_noise_without_naming_rdp():
    """dp_accounting's connect-the-dots bounds of a sampled Laplace overflow at b < 1/709 (helper-7):
    the span is then infinite, and the refusal a DPConfigError before anything is drawn (RDP does
    not compose a sampled Laplace, so the message does not offer it)."""
    ledger = dpcore.PrivacyLedger(None, 1e-5)
    event = dpcore.PrivacyEvent.of("poisson_laplace", 1e-3, 0.01)
    drawn = []
    with pytest.raises(dpcore.DPConfigError, match="too small for the pld accountant") as err:
        release_noting_draws(event, ledger, drawn)
    assert "rdp" not in str(err.value) and not drawn and len(ledger) == 0


def test_a_release_on_the_whole_dataset_is_checked_at_the_count_it_would_reach():
    """The span of k Gaussian releases on the whole dataset grows with k (σ/√k): about a million
    at σ = 1 no grid holds."""
    ledger = dpcore.PrivacyLedger(None, 1e-5)
    gram = dpcore.PrivacyEvent.of("gaussian", 1.0)
    ledger.check(gram, count=1_000)
    with pytest.raises(dpcore.DPConfigError, match="2000000 releases"):
        ledger.check(gram, count=2_000_000)


def test_an_append_that_cannot_be_composed_changes_neither_the_ledger_nor_its_journal(tmp_path, monkeypatch):
    journal = tmp_path / "ledger.jsonl"
    ledger = dpcore.PrivacyLedger(None, 1e-5, journal=journal)
    step = dpcore.PrivacyEvent.dpsgd_step(1.0, 0.01)
    ledger.append(step, step=1, clip_norm=1.0)
    before = journal.read_text()
    with pytest.raises(dpcore.DPConfigError, match="too small"):  # also without the budget check
        ledger.append(dpcore.PrivacyEvent.dpsgd_step(1e-5, 0.01), step=2, clip_norm=1.0, check_budget=False)

    def failing(counts):
        raise RuntimeError("the accountant failed")

    monkeypatch.setattr(ledger, "epsilon_of", failing)
    with pytest.raises(RuntimeError, match="accountant failed"):  # ε comes before anything is changed
        ledger.append(dpcore.PrivacyEvent.dpsgd_step(2.0, 0.01), step=2, clip_norm=1.0)
    assert len(ledger) == 1 and journal.read_text() == before and ledger.groups() == [(step, 1)]

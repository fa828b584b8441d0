"""The data-independent bound on a whole sweep's privacy cost (tuning.search_cost), checked
against dp_accounting's RDP accountant composing the same mechanisms directly."""

from __future__ import annotations

import itertools

import dp_accounting
import pytest

import dpcore
from pipelines.config import TrainConfig
from tuning import search_cost
from tuning.space import parse_space

from ..helpers import rdp_epsilon

N = 4232  # SpamAssassin's training split
DELTA = 1e-5


def _planned(lot: int, epochs: float, eps: float, accountant: str = "pld"):
    sigma, q, steps = dpcore.plan(
        dataset_size=N, lot_size=lot, epochs=epochs, target_epsilon=eps, target_delta=DELTA, accountant=accountant
    )
    return sigma, q, steps, dpcore.max_steps(sigma, q, eps, DELTA, accountant)


def test_one_mechanism_k_trials_equals_dp_accounting_composing_them():
    base = TrainConfig(target_epsilon=3.0, epochs=8, lot_size=256)
    bound = search_cost.search_bound(base, parse_space({"lr": {"low": 1e-3, "high": 0.1, "log": True}}, N), N)
    sigma, q, steps, most = _planned(256, 8, 3.0)
    (m,) = bound.mechanisms
    assert (m.noise_multiplier, m.sample_rate, m.max_releases) == (sigma, q, most)
    # the ledger's cap (133 here), not the planned steps (132): a trial whose steps were
    # re-released after a crash may release up to the cap
    assert most > steps
    for k in (1, 5, 20):
        assert bound.epsilon(k) == pytest.approx(rdp_epsilon([(q, sigma, most)] * k), rel=1e-9)
    assert bound.epsilon(1) >= 3.0 * (1 - 1e-6)  # RDP is no tighter than the PLD the trial was calibrated with
    assert bound.epsilon(1) < bound.epsilon(5) < bound.epsilon(20)


def test_several_lot_sizes_bound_every_adaptive_choice_of_them():
    base = TrainConfig(target_epsilon=3.0, epochs=4, lot_size=512)
    space = parse_space({"lr": {"low": 1e-3, "high": 0.1, "log": True}, "lot_size": {"choices": [128, 256, 512]}}, N)
    bound = search_cost.search_bound(base, space, N)
    mechs = {lot: _planned(lot, 4, 3.0) for lot in (128, 256, 512)}
    assert {m.lot_size: (m.noise_multiplier, m.sample_rate, m.max_releases) for m in bound.mechanisms} == {
        lot: (s, q, most) for lot, (s, q, _, most) in mechs.items()
    }
    k = 3
    eps = bound.epsilon(k)
    # any sequence of k trials, each any of the mechanisms (as TPE may pick them), costs at most the bound ...
    worst = max(
        rdp_epsilon([(mechs[lot][1], mechs[lot][0], mechs[lot][3]) for lot in seq])
        for seq in itertools.product(mechs, repeat=k)
    )
    assert worst <= eps * (1 + 1e-9)
    # ... and the bound is no looser than k trials that each ran every mechanism
    every = [(q, s, most) for s, q, _, most in mechs.values()] * k
    assert eps < rdp_epsilon(every)
    assert bound.epsilon(10) == pytest.approx(10.45, abs=0.01)  # docs/text.md: the SpamAssassin sweep of 10 trials


def test_epochs_choices_multiply_the_mechanisms_and_ranges_give_a_reason():
    base = TrainConfig(target_epsilon=3.0, epochs=4, lot_size=512)
    space = parse_space({"lot_size": {"choices": [256, 512]}, "epochs": {"choices": [2, 4]}}, N)
    found = search_cost.mechanisms(base, space, N)
    assert sorted((m.lot_size, m.epochs) for m in found) == [(256, 2.0), (256, 4.0), (512, 2.0), (512, 4.0)]
    for raw, name in (
        ({"lot_size": {"low": 64, "high": 512, "log": True}}, "lot_size"),
        ({"epochs": {"low": 1, "high": 8}}, "epochs"),
    ):
        why = search_cost.search_bound(base, parse_space(raw, N), N)
        assert isinstance(why, str) and why.startswith(f"{name} is searched over a range")
    laplace = TrainConfig(
        target_epsilon=3.0, epochs=4, lot_size=512, noise="laplace", clip_norm_type="l1", accountant="pld"
    )
    why = search_cost.search_bound(laplace, parse_space({"lr": {"low": 1e-3, "high": 0.1}}, N), N)
    assert isinstance(why, str) and "laplace" in why
    out = search_cost.summary(why, 10)
    assert out["search_epsilon_bound"] is None and out["search_bound"].startswith("none: noise=laplace")
    noisy_stats = TrainConfig(target_epsilon=3.0, epochs=4, lot_size=512, diagnostics=True)
    why = search_cost.search_bound(noisy_stats, parse_space({"lr": {"low": 1e-3, "high": 0.1}}, N), N)
    assert isinstance(why, str) and why.startswith("diagnostics")


def test_only_lot_size_and_epochs_of_the_searchable_options_reach_the_plan():
    # the bound enumerates MECHANISM_OPTIONS and treats every other searchable option as leaving
    # each trial's mechanism alone: making, say, noise_multiplier searchable must fail here first
    from tuning.space import SEARCHABLE

    assert set(SEARCHABLE) & set(TrainConfig().plan_options()) == set(search_cost.MECHANISM_OPTIONS)
    assert not set(SEARCHABLE) & {"noise", "noise_multiplier", "pca_components", "pca_noise_multiplier", "seed"}


def test_a_lot_size_that_cannot_be_planned_runs_no_mechanism():
    # at ε=0.2, 100 epochs of lot 2048 need σ above the default limit (100): such a trial fails its plan
    base = TrainConfig(target_epsilon=0.2, epochs=100, lot_size=512)
    space = parse_space({"lot_size": {"choices": [2048, 512]}}, N)
    with pytest.raises(dpcore.DPConfigError, match="cannot be reached"):
        dpcore.plan(dataset_size=N, **TrainConfig(target_epsilon=0.2, epochs=100, lot_size=2048).plan_options())
    assert [m.lot_size for m in search_cost.mechanisms(base, space, N)] == [512]


def test_a_dp_pca_release_is_in_every_trial():
    space = parse_space({"lr": {"low": 1e-3, "high": 0.1}}, N)
    plain = search_cost.search_bound(TrainConfig(target_epsilon=3.0, epochs=4, lot_size=512), space, N)
    pca = TrainConfig(target_epsilon=3.0, epochs=4, lot_size=512, pca_components=8, pca_noise_multiplier=8.0)
    with_pca = search_cost.search_bound(pca, space, N)
    (m,) = with_pca.mechanisms
    assert len(m.prior) == 1 and m.prior[0][1] == 1
    # each trial's σ is calibrated around its PCA release, so one trial stays within its target ...
    assert with_pca.epsilon(1) == pytest.approx(plain.epsilon(1), rel=0.05)
    # ... and the reference composes the same PCA event plus the steps, with dp_accounting alone
    pca_event = m.prior[0][0].to_dp_event()
    acc = dp_accounting.rdp.RdpAccountant()
    one = dp_accounting.ComposedDpEvent(
        [
            pca_event,
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(m.sample_rate, dp_accounting.GaussianDpEvent(m.noise_multiplier)),
                m.max_releases,
            ),
        ]
    )
    acc.compose(dp_accounting.ComposedDpEvent([one] * 4))
    assert with_pca.epsilon(4) == pytest.approx(acc.get_epsilon(DELTA), rel=1e-9)


def test_searches_on_the_same_split_compose():
    # a preset's stages: each its own bound and K; together, their RDP curves add
    space = parse_space({"lr": {"low": 1e-3, "high": 0.1}}, N)
    a = search_cost.search_bound(TrainConfig(target_epsilon=3.0, epochs=4, lot_size=512), space, N)
    b = search_cost.search_bound(TrainConfig(target_epsilon=3.0, epochs=4, lot_size=256), space, N)
    (ma,), (mb,) = a.mechanisms, b.mechanisms
    reference = rdp_epsilon(
        [(ma.sample_rate, ma.noise_multiplier, ma.max_releases)] * 3
        + [(mb.sample_rate, mb.noise_multiplier, mb.max_releases)] * 2
    )
    assert search_cost.combined([(a, 3), (b, 2)]) == pytest.approx(reference, rel=1e-9)
    assert max(a.epsilon(3), b.epsilon(2)) < search_cost.combined([(a, 3), (b, 2)])
    assert search_cost.combined([(a, 3), ("lot_size is searched over a range", 2)]) is None
    assert search_cost.combined([(a, 3), None]) is None


def test_a_later_stage_is_bounded_over_every_choice_the_earlier_one_could_make():
    """helper-41: the BAM preset's stage 2 runs with stage 1's best lr and lot size, which stage 1
    chose on the validation split. Composing the stages as they ran gave a total that depended on
    that choice (a smaller ε when a smaller lot won), so it was no data-independent bound, and each
    stage-2 model was registered with its own stage's bound alone. Now a stage-2 bound takes, per
    trial, the worst over every lot size stage 1 could have picked, composed with stage 1's trials:
    the same total whichever lot won, equal to dp_accounting composing all trials at the worst
    mechanism, and never below what the stages cost as they ran."""
    base = TrainConfig(target_epsilon=3.0, epochs=4)
    lots = (128, 256, 512)
    stage1 = search_cost.search_bound(
        base, parse_space({"lr": {"low": 1e-3, "high": 0.1}, "lot_size": {"choices": list(lots)}}, N), N
    )
    ascent = parse_space({"ascent": {"low": 1e-3, "high": 0.2, "log": True}}, N)
    k1, k2, k3 = 9, 6, 5
    totals, as_ran = {}, {}
    for lot in lots:  # whichever lot stage 1 picked
        raw_bam = search_cost.search_bound(
            TrainConfig(target_epsilon=3.0, epochs=4, lot_size=lot, method="bam"), ascent, N
        )
        raw_sat = search_cost.search_bound(
            TrainConfig(target_epsilon=3.0, epochs=4, lot_size=lot, method="dpsat"), ascent, N
        )
        bam, sat = (search_cost.after(raw, [(stage1, k1)]) for raw in (raw_bam, raw_sat))
        assert isinstance(bam, search_cost.StagedBound) and bam.prior == ((stage1, k1),)
        totals[lot] = search_cost.combined([(stage1, k1), (bam.own, k2), (sat.own, k3)])
        as_ran[lot] = search_cost.combined([(stage1, k1), (raw_bam, k2), (raw_sat, k3)])
        assert as_ran[lot] <= totals[lot] * (1 + 1e-12)
        # the registered stage-2 model's ε covers stage 1's trials too
        assert bam.epsilon(k2) == pytest.approx(search_cost.combined([(stage1, k1), (bam.own, k2)]), rel=1e-12)
        assert bam.epsilon(k2) > stage1.epsilon(k1)
        assert search_cost.summary(bam, k2)["search_trials"] == k1 + k2
    assert len({round(t, 9) for t in as_ran.values()}) > 1, as_ran  # as they ran: it depends on the pick
    assert len({round(t, 12) for t in totals.values()}) == 1, totals  # the bound: the same for every pick
    # every trial at stage 1's pointwise-worst curve
    assert totals[256] == pytest.approx(stage1.epsilon(k1 + k2 + k3), rel=1e-9)
    worst = max(stage1.mechanisms, key=lambda m: rdp_epsilon([(m.sample_rate, m.noise_multiplier, m.max_releases)]))
    assert stage1.epsilon(k1 + k2 + k3) >= rdp_epsilon(
        [(worst.sample_rate, worst.noise_multiplier, worst.max_releases)] * (k1 + k2 + k3)
    ) * (1 - 1e-9)
    assert search_cost.after(
        search_cost.search_bound(base, ascent, N), [("lot_size is searched over a range", 3)]
    ).startswith("an earlier stage")

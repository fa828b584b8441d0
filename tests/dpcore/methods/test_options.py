"""The options of the private step (``dpcore/methods/options.py``): the Laplace form (L1 clipping,
accounted by PLD as dp_accounting does, calibrated to the target, noise of the stated scale),
augmentation multiplicity (the K copies' gradients averaged, then clipped to C per example, and an
augment of the wrong shape refused), and bad method options refused before any budget is spent."""

from __future__ import annotations

import warnings

import dp_accounting
import pytest
import scipy.stats
import torch
from torch import nn

import dpcore
from dpcore.accounting import POISSON_LAPLACE
from dpcore.clipping import per_sample_norms

from ...helpers import UNSEEDED_SAMPLES, assert_unseeded_draw_fits, ce
from ._common import _events, _train, example_grad, flat_norm, make_opt, mlp64

warnings.simplefilter("ignore", dpcore.SeededRandomnessWarning)


def test_laplace_form_events_and_epsilon_match_dp_accounting():
    _, lap = _train({"noise": "laplace", "clip_norm_type": "l1", "noise_multiplier": 3.0})
    assert {e[0] for e in _events(lap)} == {POISSON_LAPLACE}
    q, b, t = lap.sample_rate, 3.0, len(lap.ledger)
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.LaplaceDpEvent(b)), t)
    assert lap.ledger.epsilon() == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    # A longer composition, straight through the accountant, against dp_accounting's own.
    ev = dpcore.PrivacyEvent(POISSON_LAPLACE, 2.0, 0.02)
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.LaplaceDpEvent(2.0)), 2000)
    assert dpcore.epsilon([(ev, 2000)], 1e-6) == pytest.approx(acc.get_epsilon(1e-6), rel=1e-9)


def test_laplace_form_calibration_meets_the_target():
    sigma, q, steps = dpcore.plan(
        dataset_size=1000, lot_size=50, epochs=3, target_epsilon=3.0, target_delta=1e-5, noise="laplace"
    )
    ev = dpcore.PrivacyEvent(POISSON_LAPLACE, sigma, q)
    eps = dpcore.epsilon([(ev, steps)], 1e-5)
    assert 0.99 * 3.0 <= eps <= 3.0


def test_laplace_noise_has_the_stated_scale_and_contributions_are_l1_clipped():
    z = dpcore.SeededRandomness(3).laplace(40_000, 2.5, dtype=torch.float64).numpy()
    assert scipy.stats.kstest(z, scipy.stats.laplace(scale=2.5).cdf).pvalue > 1e-3
    z = dpcore.SecureRandomness().laplace(UNSEEDED_SAMPLES, 2.5, dtype=torch.float64)
    assert_unseeded_draw_fits(z, scipy.stats.laplace(scale=2.5).cdf)
    # power: the same check rejects a scale 5% off (KS distance 0.009)
    with pytest.raises(AssertionError, match="KS p"):
        assert_unseeded_draw_fits(z * 1.05, scipy.stats.laplace(scale=2.5).cdf)
    model = mlp64()
    x, y = torch.randn(30, 6, dtype=torch.float64) * 10, torch.randint(0, 3, (30,))
    opt = make_opt(model, noise="laplace", clip_norm_type="l1", clip=0.3)
    for i in range(30):
        opt.accumulate(x[i : i + 1], y[i : i + 1])
        contribution = sum(float(s.abs().sum()) for s in opt._sum.values())
        assert contribution <= 0.3
        opt.lot.reset()


def test_augmentation_multiplicity_averages_then_clips_each_example_to_c():
    model = mlp64()
    k, clip = 4, 0.2
    x, y = torch.randn(12, 6, dtype=torch.float64) * 20, torch.randint(0, 3, (12,))
    copies = x.unsqueeze(1) + 0.5 * torch.randn(12, k, 6, dtype=torch.float64)
    gs = dpcore.PerSampleGradients(model, ce, multiplicity=k)
    per_example = gs(copies, y)
    # Each example's vector is the mean of its K copies' gradients ...
    for i in range(12):
        grads = [example_grad(model, copies[i, j], y[i]) for j in range(k)]
        for name, parts in zip([n for n, _ in model.named_parameters()], zip(*grads)):
            torch.testing.assert_close(per_example[name][i], sum(parts) / k, rtol=1e-10, atol=1e-12)
    norms = per_sample_norms(per_example)
    assert (norms > clip).all()  # every example is clipped: the bound is what holds them
    # ... and one example's contribution to the sum has norm ≤ C (each example in its own lot).
    for i in range(12):
        one = make_opt(model, clip=clip, augment=lambda xb, i=i: copies[i : i + 1], augmentation_multiplicity=k)
        one.accumulate(x[i : i + 1], y[i : i + 1])
        assert flat_norm(one._sum.values()) <= clip


def test_augment_returning_the_wrong_shape_is_refused():
    model = mlp64()
    opt = make_opt(model, augment=lambda xb: xb.unsqueeze(1), augmentation_multiplicity=2)
    with pytest.raises(dpcore.DPConfigError, match="K=2"):
        opt.accumulate(torch.randn(3, 6, dtype=torch.float64), torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"method": "bam", "ascent": -0.1}, "negative"),
        ({"method": "dpsat", "ascent": -1.0}, "negative"),
        ({"augmentation_multiplicity": 0}, "augmentation_multiplicity"),
        ({"noise": "laplace"}, "clip_norm_type='l1'"),
        ({"noise": "laplace", "clip_norm_type": "l1", "accountant": "rdp"}, "PLD only"),
        ({"method": "bam", "ascent": 0.1, "clipping": "bookkeeping"}, "vmap"),
        ({"method": "sam"}, "unknown"),
    ],
)
def test_bad_method_options_fail_before_any_budget_is_spent(kw, match, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 3))
    journal = tmp_path / "j.jsonl"
    with pytest.raises(dpcore.DPConfigError, match=match):
        dpcore.make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            ce,
            dataset_size=100,
            lot_size=10,
            epochs=1,
            target_epsilon=1.0,
            target_delta=1e-5,
            clip_norm=1.0,
            journal=str(journal),
            **kw,
        )
    assert not journal.exists()

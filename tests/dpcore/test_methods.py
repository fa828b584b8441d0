"""Issue C: BAM (SAM and exact), DP-SAT, the Laplace form, augmentation multiplicity, EMA,
DP-PCA and the BAM diagnostics, each checked against an independent computation."""

from __future__ import annotations

import copy
import math
import warnings
from fractions import Fraction
from pathlib import Path

import dp_accounting
import pytest
import scipy.stats
import torch
from torch import nn

import dpcore
from dpcore.accounting import GAUSSIAN, POISSON_GAUSSIAN, POISSON_LAPLACE
from dpcore.clipping import CLIP_MARGIN, per_sample_norms
from dpcore.pca import normalized_rows

from ..helpers import UNSEEDED_SAMPLES, assert_unseeded_draw_fits, ce

warnings.simplefilter("ignore", dpcore.SeededRandomnessWarning)


def mlp64(d_in=6, hidden=7, classes=3, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, classes)).double()


def example_grad(model, x, y, params=None):
    """Ordinary autograd gradient of one example's loss (a reference, no torch.func)."""
    m = model
    if params is not None:
        m = copy.deepcopy(model)
        with torch.no_grad():
            for p, v in zip(m.parameters(), params):
                p.copy_(v)
    ps = list(m.parameters())
    return torch.autograd.grad(ce(m(x[None]), y[None]), ps)


def flat_norm(ts):
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in ts))


def make_opt(model, *, seed=0, n=64, q=0.25, sigma=1.0, clip=1.0, lr=0.1, optimizer="sgd", ledger=None, **kw):
    opt = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "nadam": torch.optim.NAdam}[optimizer](
        model.parameters(), lr=lr
    )
    return dpcore.DPOptimizer(
        opt,
        model=model,
        loss_fn=ce,
        noise_multiplier=sigma,
        clip_norm=clip,
        sample_rate=q,
        dataset_size=n,
        randomness=dpcore.SeededRandomness(seed),
        ledger=ledger if ledger is not None else dpcore.PrivacyLedger(None, 1e-5),
        **kw,
    )


# ------------------------------------------------------------------------------------------
# BAM
def test_bam_sam_equals_an_explicit_per_example_loop():
    model = mlp64()
    x, y = torch.randn(9, 6, dtype=torch.float64) * 3, torch.randint(0, 3, (9,))
    lam = 0.3
    got, at_theta = dpcore.PerSampleGradients(model, ce).bam(x, y, lam, "sam")
    names = [n for n, _ in model.named_parameters()]
    theta = [p.detach() for p in model.parameters()]
    for i in range(9):
        g = example_grad(model, x[i], y[i])
        norm = flat_norm(g)
        shifted = [t + lam * gi / norm for t, gi in zip(theta, g)]
        ref = example_grad(model, x[i], y[i], shifted)
        for name, r, gi in zip(names, ref, g):
            torch.testing.assert_close(got[name][i], r, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(at_theta[name][i], gi, rtol=1e-10, atol=1e-12)


def test_bam_sam_clipped_sum_in_the_optimizer_equals_the_loop():
    model = mlp64()
    x, y = torch.randn(11, 6, dtype=torch.float64) * 3, torch.randint(0, 3, (11,))
    lam, clip = 0.2, 0.5
    opt = make_opt(model, method="bam", ascent=lam, clip=clip, physical_batch_size=4)
    opt.accumulate(x, y)
    theta = [p.detach().clone() for p in model.parameters()]
    ref = [torch.zeros_like(t) for t in theta]
    for i in range(11):
        g = example_grad(model, x[i], y[i])
        gb = example_grad(model, x[i], y[i], [t + lam * gi / flat_norm(g) for t, gi in zip(theta, g)])
        f = min(1.0, clip * (1 - CLIP_MARGIN) / flat_norm(gb))  # with the clipping margin
        for r, gi in zip(ref, gb):
            r += f * gi
    for (name, _), r in zip(model.named_parameters(), ref):
        torch.testing.assert_close(opt._sum[name].to(r.dtype), r, rtol=1e-5, atol=1e-10)


def test_bam_exact_matches_a_finite_difference_hessian_vector_product():
    model = mlp64(seed=3)
    x, y = torch.randn(5, 6, dtype=torch.float64) * 2, torch.randint(0, 3, (5,))
    lam, h = 0.25, 1e-5
    got, _ = dpcore.PerSampleGradients(model, ce).bam(x, y, lam, "exact")
    theta = [p.detach() for p in model.parameters()]
    names = [n for n, _ in model.named_parameters()]
    for i in range(5):
        g = example_grad(model, x[i], y[i])
        v = [gi / flat_norm(g) for gi in g]
        plus = example_grad(model, x[i], y[i], [t + h * vi for t, vi in zip(theta, v)])
        minus = example_grad(model, x[i], y[i], [t - h * vi for t, vi in zip(theta, v)])
        for name, gi, a, b in zip(names, g, plus, minus):
            hvp = (a - b) / (2 * h)
            torch.testing.assert_close(got[name][i], gi + lam * hvp, rtol=1e-6, atol=1e-8)


def test_bam_sam_is_the_exact_form_to_first_order_in_lambda():
    model = mlp64(seed=5)
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
    gs = dpcore.PerSampleGradients(model, ce)
    errs = []
    for lam in (1e-2, 1e-3):
        sam, _ = gs.bam(x, y, lam, "sam")
        exact, _ = gs.bam(x, y, lam, "exact")
        errs.append(max(float((sam[k] - exact[k]).abs().max()) for k in sam))
    assert errs[1] < errs[0] / 50  # the gap is O(λ²): 10× smaller λ, ~100× smaller gap


def _train(method_kw, steps=6, seed=11, optimizer="sgd"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(200, 6) * 2, torch.randint(0, 3, (200,))
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.5)
        if optimizer == "sgd"
        else torch.optim.NAdam(model.parameters(), lr=0.01)
    )
    private = dpcore.make_private(
        model,
        opt,
        ce,
        dataset_size=200,
        lot_size=40,
        epochs=steps * 40 / 200,
        target_epsilon=5.0,
        target_delta=1e-5,
        clip_norm=0.5,
        seed=seed,
        physical_batch_size=16,
        **{"clipping": "vmap", **method_kw},  # one clipping path for every method compared
    )
    for lot in private.sampler:
        private.optimizer.accumulate(x[lot], y[lot])
        private.optimizer.step()
    return model, private


@pytest.mark.parametrize("variant", ["sam", "exact"])
def test_bam_with_lambda_zero_is_dpsgd_bit_for_bit(variant):
    ref, ref_private = _train({})
    bam, bam_private = _train({"method": "bam", "ascent": 0.0, "bam_variant": variant})
    for a, b in zip(ref.parameters(), bam.parameters()):
        assert torch.equal(a, b)
    assert [(e.kind, e.sample_rate, e.noise_multiplier, e.step) for e in ref_private.ledger.entries] == [
        (e.kind, e.sample_rate, e.noise_multiplier, e.step) for e in bam_private.ledger.entries
    ]
    other, _ = _train({"method": "bam", "ascent": 0.05, "bam_variant": variant})
    assert any(not torch.equal(a, b) for a, b in zip(ref.parameters(), other.parameters()))


def test_bam_lambda_schedule_is_followed_step_by_step():
    sched = dpcore.ascent_schedule(0.1, "warmup", total_steps=10, warmup_fraction=0.5)
    assert [round(sched(t), 6) for t in (0, 1, 5, 9)] == [0.0, 0.02, 0.1, 0.1]
    cos = dpcore.ascent_schedule(0.1, "cosine", total_steps=10)
    assert cos(0) == pytest.approx(0.1) and cos(5) == pytest.approx(0.05) and cos(10) == pytest.approx(0.0)
    seen = []

    class Recording:
        def __call__(self, step):
            seen.append(step)
            return sched(step)

    # Step 0 of a warm-up schedule has λ=0: the first update is DP-SGD's bit for bit, later ones differ.
    ref, _ = _train({}, steps=1)
    bam, _ = _train({"method": "bam", "ascent": Recording()}, steps=1)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), bam.parameters()))
    _train({"method": "bam", "ascent": Recording()}, steps=4)
    assert sorted(set(seen)) == [0, 1, 2, 3]


# ------------------------------------------------------------------------------------------
# Every method writes DP-SGD's ledger events
def _events(private):
    return [(e.kind, e.sample_rate, e.noise_multiplier, e.clip_norm, e.step, e.status) for e in private.ledger.entries]


def _flip_augment(k):
    g = torch.Generator().manual_seed(0)

    def augment(x):
        copies = x.unsqueeze(1).expand(x.shape[0], k, *x.shape[1:]).clone()
        noise = 0.1 * torch.randn(copies.shape, generator=g)
        return copies + noise

    return augment


def test_every_method_writes_the_same_ledger_events_as_dpsgd():
    kw = dict(noise_multiplier=1.3)
    _, ref = _train(kw)
    variants = [
        {"method": "bam", "ascent": 0.05},
        {"method": "bam", "ascent": 0.05, "bam_variant": "exact"},
        {"method": "dpsat", "ascent": 0.05},
        {"augment": _flip_augment(3), "augmentation_multiplicity": 3},
        {"diagnostics": True},
    ]
    for v in variants:
        _, other = _train({**kw, **v})
        assert _events(other) == _events(ref), v
        assert other.ledger.epsilon() == ref.ledger.epsilon()
    _, nadam = _train(kw, optimizer="nadam")  # DP-Adam/NAdam (Gaussian form): post-processing
    assert _events(nadam) == _events(ref)
    assert {e[0] for e in _events(ref)} == {POISSON_GAUSSIAN} and len(_events(ref)) == 6


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


# ------------------------------------------------------------------------------------------
# Augmentation multiplicity
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


# ------------------------------------------------------------------------------------------
# DP-SAT
class RecordingSampler:
    """Wraps PerSampleGradients and records the weights that each physical batch is evaluated at."""

    def __init__(self, inner, model):
        self.inner, self.model, self.seen = inner, model, []

    def __call__(self, x, y, params=None):
        self.seen.append([p.detach().clone() for p in self.model.parameters()])
        return self.inner(x, y, params)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("physical", [1, 3, 64])
def test_dpsat_shift_is_applied_once_per_lot_and_removed_exactly(physical):
    model = mlp64()
    rho = 0.3
    opt = make_opt(model, method="dpsat", ascent=rho, physical_batch_size=physical, lr=0.0, sigma=0.5)
    rec = RecordingSampler(opt.grad_sampler, model)
    opt.grad_sampler = rec
    theta0 = [p.detach().clone() for p in model.parameters()]
    torch.manual_seed(1)
    for _step in range(5):
        x, y = torch.randn(7, 6, dtype=torch.float64), torch.randint(0, 3, (7,))
        rec.seen.clear()
        prev = (
            None if opt._prev_private is None else [opt._prev_private[n].clone() for n, _ in model.named_parameters()]
        )
        opt.accumulate(x[:4], y[:4])
        opt.accumulate(x[4:], y[4:])  # two accumulate calls in the same lot
        opt.step()
        assert len(rec.seen) == (2 if physical >= 4 else -(-4 // physical) + -(-3 // physical))
        expected = theta0 if prev is None else [t + rho * g / flat_norm(prev) for t, g in zip(theta0, prev)]
        for seen in rec.seen:  # every physical batch of the lot sees the same, once-shifted weights
            for a, b in zip(seen, expected):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-15)
        # lr = 0: after the step the weights are θ exactly, however many batches the lot had.
        assert all(torch.equal(p, t) for p, t in zip(model.parameters(), theta0))
    assert opt.shifts_applied == 4  # no previous gradient before the first step


def test_dpsat_shifting_per_physical_batch_would_drift():
    """What the public DP-SAT code does (shift and unshift around each physical batch) does
    not give θ back bit for bit; the optimizer's restore-from-copy does (test above)."""
    torch.manual_seed(0)
    theta = torch.randn(10_000, dtype=torch.float32)
    e = 0.3 * torch.randn(10_000) / 100
    p = theta.clone()
    for _ in range(50):
        p.add_(e)
        p.sub_(e)
    assert not torch.equal(p, theta)


def test_dpsat_update_is_independent_of_the_physical_batch_size():
    results = []
    for physical in (2, 50):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
        opt = make_opt(model, method="dpsat", ascent=0.2, physical_batch_size=physical, seed=5)
        torch.manual_seed(9)
        for _ in range(4):
            x, y = torch.randn(20, 6, dtype=torch.float64), torch.randint(0, 3, (20,))
            opt.accumulate(x, y)
            opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_dpsat_state_survives_a_checkpoint():
    model = mlp64()
    opt = make_opt(model, method="dpsat", ascent=0.2)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
    opt.accumulate(x, y)
    opt.step()
    state = opt.state_dict()
    other = make_opt(copy.deepcopy(model), method="dpsat", ascent=0.2)
    other.load_state_dict(state)
    for n, g in opt._prev_private.items():
        assert torch.equal(other._prev_private[n], g)


def test_budget_refusal_while_shifted_restores_the_weights():
    model = mlp64()
    ledger = dpcore.PrivacyLedger(6.0, 1e-5)
    opt = make_opt(model, method="dpsat", ascent=0.5, ledger=ledger, sigma=0.8, q=0.5)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
    with pytest.raises(dpcore.BudgetExceededError):
        for _ in range(100):
            before = [p.detach().clone() for p in model.parameters()]
            opt.accumulate(x, y)
            assert opt.shifts_applied == 0 or not torch.equal(next(model.parameters()), before[0])  # shifted now
            opt.step()
    assert opt.shifts_applied >= 1  # the refused lot was evaluated at a shifted point ...
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # ... and θ is back


def test_an_error_inside_a_shifted_lot_restores_the_weights_and_a_restore_keeps_the_checkpoint():
    model = mlp64()
    opt = make_opt(model, method="dpsat", ascent=0.5)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
    opt.accumulate(x, y)
    opt.step()
    checkpoint = ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict())
    theta = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError):
        opt.accumulate(x, torch.full((8,), 7))  # class 7 of 3: cross_entropy raises mid-lot
    assert opt.shifts_applied == 1 and all(torch.equal(p, t) for p, t in zip(model.parameters(), theta))
    # A restart in the same process: model first, then the optimizer, must give the checkpoint.
    opt.accumulate(x, y)  # a lot in flight (shifted) when the worker restores
    model.load_state_dict(checkpoint[0])
    opt.load_state_dict(checkpoint[1])
    assert all(torch.equal(model.state_dict()[k], v) for k, v in checkpoint[0].items())


def test_dpsat_ascends_along_the_noised_released_gradient():
    """The shift direction is the previous *released* gradient (clipped sum + noise)/(qN),
    replayed here from the seeded noise stream, not the clean clipped sum."""
    from dpcore.clipping import clipped_sum

    model = mlp64()
    q, n, sigma, clip = 0.25, 64, 1.0, 1.0
    opt = make_opt(model, method="dpsat", ascent=0.3, q=q, n=n, sigma=sigma, clip=clip, seed=8)
    replay = dpcore.SeededRandomness(8)
    x, y = torch.randn(10, 6, dtype=torch.float64), torch.randint(0, 3, (10,))
    ref, _ = clipped_sum(dpcore.PerSampleGradients(model, ce)(x, y), clip)
    opt.accumulate(x, y)
    opt.step()
    for name, p in model.named_parameters():
        released = (ref[name] + replay.normal(p.shape, sigma * clip, dtype=torch.float64)) / (q * n)
        torch.testing.assert_close(opt._prev_private[name], released, rtol=1e-12, atol=1e-14)
        assert not torch.allclose(opt._prev_private[name], ref[name] / (q * n), rtol=1e-3, atol=0)


# ------------------------------------------------------------------------------------------
# EMA
def test_parameter_ema_follows_de_et_al_with_warmup():
    model = mlp64()
    ema = dpcore.ParameterEMA(model, decay=0.9)
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = make_opt(model)
    for t in range(15):
        x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
        opt.accumulate(x, y)
        opt.step()
        ema.update()
        d = min(0.9, (1 + t) / (10 + t))
        for n, p in model.named_parameters():
            ref[n] = d * ref[n] + (1 - d) * p.detach()
    avg = ema.averaged_state_dict()
    for n in ref:
        torch.testing.assert_close(avg[n], ref[n], rtol=1e-12, atol=1e-14)
    with pytest.raises(dpcore.DPConfigError):
        dpcore.ParameterEMA(model, decay=1.0)


# ------------------------------------------------------------------------------------------
# DP-PCA
def test_dp_pcas_rows_keep_the_clipping_margin():
    """Each row's term in the released Gram matrix has Frobenius norm (1 − m)², m = CLIP_MARGIN:
    the room the float64 product's rounding needs (σ made negligible here to read it)."""
    from dpcore.clipping import CLIP_MARGIN

    x = torch.randn(50, 6)
    with pytest.warns(dpcore.SeededRandomnessWarning):
        released, _ = dpcore.pca.release_gram(x, 1e-12, dpcore.SeededRandomness(0), ledger=None)
    assert float(torch.trace(released)) == pytest.approx(50 * (1 - CLIP_MARGIN) ** 2, rel=1e-12)


def test_dp_pca_warns_above_the_rows_its_margin_covers():
    """The Gram product's worst-case rounding grows as N²·u: the margin covers it up to
    covered_rows() (about 950,000), and DP-PCA warns above that. The bound is checked on its
    own, in exact rationals: (1 − m)²·(1 + N·γ_{N+1} + (N + 1)·γ_{N+2}) (N rows against the
    neighbour's N + 1) crosses 1 between covered_rows() and one more row."""
    from dpcore.clipping import UNIT_ROUNDOFF
    from dpcore.pca import covered_rows, gram_sensitivity

    n = covered_rows()
    assert 900_000 < n < 1_000_000

    u = Fraction(UNIT_ROUNDOFF)

    def by_hand(rows):
        def g(k):
            return k * u / (1 - k * u)

        return (1 - Fraction(CLIP_MARGIN)) ** 2 * (1 + rows * g(rows + 1) + (rows + 1) * g(rows + 2))

    assert by_hand(n) <= 1 < by_hand(n + 1)
    for rows in (n, n + 1):
        assert gram_sensitivity(rows) == pytest.approx(float(by_hand(rows)), rel=1e-15)
    for rows, warns in ((n, False), (n + 1, True)):
        x = torch.ones(rows, 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dpcore.pca.release_gram(x, 1.0, dpcore.SeededRandomness(0), ledger=None)
        said = [str(w.message) for w in caught if "DP-PCA over" in str(w.message)]
        assert bool(said) == warns, said
        if warns:
            assert f"covers up to {n:,} rows" in said[0]
    root = Path(__file__).resolve().parents[2]
    for doc in ("README.md", "docs/methods.md"):  # the documents state the number the function gives
        assert f"{n:,} rows" in " ".join((root / doc).read_text().split()), doc


def test_dp_pca_noise_has_the_stated_scale_and_is_symmetric():
    torch.manual_seed(0)
    x = torch.randn(500, 1, 8, 8) * 7 + 2
    sigma, d = 4.0, 64
    a = normalized_rows(x)
    assert torch.allclose(a.norm(dim=1), torch.ones(500, dtype=torch.float64))
    a = a * (1 - CLIP_MARGIN)  # the released rows keep the clipping margin
    exact = a.T @ a
    exact = 0.5 * (exact + exact.T)
    devs = []
    for seed in range(4):
        res = dpcore.dp_pca(x, 10, sigma, dpcore.SeededRandomness(seed), ledger=None)
        assert torch.equal(res.released, res.released.T)
        e = res.released - exact
        iu = torch.triu_indices(d, d)
        devs.append(e[iu[0], iu[1]])
    z = torch.cat(devs).numpy() / sigma  # 4 × 2080 independent entries
    se = 1 / math.sqrt(2 * z.size)
    assert abs(z.std() - 1) < 5 * se and abs(z.mean()) < 5 / math.sqrt(z.size)
    assert scipy.stats.kstest(z, "norm").pvalue > 1e-3
    # the secure generator gives the same scale
    e = dpcore.dp_pca(x, 10, sigma, dpcore.SecureRandomness(), ledger=None).released - exact
    iu = torch.triu_indices(d, d)
    assert abs(float(e[iu[0], iu[1]].std()) / sigma - 1) < 5 / math.sqrt(2 * iu.shape[1])


def test_dp_pca_projection_is_the_top_k_eigenvectors_and_is_ledgered():
    torch.manual_seed(0)
    basis = torch.linalg.qr(torch.randn(20, 3))[0]
    x = torch.randn(2000, 3) @ basis.T * 10 + 0.01 * torch.randn(2000, 20)
    ledger = dpcore.PrivacyLedger(5.0, 1e-5)
    res = dpcore.dp_pca(x, 3, 2.0, dpcore.SeededRandomness(0), ledger=ledger)
    assert torch.allclose(res.components @ res.components.T, torch.eye(3), atol=1e-5)
    overlap = torch.linalg.svdvals(res.components @ basis)
    assert overlap.min() > 0.99  # the signal subspace is found through the noise
    assert [(e.kind, e.noise_multiplier, e.sample_rate, e.step) for e in ledger.entries] == [(GAUSSIAN, 2.0, 1.0, 0)]
    assert ledger.committed_steps() == []
    sampled = dpcore.dp_pca(x, 3, 2.0, dpcore.SeededRandomness(0), sample_rate=0.1, ledger=ledger)
    assert sampled.event == dpcore.PrivacyEvent(POISSON_GAUSSIAN, 2.0, 0.1)
    assert ledger.epsilon() == pytest.approx(
        dpcore.epsilon(
            [(dpcore.PrivacyEvent(GAUSSIAN, 2.0), 1), (dpcore.PrivacyEvent(POISSON_GAUSSIAN, 2.0, 0.1), 1)], 1e-5
        )
    )
    proj = dpcore.PCAProjection(res.components)
    assert list(proj.parameters()) == [] and proj(x[:5]).shape == (5, 3)


def test_pca_cost_is_composed_with_training_in_the_plan():
    pca = [(dpcore.PrivacyEvent(GAUSSIAN, 8.0), 1)]
    plain = dpcore.plan(dataset_size=1000, lot_size=100, epochs=5, target_epsilon=2.0, target_delta=1e-5)
    with_pca = dpcore.plan(
        dataset_size=1000, lot_size=100, epochs=5, target_epsilon=2.0, target_delta=1e-5, prior_groups=pca
    )
    assert with_pca[0] > plain[0]
    total = dpcore.epsilon(pca + [(dpcore.PrivacyEvent.dpsgd_step(with_pca[0], with_pca[1]), with_pca[2])], 1e-5)
    assert 0.99 * 2.0 <= total <= 2.0
    with pytest.raises(dpcore.DPConfigError, match="nothing is left"):
        dpcore.plan(
            dataset_size=1000,
            lot_size=100,
            epochs=5,
            target_epsilon=0.1,
            target_delta=1e-5,
            prior_groups=[(dpcore.PrivacyEvent(GAUSSIAN, 1.0), 1)],
        )


# ------------------------------------------------------------------------------------------
# Diagnostics
def test_diagnostics_match_an_explicit_computation_and_are_off_by_default():
    model = mlp64()
    x, y = torch.randn(10, 6, dtype=torch.float64) * 4, torch.randint(0, 3, (10,))
    clip = 0.3
    opt = make_opt(model, clip=clip, diagnostics=True, physical_batch_size=4, sigma=0.7)
    theta = [p.detach().clone() for p in model.parameters()]
    opt.accumulate(x, y)
    replay = dpcore.SeededRandomness(0)
    opt.step()
    rec = opt.diagnostics_history[-1]
    grads = [torch.cat([g.reshape(-1) for g in example_grad(model_at(model, theta), x[i], y[i])]) for i in range(10)]
    g = torch.stack(grads)
    g_hat = g.mean(0)
    m = torch.clamp(g.norm(dim=1) / (clip * (1 - CLIP_MARGIN)), min=1.0)  # with the clipping margin
    clipped = (g / m[:, None]).mean(0)
    a = float(((g @ g_hat) / g_hat.norm() ** 2 / m).mean())  # BAM Appendix C: (1/l) Σ η_i / M_i
    noise = torch.cat([replay.normal(p.shape, 0.7 * clip, dtype=torch.float64).reshape(-1) for p in theta])
    released = clipped + noise / 10
    assert rec["bias"] == pytest.approx(float((clipped - g_hat).norm()), rel=1e-5)
    assert rec["magnitude_error_a"] == pytest.approx(a, rel=1e-5)
    assert rec["direction_error_c"] == pytest.approx(float((released - a * g_hat).norm()), rel=1e-5)
    cos = float(((g / g.norm(dim=1, keepdim=True)) @ g_hat).mean() / g_hat.norm())
    assert rec["cos_per_example_ascent"] == pytest.approx(cos, rel=1e-6)
    plain = make_opt(mlp64())
    plain.accumulate(x, y)
    plain.step()
    assert plain.diagnostics_history == []


def model_at(model, theta):
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p, t in zip(m.parameters(), theta):
            p.copy_(t)
    return m


# ------------------------------------------------------------------------------------------
# Bad input: a clear error before any budget is spent
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


@pytest.mark.parametrize("k", [0, -3, 65, 2.5])
def test_bad_pca_dimension_is_refused_before_the_release(k):
    ledger = dpcore.PrivacyLedger(1.0, 1e-5)
    with pytest.raises(dpcore.DPConfigError, match="pca_components"):
        dpcore.dp_pca(torch.randn(50, 64), k, 4.0, dpcore.SeededRandomness(0), ledger=ledger)
    assert len(ledger) == 0


# ------------------------------------------------------------------------------------------
# Adding a method: one class, one registry entry
def test_a_method_added_to_the_registry_changes_only_which_vectors_are_clipped():
    """A method sees the per-example computation and nothing else: whatever vectors it returns
    are clipped to C by the same code, so even one that inflates the gradients 1000× keeps each
    example's contribution ≤ C; and it is refused with book-keeping when it says so."""
    from dpcore.methods import METHODS, Method

    class Inflated(Method):
        name = "inflated"
        bookkeeping_ok = False

        def per_example(self, grad_sampler, xb, yb, step):
            g = grad_sampler(xb, yb)
            return {k: 1000.0 * v for k, v in g.items()}, g

    METHODS["inflated"] = Inflated
    try:
        model = mlp64()
        x, y = torch.randn(12, 6, dtype=torch.float64), torch.randint(0, 3, (12,))
        opt = make_opt(model, method="inflated", clip=0.3)
        assert isinstance(opt.method, Inflated)
        for i in range(12):
            opt.accumulate(x[i : i + 1], y[i : i + 1])
            assert flat_norm(opt._sum.values()) <= 0.3 * (1 + 1e-9)
            opt.lot.reset()
        wide = make_opt(model, method="inflated", clip=1e9)  # no clipping: the method's vectors are the ones summed
        wide.accumulate(x[:1], y[:1])
        assert flat_norm(wide._sum.values()) == pytest.approx(1000.0 * flat_norm(example_grad(model, x[0], y[0])))
        with pytest.raises(dpcore.DPConfigError, match="bookkeeping"):
            make_opt(mlp64(), method="inflated", clipping="bookkeeping")
    finally:
        del METHODS["inflated"]
    with pytest.raises(dpcore.DPConfigError, match="unknown"):
        make_opt(mlp64(), method="inflated")

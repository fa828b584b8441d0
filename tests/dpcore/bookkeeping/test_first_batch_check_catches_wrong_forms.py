"""The first-batch check (dpcore.fastpath.CheckedBookKeeping) refuses a wrong layer form: one
whose norms fall below the reference's (even where no example is clipped, or only on examples
far smaller than the largest), a clipped sum with a NaN, and an error spread thinly over every
element of a sum; while it expects the ghost form's rounding allowance above the exact norm
and measures sums by the examples' shares, so an honest ghost form passes."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpcore.bookkeeping import BookKeepingClipper
from dpcore.clipping import per_sample_norms
from dpcore.grad_sample import PerSampleGradients

from ._common import _bk_optimizer, _reference, ce


class UnderNormedLinear(nn.Linear):
    """A Linear whose registered form below reports 0.9× each example's norm: a wrong formula
    that a comparison of clipped sums alone cannot see while no example is clipped."""


def test_the_check_compares_norms_so_a_form_that_underestimates_them_is_refused():
    from dpcore.bookkeeping import LAYERS, SquaredNorms, register_layer
    from dpcore.bookkeeping.linear import LinearForm

    class Under(LinearForm):
        def per_example(self, m, a, g, sq, ctx):
            own = SquaredNorms(sq.batch, sq.device)
            part = super().per_example(m, a, g, own, ctx)
            sq += 0.81 * own.total()
            return part

    torch.manual_seed(3)
    model = nn.Sequential(UnderNormedLinear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    register_layer(UnderNormedLinear, Under())
    try:
        big = _bk_optimizer(model, clip=1e6)  # nothing clipped: the two sums are equal
        fast = {}
        big._fast.clipper.clipped_sum(x, y, 1e6, fast)
        ref, _ = _reference(model, x, y, 1e6)
        assert all(torch.allclose(fast[k], ref[k], atol=1e-6) for k in ref)
        assert "per-example norms are below" in big._fast.formulas_disagree(x, y)
        with pytest.warns(UserWarning, match="per-example norms are below.*using the vmap path"):
            big.accumulate(x, y)
        assert big.clipping == "vmap"
    finally:
        LAYERS.pop(UnderNormedLinear)


def test_the_check_refuses_a_norm_short_of_its_own_examples_even_where_the_largest_hides_it(monkeypatch):
    """Norms can spread over many orders of magnitude (here 10⁰ to 10⁻⁷ between the examples'
    inputs): a form whose norms fall 1e-6 short only on the small examples stays far inside
    FORMULA_RTOL of the largest norm, and is refused by the bound on each example's own norm
    (BELOW_RTOL); the same form on honest norms passes."""
    from dpcore import fastpath
    from dpcore.bookkeeping import LAYERS, SquaredNorms, register_layer
    from dpcore.bookkeeping.linear import LinearForm

    class ShortOnSmall(LinearForm):
        short = 1e-6  # ten times BELOW_RTOL

        def per_example(self, m, a, g, sq, ctx):
            own = SquaredNorms(sq.batch, sq.device)
            part = super().per_example(m, a, g, own, ctx)
            t = own.total()
            sq += torch.where(t < 1e-6 * t.max(), t * (1 - self.short), t)
            return part

    torch.manual_seed(3)
    model = nn.Sequential(UnderNormedLinear(4, 3, bias=False))
    x = torch.randn(8, 4) * (10.0 ** -torch.arange(8.0)).unsqueeze(1)
    y = torch.randint(0, 3, (8,))
    form = ShortOnSmall()
    register_layer(UnderNormedLinear, form)
    try:
        check = fastpath.CheckedBookKeeping(model, ce, 1.0)
        assert "below the per-example (vmap) reference's" in check.formulas_disagree(x, y)
        assert "of its own example's" in check.formulas_disagree(x, y)
        form.short = 0.0
        assert check.formulas_disagree(x, y) == ""
    finally:
        LAYERS.pop(UnderNormedLinear)


def test_the_check_refuses_a_clipped_sum_with_a_nan(monkeypatch):
    """A book-keeping sum with a NaN element (on finite examples) differs from the reference:
    the comparison is written so that a NaN fails it (a plain `difference > tolerance` is False
    for a NaN, and let such a sum pass)."""
    from dpcore import fastpath

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    check = fastpath.CheckedBookKeeping(model, ce, 1.0)
    assert check.formulas_disagree(x, y, 8) == ""
    real = BookKeepingClipper.contributions

    def one_nan(self, *args, **kwargs):
        (name, value), *rest = real(self, *args, **kwargs)
        value = value.clone()
        value.view(-1)[0] = float("nan")
        return [(name, value), *rest]

    monkeypatch.setattr(BookKeepingClipper, "contributions", one_nan)
    assert "its clipped sum at bound" in check.formulas_disagree(x, y, 8)


class Mirror(nn.Module):
    """Each position, then its negation, scaled: a following Linear's terms cancel in pairs, so
    its per-example gradient is zero while its terms' magnitudes β are large."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return torch.cat([x, -x], dim=1) * self.scale


class MeanOverPositions(nn.Module):
    def forward(self, z):
        return z.mean(1)


def test_the_check_expects_the_ghost_forms_allowance_and_measures_sums_by_their_shares(monkeypatch):
    """A wide ghost-form Linear whose positions cancel (as long sequences through wide layers
    do, in part): the allowance the ghost norm adds for its float64 rounding, 2(d + c + 2T + 4)·u·β²,
    is far above FORMULA_RTOL of the norms' scale, and its clipped sums cancel between examples.
    The check expects the allowance and measures the sums against Σ_i f_i·‖g_i‖, so it passes
    (it refused such models, which then ran on vmap); a norm above the exact one by more than
    twice the allowance, or below it by more than FORMULA_RTOL of the scale, still fails it."""

    from dpcore import fastpath
    from dpcore.bookkeeping import base

    torch.manual_seed(0)
    model = nn.Sequential(Mirror(30.0), nn.Linear(2048, 2048, bias=False), MeanOverPositions(), nn.Linear(2048, 2))
    x, y = torch.randn(8, 8, 2048), torch.randint(0, 2, (8,))
    norms = []
    model64 = copy.deepcopy(model).double()
    sq, _ = BookKeepingClipper(model64, F.cross_entropy).measure(x.double(), y, 1.0, 8, norms)
    (allowance,) = norms[0].allowances  # the ghost form of the wide Linear (the head has one position)
    assert float(allowance.min()) > 100 * fastpath.FORMULA_RTOL * float(sq.max())  # the case is exercised
    check = fastpath.CheckedBookKeeping(model, F.cross_entropy, 1.0)
    assert check.formulas_disagree(x, y, 8) == ""

    real = base.weight_sq_norms

    def off_by(k):  # the same form (and the same reported allowance), its norm k allowances off
        def form(A, G, channels_first, ctx):
            s, W, magnitude_sq = real(A, G, channels_first, ctx)
            if magnitude_sq is None:
                return s, W, magnitude_sq
            d, c, T = A.shape[2], G.shape[2], A.shape[1]
            u = torch.finfo(torch.float64).eps / 2
            return s + k * 2 * (d + c + 2 * T + 4) * u * magnitude_sq, W, magnitude_sq

        return form

    monkeypatch.setattr(base, "weight_sq_norms", off_by(3))
    assert "per-example norms are above" in check.formulas_disagree(x, y, 8)
    # The allowance is expected above the exact norm only: a form that reports it but lands
    # below (here by two allowances, inside the width a two-sided test would allow) would let
    # an example's share exceed C, and is refused.
    monkeypatch.setattr(base, "weight_sq_norms", off_by(-2))
    assert "per-example norms are below" in check.formulas_disagree(x, y, 8)


def test_the_check_measures_a_sums_difference_over_all_its_elements(monkeypatch):
    """The clipped sums' difference is one vector over every parameter, measured in ℓ2 as the
    shares are: an error spread thinly over a wide layer (each element under FORMULA_RTOL of
    Σ_i f_i·‖g_i‖, the whole well above it) is refused, though no single element shows it."""
    from dpcore import fastpath

    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 3))
    x, y = torch.randn(8, 256), torch.randint(0, 3, (8,))
    check = fastpath.CheckedBookKeeping(model, ce, 1.0)
    assert check.formulas_disagree(x, y, 8) == ""
    per_example = PerSampleGradients(copy.deepcopy(model).double(), ce)(x.double(), y)
    shares = float(per_sample_norms(per_example).sum())  # Σ_i ‖g_i‖ ≥ Σ_i f_i·‖g_i‖ at any bound
    n = sum(v.numel() for v in per_example.values())
    each = 4 * fastpath.FORMULA_RTOL * shares / n**0.5  # in ℓ2, 4·FORMULA_RTOL of Σ_i ‖g_i‖
    real = BookKeepingClipper.contributions

    def spread(self, *args, **kwargs):
        return [(k, v + each) for k, v in real(self, *args, **kwargs)]

    monkeypatch.setattr(BookKeepingClipper, "contributions", spread)
    assert "clipped sum at bound 1 differs" in check.formulas_disagree(x, y, 8)

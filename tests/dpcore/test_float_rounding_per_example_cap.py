"""The cap that holds each example's within-batch rounding to ρ·C: where a ghost form's
per-position terms cancel, the example's norm is raised so that its factor covers the rounding of
the one product over the batch (computed in chunks of examples, and for the weight-standardised
and Embedding forms too), while natural examples keep their norms; the cap, and which form a layer
takes, are fixed at the configured physical batch size, so removing an example from a lot moves the
sum by that example's share alone; a non-finite norm or floor skips the example."""

import math
import warnings

import pytest
import torch
from torch import nn

import dpcore
from dpcore.bookkeeping.base import Context, SquaredNorms, weight_and_bias
from dpcore.bookkeeping.clipper import BookKeepingClipper
from dpcore.bookkeeping.embedding import EmbeddingForm
from dpcore.bookkeeping.wsconv import WSConvForm, WSJacobian, centred
from dpcore.clipping import (
    ROUNDING_SHARE,
    clip_factors,
    gamma,
    ghost_roundings,
    per_sample_norms,
    rounding_floor,
)
from dpcore.grad_sample import PerSampleGradients
from dpcore.layers import WSConv2d

from ..helpers import ce
from ._float_common import _optimizer


def _ghost_linear(G, A, rounding_batch=None):
    """A Linear layer's ghost form on [B, T, d] inputs A and [B, T, c] output gradients G:
    (the squared norms to clip on, the plain squared norms, the part)."""
    m = nn.Linear(A.shape[2], G.shape[2], bias=False)
    sq = SquaredNorms(A.shape[0], A.device, rounding_batch)
    part = weight_and_bias(m, A, G, False, sq, Context(clip_norm=1.0, max_elements=0))
    plain, _ = sq.measured()  # with the ghost form's allowance, before the floor
    return sq.total(), plain, part


@pytest.mark.parametrize("cancel", [2.0**-10, 2.0**-20, 2.0**-40])
def test_a_ghost_example_whose_positions_cancel_takes_at_most_its_share_of_rounding(cancel):
    """Example 1's two positions have the same input and gradients g and −(1 − cancel)·g: its
    gradient is `cancel` of its terms β, whose rounding in the one product over all (example,
    position) rows is up to γ_{B·T+1}·β. Its gradient has norm C/2 (factor 1), but its factor is
    cut so that f·γ·β ≤ ρ·C where γ·β exceeds ρ·C (cancel = 2⁻²⁰, 2⁻⁴⁰); an example without cancellation (example 0), and
    example 1 where the ratio is within ρ/γ (cancel = 2⁻¹⁰), keep their plain norms, bit for bit."""
    torch.manual_seed(3)
    C = 1.0
    a, g = torch.randn(8, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    A = torch.stack([torch.randn(2, 8, dtype=torch.float64), torch.stack([a, a])])  # [B=2, T=2, d=8]
    G = torch.stack([torch.randn(2, 4, dtype=torch.float64), torch.stack([g, -(1 - cancel) * g])])
    G[1] *= 0.5 / float(torch.outer(G[1].sum(0), a).norm())  # example 1's gradient: norm C/2
    total, plain, _ = _ghost_linear(G, A)
    beta = float((A.norm(dim=2) * G.norm(dim=2)).sum(1)[1])
    k = gamma(2 * 2 + 1 + 1)  # one product over the batch's 2·2 terms, one chunk: ghost_roundings(2, 2)
    assert ghost_roundings(2, 2) == 2 * 2 + 1 + 1
    assert float(total[0]) == float(plain[0])
    f = float(clip_factors(total.sqrt(), C)[0][1])
    assert f * k * beta <= ROUNDING_SHARE * C * (1 + 1e-12)
    if k * beta <= ROUNDING_SHARE * math.sqrt(float(plain[1])):
        assert float(total[1]) == float(plain[1])
    else:
        assert float(total[1]) > float(plain[1])
        assert f < float(clip_factors(plain.sqrt(), C)[0][1])


def test_natural_ghost_examples_keep_their_norms():
    """Random inputs and gradients over 256 positions (β/‖g‖ near √T = 16), counted at a
    configured batch of 256: one product over the batch's 65,536 terms would cap every example
    (ρ/γ_{B·T+1} ≈ 8), but the product runs in chunks of 16 examples (ρ/γ ≈ 127), and the cap
    changes no example's norm."""
    torch.manual_seed(4)
    A, G = torch.randn(16, 256, 8), torch.randn(16, 256, 6)
    total, plain, _ = _ghost_linear(G, A, rounding_batch=256)
    assert torch.equal(total, plain)
    beta = (A.double().norm(dim=2) * G.double().norm(dim=2)).sum(1)
    ratio = beta / plain.sqrt()
    assert ROUNDING_SHARE / gamma(256 * 256 + 1) < float(ratio.min())  # one product: all capped
    assert 4 * float(ratio.max()) < ROUNDING_SHARE / gamma(ghost_roundings(256, 256))  # chunks: far off


def test_the_ghost_sum_in_chunks_of_examples_equals_the_per_example_sum():
    """40 examples of 256 positions: the product runs in 3 chunks (16, 16, 8 examples), and the
    clipped sum equals Σ_i f_i·G_iᵀA_i formed example by example, for a Linear and a convolution
    layout."""
    torch.manual_seed(12)
    A, G = torch.randn(40, 256, 8, dtype=torch.float64), torch.randn(40, 256, 6, dtype=torch.float64)
    f = torch.rand(40, dtype=torch.float64)
    want = sum(f[i] * G[i].t() @ A[i] for i in range(40))
    _, _, part = _ghost_linear(G, A)
    ((_, got),) = part.contributions(f, lambda t: t)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    m = nn.Conv1d(8, 6, 1, bias=False)  # channels first: [B, d, T] and [B, c, T]
    sq = SquaredNorms(40, A.device)
    part = weight_and_bias(m, A.transpose(1, 2), G.transpose(1, 2), True, sq, Context(clip_norm=1.0, max_elements=0))
    ((_, got),) = part.contributions(f, lambda t: t)
    torch.testing.assert_close(got.reshape(6, 8), want, rtol=1e-12, atol=1e-12)


def test_a_weight_standardised_ghost_form_adds_the_rounding_of_its_product_and_vjp():
    """The WSConv2d ghost form's rounding term: γ_k²·Σ_o (Σ_t ‖Ã_t‖·|g_{t,o}|)²/s_o² with
    k = B·T + 3·(n + 4) at the configured batch B, computed here from the patches directly, and
    folded into the norms the form's examples are clipped on."""
    torch.manual_seed(5)
    m = WSConv2d(3, 5, 3, padding=1).double()
    a, g = torch.randn(2, 3, 6, 6, dtype=torch.float64), torch.randn(2, 5, 6, 6, dtype=torch.float64)
    A = torch.nn.functional.unfold(a, 3, padding=1)  # [B, n=27, T=36]
    sq = SquaredNorms(2, A.device, rounding_batch=4)
    WSConvForm().ghost(m, A, g.reshape(2, 5, -1), sq, Context(clip_norm=1.0, max_elements=0))
    jac = WSJacobian(m)
    Ac, Gc = centred(A, g.reshape(2, 5, -1))
    s = jac.s.view(-1)
    want = torch.zeros(2, dtype=torch.float64)
    for i in range(2):
        for o in range(5):
            mag = sum(float(Ac[i, :, t].norm()) * abs(float(Gc[i, o, t])) for t in range(36))
            want[i] += (mag / float(s[o])) ** 2
    plain = (
        torch.stack(sq.terms).sum(0)
        + torch.linalg.vector_norm(torch.cat(sq.rows[torch.float64], 1), dim=1).square()
        + torch.stack(sq.allowances).sum(0)
    )
    extra = gamma(4 * 36 + 1 + 1 + 3 * (27 + 4)) ** 2 * want  # one chunk of the 4 configured examples
    torch.testing.assert_close(sq.total(), rounding_floor(plain, 4, extra), rtol=1e-12, atol=0)
    ((positions, more, magnitude_sq),) = sq.rounding
    assert (positions, more) == (36, 3 * (27 + 4))
    torch.testing.assert_close(magnitude_sq, want, rtol=1e-12, atol=0)


def _ghost_model(d=8, c=4):
    """A Linear layer over T positions whose outputs are summed: book-keeping's ghost form
    where materialising is over budget (``max_elements=0``)."""

    class Positions(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(d, c, bias=False, dtype=torch.float64)

        def forward(self, x):
            return self.lin(x).sum(1)

    return Positions()


def test_an_examples_factor_does_not_depend_on_how_many_examples_share_its_batch():
    """Example 0's two positions nearly cancel, so its rounding cap binds. Its norm to clip on,
    and every other example's, is the same in a batch of 5 and in the batch without example 4
    (the last batch of a Poisson lot, which one example more or less shortens): the cap is
    taken at the configured physical batch size (8), bit for bit. At each batch's own size it
    is not (what the clipper did before)."""
    torch.manual_seed(7)
    model = _ghost_model()
    clipper = BookKeepingClipper(model, ce)
    clipper.MAX_PER_EXAMPLE_ELEMENTS = 0  # the ghost form
    x = torch.randn(5, 2, 8, dtype=torch.float64)
    x[0, 1] = -(1 - 2.0**-40) * x[0, 0]  # example 0: positions that cancel
    y = torch.randint(0, 4, (5,))
    full, _ = clipper.measure(x, y, 1.0, batch_size=8)
    short, _ = clipper.measure(x[:4], y[:4], 1.0, batch_size=8)
    exact = per_sample_norms(PerSampleGradients(model, ce)(x, y)).square()
    assert float(full[0]) > 1e6 * float(exact[0])  # example 0 is capped
    torch.testing.assert_close(full[1:], exact[1:], rtol=1e-12, atol=0)  # the others are not
    assert torch.equal(full[:4], short)
    own_full, _ = clipper.measure(x, y, 1.0)
    own_short, _ = clipper.measure(x[:4], y[:4], 1.0)
    assert not torch.equal(own_full[:4], own_short)
    with pytest.raises(ValueError, match="exceeds the physical batch size"):
        clipper.measure(x, y, 1.0, batch_size=4)


def test_removing_an_example_moves_the_lots_sum_by_its_share_alone_when_the_cap_scales_every_norm(monkeypatch):
    """The vmap path's cap (γ_{B+2} > ρ: every norm scaled by γ/ρ) made large enough to bind
    by a smaller ρ, between γ_6 and γ_7, for a DPOptimizer with physical batches of 8: a lot of
    5 examples and the same lot without its last one differ by that example's clipped share
    alone (to float64 rounding), since the factors are taken at the configured batch size. At
    the batch's own size, the other four examples' factors would change with it (γ_7 > ρ >
    γ_6): a difference far above C."""
    monkeypatch.setattr(dpcore.clipping, "ROUNDING_SHARE", 6.5 * 2.0**-53)
    torch.manual_seed(8)
    x, y = torch.randn(5, 3) * 10, torch.randint(0, 2, (5,))

    def lot_sum(n):
        model = nn.Linear(3, 2)
        torch.nn.init.constant_(model.weight, 0.5)
        torch.nn.init.zeros_(model.bias)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = _optimizer(1000, 8, model=model, clipping="vmap")
        opt.accumulate(x[:n], y[:n])
        return torch.cat([opt.lot.sums[k].flatten() for k in ("weight", "bias")]), opt

    with_it, opt = lot_sum(5)
    without, _ = lot_sum(4)
    per_sample = opt.grad_sampler(x[4:], y[4:])
    share, _ = dpcore.clipping.clipped_sum(per_sample, 1.0, batch_size=8)
    share = torch.cat([share[k].flatten() for k in ("weight", "bias")])
    assert float(share.norm()) <= 1.0
    torch.testing.assert_close(with_it - without, share, rtol=0, atol=1e-12)


def test_a_non_finite_norm_or_an_overflowing_floor_skips_the_example():
    sq = torch.tensor([float("nan"), 1.0, 4.0], dtype=torch.float64)
    floor = rounding_floor(sq, 8, torch.tensor([0.0, 0.0, 1e300], dtype=torch.float64))
    assert math.isnan(float(floor[0])) and float(floor[1]) == 1.0 and math.isinf(float(floor[2]))
    factors, finite = clip_factors(floor.sqrt(), 1.0)
    assert finite.tolist() == [False, True, False] and factors.tolist()[0] == factors.tolist()[2] == 0.0


def test_a_token_tables_batch_sum_has_one_row_per_token():
    """The Embedding form sums the batch's shares of each token before they go into the lot's
    sum (one addition per row per batch, as for every other parameter), and the rows add up to
    the dense clipped sum."""
    torch.manual_seed(6)
    m = nn.Embedding(11, 4)
    tokens = torch.randint(0, 11, (5, 7))
    g = torch.randn(5, 7, 4)
    sq = SquaredNorms(5, tokens.device)
    part = EmbeddingForm().per_example(m, tokens, g, sq, Context(clip_norm=1.0, max_elements=0))
    factors = torch.rand(5, dtype=torch.float64)
    ((_, update),) = part.contributions(factors, lambda t: t)
    nonzero = update.rows.abs().sum(1) > 0
    assert len(set(update.index[nonzero].tolist())) == int(nonzero.sum())
    want = torch.zeros(11, 4, dtype=torch.float64)
    for i in range(5):
        for t in range(7):
            want[tokens[i, t]] += factors[i] * g[i, t].double()
    torch.testing.assert_close(update.dense(), want, rtol=1e-12, atol=1e-14)


class _Positions(nn.Module):
    """A float32 Linear(8, 4) over 2 positions whose outputs are summed."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4, bias=False)

    def forward(self, x):
        return self.lin(x).sum(1)


def test_a_layers_form_is_chosen_at_the_configured_batch_size_not_the_batchs_own():
    """With an element budget of 4 examples' gradients, a batch of 4 would materialise and one of
    5 would take the ghost form; at the configured batch size (8) both take the ghost form. The
    two forms add different vectors for an example (float32 against float64 products, and only
    the ghost form is capped), so a lot whose last batch changed form when an example was
    removed would move every other example's share: removing example 4 from a lot of 5 moves
    the book-keeping sum by that example's share alone, to float64 rounding."""
    from dpcore.bookkeeping.base import GhostPart

    torch.manual_seed(13)
    x, y = torch.randn(5, 2, 8), torch.randint(0, 4, (5,))
    clipper = BookKeepingClipper(_Positions(), ce)
    clipper.MAX_PER_EXAMPLE_ELEMENTS = 4 * 32
    kinds = {n: [type(p) for _, p in clipper.measure(x[:n], y[:n], 1.0, batch_size=8)[1]] for n in (4, 5)}
    assert kinds[4] == kinds[5] == [GhostPart]
    assert [type(p) for _, p in clipper.measure(x[:4], y[:4], 1.0)[1]] != [GhostPart]  # at its own size: not

    def lot_sum(n):
        torch.manual_seed(14)
        model = _Positions()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = _optimizer(1000, 8, model=model, clipping="bookkeeping")
        opt.lot.fast.clipper.MAX_PER_EXAMPLE_ELEMENTS = 4 * 32
        opt.accumulate(x[:n], y[:n])
        assert opt.clipping == "bookkeeping"
        return opt.lot.sums["lin.weight"].clone(), opt

    with_it, opt = lot_sum(5)
    without, _ = lot_sum(4)
    share = {}
    opt.lot.fast.clipper.clipped_sum(x[4:], y[4:], 1.0, share, batch_size=8)
    assert float(share["lin.weight"].norm()) <= 1.0
    torch.testing.assert_close(with_it - without, share["lin.weight"], rtol=0, atol=1e-12)


def test_a_materialised_rounding_term_counts_every_row_of_the_batch():
    """A materialised form's weighted sum adds the batch's rows one after another: B + 2 roundings
    at the configured batch size B, then ``more`` (helper-1: counted as a one-position ghost form,
    whose chunks of 4,096 examples gave 4,099 roundings at B = 8,192)."""
    sq = SquaredNorms(2, torch.device("cpu"), rounding_batch=8192)
    beta_sq = torch.tensor([1.0, 4.0], dtype=torch.float64)
    sq += torch.zeros(2, dtype=torch.float64)
    sq.add_rounding(beta_sq, positions=None, more=10)
    torch.testing.assert_close(
        sq.total(), rounding_floor(torch.zeros(2, dtype=torch.float64), 8192, gamma(8192 + 2 + 10) ** 2 * beta_sq)
    )
    assert ghost_roundings(8192, 1) < 8192 + 2  # what the one-position count would have taken

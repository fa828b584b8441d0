"""The bound on floating-point rounding that the clipping margin covers (README, "What the
guarantee does not cover"): the bound's arithmetic against an exact rational computation, the
lot sizes it covers, and the cap that holds each example's within-batch rounding to ρ·C where
a ghost form's per-position terms cancel."""

import math
import warnings
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from torch import nn

import dpcore
from dpcore.bookkeeping.base import Context, SquaredNorms, weight_and_bias
from dpcore.bookkeeping.embedding import EmbeddingForm
from dpcore.bookkeeping.wsconv import WSJacobian, centred
from dpcore.clipping import (
    CLIP_MARGIN,
    NORM_ERROR,
    ROUNDING_SHARE,
    clip_factors,
    covered_lot_size,
    float_sensitivity,
    gamma,
)
from dpcore.layers import WSConv2d

from ..helpers import ce

U = Fraction(1, 2**53)


def exact_bound(lot: int, batch: int, workers: int) -> Fraction:
    """The README's bound in exact rational arithmetic: S + 2·L·(ρ + γ_n·(1 + ρ)),
    n = ⌈L/B⌉ + 2W."""
    n = -(-lot // batch) + 2 * workers
    g = n * U / (1 - n * U)
    rho = Fraction(ROUNDING_SHARE)
    share = (1 - Fraction(CLIP_MARGIN)) * (1 + Fraction(NORM_ERROR))
    return share + 2 * lot * (rho + g * (1 + rho))


@pytest.mark.parametrize("lot,batch,workers", [(1, 1, 1), (60_000, 256, 1), (456_000, 1, 1), (800_000, 64, 8)])
def test_the_bound_matches_an_exact_rational_computation(lot, batch, workers):
    assert float_sensitivity(lot, batch, workers) == pytest.approx(float(exact_bound(lot, batch, workers)), rel=1e-14)
    assert gamma(10) == pytest.approx(float(10 * U / (1 - 10 * U)), rel=1e-15)


@pytest.mark.parametrize("batch,workers", [(1, 1), (16, 1), (64, 1), (256, 1), (256, 8)])
def test_the_covered_lot_size_is_where_the_bound_reaches_C(batch, workers):
    L = covered_lot_size(batch, workers)
    assert exact_bound(L, batch, workers) <= 1 < exact_bound(L + 1, batch, workers)


def test_the_readme_states_the_covered_lot_sizes_it_computes():
    """The README's numbers are the function's (rounded down to thousands)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for batch in (1, 16, 256):
        stated = f"{covered_lot_size(batch) // 1000:,},000"
        assert stated in readme, (batch, stated)


def _ghost_linear(G, A):
    """A Linear layer's ghost form on [B, T, d] inputs A and [B, T, c] output gradients G:
    (the squared norms to clip on, the plain squared norms, the part)."""
    m = nn.Linear(A.shape[2], G.shape[2], bias=False)
    sq = SquaredNorms(A.shape[0], A.device)
    part = weight_and_bias(m, A, G, False, sq, Context(clip_norm=1.0, max_elements=0))
    plain = torch.stack(sq.terms).sum(0)
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
    k = gamma(2 * 2 + 1)
    assert float(total[0]) == float(plain[0])
    f = float(clip_factors(total.sqrt(), C)[0][1])
    assert f * k * beta <= ROUNDING_SHARE * C * (1 + 1e-12)
    if k * beta <= ROUNDING_SHARE * math.sqrt(float(plain[1])):
        assert float(total[1]) == float(plain[1])
    else:
        assert float(total[1]) > float(plain[1])
        assert f < float(clip_factors(plain.sqrt(), C)[0][1])


def test_natural_ghost_examples_keep_their_norms():
    """Random inputs and gradients over 64 positions (β/‖g‖ near √T = 8, far below ρ/γ): the
    cap changes no example's norm."""
    torch.manual_seed(4)
    A, G = torch.randn(16, 64, 32), torch.randn(16, 64, 24)
    total, plain, _ = _ghost_linear(G, A)
    assert torch.equal(total, plain)


def test_a_weight_standardised_ghost_form_adds_the_rounding_of_its_product_and_vjp():
    """The WSConv2d ghost form's rounding term: γ_k²·Σ_o (Σ_t ‖Ã_t‖·|g_{t,o}|)²/s_o² with
    k = B·T + 3·(n + 4), computed here from the patches directly."""
    torch.manual_seed(5)
    m = WSConv2d(3, 5, 3, padding=1).double()
    a, g = torch.randn(2, 3, 6, 6, dtype=torch.float64), torch.randn(2, 5, 6, 6, dtype=torch.float64)
    A = torch.nn.functional.unfold(a, 3, padding=1)  # [B, n=27, T=36]
    jac = WSJacobian(m)
    Ac, Gc = centred(A, g.reshape(2, 5, -1))
    got = jac.rounding(Ac, Gc)
    s = jac.s.view(-1)
    want = torch.zeros(2, dtype=torch.float64)
    for i in range(2):
        for o in range(5):
            mag = sum(float(Ac[i, :, t].norm()) * abs(float(Gc[i, o, t])) for t in range(36))
            want[i] += (mag / float(s[o])) ** 2
    torch.testing.assert_close(got, gamma(2 * 36 + 3 * (27 + 4)) ** 2 * want, rtol=1e-12, atol=0)


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


def _optimizer(dataset_size, batch):
    model = nn.Linear(3, 2)
    return dpcore.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        loss_fn=ce,
        noise_multiplier=1.0,
        clip_norm=1.0,
        sample_rate=0.01,
        dataset_size=dataset_size,
        randomness=dpcore.SeededRandomness(0),
        ledger=dpcore.PrivacyLedger(None, 1e-5),
        physical_batch_size=batch,
    )


def test_the_optimizer_warns_where_the_dataset_could_form_an_uncovered_lot():
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="floating point")
        opt = _optimizer(60_000, 1)
    assert opt.float_sensitivity == float_sensitivity(60_000, 1) < 1
    with pytest.warns(UserWarning, match="covers lots of up to 848,"):
        opt = _optimizer(10_000_000, 256)
    assert opt.float_sensitivity > 1
    with pytest.warns(UserWarning, match="floating point"):  # a smaller physical batch covers less
        _optimizer(600_000, 256).physical_batch_size = 1

"""Ghost norms (the Gram forms of Linear and Conv2d layers in dpcore.bookkeeping.base, and of
weight-standardised convolutions in dpcore.bookkeeping.wsconv) carry an allowance for their
float64 rounding where terms cancel, so the norms clipped on are never below the exact norm,
and an example whose gradient rounds to zero cannot swallow another example's share."""

import pytest
import torch
from torch import nn

from dpcore.clipping import clip_factors


@pytest.mark.parametrize("channels_first", [False, True], ids=["linear", "conv"])
def test_a_ghost_norm_is_never_below_the_exact_one_when_positions_cancel(channels_first):
    """An example whose two positions' terms almost cancel (g₂ = −(1 − 2⁻²²)·g₁ at the same
    input): its gradient is 2⁻²² of its terms, and float64 rounding of the Gram form, relative to
    the terms, is then not small next to its squared norm. The ghost norm carries an allowance
    for that rounding, which the form adds through SquaredNorms.add_allowance, so that what it
    adds is what the check against vmap expects: the norms to clip on are never below the exact
    norm (float64, from the same numbers) in 20 draws, where those without it often are."""
    from dpcore.bookkeeping.base import Context, GhostPart, SquaredNorms, weight_and_bias

    torch.manual_seed(21)
    m = nn.Linear(64, 32, bias=False)
    below = 0
    for _ in range(20):
        a, g = torch.randn(64) * 100, torch.randn(32) * 100
        A = torch.stack([a, a], 1 if channels_first else 0).unsqueeze(0)  # [1, d, 2] or [1, 2, d]
        G = torch.stack([g, -(g * (1 - 2.0**-22))], 1 if channels_first else 0).unsqueeze(0)
        Ad, Gd = (A[0].T, G[0].T) if channels_first else (A[0], G[0])
        exact = float((Gd.double().T @ Ad.double()).norm())
        sq = SquaredNorms(1, A.device)
        part = weight_and_bias(m, A, G, channels_first, sq, Context(clip_norm=1.0, max_elements=0))
        assert isinstance(part, GhostPart) and len(sq.allowances) == 1  # the ghost form, with its allowance
        below += float(sq.terms[0].sqrt()) < exact
        assert float(sq.measured()[0].sqrt()) >= exact
        assert float(sq.total().sqrt()) >= exact
    assert below >= 5  # without the allowance the norm is below the exact one (12 of the 20 draws)


@pytest.mark.parametrize("J", [2.0**30, 2.0**45, 2.0**53, 2.0**60])
def test_an_example_whose_gradient_rounds_to_zero_cannot_swallow_another_examples_share(J):
    """Neighbouring batches through the ghost form's clipped sum: example j's two positions have
    the same input and gradients J and −J, so its gradient is exactly 0 and, without an
    allowance for rounding in its ghost norm, its factor would be 1; its terms of size J in the
    one product over all (example, position) rows then swallow example i's share (C·1, rounded
    away next to J: the sum moved by 1.43·C when i was removed, at J = 2⁵³, before the allowance).
    With it, removing i moves the clipped sum by at most C."""
    from dpcore.bookkeeping.base import Context, SquaredNorms, weight_and_bias

    C = 1.4
    m = nn.Linear(1, 1, bias=False)
    A = torch.tensor([[[1.0], [0.0]], [[1.0], [1.0]]])  # [B=2, T=2, d=1]: i = example 0, j = 1
    G = torch.tensor([[[C], [0.0]], [[J], [-J]]])

    def clipped(G):
        ctx = Context(clip_norm=C, max_elements=0)
        sq = SquaredNorms(2, A.device)
        part = weight_and_bias(m, A, G, False, sq, ctx)
        factors, _ = clip_factors(sq.total().sqrt(), C)
        return part.contributions(factors, lambda t: t)[0][1]

    without_i = G.clone()
    without_i[0] = 0.0
    assert float((clipped(G) - clipped(without_i)).norm()) <= C


@pytest.mark.parametrize("offset", [0.0, 1e3, 1e6, 1e8])
def test_ws_ghost_norms_never_underestimate_even_when_the_terms_cancel(offset):
    """Patches with a large constant offset make the per-example gradient point almost along
    the mean direction, which the standardisation removes: the ghost identity then subtracts
    nearly equal numbers. The ghost norm must stay ≥ the exact norm of the materialised VJP
    (float64), and within 1e-9 of it when nothing cancels."""
    from dpcore.bookkeeping.wsconv import WSJacobian as _WSJacobian
    from dpcore.bookkeeping.wsconv import centred
    from dpcore.layers import WSConv2d

    torch.manual_seed(16)
    conv = WSConv2d(4, 6, 3)
    jac = _WSJacobian(conv)
    B, n, T = 5, 36, 10
    R = torch.round(torch.randn(B, n, T, dtype=torch.float64) * 1024) / 1024  # exact after + offset
    A = R + offset
    assert torch.equal(A - offset, R)
    G = torch.randn(B, 6, T, dtype=torch.float64)
    # The standardisation's VJP discards the constant direction exactly, so the exact norm is
    # that of the offset-free patches (computed without any cancellation).
    exact = jac.vjp(torch.einsum("bot,bnt->bon", G, R)).square().sum((1, 2))
    ghost = jac.ghost_sq_norms(A, G)
    assert (ghost >= exact * (1 - 1e-12)).all(), ghost - exact
    if offset == 0.0:
        assert torch.allclose(ghost, exact, rtol=1e-9, atol=0)
    else:
        assert (ghost <= exact + 1e-6 * (exact + 1.0) * (offset**2)).all()
    # The allowance it reports (what the float64 check expects above the exact norm) covers
    # what it added: the check does not refuse the layer for its own allowance.
    norms, allowance = jac.centred_sq_norms(*centred(A, G))
    assert torch.equal(norms + allowance, ghost)
    assert (ghost - exact <= 2 * allowance).all()


def test_the_ws_ghost_form_adds_its_allowance_where_the_gradient_lies_along_the_weights():
    """Per-example gradients for ŵ almost along ŵ itself: the standardisation's VJP removes that
    direction, and the ghost identity subtracts nearly equal numbers, so its norms without the
    allowance come out below the exact ones (13 of 16 here). The form adds the allowance
    (SquaredNorms.add_allowance), so the norms it clips on are never below the exact norm of the
    vector its clipped sum adds (the VJP with the same ŵ and s, in long double from the same
    float64 numbers)."""
    import numpy as np

    from dpcore.bookkeeping.base import Context, SquaredNorms
    from dpcore.bookkeeping.wsconv import WSConvForm
    from dpcore.bookkeeping.wsconv import WSJacobian as _WSJacobian
    from dpcore.layers import WSConv2d

    torch.manual_seed(16)
    conv = WSConv2d(4, 6, 3, bias=False).double()
    jac = _WSJacobian(conv)
    B, n, o = 16, 36, 2
    A = 1e3 * jac.w_hat[o].view(1, n, 1).expand(B, n, 1) + 1e-3 * torch.randn(B, n, 1, dtype=torch.float64)
    G = torch.zeros(B, 6, 1, dtype=torch.float64)
    G[:, o] = 1.0
    sq = SquaredNorms(B, A.device)
    WSConvForm().ghost(conv, A, G, sq, Context(clip_norm=1.0, max_elements=0))
    L = np.longdouble
    w_hat, s = jac.w_hat.numpy().astype(L), jac.s.numpy().astype(L)
    exact = []
    for a, g in zip(A.numpy().astype(L), G.numpy().astype(L)):
        v = g @ a.T  # [out, n]
        vjp = (v - v.mean(1, keepdims=True) - w_hat * ((v * w_hat).sum(1, keepdims=True) / n)) / s
        exact.append(float((vjp**2).sum()))
    exact = torch.tensor(exact, dtype=torch.float64)
    assert int((torch.stack(sq.terms).sum(0) < exact).sum()) >= 4  # without the allowance: below
    assert (sq.measured()[0] >= exact).all()
    assert (sq.total() >= exact).all()

""":class:`dpcore.layers.WSConv2d`: a convolution with weight standardisation.

The layer uses ŵ(w), so its per-example gradients are the standardisation's vector-Jacobian
product of the per-example gradients for ŵ (:class:`WSJacobian`, which also gives their norms
in a ghost form when they are not materialised).
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers import WS_EPS
from .base import GhostPart, bias_per_example, by_channel
from .conv import ConvForm, conv_per_example


def centred(A: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Patches ``A`` [B, n, T] centred over their n entries, in float64 (a [B, n, T] view of a
    new [n, B, T] buffer, the layout a product over every (example, position) reads without a
    copy), and output gradients ``G`` [B, out, T] in float64."""
    flat = by_channel(A, torch.float64)
    flat.sub_(flat.mean(0, keepdim=True))
    return flat.transpose(0, 1), G.double()


class WSJacobian:
    """The weight standardisation ŵ = (w − μ)/s of a :class:`WSConv2d`, s = sqrt(σ² + ε), per
    output filter of n weights. Its vector-Jacobian product, for a gradient v with respect to
    ŵ (one filter), is (v − mean(v) − ŵ·mean(v ⊙ ŵ)) / s; with κ = ‖ŵ‖²/n = σ²/(σ² + ε) and
    ŵ ⟂ 1, ‖that‖² = (‖v‖² − (1ᵀv)²/n − (2 − κ)(ŵᵀv)²/n) / s². Everything in float64."""

    def __init__(self, m: nn.Conv2d):
        w = m.weight.detach().double().reshape(m.out_channels, -1)
        self.n = w.shape[1]
        mean = w.mean(1, keepdim=True)
        var = w.var(1, keepdim=True, unbiased=False)
        self.s = torch.sqrt(var + WS_EPS)  # [out, 1]
        self.w_hat = (w - mean) / self.s  # [out, n]
        self.kappa = self.w_hat.square().mean(1)  # [out]

    def vjp(self, v: torch.Tensor) -> torch.Tensor:
        """Gradients with respect to w from gradients ``v`` [..., out, n] with respect to ŵ,
        computed in float64 (``v`` is left as it is)."""
        return self.vjp_(v.to(torch.float64, copy=True)).to(v.dtype)

    def vjp_(self, v: torch.Tensor) -> torch.Tensor:
        """:meth:`vjp` in place, in ``v``'s own precision: for per-example gradients that are
        then measured as they are (their norms are taken from the result, so its rounding is
        what gets clipped)."""
        w_hat = self.w_hat.to(v.dtype)
        mean = v.mean(-1, keepdim=True)
        along = torch.einsum("...on,on->...o", v, w_hat).unsqueeze(-1).div_(self.n)
        v.sub_(mean).addcmul_(along, w_hat, value=-1.0)
        return v.div_(self.s.to(v.dtype))

    def ghost_sq_norms(self, A: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
        """Per-example ‖vjp(Σ_t G_t A_tᵀ)‖², never below the exact value, from patches A
        [B, n, T] and output gradients G [B, out, T] without forming the per-example gradients.

        The patches are centred first: the standardisation discards the mean direction, so
        with ṽ = Σ_t g_t Ã_t (Ã_t centred), ‖vjp(v)‖² = (‖ṽ‖² − (2 − κ)(ŵᵀṽ)²/n) / s², where
        ‖ṽ‖² comes from the Gram matrices and ŵᵀṽ from ŵ applied to the patches. The
        subtraction can cancel (v nearly along ŵ), so an allowance for float64 rounding is
        added, 8·(n + T)·u·(Σ_t ‖Ã_t‖·|g_t|)², which bounds every term's magnitude: the
        result can only overestimate the norm, which costs a smaller clip factor, never a
        share above C."""
        sq, allowance = self.centred_sq_norms(*centred(A, G))
        return sq + allowance

    def centred_sq_norms(
        self, A: torch.Tensor, G: torch.Tensor, magnitudes: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the norms of :meth:`ghost_sq_norms` without their allowance, which can be below the
        exact ones; the allowance, [B]), from the operands :func:`centred` made (``magnitudes``:
        their :meth:`filter_magnitudes`, if already formed). A form adds the allowance with
        :meth:`~dpcore.bookkeeping.base.SquaredNorms.add_allowance`."""
        B, n, T = A.shape
        flat = A.transpose(0, 1).reshape(n, B * T)  # no copy where A came from centred()
        aa = A.transpose(1, 2) @ A  # [B, T, T]
        vv = ((aa @ G.transpose(1, 2)) * G.transpose(1, 2)).sum(1)  # [B, out]: ‖ṽ_o‖²
        # ŵ meets every (example, position) in one matrix product (batched over examples, each
        # product would be only T wide).
        w_a = (self.w_hat @ flat).view(-1, B, T)  # [out, B, T]: ŵ_oᵀÃ_t
        w_v = (w_a * G.transpose(0, 1)).sum(2).t()  # [B, out]: ŵ_oᵀṽ_o = Σ_t g_t·ŵ_oᵀÃ_t
        bound = (self.filter_magnitudes(A, G) if magnitudes is None else magnitudes).square()
        allowance = 8.0 * (self.n + T) * torch.finfo(torch.float64).eps * bound
        per_filter = (vv - (2.0 - self.kappa) * w_v.square() / self.n).clamp_min(0.0)
        scale = self.s.view(1, -1).square()
        return (per_filter / scale).sum(1), (allowance / scale).sum(1)

    @staticmethod
    def filter_magnitudes(A: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
        """Σ_t ‖Ã_t‖·|g_{t,o}| for each example and output filter o ([B, out]): what the terms of
        filter o's per-example gradient add up to in magnitude."""
        return (G.abs() * torch.linalg.vector_norm(A, dim=1, keepdim=True)).sum(2)

    def add_rounding(self, sq, magnitudes: torch.Tensor, positions: int) -> None:
        """Add into ``sq`` (:meth:`~dpcore.bookkeeping.base.SquaredNorms.add_rounding`) the
        rounding of the clipped sum: one product over the batch's (example, position) terms, then
        the VJP. Filter o's error e_o maps to P(e_o)/s_o, P a projection (norm ≤ 1), and the
        VJP's own rounding of the sum (a mean over n, ŵᵀv over n, three updates) is within
        3·γ_{n+4} of its size: so γ_k with k = ghost_roundings(batch, T) + 3·(n + 4), and
        β_i² = Σ_o (Σ_t ‖Ã_t‖·|g_{t,o}|)²/s_o² from the :meth:`filter_magnitudes`."""
        beta_sq = (magnitudes / self.s.view(1, -1)).square().sum(1)
        sq.add_rounding(beta_sq, positions=positions, more=3 * (self.n + 4))


class WSConvForm(ConvForm):
    def weight_per_example(self, m, a, g):
        W, _ = conv_per_example(m, a, g)  # gradients for the weight used, ŵ ...
        return WSJacobian(m).vjp_(W), None  # ... back through the standardisation, per example

    def ghost(self, m, A, G, sq, ctx):
        jac = WSJacobian(m)
        bias_g = bias_per_example(m, G.sum(2), sq)
        # The clipped sum contracts the centred patches the norms used: the standardisation's VJP
        # discards the mean direction (ŵ ⟂ 1), so the sum is the same as with the patches as
        # recorded, and the float64 copy is made once.
        A, G = centred(A, G)
        magnitudes = jac.filter_magnitudes(A, G)
        norms, allowance = jac.centred_sq_norms(A, G, magnitudes)
        sq += norms
        sq.add_allowance(allowance)
        jac.add_rounding(sq, magnitudes, positions=A.shape[2])
        return GhostPart(m, A, G, True, bias_g, post=jac.vjp)

""":class:`dpcore.layers.WSConv2d`: a convolution with weight standardisation.

The layer uses ŵ(w), so its per-example gradients are the standardisation's vector-Jacobian
product of the per-example gradients for ŵ (:class:`WSJacobian`). Neither form applies that
product per example: both measure each example's norm through it from a few sums over the
gradients for ŵ (materialised, or in a ghost form from the patches), and the clipped sum, a
linear function of those gradients, goes through it once, in float64.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .. import native
from ..layers import WS_EPS
from .base import GhostPart, MaterialisedPart, bias_per_example, by_channel
from .conv import ConvForm, patch_view, per_example_gradients, weight_order
from .norms import balanced


def centred(A: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Patches ``A`` [B, n, T] centred over their n entries, in float64 (a [B, n, T] view of a
    new [n, B, T] buffer, the layout a product over every (example, position) reads without a
    copy), and output gradients ``G`` [B, out, T] in float64."""
    flat = by_channel(A, torch.float64)
    flat.sub_(flat.mean(0, keepdim=True))
    return flat.transpose(0, 1), G.double()


def centred_patches(m: nn.Conv2d, a: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`centred` of the patches of ``m``'s input ``a`` [B, in, H, W], made from it in one
    pass: each patch's mean is the window sum of the input's channel sums (float64), and the
    float64 buffer is filled by one copy from a strided view of the input (no float32 patches)
    and centred in place. (One subtraction from the strided view into the buffer took twice as
    long as the copy and the subtraction: 30–40 against 15–17 ms on ResNet-9's deepest layers.)"""
    view = patch_view(m, a, channels_last_batch=True)  # [in, kh, kw, B, H', W']
    C, kh, kw, B, oh, ow = view.shape
    n = C * kh * kw
    out = torch.empty((n, B, oh * ow), dtype=torch.float64, device=a.device)
    out.view(C, kh, kw, B, oh, ow).copy_(view)
    sums = patch_view(m, a.sum(1, keepdim=True, dtype=torch.float64))  # [B, 1, kh, kw, H', W']
    out.sub_(sums.sum((1, 2, 3)).div_(n).view(1, B, oh * ow))  # each patch's mean
    return out.transpose(0, 1), G.double()


def weight_rows(m: nn.Conv2d, rows: torch.Tensor) -> torch.Tensor:
    """Rows [out, in·kh·kw] in the order (kh, kw, in) of channels-last patches: the inverse of
    :func:`~dpcore.bookkeeping.conv.weight_order`."""
    (kh, kw), c = m.kernel_size, m.in_channels
    return rows.reshape(-1, c, kh, kw).permute(0, 2, 3, 1).reshape(rows.shape[0], -1)


def _gamma(k: int, dtype: torch.dtype) -> float:
    """γ_k = k·u/(1 − k·u) for the unit roundoff u of ``dtype``: the relative error bound of a
    dot product of k terms, in any order (Higham, §3.1)."""
    ku = k * torch.finfo(dtype).eps / 2
    return math.inf if ku >= 1 else ku / (1 - ku)


class WSJacobian:
    """The weight standardisation ŵ = (w − μ)/s of a :class:`WSConv2d`, s = sqrt(σ² + ε), per
    output filter of n weights. Its vector-Jacobian product, for a gradient v with respect to
    ŵ (one filter), is (v − mean(v) − ŵ·mean(v ⊙ ŵ)) / s; with κ = ‖ŵ‖²/n = σ²/(σ² + ε) and
    ŵ ⟂ 1, ‖that‖² = (‖v‖² − (1ᵀv)²/n − (2 − κ)(ŵᵀv)²/n) / s². Everything in float64."""

    def __init__(self, m: nn.Conv2d):
        w = m.weight.detach().double().reshape(m.out_channels, -1)
        self.float64 = m.weight.dtype == torch.float64  # its operands may underflow when squared
        self.n = w.shape[1]
        centred = w - w.mean(1, keepdim=True)
        # The variance as the mean square of the centred weights (torch's var, a Welford
        # reduction, took 9 ms for 512 filters of 4608 here, against under 1 ms).
        self.s = torch.sqrt(centred.square().mean(1, keepdim=True) + WS_EPS)  # [out, 1]
        self.w_hat = centred.div_(self.s)  # [out, n]
        self.kappa = self.w_hat.square().mean(1)  # [out]

    def vjp(self, v: torch.Tensor) -> torch.Tensor:
        """Gradients with respect to w from gradients ``v`` [..., out, n] with respect to ŵ,
        computed in float64 (``v`` is left as it is)."""
        v = v.to(torch.float64, copy=True)
        mean = v.mean(-1, keepdim=True)
        along = torch.einsum("...on,on->...o", v, self.w_hat).unsqueeze(-1).div_(self.n)
        v.sub_(mean).addcmul_(along, self.w_hat, value=-1.0)
        return v.div_(self.s)

    def materialised_sq_norms(
        self, W: torch.Tensor, w_hat: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(‖vjp(W_i)‖² per example without its allowance, the allowance, β_i²) for per-example
        gradients ``W`` [B, out, n] with respect to ŵ, which are left as they are (``w_hat``: ŵ
        with its entries in the order of W's rows, if that is not the weight's).

        Per filter, ‖v‖², 1ᵀv and ŵᵀv, each formed in float64: by the compiled kernel
        (:func:`dpcore.native.row_stats`) from one read of W, else from a float64 copy of one
        example at a time (shapes that do not depend on the batch's size). (Forming the VJP
        of every row took six reads of W and three writes.) For the stored ŵ, which is ⟂ 1 only
        to its rounding (δ = 1ᵀŵ: far from 0 where the weights' mean is large next to their
        spread), s²‖vjp(v)‖² = ‖v‖² − (1ᵀv)²/n − (2 − κ)(ŵᵀv)²/n + 2(1ᵀv)(ŵᵀv)δ/n² exactly,
        κ = ‖ŵ‖²/n. The subtraction can cancel (v nearly along 1 or ŵ), so the allowance covers,
        relative to ‖v‖, the rounding of ‖v‖², of 1ᵀv and ŵᵀv (γ_{n+1}·‖v‖·√n and ·‖ŵ_o‖), of
        κ and δ, and of the formula: the norms with it are never below the exact norms of the
        VJP of W_i (a natural gradient's norm gains about 10⁻¹² of itself). β_i² = Σ_o
        ‖v_o‖²/s_o² bounds what the clipped sum's terms, then its VJP, round
        (:meth:`~dpcore.bookkeeping.base.SquaredNorms.add_rounding`)."""
        B, out, n = W.shape
        w_hat = self.w_hat if w_hat is None else w_hat
        stats = native.row_stats(W.reshape(B * out, n), w_hat)
        if stats is not None:
            s2, s1, sw = (stats[:, k].view(B, out) for k in range(3))
        else:
            s2, s1, sw = self._float64_sums(W, w_hat)
        rel_s2 = _gamma(n + 4, torch.float64)  # float64 squares of float32 or float64 entries, summed
        g = _gamma(n + 1, torch.float64)  # a float64 dot product of n terms
        rn = math.sqrt(n)
        length = s2.mul(1.0 + rel_s2).sqrt()  # ‖v_o‖, rounded up
        # The sums scaled by 1/√n before they are squared: |1ᵀv|/√n ≤ ‖v‖ and |ŵᵀv|/√n ≤ √κ·‖v‖,
        # so no square overflows while ‖v‖² is finite (a float64 model's (1ᵀv)² could reach
        # n·‖v‖² and overflow to inf, its term −inf, clamped to 0: helper-2's review).
        a1, aw = s1 / rn, sw / rn
        e1 = g * length  # |error of 1ᵀv|/√n ≤ γ·Σ|v|/√n ≤ γ·‖v‖
        ew = g * torch.linalg.vector_norm(w_hat, dim=1).mul(1.0 + 1e-12).view(1, -1) * length / rn
        two_k = (2.0 - self.kappa).view(1, -1)
        delta = w_hat.sum(1).view(1, -1)  # 1ᵀŵ_o in float64: within γ_n·‖ŵ_o‖₁ of its exact value
        e_delta = g * w_hat.abs().sum(1).view(1, -1)
        per_filter = s2 - a1.square() - two_k * aw.square() + 2.0 * (a1 * aw) * (delta / n)
        # Not finite while ‖v‖² is (a product near float64's largest value): a bound from ‖v‖², as
        # s·J = I − 11ᵀ/n − ŵŵᵀ/n has norm at most max(1, κ) for the stored ŵ (its eigenvalues
        # are 1 and 1 − λ, 0 ≤ λ ≤ 1 + κ).
        bound = s2 * (1.0 + rel_s2) * self.kappa.clamp_min(1.0).square().view(1, -1)
        per_filter = torch.where(torch.isfinite(per_filter) | ~torch.isfinite(s2), per_filter, bound)
        # |s̃² − s²| ≤ 2|s̃|·e for a sum s̃ within e of s (and s̃² ≤ |s̃|·e where |s̃| < e); the
        # cross term's product is within (|ã1| + e1)(|ãw| + ew)(|δ̃| + e_δ) − |ã1·ãw·δ̃| of its
        # exact value; κ is within γ_{n+1}·κ of ‖ŵ‖²/n; the scalings by 1/√n and 1/n round
        # within the last term's 128·u.
        cross = (a1.abs() + e1) * (aw.abs() + ew) * (delta.abs() + e_delta) - (a1 * aw * delta).abs()
        allowance = (
            2.0 * a1.abs() * e1
            + two_k * 2.0 * aw.abs() * ew
            + 2.0 * cross / n
            + g * self.kappa.view(1, -1) * aw.square()
            + (rel_s2 + 64 * torch.finfo(torch.float64).eps) * s2
        )
        scale = self.s.view(1, -1).square()
        beta_sq = (s2 / scale).sum(1) * (1.0 + rel_s2)
        return (per_filter.clamp_min(0.0) / scale).sum(1), (allowance / scale).sum(1), beta_sq

    @staticmethod
    def _float64_sums(W: torch.Tensor, w_hat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(‖v‖², 1ᵀv, ŵᵀv) [B, out] of the rows of ``W`` [B, out, n], from a float64 copy of one
        example at a time: each example's sums are formed by operations of the same shapes
        whatever the batch's size (a product over several examples could round an example's sums
        differently with the number of examples beside it)."""
        B, out, n = W.shape
        U = torch.stack([torch.ones_like(w_hat), w_hat], dim=2).to(W.device)  # [out, n, 2]
        st = torch.empty((B, out, 1, 2), dtype=torch.float64, device=W.device)
        s2 = torch.empty((B, out), dtype=torch.float64, device=W.device)
        for i in range(B):
            v = W[i].to(torch.float64)
            torch.bmm(v.unsqueeze(1), U, out=st[i])
            torch.linalg.vector_norm(v, dim=1, out=s2[i])
        return s2.square_(), st[:, :, 0, 0], st[:, :, 0, 1]

    def ghost_sq_norms(self, A: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
        """Per-example ‖vjp(Σ_t G_t A_tᵀ)‖², never below the exact value, from patches A
        [B, n, T] and output gradients G [B, out, T] without forming the per-example gradients.

        The patches are centred first: the standardisation discards the mean direction, so
        with ṽ = Σ_t g_t Ã_t (Ã_t centred), ‖vjp(ṽ)‖² = (‖ṽ‖² − (2 − κ)(ŵᵀṽ)²/n) / s² where
        1ᵀṽ = 0 and ŵ ⟂ 1, ‖ṽ‖² from the Gram matrices and ŵᵀṽ from ŵ applied to the patches;
        the clipped sum releases vjp(ṽ). The subtraction can cancel (ṽ nearly along ŵ), so an
        allowance for float64 rounding is added, 16·(n + T)·u·μ² with μ = Σ_t ‖Ã_t‖·|g_t|,
        which bounds every term's magnitude. The centred patches are ⟂ 1 and the stored ŵ is
        ⟂ 1 only to their rounding (δ = 1ᵀŵ; far from 0 where the weights' mean is large next to
        their spread), and the exact norm then has the terms −(1ᵀṽ)²/n + 2(1ᵀṽ)(ŵᵀṽ)δ/n² too,
        at most (ŵᵀṽ)²δ²/n³ ≤ κ(δ/n)²·μ² whatever 1ᵀṽ is: that is added as well (helper-2's
        review: without it, float64 weights of mean 10¹³–10¹⁵ times their spread gave shares of
        1.05–56·C). The result can only overestimate the norm, which costs a smaller clip
        factor, never a share above C."""
        sq, allowance = self.centred_sq_norms(*centred(A, G))
        return sq + allowance

    def centred_sq_norms(self, A: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the norms of :meth:`ghost_sq_norms` without their allowance, which can be below the
        exact ones; the allowance, [B]), from the operands :func:`centred` made."""
        sq, allowance, _ = self.centred_terms(A, G)
        return sq, allowance

    def centred_terms(self, A: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(:meth:`centred_sq_norms`' two, and each filter's magnitudes Σ_t ‖Ã_t‖·|g_{t,o}|
        [B, out]: what the terms of filter o's per-example gradient add up to in magnitude).
        A form adds the allowance with :meth:`~dpcore.bookkeeping.base.SquaredNorms.add_allowance`.
        A float64 layer's operands are balanced per (example, position) first
        (:func:`~dpcore.bookkeeping.norms.balanced`: the same ṽ, ŵᵀṽ and magnitudes, with no
        square of a tiny input rounding to 0); the clipped sum contracts them as they are."""
        if self.float64:
            A, G = balanced(A, G, True)
        B, n, T = A.shape
        flat = A.transpose(0, 1).reshape(n, B * T)  # no copy where A came from centred()
        aa = A.transpose(1, 2) @ A  # [B, T, T]
        vv = ((aa @ G.transpose(1, 2)) * G.transpose(1, 2)).sum(1)  # [B, out]: ‖ṽ_o‖²
        # ŵ meets every (example, position) in one matrix product (batched over examples, each
        # product would be only T wide).
        w_a = (self.w_hat @ flat).view(-1, B, T)  # [out, B, T]: ŵ_oᵀÃ_t
        w_v = (w_a * G.transpose(0, 1)).sum(2).t()  # [B, out]: ŵ_oᵀṽ_o = Σ_t g_t·ŵ_oᵀÃ_t
        # ‖Ã_t‖ from the Gram matrices' diagonals (a norm over the strided n axis took longer
        # than the Gram matrices themselves).
        magnitudes = (G.abs() * aa.diagonal(dim1=1, dim2=2).sqrt().unsqueeze(1)).sum(2)
        eps = torch.finfo(torch.float64).eps
        # κ(δ/n)²·μ² for the terms that 1ᵀṽ = 0 and ŵ ⟂ 1 would remove (|δ| rounded up by its
        # error, γ_{n+1}·‖ŵ‖₁; the factor takes the rounding of κ, δ/n and μ²).
        delta = self.w_hat.sum(1).abs() + _gamma(self.n + 1, torch.float64) * self.w_hat.abs().sum(1)
        off_axis = self.kappa * (delta / self.n).square() * (1.0 + 2 * (self.n + 2 * T + 8) * eps)
        allowance = (8.0 * (self.n + T) * eps + off_axis.view(1, -1)) * magnitudes.square()
        # ŵᵀṽ scaled by 1/√n before it is squared (|ŵᵀṽ|/√n ≤ √κ·‖ṽ‖: no overflow while ‖ṽ‖² is
        # finite); where the difference is still not finite, max(1, κ)²·‖ṽ‖² bounds it (the norm
        # of s·J, as in materialised_sq_norms; the allowance takes the rounding of ‖ṽ‖²).
        per_filter = vv - (2.0 - self.kappa) * (w_v / math.sqrt(self.n)).square()
        bound = vv * self.kappa.clamp_min(1.0).square().view(1, -1)
        per_filter = torch.where(torch.isfinite(per_filter) | ~torch.isfinite(vv), per_filter, bound).clamp_min(0.0)
        scale = self.s.view(1, -1).square()
        return (per_filter / scale).sum(1), (allowance / scale).sum(1), magnitudes

    def add_rounding(self, sq, magnitudes: torch.Tensor, positions: int) -> None:
        """Add into ``sq`` (:meth:`~dpcore.bookkeeping.base.SquaredNorms.add_rounding`) the
        rounding of the clipped sum: one product over the batch's (example, position) terms, then
        the VJP. Filter o's error e_o maps to P(e_o)/s_o, P a projection (norm ≤ 1), and the
        VJP's own rounding of the sum (a mean over n, ŵᵀv over n, three updates) is within
        3·γ_{n+4} of its size: so γ_k with k = ghost_roundings(batch, T) + 3·(n + 4), and
        β_i² = Σ_o (Σ_t ‖Ã_t‖·|g_{t,o}|)²/s_o² from the filters' magnitudes."""
        beta_sq = (magnitudes / self.s.view(1, -1)).square().sum(1)
        sq.add_rounding(beta_sq, positions=positions, more=3 * (self.n + 4))


class WSConvForm(ConvForm):
    def materialised(self, m, a, g, G, sq, ctx):
        # Gradients for the weight used, ŵ (the native kernel's norms are theirs, not the VJP's),
        # measured through the standardisation; the clipped sum goes back through it once.
        W, _, last = per_example_gradients(m, a, g)
        jac = WSJacobian(m)
        w_hat = weight_rows(m, jac.w_hat) if last else jac.w_hat  # ŵ in the order of W's rows
        norms, allowance, beta_sq = jac.materialised_sq_norms(W, w_hat)
        sq += norms
        sq.add_allowance(allowance)
        sq.add_rounding(beta_sq, positions=None, more=3 * (jac.n + 4))  # a weighted sum, then the VJP
        post = (lambda w: jac.vjp(weight_order(m, w))) if last else jac.vjp
        return MaterialisedPart(m, W, bias_per_example(m, G.sum(2), sq), post=post)

    def ghost_input(self, m, a, G, sq, ctx):
        bias_g = bias_per_example(m, G.sum(2), sq)
        return self._ghost(m, *centred_patches(m, a, G), bias_g, sq)

    def ghost(self, m, A, G, sq, ctx):
        bias_g = bias_per_example(m, G.sum(2), sq)
        # The clipped sum contracts the centred patches the norms used, so what it releases,
        # vjp(ṽ), is what was measured. The standardisation's VJP discards the mean direction, so
        # that is vjp(v) of the patches as recorded, to the stored ŵ's rounding (ŵ ⟂ 1 to δ); the
        # float64 copy is made once.
        return self._ghost(m, *centred(A, G), bias_g, sq)

    @staticmethod
    def _ghost(m, A, G, bias_g, sq):
        """The ghost part from centred float64 patches ``A`` and output gradients ``G``."""
        jac = WSJacobian(m)
        norms, allowance, magnitudes = jac.centred_terms(A, G)
        sq += norms
        sq.add_allowance(allowance)
        jac.add_rounding(sq, magnitudes, positions=A.shape[2])
        return GhostPart(m, A, G, True, bias_g, post=jac.vjp)

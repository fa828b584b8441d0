"""The squared-norm helpers the book-keeping forms share: a materialised gradient's row norms
(float32 chunks summed in float64), a weight-and-bias layer's exact per-example or ghost norms,
the float64 balancing of each position's input and output gradient, and the ghost form's
allowance for its own rounding. :func:`dpcore.bookkeeping.base.weight_and_bias` turns them
into a layer's :class:`~dpcore.bookkeeping.base.Part`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .base import Context


# Squared norms of float32 rows are summed in float32 over chunks of this many elements, and
# the chunks in float64. For a sum of k non-negative terms the rounding error is at most
# (k−1)·u in any order (u = 2⁻²⁴), so with the squaring and the square root of
# ``vector_norm`` the squared norm is within (k+2)·u ≈ 1.1e-6 of exact, and the norm within
# 5.4e-7 (dpcore.clipping.NORM_ERROR, which the clipping margin CLIP_MARGIN covers with the sums'
# rounding). It avoids a float64 copy of every per-example gradient.
F32_CHUNK = 16
# Below this clipping bound, float32 underflow of squares (|w| < 1e-19) could matter
# relative to C²: then the rows are summed in float64.
F32_MIN_CLIP = 1e-4


def row_sq_norms(W: torch.Tensor, ctx: Context) -> torch.Tensor:
    """‖W_i‖² in float64 for each row of a 2-D tensor, with an error well inside the clipping
    margin (see ``F32_CHUNK``). A float32 chunk can overflow (squares above ~1e38): the result
    is then not finite, and the caller, having noted in ``ctx.float32_rows`` that this path ran,
    measures the batch again with ``ctx.exact_rows`` (float64 throughout), so that a finite but
    huge gradient is clipped, not skipped. That check is made once per batch, not per layer:
    reading a device value makes the host wait for a GPU."""
    rows, n = W.shape
    if W.dtype != torch.float32 or ctx.clip_norm < F32_MIN_CLIP or n < 2 * F32_CHUNK or ctx.exact_rows:
        return torch.linalg.vector_norm(W, dim=1, dtype=torch.float64).square()
    ctx.float32_rows.append(W.shape)
    head = n - n % F32_CHUNK
    chunks = torch.linalg.vector_norm(W[:, :head].reshape(rows, -1, F32_CHUNK), dim=2)  # float32
    sq = torch.linalg.vector_norm(chunks, dim=1, dtype=torch.float64).square()  # the chunks summed in float64
    if head < n:
        sq += torch.linalg.vector_norm(W[:, head:], dim=1, dtype=torch.float64).square()
    return sq


def weight_sq_norms(A: torch.Tensor, G: torch.Tensor, channels_first: bool, ctx: Context):
    """(‖W_i‖_F² per example in float64, the per-example gradients W_i or None, the magnitudes
    β_i² of :meth:`SquaredNorms.add_rounding` or None), by the cheaper exact form: W_i = G_iᵀA_i
    materialised, or the ghost Σ_{t,s}(a_t·a_s)(g_t·g_s), whose clipped sum runs over the batch's
    (example, position) terms (T per example), each multiplied by f_i: β_i = Σ_t ‖a_t‖·‖g_t‖.
    The ghost norms come without the allowance for their rounding (:func:`ghost_allowance`),
    which can put them below the exact ones: :func:`weight_and_bias` adds it."""
    if channels_first:  # A [B, d, T], G [B, c, T]
        B, d, T = A.shape
        c = G.shape[1]
    else:  # A [B, T, d], G [B, T, c]
        B, T, d = A.shape
        c = G.shape[2]
    if A.dtype == torch.float64 or G.dtype == torch.float64:  # a float64 model's operands
        A, G = balanced(A, G, channels_first)
    if T == 1:
        a, g = (A[:, :, 0], G[:, :, 0]) if channels_first else (A[:, 0], G[:, 0])
        sq = (
            torch.linalg.vector_norm(a, dim=1, dtype=torch.float64).square()
            * torch.linalg.vector_norm(g, dim=1, dtype=torch.float64).square()
        )
        return sq, None, None  # its terms are the shares themselves (rounding_floor's first term)
    # (Convolutions reach here only when materialising is over budget: the ghost form.)
    if not channels_first and ctx.materialises(c * d, B) and T * d * c <= 4 * T * T * (d + c):
        W = G.transpose(1, 2) @ A  # [B, c, d]
        return row_sq_norms(W.reshape(B, -1), ctx), W, None
    A64, G64 = A.double(), G.double()
    if channels_first:
        aa = A64.transpose(1, 2) @ A64  # [B, T, T]
        gg = G64.transpose(1, 2) @ G64
    else:
        aa = A64 @ A64.transpose(1, 2)
        gg = G64 @ G64.transpose(1, 2)
    # Summed over s, then over t: each term takes part in at most 2T − 2 additions.
    sq = (aa * gg).sum(2).sum(1)
    dim = 1 if channels_first else 2
    beta = (torch.linalg.vector_norm(A64, dim=dim) * torch.linalg.vector_norm(G64, dim=dim)).sum(1)
    # The clipped sum (GhostPart) passes each term f_i·g_t·a_tᵀ through ghost_roundings(B, T)
    # roundings (f_i·g_t, the products, the additions within and across chunks, in any order): β_i
    # bounds the magnitudes it rounds. The norms come without their allowance
    # (ghost_allowance), which the caller adds with SquaredNorms.add_allowance.
    return sq, None, beta.square()


def balanced(A: torch.Tensor, G: torch.Tensor, channels_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``A`` and ``G`` (laid out as in :func:`weight_sq_norms`) with each (example, position)'s
    pair rescaled by an exact power of two, a_t·2⁻ᵉ and g_t·2ᵉ, e chosen so that max|a_t| and
    max|g_t| meet halfway (new tensors). Every product g_t·a_tᵀ, and so every per-example
    gradient and its norm, is unchanged; but the squares and Gram entries the norms are formed
    from are now of the size of ‖a_t‖·‖g_t‖ itself. Without it a float64 model's input of
    10⁻¹⁶² and output gradient of 10¹⁵⁴ gave ‖a‖² = 0 (each square below float64's smallest
    number) while g·aᵀ ≈ 10⁻⁸ is summed: a norm of 0, the factor 1, shares of 1.7–9.6·C
    (helper-3's review); the mirror case, ‖a‖² = inf, skipped a gradient of norm 4. Float32
    operands (widened to float64 in the norms) cannot reach either. Left: a position whose
    ‖a_t‖·‖g_t‖ is itself below about 10⁻¹⁵⁴ may round to 0 in the sums, an absolute error below
    T·2⁻⁵³⁷ ≈ T·10⁻¹⁶² in the norm, far inside the clipping margin for any clip_norm ≥ 10⁻¹⁰⁰
    (:func:`dpcore.validation.check_clip_norm`)."""
    dim = 1 if channels_first else 2  # the features of one position
    ea = torch.frexp(A.abs().amax(dim, keepdim=True))[1]  # exponents (0 for a zero or non-finite max)
    eg = torch.frexp(G.abs().amax(dim, keepdim=True))[1]
    # |e| ≤ 1000: 2^±e is a normal float64 number, so each scaling is exact (an element pushed
    # below 2⁻¹⁰⁷⁴ was far below its position's largest and counts nothing measurable).
    e = torch.div(ea - eg, 2, rounding_mode="floor").clamp_(-1000, 1000)
    return torch.ldexp(A.double(), -e), torch.ldexp(G.double(), e)


def ghost_allowance(A: torch.Tensor, G: torch.Tensor, channels_first: bool, magnitude_sq: torch.Tensor) -> torch.Tensor:
    """The allowance for the float64 rounding of the ghost norms of :func:`weight_sq_norms`
    (inputs ``A`` and output gradients ``G`` laid out as there; ``magnitude_sq``: its β_i²).

    An example's positions can pull in opposite directions; its gradient is then small next to
    its terms, and float64 rounding, relative to the terms, is not small next to its norm: the
    norm could come out below the exact one, and an example whose gradient rounds to zero
    would keep the factor 1 however large its terms, whose rounding in the clipped sum could
    then swallow another example's share. Each Gram entry is within γ_d·‖a_t‖‖a_s‖
    (γ_c·‖g_t‖‖g_s‖) of exact and the sums add γ_2T, so the error is at most about
    (d + c + 2T)·u·β², β = Σ_t ‖a_t‖·‖g_t‖: doubled, so that the norm is never below the exact
    one and f_i·β ≤ C/√(2(d + c + 2T)·u)."""
    if channels_first:  # A [B, d, T], G [B, c, T]
        (d, T), c = A.shape[1:], G.shape[1]
    else:  # A [B, T, d], G [B, T, c]
        (T, d), c = A.shape[1:], G.shape[2]
    u = torch.finfo(torch.float64).eps / 2  # the unit roundoff
    return 2 * (d + c + 2 * T + 4) * u * magnitude_sq

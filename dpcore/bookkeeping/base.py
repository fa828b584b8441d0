"""What a layer type gives book-keeping clipping, and the pieces the forms share.

A :class:`LayerForm` says whether it takes a module (:meth:`~LayerForm.accepts`), what it
refuses about it (:meth:`~LayerForm.problems`), and, from the layer's recorded input ``a`` and
output gradient ``g``, adds each example's squared gradient norm into ``sq`` and returns a
:class:`Part` that later forms the clipped sum Σ_i f_i·grad_i of each parameter. A form is
registered for an exact module type with :func:`dpcore.bookkeeping.register_layer`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn


class Unsupported(Exception):
    """Raised during a call when the fast path cannot be used for this model/batch."""


@dataclass(frozen=True)
class Context:
    """What a form may need beyond the layer: the clipping bound (for the precision of norms)
    and how many elements of per-example gradients it may materialise. ``exact_rows``: row
    norms in float64 throughout (see :func:`row_sq_norms`), which notes in ``float32_rows``
    each time it took the float32 path instead."""

    clip_norm: float
    max_elements: int
    exact_rows: bool = False
    float32_rows: list = field(default_factory=list)
    float32_sums: bool = True  # whether a ghost form may sum in float32 (:func:`float32_sum_slack`)
    # Per layer, each example's bound on the rounding of its share in a float32 clipped sum
    # ([B] float64, see :class:`GhostPart`); the clip factor is computed for ‖g_i‖ + √Σ slack².
    slack_sq: list = field(default_factory=list)


# drop_bad(t): the rows of examples with a non-finite gradient set to exactly zero (never NaN·0).
DropBad = Callable[[torch.Tensor | None], torch.Tensor | None]


@dataclass
class RowUpdate:
    """A clipped sum that is non-zero only in some rows of a large parameter (a token table):
    ``rows[k]`` is added into row ``index[k]`` (an index may repeat; its rows add up). Added
    into a running sum directly, it never forms a tensor of the parameter's full size."""

    index: torch.Tensor  # [P] long
    rows: torch.Tensor  # [P, ...] in the parameter's dtype
    shape: torch.Size

    def add_to(self, total: torch.Tensor) -> None:
        total.index_add_(0, self.index, self.rows.to(total.dtype))

    def dense(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.rows.dtype, device=self.rows.device).index_add_(
            0, self.index, self.rows
        )


class Part:
    """One layer's per-example data, kept between the norms and the clipped sum."""

    def contributions(
        self, factors: torch.Tensor, wide: bool, drop_bad: DropBad
    ) -> list[tuple[str, torch.Tensor | RowUpdate]]:
        """(parameter name within the layer, Σ_i f_i·grad_i) for each trainable parameter, in
        the parameter's dtype (a :class:`RowUpdate` where only some rows are non-zero); summed
        in float64 when ``wide``."""
        raise NotImplementedError


class LayerForm:
    """How book-keeping clipping handles one layer type (Linear, Conv2d, GroupNorm, ...)."""

    def accepts(self, m: nn.Module) -> bool:
        """Whether this form covers this instance (a convolution with groups > 1 may not be)."""
        return True

    def problems(self, m: nn.Module) -> list[str]:
        """Parameter names (within the layer) with the reason the form refuses them."""
        return []

    def per_example(self, m: nn.Module, a: torch.Tensor, g: torch.Tensor, sq: torch.Tensor, ctx: Context) -> Part:
        """Add ‖grad_i‖² of this layer's trainable parameters into ``sq`` (float64, [B]) and
        return the :class:`Part` that forms their clipped sums."""
        raise NotImplementedError


def dtypes(m: nn.Module, wide: bool) -> tuple[torch.dtype, torch.dtype]:
    """(the parameters' dtype, the dtype the clipped sum is formed in)."""
    pdtype = next(p for p in m.parameters(recurse=False)).dtype
    return pdtype, (torch.float64 if wide else pdtype)


# -- weight-and-bias layers (Linear, Conv2d) ------------------------------------------------------


def refuse_frozen_weight(m: nn.Module) -> list[str]:
    """A trainable bias beside a frozen weight is not handled."""
    if m.bias is not None and m.bias.requires_grad and not m.weight.requires_grad:
        return ["bias (its weight is frozen)"]
    return []


def bias_per_example(m: nn.Module, per_example_bias: torch.Tensor, sq: torch.Tensor):
    """Per-example bias gradients (Σ over positions of G), their norms added into ``sq``."""
    if m.bias is None or not m.bias.requires_grad:
        return None
    sq += torch.linalg.vector_norm(per_example_bias, dim=1, dtype=torch.float64).square()
    return per_example_bias


@dataclass
class MaterialisedPart(Part):
    """Per-example weight gradients ``W`` [B, out, in] (and bias gradients [B, out])."""

    m: nn.Module
    W: torch.Tensor
    bias_g: torch.Tensor | None

    def contributions(self, factors, wide, drop_bad):
        pdtype, dtype = dtypes(self.m, wide)
        f = factors.to(dtype)
        pe = drop_bad(self.W).to(dtype)
        w = f @ pe.reshape(pe.shape[0], -1)  # Σ_i f_i W_i: one matrix-vector product
        out = [("weight", w.reshape(self.m.weight.shape).to(pdtype))]
        if self.bias_g is not None:
            out.append(("bias", (f @ drop_bad(self.bias_g).to(dtype)).to(self.m.bias.dtype)))
        return out


@dataclass
class GhostPart(Part):
    """Inputs ``A`` and output gradients ``G`` whose per-example products are never formed:
    the clipped sum is Σ_i f_i G_iᵀA_i over (example, position). ``post`` (linear) maps the
    sum to the weight's gradient (a weight standardisation's VJP).

    With several positions, each example's share must keep the norm its factor was computed
    for, and a float32 sum over (example, position) terms does not by itself: summed in any
    order, n products come out as Σ_k x_k·y_k·(1 + θ_k) with |θ_k| ≤ γ_n = n·u/(1 − n·u)
    (u = 2⁻²⁴; Higham, *Accuracy and Stability of Numerical Algorithms*, §3.1), so example i's
    share is f_i·(G_iᵀA_i + E_i) with ‖E_i‖_F ≤ γ_n·Σ_t ‖g_t‖·‖a_t‖, which can exceed the 1e-6
    margin when the positions' terms cancel. Where ``float32_chunk`` is set
    (:func:`float32_sum_slack`, which added that bound to the example's norm for its clip
    factor), the sum runs in float32, in chunks of that many examples (n ≤
    :data:`F32_SUM_TERMS` + 2), the chunks added in float64. Otherwise it runs in float64."""

    m: nn.Module
    A: torch.Tensor
    G: torch.Tensor
    channels_first: bool
    bias_g: torch.Tensor | None
    post: Callable | None = None
    float32_chunk: int = 0

    def contributions(self, factors, wide, drop_bad):
        pdtype, dtype = dtypes(self.m, wide)
        f = factors.to(dtype)
        A, G = drop_bad(self.A), drop_bad(self.G)
        one_position = A.shape[2 if self.channels_first else 1] == 1
        if self.float32_chunk and not wide:
            w = torch.zeros(
                G.shape[1 if self.channels_first else 2],
                A.shape[1 if self.channels_first else 2],
                dtype=torch.float64,
                device=A.device,
            )
            for lo in range(0, A.shape[0], self.float32_chunk):
                hi = lo + self.float32_chunk
                w += self._sum(f[lo:hi].float(), G[lo:hi], A[lo:hi], torch.float32).double()
        else:
            # One position per example: a float32 sum over the examples, as any clipped sum is.
            acc = dtype if (one_position and self.post is None) else torch.float64
            w = self._sum(f, G, A, acc)
        if self.post is not None:  # the standardisation's VJP is linear: applied to the sum
            w = self.post(w)
        w = w.to(dtype)
        out = [("weight", w.reshape(self.m.weight.shape).to(pdtype))]
        if self.bias_g is not None:
            out.append(("bias", (f @ drop_bad(self.bias_g).to(dtype)).to(self.m.bias.dtype)))
        return out

    def _sum(self, f, G, A, acc):
        """Σ over (example, position) of f_i·g·aᵀ in ``acc``: (f·G) times A, one matrix product."""
        Gf = G.to(acc) * f.to(acc).view(-1, 1, 1)
        if self.channels_first:  # [B, c, T] and [B, d, T]
            return torch.einsum("bct,bdt->cd", Gf, A.to(acc))
        return Gf.reshape(-1, Gf.shape[2]).t() @ A.to(acc).reshape(-1, A.shape[2])


# A ghost form's float32 clipped sum adds at most this many (example, position) terms in one
# product (then the chunks in float64): γ_n ≤ 2.5e-4, the bound on each term's relative rounding.
F32_SUM_TERMS = 4096
U32 = 2.0**-24


def gamma32(n: int) -> float:
    """γ_n = n·u/(1 − n·u) for float32: the relative rounding of each term of a sum of n products."""
    nu = n * U32
    if nu >= 0.5:
        raise ValueError(f"gamma32: n = {n} is too large for a float32 error bound")
    return nu / (1.0 - nu)


def exact_float32_matmul(device: torch.device) -> bool:
    """Whether float32 matrix products on ``device`` are IEEE float32 (not TF32 or bf16, which
    torch allows through ``set_float32_matmul_precision`` or the backends' ``fp32_precision``):
    the rounding bound of :func:`gamma32` holds only then. Unknown devices: no."""
    try:
        if device.type == "cpu":
            return torch.backends.mkldnn.matmul.fp32_precision in ("none", "ieee")
        if device.type == "cuda":
            mm = torch.backends.cuda.matmul
            return mm.fp32_precision in ("none", "ieee") and not mm.allow_tf32
    except Exception:  # a torch without these settings, or with mixed old and new ones
        return False
    return False


def float32_sum_slack(A: torch.Tensor, G: torch.Tensor, channels_first: bool, ctx: Context, scale=None) -> int:
    """If the ghost form's clipped sum of this layer can run in float32 (float32 inputs, exact
    float32 products, a clipping bound where underflow cannot matter, at most
    :data:`F32_SUM_TERMS` positions), add each example's bound on its share's rounding to
    ``ctx.slack_sq`` and return the examples per float32 chunk; else 0 (a float64 sum).

    The bound is γ_{n+2}·Σ_t ‖g_t‖·‖a_t‖ with n = chunk × positions (the +2: rounding f_i to
    float32, and f_i·g). ``scale`` [c] (a weight standardisation's 1/s per output filter, whose
    VJP is applied to the sum): per output filter, γ·Σ_t |g_to|·‖a_t‖·scale_o, combined in
    quadrature over the filters."""
    positions = A.shape[2 if channels_first else 1]
    if (
        A.dtype != torch.float32
        or not ctx.float32_sums
        or ctx.exact_rows
        or ctx.clip_norm < F32_MIN_CLIP
        or positions > F32_SUM_TERMS
        or not exact_float32_matmul(A.device)
    ):
        return 0
    chunk = min(F32_SUM_TERMS // positions, A.shape[0])
    g32 = gamma32(chunk * positions + 2)
    chunks = -(-A.shape[0] // chunk)
    g32 += (1.0 + g32) * chunks * 2.0**-52  # the chunks added in float64 (γ of float64, doubled)
    g32 *= 1.0 + 1e-9  # β below is summed in float64: relative error ≪ 1e-9
    # (Products that underflow to subnormals add at most n·2⁻¹⁴⁹ per entry: ≪ 1e-6·C for C ≥ 1e-4.)
    dim = 1 if channels_first else 2
    ctx.float32_rows.append(A.shape)  # the norms below are float32: an overflow is measured again
    a_norms = float32_norms_above(A, dim)  # [B, T]
    if scale is None:
        beta = (a_norms * float32_norms_above(G, dim)).sum(1)
        ctx.slack_sq.append((g32 * beta).square())
    else:  # channels first: G [B, c, T]
        beta = (G.abs().double() * a_norms.unsqueeze(1)).sum(2) * scale.view(1, -1)  # [B, c]
        ctx.slack_sq.append(g32**2 * beta.square().sum(1))
    return chunk


def float32_norms_above(X: torch.Tensor, dim: int) -> torch.Tensor:
    """Upper bounds (float64) of the Euclidean norms of float32 ``X`` along ``dim``, computed in
    float32 (a float64 copy of a layer's patches costs more than the rest of the bound): the
    sum of n squares, in any order and at least float32 precision, is within γ_n of exact, the
    square root adds u, and squares that underflow lose at most n·2⁻¹²⁶ of the sum. Not finite
    if a square overflows."""
    n = X.shape[dim]
    norms = torch.linalg.vector_norm(X, dim=dim).double()
    return norms * ((1.0 + U32) / (1.0 - gamma32(n)) ** 0.5) + n**0.5 * 2.0**-63


# -- norms --------------------------------------------------------------------------------------------

# Squared norms of float32 rows are summed in float32 over chunks of this many elements, and
# the chunks in float64. For a sum of k non-negative terms the rounding error is at most
# (k−1)·u in any order (u = 2⁻²⁴), so with the squaring and the square root of
# ``vector_norm`` the squared norm is within (k+2)·u ≈ 1.1e-6 of exact, and the norm within
# 5.4e-7: inside the clipping margin of 1e-6 (dpcore.clipping.CLIP_MARGIN), so the clipped share
# still has norm ≤ C. It avoids a float64 copy of every per-example gradient.
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


def weight_and_bias(m: nn.Module, A: torch.Tensor, G: torch.Tensor, channels_first: bool, sq, ctx: Context) -> Part:
    """The part of a weight-and-bias layer from its inputs ``A`` and output gradients ``G``
    (channels first: [B, d, T] and [B, c, T]; else [B, T, d] and [B, T, c]), its examples'
    squared norms added into ``sq``: per-example weight gradients where they are the cheaper
    exact form, else the ghost form."""
    s, W = weight_sq_norms(A, G, channels_first, ctx)
    sq += s
    bias_g = bias_per_example(m, G.sum(2 if channels_first else 1), sq)
    if W is not None:
        return MaterialisedPart(m, W, bias_g)
    one_position = A.shape[2 if channels_first else 1] == 1
    chunk = 0 if one_position else float32_sum_slack(A, G, channels_first, ctx)
    return GhostPart(m, A, G, channels_first, bias_g, float32_chunk=chunk)


def weight_sq_norms(A: torch.Tensor, G: torch.Tensor, channels_first: bool, ctx: Context):
    """(‖W_i‖_F² per example in float64, the per-example gradients W_i or None), by the
    cheaper exact form: W_i = G_iᵀA_i materialised, or the ghost Σ_{t,s}(a_t·a_s)(g_t·g_s)."""
    if channels_first:  # A [B, d, T], G [B, c, T]
        B, d, T = A.shape
        c = G.shape[1]
    else:  # A [B, T, d], G [B, T, c]
        B, T, d = A.shape
        c = G.shape[2]
    if T == 1:
        a, g = (A[:, :, 0], G[:, :, 0]) if channels_first else (A[:, 0], G[:, 0])
        sq = (
            torch.linalg.vector_norm(a, dim=1, dtype=torch.float64).square()
            * torch.linalg.vector_norm(g, dim=1, dtype=torch.float64).square()
        )
        return sq, None
    # (Convolutions reach here only when materialising is over budget: the ghost form.)
    if not channels_first and B * c * d <= ctx.max_elements and T * d * c <= 4 * T * T * (d + c):
        W = G.transpose(1, 2) @ A  # [B, c, d]
        return row_sq_norms(W.reshape(B, -1), ctx), W
    A64, G64 = A.double(), G.double()
    if channels_first:
        aa = A64.transpose(1, 2) @ A64  # [B, T, T]
        gg = G64.transpose(1, 2) @ G64
    else:
        aa = A64 @ A64.transpose(1, 2)
        gg = G64 @ G64.transpose(1, 2)
    # Summed over s, then over t: each term takes part in at most 2T − 2 additions.
    sq = (aa * gg).sum(2).sum(1)
    # The positions' terms can cancel (an example's own positions pulling opposite ways), and
    # then float64 rounding, relative to the terms, is not small relative to the result. Each
    # Gram entry is within γ_d·‖a_t‖‖a_s‖ (γ_c·‖g_t‖‖g_s‖) of exact and the sums add γ_2T, so
    # the error is at most about (d + c + 2T)·u·β², β = Σ_t ‖a_t‖·‖g_t‖: added (doubled), so
    # that the norm is never below the exact one.
    dim = 1 if channels_first else 2
    beta = (torch.linalg.vector_norm(A64, dim=dim) * torch.linalg.vector_norm(G64, dim=dim)).sum(1)
    allowance = 2.0 * (d + c + 2 * T + 4) * torch.finfo(torch.float64).eps / 2 * beta.square()
    return sq + allowance, None


# -- normalisation layers (GroupNorm, LayerNorm) ----------------------------------------------------


@dataclass
class NormPart(Part):
    """Per-example gradients of a normalisation layer's γ and β ([B, numel] each, None if
    frozen): each example is normalised on its own, so they are sums over its positions."""

    m: nn.Module
    gamma: torch.Tensor | None
    beta: torch.Tensor | None

    @classmethod
    def measured(cls, m: nn.Module, gamma, beta, sq: torch.Tensor) -> NormPart:
        """The part, with the squared norms of γ's and β's gradients added into ``sq``."""
        for t in (gamma, beta):
            if t is not None:
                sq += torch.linalg.vector_norm(t, dim=1, dtype=torch.float64).square()
        return cls(m, gamma, beta)

    def contributions(self, factors, wide, drop_bad):
        pdtype, dtype = dtypes(self.m, wide)
        f = factors.to(dtype)
        return [
            (name, (f @ drop_bad(t).to(dtype)).to(pdtype).reshape(getattr(self.m, name).shape))
            for name, t in (("weight", self.gamma), ("bias", self.beta))
            if t is not None
        ]

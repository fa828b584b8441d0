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

from ..clipping import gamma, ghost_chunk, ghost_roundings, rounding_batch_size, rounding_floor, weighted_sum
from .norms import ghost_allowance, weight_sq_norms
from .sums import RowUpdate, SmallRows


class Unsupported(Exception):
    """Raised during a call when the fast path cannot be used for this model/batch."""


@dataclass(frozen=True)
class Context:
    """What a form may need beyond the layer: the clipping bound (for the precision of norms)
    and how many elements of per-example gradients it may materialise. ``exact_rows``: row
    norms in float64 throughout (see :func:`~dpcore.bookkeeping.norms.row_sq_norms`), which notes in ``float32_rows``
    each time it took the float32 path instead."""

    clip_norm: float
    max_elements: int
    exact_rows: bool = False
    float32_rows: list = field(default_factory=list)
    # The configured physical batch size (None: each batch's own size). A form chooses between
    # materialising and its ghost form by it, never by the batch's own size: the last batch of a
    # Poisson lot holds a number of examples that depends on the data, and the two forms add
    # different vectors for an example (the ghost form's are capped, the materialised ones are
    # rounded in float32), so a choice by the batch's size would let one example change the
    # others' contributions.
    batch_size: int | None = None

    def materialises(self, per_example: int, batch: int) -> bool:
        """Whether per-example tensors of ``per_example`` elements fit ``max_elements`` for a
        batch of ``batch`` examples, counted at the configured batch size where one is set."""
        return (batch if self.batch_size is None else self.batch_size) * per_example <= self.max_elements


class SquaredNorms:
    """Each example's squared gradient norm (float64, [B]), as the layers' forms add their terms
    into it: ``sq += t`` (a float64 [B] tensor), ``sq.index_add_(0, example, t)``, or
    ``sq.add_rows(v)`` (the squared norm of each example's row of a small [B, k] tensor, such as
    a bias's per-example gradients). Everything is summed once, by :meth:`total`: the rows of
    each dtype are joined and measured together (float64 accumulation), and the terms stacked
    and summed. On a GPU that is a few kernels in place of one to three per layer. A term is
    read only then: a form must not change a tensor after adding it. A term or rows of another
    shape or dtype raise :class:`Unsupported` (the model then runs on vmap, with a warning that
    says why). A ghost form also adds the rounding its clipped sum's product can take
    (:meth:`add_rounding`), which :meth:`total` folds in (:func:`dpcore.clipping.rounding_floor`),
    and the allowance for its own float64 rounding (:meth:`add_allowance`), which :meth:`total`
    adds to the norms: a form adds its norms without it, so none can leave it out or take it
    back, and the check against vmap reads what was added (:meth:`measured`)."""

    def __init__(self, batch: int, device: torch.device, rounding_batch: int | None = None):
        self.batch, self.device = batch, device
        # The configured physical batch size, at which the rounding bound is taken (see total()).
        self.rounding_batch = rounding_batch_size(batch, rounding_batch)
        self.terms: list[torch.Tensor] = []
        self.rows: dict[torch.dtype, list[torch.Tensor]] = {}
        self.rounding: list[tuple[int, int, torch.Tensor]] = []
        self.allowances: list[torch.Tensor] = []

    def add_allowance(self, allowance: torch.Tensor) -> None:
        """An allowance (float64 [B], ≥ 0) for the float64 rounding of a form's own norms, where
        an example's terms can cancel (a ghost form's Gram sums, a standardisation's subtraction):
        at least what that rounding can take off the norm, so that the norm :meth:`total` gives
        is never below the exact one. The check against vmap
        (:class:`dpcore.fastpath.CheckedBookKeeping`) expects up to twice it above the exact
        norm, and nothing below."""
        if allowance.shape != (self.batch,) or allowance.dtype != torch.float64:
            raise Unsupported(
                f"a layer form added an allowance of {allowance.dtype} {tuple(allowance.shape)}, "
                f"not float64 ({self.batch},)"
            )
        self.allowances.append(allowance.clamp_min(0.0))

    def add_rounding(self, magnitude_sq: torch.Tensor, positions: int | None, more: int = 0) -> None:
        """The rounding of a ghost form's clipped sum (:class:`GhostPart`), whose terms are not
        the examples' shares but their per-position products: ``positions`` per example, whose
        magnitudes add up to β_i for example i (``magnitude_sq``: β_i², float64 [B]), summed in
        chunks of whole examples and then passed through ``more`` further roundings (a
        standardisation's VJP). :meth:`total` counts the roundings at the configured batch size,
        k = ghost_roundings(rounding_batch, positions) + more
        (:func:`dpcore.clipping.ghost_roundings`), and holds (γ_k·β_i)² to the example's share of
        the margin. A form whose clipped sum adds anything but its examples' shares (each
        example's exact contribution, as a materialised or one-position form adds it) must call
        this. ``positions=None``: the terms are materialised rows, summed one after another over
        the batch (a weighted sum, then ``more`` roundings): k = rounding_batch + 2 + more."""
        if magnitude_sq.shape != (self.batch,) or magnitude_sq.dtype != torch.float64:
            raise Unsupported(
                f"a layer form added a rounding term of {magnitude_sq.dtype} {tuple(magnitude_sq.shape)}, "
                f"not float64 ({self.batch},)"
            )
        if (positions is not None and positions < 1) or more < 0:
            raise ValueError(f"a rounding term needs positions ≥ 1 (or None) and more ≥ 0 (got {positions}, {more})")
        self.rounding.append((positions, more, magnitude_sq))

    def add_rows(self, rows: torch.Tensor) -> None:
        if rows.dim() != 2 or rows.shape[0] != self.batch:
            raise Unsupported(
                f"a layer form added per-example rows of shape {tuple(rows.shape)}, not [{self.batch}, k]"
            )
        self.rows.setdefault(rows.dtype, []).append(rows)

    def __iadd__(self, term: torch.Tensor) -> SquaredNorms:
        if term.shape != (self.batch,) or term.dtype != torch.float64:
            raise Unsupported(
                f"a layer form added a squared-norm term of {term.dtype} {tuple(term.shape)}, not float64 ({self.batch},)"
            )
        self.terms.append(term)
        return self

    def index_add_(self, dim: int, index: torch.Tensor, source: torch.Tensor) -> SquaredNorms:
        """Add ``source[k]`` into example ``index[k]`` (as ``Tensor.index_add_``)."""
        zeros = torch.zeros(self.batch, dtype=torch.float64, device=self.device)
        return self.__iadd__(zeros.index_add_(dim, index, source))

    def measured(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(each example's squared norm with the forms' allowances added, the allowances' sum),
        float64 [B] each: the norms before :meth:`total` raises any for the clipped sum's
        rounding."""
        terms = list(self.terms)
        for rows in self.rows.values():
            joined = rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)
            terms.append(torch.linalg.vector_norm(joined, dim=1, dtype=torch.float64).square())
        if not terms:
            sq = torch.zeros(self.batch, dtype=torch.float64, device=self.device)
        else:
            sq = terms[0].clone() if len(terms) == 1 else torch.stack(terms).sum(0)
        allowance = torch.zeros_like(sq) if not self.allowances else sum(self.allowances[1:], self.allowances[0])
        return (sq + allowance if self.allowances else sq), allowance

    def total(self) -> torch.Tensor:
        """The squared norms to clip on: each example's with its forms' allowances
        (:meth:`measured`), never below the exact one, raised where its rounding in the clipped
        sum would exceed its share of the margin (:func:`dpcore.clipping.rounding_floor`;
        natural examples are not)."""
        sq, _ = self.measured()
        extra = None
        for positions, more, magnitude_sq in self.rounding:
            terms = self.rounding_batch + 2 if positions is None else ghost_roundings(self.rounding_batch, positions)
            term = gamma(terms + more) ** 2 * magnitude_sq
            extra = term if extra is None else extra + term
        return rounding_floor(sq, self.rounding_batch, extra)


# drop_bad(t): the rows of examples with a non-finite gradient set to exactly zero (never NaN·0).
DropBad = Callable[[torch.Tensor | None], torch.Tensor | None]


class Part:
    """One layer's per-example data, kept between the norms and the clipped sum."""

    def contributions(
        self, factors: torch.Tensor, drop_bad: DropBad
    ) -> list[tuple[str, torch.Tensor | RowUpdate | SmallRows]]:
        """(parameter name within the layer, Σ_i f_i·grad_i) for each trainable parameter, in
        float64 with every sum over examples accumulated in float64 (see
        :func:`dpcore.clipping.weighted_sum`): a :class:`RowUpdate` where only some rows are
        non-zero; or its per-example rows as :class:`SmallRows`, whose sum the clipper forms.
        ``factors`` are float64 and never rounded to a narrower dtype."""
        raise NotImplementedError


class LayerForm:
    """How book-keeping clipping handles one layer type (Linear, Conv2d, GroupNorm, ...)."""

    def accepts(self, m: nn.Module) -> bool:
        """Whether this form covers this instance (a convolution with groups > 1 may not be)."""
        return True

    def problems(self, m: nn.Module) -> list[str]:
        """Parameter names (within the layer) with the reason the form refuses them."""
        return []

    def per_example(self, m: nn.Module, a: torch.Tensor, g: torch.Tensor, sq: SquaredNorms, ctx: Context) -> Part:
        """Add ‖grad_i‖² of this layer's trainable parameters into ``sq`` (float64 [B] terms) and
        return the :class:`Part` that forms their clipped sums."""
        raise NotImplementedError


# -- weight-and-bias layers (Linear, Conv2d) ------------------------------------------------------


def refuse_frozen_weight(m: nn.Module) -> list[str]:
    """A trainable bias beside a frozen weight is not handled."""
    if m.bias is not None and m.bias.requires_grad and not m.weight.requires_grad:
        return ["bias (its weight is frozen)"]
    return []


def bias_per_example(m: nn.Module, per_example_bias: torch.Tensor, sq: SquaredNorms):
    """Per-example bias gradients (Σ over positions of G), their norms added into ``sq``."""
    if m.bias is None or not m.bias.requires_grad:
        return None
    sq.add_rows(per_example_bias)
    return per_example_bias


@dataclass
class MaterialisedPart(Part):
    """Per-example weight gradients ``W`` [B, out, in] (and bias gradients [B, out]). ``post``
    (linear) maps the sum to the weight's gradient (a weight standardisation's VJP), as in
    :class:`GhostPart`."""

    m: nn.Module
    W: torch.Tensor
    bias_g: torch.Tensor | None
    post: Callable | None = None

    def contributions(self, factors, drop_bad):
        w = weighted_sum(factors, drop_bad(self.W))  # Σ_i f_i W_i, float64
        if self.post is not None:
            w = self.post(w)
        out = [("weight", w.reshape(self.m.weight.shape))]
        if self.bias_g is not None:
            out.append(("bias", SmallRows(drop_bad(self.bias_g), self.m.bias)))
        return out


@dataclass
class GhostPart(Part):
    """Inputs ``A`` and output gradients ``G`` whose per-example products are never formed:
    the clipped sum is Σ_i f_i G_iᵀA_i over (example, position). ``post`` (linear) maps the
    sum to the weight's gradient (a weight standardisation's VJP)."""

    m: nn.Module
    A: torch.Tensor
    G: torch.Tensor
    channels_first: bool
    bias_g: torch.Tensor | None
    post: Callable | None = None

    def contributions(self, factors, drop_bad):
        f = factors.to(torch.float64)
        A, G = drop_bad(self.A), drop_bad(self.G)
        # The sum over (example, position) runs in float64: over examples for the reason of
        # dpcore.clipping.weighted_sum, and over positions so that each example's share keeps the
        # norm the factor was computed for (float32 accumulation over many positions could exceed
        # the clipping margin, dpcore.clipping.CLIP_MARGIN).
        # The product runs over whole examples, ghost_chunk(T) at a time, each chunk's result
        # added into the sum: every term then passes through ghost_roundings(B, T) roundings
        # (SquaredNorms.add_rounding counts them at the configured batch size), far fewer than the
        # B·T + 1 of one product over the batch, so that natural examples stay clear of the cap.
        if self.channels_first:  # (f·G) [c, example·position] times A [d, example·position]ᵀ
            Gf = by_channel(G, torch.float64).mul_(f.view(1, -1, 1))
            X, Y = Gf.view(Gf.shape[0], -1), channel_rows(A, torch.float64).t()
            T = G.shape[2]
        else:  # (f·G) over the (example, position) rows, transposed, times A
            Gf = G.to(torch.float64) * f.view(-1, 1, 1)
            X, Y = Gf.reshape(-1, Gf.shape[2]).t(), A.to(torch.float64).reshape(-1, A.shape[2])
            T = G.shape[1]
        step = ghost_chunk(T) * T
        w = X[:, :step] @ Y[:step]
        for k in range(step, X.shape[1], step):
            w.addmm_(X[:, k : k + step], Y[k : k + step])
        if self.post is not None:  # the standardisation's VJP is linear: applied to the sum
            w = self.post(w)
        out = [("weight", w.reshape(self.m.weight.shape))]
        if self.bias_g is not None:
            out.append(("bias", SmallRows(drop_bad(self.bias_g), self.m.bias)))
        return out


def by_channel(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new [k, B, T] buffer in ``dtype`` holding the [B, k, T] tensor ``t``: one copy."""
    return torch.empty((t.shape[1], t.shape[0], *t.shape[2:]), dtype=dtype, device=t.device).copy_(t.transpose(0, 1))


def channel_rows(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A [B, k, T] tensor as [k, B·T] rows in ``dtype``: one copy at most, none where it is a
    view of a [k, B, T] buffer of that dtype (:func:`by_channel`)."""
    rows = t.transpose(0, 1) if t.dtype == dtype else by_channel(t, dtype)
    return rows.reshape(rows.shape[0], -1)


def weight_and_bias(
    m: nn.Module, A: torch.Tensor, G: torch.Tensor, channels_first: bool, sq: SquaredNorms, ctx: Context
) -> Part:
    """The part of a weight-and-bias layer from its inputs ``A`` and output gradients ``G``
    (channels first: [B, d, T] and [B, c, T]; else [B, T, d] and [B, T, c]), its examples'
    squared norms added into ``sq``: per-example weight gradients where they are the cheaper
    exact form, else the ghost form."""
    s, W, magnitude_sq = weight_sq_norms(A, G, channels_first, ctx)
    sq += s
    if magnitude_sq is not None:  # the ghost form: one product over (example, position), then the multiply
        sq.add_allowance(ghost_allowance(A, G, channels_first, magnitude_sq))
        sq.add_rounding(magnitude_sq, positions=A.shape[2] if channels_first else A.shape[1])
    bias_g = bias_per_example(m, G.sum(2 if channels_first else 1), sq)
    return MaterialisedPart(m, W, bias_g) if W is not None else GhostPart(m, A, G, channels_first, bias_g)


# -- normalisation layers (GroupNorm, LayerNorm) ----------------------------------------------------


@dataclass
class NormPart(Part):
    """Per-example gradients of a normalisation layer's γ and β ([B, numel] each, None if
    frozen): each example is normalised on its own, so they are sums over its positions."""

    m: nn.Module
    gamma: torch.Tensor | None
    beta: torch.Tensor | None

    @classmethod
    def measured(cls, m: nn.Module, gamma, beta, sq: SquaredNorms) -> NormPart:
        """The part, with the squared norms of γ's and β's gradients added into ``sq``."""
        for t in (gamma, beta):
            if t is not None:
                sq.add_rows(t)
        return cls(m, gamma, beta)

    def contributions(self, factors, drop_bad):
        return [
            (name, SmallRows(drop_bad(t), getattr(self.m, name)))
            for name, t in (("weight", self.gamma), ("bias", self.beta))
            if t is not None
        ]

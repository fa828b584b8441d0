"""``nn.Embedding`` (a text model's token table).

Example i's gradient is W_i = Σ_t e_{x_t} g_tᵀ: its output gradients g_t added into the rows of
its tokens x_t. Only the rows of the tokens it holds are non-zero, so the form keeps, for each
(example, distinct token) pair, the sum S of that token's output gradients in the example
(float64). ‖W_i‖² is the sum of ‖S‖² over the example's pairs: exact, and O(B·T·D) whatever
the vocabulary. Each pair's share f_i·S is formed in float64 (the very vector whose norm was
measured), the batch's shares of each token are summed (float64, at most B terms, as in any
layer's batch sum), and that one row per token is added into its row of the running sum
(:class:`~dpcore.bookkeeping.sums.RowUpdate`): no tensor of the table's size is formed per
batch, and a row of the lot's sum takes one addition per batch, as every other parameter does
(:func:`dpcore.clipping.float_sensitivity`). Positions holding ``padding_idx`` get no gradient,
as in ``nn.Embedding``.

Refused: ``max_norm`` (the forward renormalises rows of the table in place), ``sparse=True``,
and ``scale_grad_by_freq`` (it scales each token's gradient by its count in the whole batch,
which couples the examples).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .base import Context, LayerForm, Part, Unsupported
from .sums import RowUpdate


@dataclass
class EmbeddingPart(Part):
    m: nn.Embedding
    example: torch.Tensor  # [P] the example of each (example, token) pair
    token: torch.Tensor  # [P] its token
    S: torch.Tensor  # [P, D] float64: that token's output gradients summed over the example's positions
    # (P is the batch's number of positions: the slots past the distinct pairs hold S = 0.)

    def contributions(self, factors, drop_bad):
        # An example with a non-finite gradient has factor 0; its non-finite rows must add
        # exactly zero (never 0·NaN). Its finite rows add 0·S = 0.
        S = torch.where(torch.isfinite(self.S), self.S, self.S.new_zeros(()))
        rows = S * factors.to(torch.float64)[self.example].unsqueeze(1)
        # One row per distinct token: the pairs sorted by token, a slot per token (no
        # torch.unique, whose size depends on the data); the slots past the last token add 0 to
        # row 0, exactly.
        token, order = torch.sort(self.token)
        first = torch.ones_like(token, dtype=torch.bool)
        first[1:] = token[1:] != token[:-1]
        slot = torch.cumsum(first, 0) - 1
        summed = torch.zeros_like(rows).index_add_(0, slot, rows[order])
        index = torch.zeros_like(token).scatter_(0, slot, token)
        return [("weight", RowUpdate(index, summed, self.m.weight.shape))]


class EmbeddingForm(LayerForm):
    def problems(self, m: nn.Embedding) -> list[str]:
        why = [
            (m.max_norm is not None, "max_norm renormalises the table in place during the forward"),
            (m.sparse, "sparse gradients"),
            (m.scale_grad_by_freq, "scale_grad_by_freq couples the examples of a batch"),
        ]
        return [f"weight ({reason})" for bad, reason in why if bad]

    def per_example(self, m: nn.Embedding, a, g, sq, ctx: Context):
        if a.is_floating_point() or a.dim() < 1:
            raise Unsupported("an Embedding was called without a batch of token ids")
        batch, dim = a.shape[0], m.embedding_dim
        tokens = a.reshape(batch, -1)
        n = tokens.numel()
        grads = g.reshape(n, dim).double()
        if m.padding_idx is not None:  # those positions add nothing (not even a NaN)
            keep = (tokens != m.padding_idx).reshape(n, 1)
            grads = torch.where(keep, grads, grads.new_zeros(()))
        example = torch.arange(batch, device=a.device).unsqueeze(1).expand_as(tokens)
        # The (example, token) pairs without torch.unique or a boolean mask, whose sizes depend
        # on the data (on a GPU, a wait for the device): the keys sorted, a slot per distinct
        # key, numbered in order; of the n slots the ones past the last pair stay zero.
        key, order = torch.sort((example * m.num_embeddings + tokens).reshape(n))
        first = torch.ones(n, dtype=torch.bool, device=a.device)
        first[1:] = key[1:] != key[:-1]
        slot = torch.cumsum(first, 0) - 1
        which = torch.empty_like(slot).scatter_(0, order, slot)  # each position's slot
        S = torch.zeros(n, dim, dtype=torch.float64, device=a.device).index_add_(0, which, grads)
        pairs = torch.zeros_like(key).scatter_(0, slot, key)  # each slot's key (a pair's positions agree)
        pair_example = pairs // m.num_embeddings
        sq.index_add_(0, pair_example, S.square().sum(1))
        return EmbeddingPart(m, pair_example, pairs % m.num_embeddings, S)

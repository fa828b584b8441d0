"""``nn.LayerNorm`` over the last dimensions of each example (a transformer's, or an MLP's).

Like GroupNorm it normalises each example on its own: γ's per-example gradient is
Σ_positions g·x̂, with x̂ = layer_norm(a) recomputed from the recorded input without affine,
and β's is Σ_positions g (positions: every leading dimension after the batch)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import Context, LayerForm, NormPart, Unsupported


class LayerNormForm(LayerForm):
    def per_example(self, m: nn.LayerNorm, a, g, sq, ctx: Context):
        shape = tuple(m.normalized_shape)
        if a.dim() <= len(shape):
            raise Unsupported("a LayerNorm normalises over the batch dimension")
        batch, width = a.shape[0], math.prod(shape)
        gg = g.reshape(batch, -1, width)
        gamma = None
        if m.weight is not None and m.weight.requires_grad:
            with torch.no_grad():
                xhat = F.layer_norm(a, shape, None, None, m.eps).reshape(batch, -1, width)
            gamma = (gg * xhat).sum(1)
        beta = gg.sum(1) if m.bias is not None and m.bias.requires_grad else None
        return NormPart.measured(m, gamma, beta, sq)

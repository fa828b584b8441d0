"""``nn.GroupNorm``: it normalises each example on its own, so γ's per-example gradient is
Σ_positions g·x̂ (x̂ the example's normalised input, recomputed from the recorded input) and
β's is Σ_positions g."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import Context, LayerForm, NormPart


class GroupNormForm(LayerForm):
    def per_example(self, m: nn.GroupNorm, a, g, sq, ctx: Context):
        batch, channels = a.shape[0], m.num_channels
        gg = g.reshape(batch, channels, -1)
        gamma = None
        if m.weight is not None and m.weight.requires_grad:
            with torch.no_grad():
                xhat = F.group_norm(a, m.num_groups, None, None, m.eps).reshape(batch, channels, -1)
            gamma = (gg * xhat).sum(2)
        beta = gg.sum(2) if m.bias is not None and m.bias.requires_grad else None
        return NormPart.measured(m, gamma, beta, sq)

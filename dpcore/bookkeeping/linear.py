"""``nn.Linear``, on one vector or a sequence of vectors per example.

The weight gradient of example i is G_iᵀA_i (inputs A_i [T, d_in], output gradients G_i
[T, d_out]). With one position its norm is ‖a_i‖·‖g_i‖ (the "ghost norm"); with several, the
cheaper exact form: G_iᵀA_i materialised, or Σ_{t,s}(a_t·a_s)(g_t·g_s) in float64.
"""

from __future__ import annotations

from torch import nn

from .base import Context, LayerForm, refuse_frozen_weight, weight_and_bias


class LinearForm(LayerForm):
    def problems(self, m: nn.Linear) -> list[str]:
        return refuse_frozen_weight(m)

    def per_example(self, m: nn.Linear, a, g, sq, ctx: Context):
        batch = a.shape[0]
        A = a.reshape(batch, -1, a.shape[-1])  # [B, T, d_in]
        G = g.reshape(batch, -1, g.shape[-1])  # [B, T, d_out]
        return weight_and_bias(m, A, G, False, sq, ctx)

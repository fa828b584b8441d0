"""BAM, bias-aware minimisation (Knolle et al. 2023, Algorithm 2).

Each example's gradient is taken at its own ascent point θ + λ·g_i/‖g_i‖ (``variant="sam"``), or
is the exact ∇L_i + λ·H_i g_i/‖g_i‖ (``variant="exact"``), then clipped, summed and noised as in
DP-SGD. The paper's line 7 writes the noise inside the per-example sum; its text says that "all
quantities are privatised as in DP-SGD", and that is what is done: one N(0, σ²C²I) draw per lot,
added to the sum of the clipped per-example BAM gradients. λ = 0 is DP-SGD exactly.
"""

from __future__ import annotations

import torch

from .base import Method, Params


class BAM(Method):
    name = "bam"
    bookkeeping_ok = False  # the clipped vectors are gradients at per-example ascent points

    @property
    def tag(self) -> str:
        return f"bam-{self.bam_variant}"

    def per_example(self, grad_sampler, xb: torch.Tensor, yb: torch.Tensor, step: int) -> tuple[Params, Params] | None:
        lam = self.ascent(step)
        return None if lam == 0 else grad_sampler.bam(xb, yb, lam, self.bam_variant)

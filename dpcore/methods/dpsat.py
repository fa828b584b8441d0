"""DP-SAT (Park et al. 2023): one shift per lot along the previous *released* gradient.

Before the lot's gradients are computed, the weights move once to θ + ρ·ĝ_{t−1}/‖ĝ_{t−1}‖,
along the previous step's privatised gradient (no extra privacy cost: post-processing of a
release); every physical batch of the lot is evaluated there, and the weights are restored
exactly (a saved copy, not a subtraction) before the update.
"""

from __future__ import annotations

import torch

from .base import Method, Params


class DPSAT(Method):
    name = "dpsat"
    needs_previous_release = True

    def begin_lot(self, params: Params, previous: Params | None, step: int) -> Params | None:
        if previous is None:
            return None
        rho = self.ascent(step)
        if rho == 0:
            return None
        sq = sum(float(g.double().square().sum()) for g in previous.values())
        if not (sq > 0 and sq < float("inf")):
            return None
        scale = rho / sq**0.5
        with torch.no_grad():
            saved = {n: p.detach().clone() for n, p in params.items()}
            for n, p in params.items():
                p.add_(previous[n], alpha=scale)
        self.shifts_applied += 1
        return saved

"""Exponential moving average of the parameters (De et al. 2022, used in the BAM appendix).

The average is taken of the parameters *after* each private update, so it is post-processing
of released quantities and costs no privacy (DESIGN invariant 5: optimizer state and EMA see
only noised gradients). De et al.'s warm-up is used: the decay at update t is
min(decay, (1 + t)/(10 + t)), so that early averages are not dominated by the initial weights.
"""

from __future__ import annotations

import torch
from torch import nn

from .errors import DPConfigError


class ParameterEMA:
    def __init__(self, model: nn.Module, decay: float = 0.999, warmup: bool = True):
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not (0.0 <= decay < 1.0):
            raise DPConfigError(f"ema decay={decay!r} is invalid: it must lie in [0, 1) (0.999 is De et al.'s value).")
        self.model = model
        self.decay = float(decay)
        self.warmup = warmup
        self.updates = 0
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    def current_decay(self) -> float:
        if not self.warmup:
            return self.decay
        return min(self.decay, (1.0 + self.updates) / (10.0 + self.updates))

    @torch.no_grad()
    def update(self) -> None:
        """Call after each optimizer step."""
        d = self.current_decay()
        for n, p in self.model.named_parameters():
            if n in self.shadow:
                self.shadow[n].mul_(d).add_(p.detach(), alpha=1.0 - d)
        self.updates += 1

    def averaged_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict with the averaged parameters in place of the current ones."""
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        state.update({n: t.clone() for n, t in self.shadow.items()})
        return state

    def state_dict(self) -> dict:
        return {
            "decay": self.decay,
            "warmup": self.warmup,
            "updates": self.updates,
            "shadow": {n: t.clone() for n, t in self.shadow.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        if set(state["shadow"]) != set(self.shadow):
            raise DPConfigError("the saved EMA state is for a different model (its parameter names differ).")
        self.decay, self.warmup, self.updates = float(state["decay"]), bool(state["warmup"]), int(state["updates"])
        for n, t in state["shadow"].items():
            self.shadow[n].copy_(t)

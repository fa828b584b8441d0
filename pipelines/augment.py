"""Augmentation multiplicity (De et al. 2022; the BAM appendix): K augmented copies of every
example of a physical batch, each a random crop of the zero-padded image and a random
horizontal flip, built on ``torchvision.transforms.v2``'s functional ops.

The copies are drawn independently per example and per copy, in one vectorised gather
(the v2 transform classes draw one set of parameters per call, i.e. the same crop for a whole
batch). Each example's K gradients are averaged before clipping, so for any fixed draws the
example's contribution is bounded by C.

The draws come from the run's own randomness (``Randomness.spawn("augment", rank)``): secret,
from the OS CSPRNG, unless the run is seeded. They must not be public. They are taken in lot
order, so whether an example is in the lot decides which draws every later example of that
lot, and of every later lot, receives: with the draws known (a public seed), adding one
example moved a lot's clipped sum by 5.98·C, and the next lot's, which did not hold it, by
5.75·C (a review's script, K = 4, lots of 20; it grows to about 2·C·L). With secret i.i.d.
draws the other examples' draws have the same law whether or not the example is there, and
the release is a mixture over them of mechanisms of sensitivity C, which is no less private.
"""

from __future__ import annotations

import torch
from torchvision.transforms.v2 import functional as TF

from dpcore import DPConfigError, Randomness, make_randomness


class CropFlipMultiplicity:
    """``x[B, C, H, W] -> x[B, K, C, H, W]``: K random crops (padding ``padding``) and flips."""

    def __init__(self, k: int, padding: int = 4, flip: bool = True, randomness: Randomness | None = None):
        self.k, self.padding, self.flip = int(k), int(padding), bool(flip)
        self.randomness = make_randomness(None) if randomness is None else randomness  # None: secure

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError(f"augmentation needs image batches [B, C, H, W], not {tuple(x.shape)}")
        b, c, h, w = x.shape
        n = b * self.k
        copies = x.unsqueeze(1).expand(b, self.k, c, h, w).reshape(n, c, h, w)
        p = self.padding
        if p:
            padded = TF.pad(copies, [p, p, p, p], fill=0)
            u = self.randomness.uniform(2 * n)  # float64 in [0, 1): offsets 0 … 2p, uniform
            dy, dx = (u * (2 * p + 1)).floor().long().clamp_(max=2 * p).split(n)
            rows = (dy[:, None] + torch.arange(h))[:, None, :, None].to(x.device)
            cols = (dx[:, None] + torch.arange(w))[:, None, None, :].to(x.device)
            idx = torch.arange(n, device=x.device)[:, None, None, None]
            chan = torch.arange(c, device=x.device)[None, :, None, None]
            copies = padded[idx, chan, rows, cols]
        if self.flip:
            flip = (self.randomness.uniform(n) < 0.5).to(x.device)
            copies = torch.where(flip[:, None, None, None], TF.horizontal_flip(copies), copies)
        return copies.reshape(b, self.k, c, h, w)

    def state_dict(self) -> dict:
        return {"randomness": self.randomness.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "randomness" not in state:
            raise DPConfigError(
                "this checkpoint's augmentation state is a public generator's (before 2026-11-29); its draws are "
                "not secret. Start the run again (a new run, a new budget)."
            )
        self.randomness.load_state_dict(state["randomness"])

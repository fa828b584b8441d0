"""Augmentation multiplicity (De et al. 2022; the BAM appendix): K augmented copies of every
example of a physical batch, each a random crop of the zero-padded image and a random
horizontal flip, built on ``torchvision.transforms.v2``'s functional ops.

The copies are drawn independently per example and per copy, in one vectorised gather
(the v2 transform classes draw one set of parameters per call, i.e. the same crop for a whole
batch). The randomness is public (a seeded generator per worker): augmentation is
data-independent, and each example's K gradients are averaged before clipping, so the
example's contribution is still bounded by C whatever the augmentations are.
"""

from __future__ import annotations

import torch
from torchvision.transforms.v2 import functional as TF


class CropFlipMultiplicity:
    """``x[B, C, H, W] -> x[B, K, C, H, W]``: K random crops (padding ``padding``) and flips."""

    def __init__(self, k: int, padding: int = 4, flip: bool = True, seed: int = 0):
        self.k, self.padding, self.flip = int(k), int(padding), bool(flip)
        self.generator = torch.Generator().manual_seed(int(seed))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError(f"augmentation needs image batches [B, C, H, W], not {tuple(x.shape)}")
        b, c, h, w = x.shape
        n = b * self.k
        copies = x.unsqueeze(1).expand(b, self.k, c, h, w).reshape(n, c, h, w)
        p = self.padding
        if p:
            padded = TF.pad(copies, [p, p, p, p], fill=0)
            dy = torch.randint(0, 2 * p + 1, (n,), generator=self.generator)
            dx = torch.randint(0, 2 * p + 1, (n,), generator=self.generator)
            rows = (dy[:, None] + torch.arange(h))[:, None, :, None].to(x.device)
            cols = (dx[:, None] + torch.arange(w))[:, None, None, :].to(x.device)
            idx = torch.arange(n, device=x.device)[:, None, None, None]
            chan = torch.arange(c, device=x.device)[None, :, None, None]
            copies = padded[idx, chan, rows, cols]
        if self.flip:
            flip = (torch.rand(n, generator=self.generator) < 0.5).to(x.device)
            copies = torch.where(flip[:, None, None, None], TF.horizontal_flip(copies), copies)
        return copies.reshape(b, self.k, c, h, w)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])

"""Layers for models trained under per-example DP.

:class:`WSConv2d` is a convolution with weight standardisation (Qiao et al. 2019), the
replacement for BatchNorm's conditioning in the DP ResNets of De et al. 2022. It lives in
dpcore because the book-keeping clipper (:mod:`dpcore.bookkeeping`) knows its exact forward:
z = conv2d(a, ŵ(w)) with ŵ each output filter's weights centred and scaled to unit variance,
so the per-example gradient with respect to w is the standardisation's vector-Jacobian
product of the per-example gradient with respect to ŵ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

WS_EPS = 1e-5


def standardize(w: torch.Tensor, eps: float = WS_EPS) -> torch.Tensor:
    """(w − mean) / sqrt(var + eps) over each output filter (all dims but the first)."""
    dims = tuple(range(1, w.dim()))
    mean = w.mean(dim=dims, keepdim=True)
    var = w.var(dim=dims, keepdim=True, unbiased=False)
    return (w - mean) / torch.sqrt(var + eps)


class WSConv2d(nn.Conv2d):
    """Convolution with weight standardisation (Qiao et al. 2019): each output filter's
    weights are centred and scaled to unit variance before use. Works with torch.func."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, standardize(self.weight), self.bias, self.stride, self.padding, self.dilation, self.groups)

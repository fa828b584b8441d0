"""Small shared helpers for tests: tiny models and an explicit per-example reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def tiny_mlp(d_in=6, hidden=5, classes=3):
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, classes))


def tiny_cnn(channels=1, classes=3):
    return nn.Sequential(
        nn.Conv2d(channels, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, classes),
    )


def loop_clipped_sum(model, loss_fn, x, y, clip_norm):
    """Reference: one ordinary backward per example, clip with min(1, C/‖g‖), sum (float64)."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for i in range(x.shape[0]):
        model.zero_grad()
        loss = loss_fn(model(x[i : i + 1]), y[i : i + 1])
        grads = torch.autograd.grad(loss, params)
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
        factor = min(1.0, clip_norm / norm.item()) if norm > 0 else 1.0
        for t, g in zip(total, grads):
            t += g.double() * factor
    return total


ce = F.cross_entropy

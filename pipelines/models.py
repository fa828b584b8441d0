"""Models that train under per-example DP (no BatchNorm; GroupNorm where a norm is needed)."""
from __future__ import annotations

import math

from torch import nn

from dpcore import DPConfigError

MODELS = ("mlp", "cnn")


def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: int = 128, depth: int = 2) -> nn.Module:
    """``depth`` linear layers with ReLU in between (depth 2 = one hidden layer)."""
    d = math.prod(input_shape)
    layers: list[nn.Module] = [nn.Flatten()]
    for i in range(depth - 1):
        layers += [nn.Linear(d if i == 0 else hidden, hidden), nn.ReLU()]
    layers.append(nn.Linear(d if depth == 1 else hidden, num_classes))
    return nn.Sequential(*layers)


def small_cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Two 3×3 conv layers (16, 32 channels) with tanh and 2×2 max-pooling, then a linear head.

    Sized for small images (8×8 digits); tanh follows Papernot et al. 2021 for DP training.
    """
    c, h, w = input_shape
    return nn.Sequential(
        nn.Conv2d(c, 16, 3, padding=1),
        nn.Tanh(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.Tanh(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * (h // 4) * (w // 4), num_classes),
    )


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if name == "mlp":
        return mlp(input_shape, num_classes)
    if name == "cnn":
        return small_cnn(input_shape, num_classes)
    raise DPConfigError(f"model={name!r} is unknown; available: {', '.join(MODELS)}.")

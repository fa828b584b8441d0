"""Models that train under per-example DP: no BatchNorm; GroupNorm where a norm is needed.

* ``mlp``: one hidden layer of 128 ReLU units.
* ``small_cnn``: two 3×3 convs (16, 32 channels) with tanh, for tiny images such as 8×8 digits.
* ``cnn``: the 2-conv MNIST model of Abadi et al. 2016 as in Opacus's MNIST example
  (8×8/2 conv 16 → max-pool → 4×4/2 conv 32 → max-pool → 32 → classes), for images ≥ 16×16.
* ``resnet9``, ``wrn16_4``: the BAM paper's models (its Table 2), after De et al. 2022:
  GroupNorm (16 groups) and weight-standardised convolutions, no BatchNorm.
* ``tv:<name>``: any ``torchvision.models`` architecture by name, e.g. ``tv:resnet18``.
  Most of them contain BatchNorm, which per-example DP cannot use: they are rejected by
  dpcore's validation unless ``replace_batchnorm`` swaps it for GroupNorm.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dpcore import DPConfigError
from dpcore.layers import WSConv2d

MODELS = ("mlp", "small_cnn", "cnn", "resnet9", "wrn16_4", "tv:<torchvision name>")
GROUPS = 16


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


def mnist_cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The 2-conv model of Abadi et al. / Opacus's MNIST example (ReLU, as Opacus)."""
    c, h, w = input_shape
    if min(h, w) < 16:
        raise DPConfigError(
            f"model='cnn' (the 2-conv MNIST model) needs images of at least 16×16, not {h}×{w}; "
            "use model='small_cnn' or 'mlp' for small images such as digits."
        )
    features = nn.Sequential(
        nn.Conv2d(c, 16, 8, stride=2, padding=3),
        nn.ReLU(),
        nn.MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, stride=2),
        nn.ReLU(),
        nn.MaxPool2d(2, 1),
        nn.Flatten(),
    )
    with torch.no_grad():
        flat = features(torch.zeros(1, c, h, w)).shape[1]
    return nn.Sequential(features, nn.Linear(flat, 32), nn.ReLU(), nn.Linear(32, num_classes))


def _gn(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(GROUPS, channels), channels)


def _conv_block(cin: int, cout: int, pool: bool = False) -> nn.Sequential:
    layers: list[nn.Module] = [WSConv2d(cin, cout, 3, padding=1, bias=False), _gn(cout), nn.ReLU()]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


class _Residual(nn.Module):
    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, x):
        return x + self.body(x)


def resnet9(input_shape: tuple[int, ...], num_classes: int, width: int = 64) -> nn.Module:
    """ResNet-9 (Page's DAWNBench net, as used by De et al. 2022 and the BAM paper) with
    GroupNorm and weight-standardised convolutions."""
    c = input_shape[0]
    w1, w2, w3, w4 = width, 2 * width, 4 * width, 8 * width
    return nn.Sequential(
        _conv_block(c, w1),
        _conv_block(w1, w2, pool=True),
        _Residual(nn.Sequential(_conv_block(w2, w2), _conv_block(w2, w2))),
        _conv_block(w2, w3, pool=True),
        _conv_block(w3, w4, pool=True),
        _Residual(nn.Sequential(_conv_block(w4, w4), _conv_block(w4, w4))),
        nn.AdaptiveMaxPool2d(1),
        nn.Flatten(),
        nn.Linear(w4, num_classes),
    )


class _WideBlock(nn.Module):
    """Pre-activation wide-ResNet block: GN-ReLU-conv-GN-ReLU-conv, 1×1 projection when needed."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.gn1, self.conv1 = _gn(cin), WSConv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.gn2, self.conv2 = _gn(cout), WSConv2d(cout, cout, 3, padding=1, bias=False)
        self.shortcut = None if (cin == cout and stride == 1) else WSConv2d(cin, cout, 1, stride=stride, bias=False)

    def forward(self, x):
        o = F.relu(self.gn1(x))
        y = self.conv1(o)
        y = self.conv2(F.relu(self.gn2(y)))
        return y + (x if self.shortcut is None else self.shortcut(o))


def wide_resnet(input_shape: tuple[int, ...], num_classes: int, depth: int = 16, widen: int = 4) -> nn.Module:
    """WRN-depth-widen (Zagoruyko & Komodakis) with GroupNorm and weight standardisation, as
    in De et al. 2022. WRN-16-4: 2 blocks per stage, widths 64/128/256."""
    if (depth - 4) % 6:
        raise DPConfigError(f"wide_resnet depth={depth} is invalid: it must be 6n+4 (16, 22, 28, 40).")
    n = (depth - 4) // 6
    widths = [16, 16 * widen, 32 * widen, 64 * widen]
    layers: list[nn.Module] = [WSConv2d(input_shape[0], widths[0], 3, padding=1, bias=False)]
    cin = widths[0]
    for stage, cout in enumerate(widths[1:]):
        for b in range(n):
            layers.append(_WideBlock(cin, cout, stride=2 if (stage > 0 and b == 0) else 1))
            cin = cout
    layers += [_gn(cin), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


def torchvision_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    import torchvision

    try:
        return torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    except (ValueError, KeyError) as e:
        raise DPConfigError(f"model='tv:{name}' is not a torchvision model ({e}).") from None


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, replace_batchnorm: bool = False) -> nn.Module:
    """Build ``name`` for ``input_shape`` [C, H, W] and ``num_classes`` (see module doc)."""
    builders = {"mlp": mlp, "small_cnn": small_cnn, "cnn": mnist_cnn, "resnet9": resnet9, "wrn16_4": wide_resnet}
    if name in builders:
        model = builders[name](tuple(input_shape), num_classes)
    elif name.startswith("tv:"):
        model = torchvision_model(name[3:], tuple(input_shape), num_classes)
    else:
        raise DPConfigError(f"model={name!r} is unknown; available: {', '.join(MODELS)}.")
    if replace_batchnorm:
        from dpcore import convert_batchnorm_to_groupnorm

        model = convert_batchnorm_to_groupnorm(model)
    return model


def build_run_model(cfg, input_shape: tuple[int, ...], num_classes: int, pca_components=None) -> nn.Module:
    """The model of a run: with DP-PCA (``cfg.pca_components``), a frozen projection onto the
    private principal directions first (``pca_components`` [k, d]; zeros as a placeholder of the
    right shape when it is not known yet), then ``cfg.model`` on k-vectors."""
    if not getattr(cfg, "pca_components", 0):
        return build_model(cfg.model, input_shape, num_classes, cfg.replace_batchnorm)
    from dpcore import PCAProjection

    k, d = cfg.pca_components, math.prod(input_shape)
    comps = torch.zeros(k, d) if pca_components is None else pca_components
    return nn.Sequential(PCAProjection(comps), build_model(cfg.model, (k,), num_classes, cfg.replace_batchnorm))

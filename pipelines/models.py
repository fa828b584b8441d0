"""Models that train under per-example DP: no BatchNorm; GroupNorm where a norm is needed.

* ``mlp``: one hidden layer of 128 ReLU units.
* ``small_cnn``: two 3×3 convs (16, 32 channels) with tanh, for tiny images such as 8×8 digits.
* ``cnn``: the 2-conv MNIST model of Abadi et al. 2016 as in Opacus's MNIST example
  (8×8/2 conv 16 → max-pool → 4×4/2 conv 32 → max-pool → 32 → classes), for images ≥ 16×16.
* ``resnet9``, ``wrn16_4``: the BAM paper's models (its Table 2), after De et al. 2022:
  GroupNorm (16 groups) and weight-standardised convolutions, no BatchNorm.
* ``scatter_linear``, ``scatter_cnn``: Tramèr & Boneh 2021's ScatterNet models. A fixed
  scattering transform (J=2, 8 angles: 81 channels per input channel at a quarter of the
  resolution; :class:`ScatterNet`), then GroupNorm without parameters (27 groups: per example,
  no statistic of the data) and a linear classifier, or a small tanh CNN. The transform is
  public and fixed, so the pipeline computes it once per dataset (``pipelines.data.features``).
* ``tv:<name>``: any ``torchvision.models`` architecture by name, e.g. ``tv:resnet18``.
  Most of them contain BatchNorm, which per-example DP cannot use: they are rejected by
  dpcore's validation unless ``replace_batchnorm`` swaps it for GroupNorm.

Options for ``mlp``, ``small_cnn`` and ``cnn`` (recipes from the DP literature, for any dataset):
``activation`` (``relu``, ``tanh``, or ``tempered:s,T,o``, the tempered sigmoid
s·sigmoid(T·x) − o of Papernot et al. 2021; tanh is s=2, T=2, o=1), ``groupnorm`` (GroupNorm after
each convolution) and ``weight_standardization`` (weight-standardised convolutions, De et al. 2022).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dpcore import DPConfigError
from dpcore.layers import WSConv2d

from .catalog import MODELS

GROUPS = 16
SCATTER_GROUPS = 27  # Tramèr & Boneh's GroupNorm over the 81 scattering channels


class TemperedSigmoid(nn.Module):
    """s·sigmoid(T·x) − o (Papernot et al. 2021): bounded, so fewer gradients are clipped."""

    def __init__(self, scale: float = 2.0, temperature: float = 2.0, offset: float = 1.0):
        super().__init__()
        self.scale, self.temperature, self.offset = float(scale), float(temperature), float(offset)

    def forward(self, x):
        return self.scale * torch.sigmoid(self.temperature * x) - self.offset

    def extra_repr(self) -> str:
        return f"scale={self.scale}, temperature={self.temperature}, offset={self.offset}"


def check_activation(name: str | None) -> None:
    make_activation(name or "relu")


def make_activation(name: str) -> nn.Module:
    """``relu``, ``tanh``, ``elu`` or ``tempered:s,T,o``."""
    if name == "relu":
        return nn.ReLU()
    if name == "tanh":
        return nn.Tanh()
    if name == "elu":
        return nn.ELU()
    if name.startswith("tempered:"):
        try:
            s, t, o = (float(v) for v in name[len("tempered:") :].split(","))
        except ValueError:
            raise DPConfigError(
                f"activation={name!r} is invalid: write tempered:SCALE,TEMPERATURE,OFFSET, e.g. tempered:2,2,1 (tanh)."
            ) from None
        if not all(math.isfinite(v) for v in (s, t, o)) or s <= 0 or t <= 0:
            raise DPConfigError(
                f"activation={name!r} is invalid: the scale and the temperature must be finite numbers > 0."
            )
        return TemperedSigmoid(s, t, o)
    raise DPConfigError(
        f"activation={name!r} is unknown; use relu, tanh, elu or tempered:s,T,o (Papernot et al. 2021)."
    )


def _conv(cin: int, cout: int, k: int, ws: bool, **kw) -> nn.Conv2d:
    return (WSConv2d if ws else nn.Conv2d)(cin, cout, k, **kw)


def mlp(
    input_shape: tuple[int, ...], num_classes: int, hidden: int = 128, depth: int = 2, activation: str = "relu", **_
) -> nn.Module:
    """``depth`` linear layers with ``activation`` in between (depth 2 = one hidden layer)."""
    d = math.prod(input_shape)
    layers: list[nn.Module] = [nn.Flatten()]
    for i in range(depth - 1):
        layers += [nn.Linear(d if i == 0 else hidden, hidden), make_activation(activation)]
    layers.append(nn.Linear(d if depth == 1 else hidden, num_classes))
    return nn.Sequential(*layers)


@dataclass(frozen=True)
class ConvStyle:
    """The options the two small CNNs share: each convolution is conv → [GroupNorm] → activation,
    the conv weight-standardised where asked."""

    activation: str
    groupnorm: bool = False
    weight_standardization: bool = False

    def block(self, cin: int, cout: int, k: int, **kw) -> list[nn.Module]:
        conv = _conv(cin, cout, k, self.weight_standardization, **kw)
        return [conv, *([_gn(cout)] if self.groupnorm else []), make_activation(self.activation)]


def small_cnn(input_shape: tuple[int, ...], num_classes: int, activation: str = "tanh", **style) -> nn.Module:
    """Two 3×3 conv layers (16, 32 channels) with tanh and 2×2 max-pooling, then a linear head.

    Sized for small images (8×8 digits); tanh follows Papernot et al. 2021 for DP training.
    ``style``: :class:`ConvStyle`'s ``groupnorm`` and ``weight_standardization``.
    """
    c, h, w = input_shape
    s = ConvStyle(activation, **style)
    return nn.Sequential(
        *s.block(c, 16, 3, padding=1),
        nn.MaxPool2d(2),
        *s.block(16, 32, 3, padding=1),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * (h // 4) * (w // 4), num_classes),
    )


def mnist_cnn(input_shape: tuple[int, ...], num_classes: int, activation: str = "relu", **style) -> nn.Module:
    """The 2-conv model of Abadi et al. / Opacus's MNIST example (ReLU, as Opacus; Tramèr &
    Boneh's and Papernot et al.'s end-to-end CNN is this model with tanh). ``style`` as
    :func:`small_cnn`'s."""
    c, h, w = input_shape
    if min(h, w) < 16:
        raise DPConfigError(
            f"model='cnn' (the 2-conv MNIST model) needs images of at least 16×16, not {h}×{w}; "
            "use model='small_cnn' or 'mlp' for small images such as digits."
        )
    s = ConvStyle(activation, **style)
    features = nn.Sequential(
        *s.block(c, 16, 8, stride=2, padding=3),
        nn.MaxPool2d(2, 1),
        *s.block(16, 32, 4, stride=2),
        nn.MaxPool2d(2, 1),
        nn.Flatten(),
    )
    with torch.no_grad():
        flat = features(torch.zeros(1, c, h, w)).shape[1]
    return nn.Sequential(features, nn.Linear(flat, 32), make_activation(activation), nn.Linear(32, num_classes))


class PublicFeatures(nn.Module):
    """A fixed, public, per-example transform at the front of a model: no trainable parameters,
    fixed before any data is seen, each output a function of one example alone. The pipeline
    computes it once per dataset (:mod:`pipelines.data.features`) and trains the rest."""

    def cache_key(self) -> str:
        raise NotImplementedError


class ScatterNet(PublicFeatures):
    """The scattering transform of Oyallon & Mallat as used by Tramèr & Boneh 2021 (kymatio's
    Scattering2D, J=2, L=8): [B, C, H, W] → [B, 81·C, H/4, W/4]."""

    def __init__(self, input_shape: tuple[int, ...], J: int = 2, L: int = 8):
        super().__init__()
        # kymatio's top-level module also imports its 3-D transform, which needs an older scipy.
        from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D

        c, h, w = input_shape
        if h % (2**J) or w % (2**J):
            raise DPConfigError(
                f"the scattering transform (J={J}) needs image sides divisible by {2**J}, not {h}×{w}; resize with --image-size."
            )
        self.J, self.L, self.input_shape = J, L, tuple(input_shape)
        self.scattering = ScatteringTorch2D(J=J, shape=(h, w), L=L)
        self.out_channels = c * (1 + J * L + L * L * J * (J - 1) // 2)

    def forward(self, x):
        out = self.scattering(x.contiguous())  # [B, C, K, H/2^J, W/2^J]
        return out.reshape(out.shape[0], -1, out.shape[-2], out.shape[-1])

    def output_shape(self) -> tuple[int, int, int]:
        _, h, w = self.input_shape
        return (self.out_channels, h // 2**self.J, w // 2**self.J)

    def cache_key(self) -> str:
        import kymatio

        return f"scatter-J{self.J}-L{self.L}-{'x'.join(map(str, self.input_shape))}-kymatio{kymatio.__version__}"


def split_public_front(model: nn.Module) -> tuple[PublicFeatures | None, nn.Module]:
    """(the model's public front end, the rest) or (None, the model)."""
    if isinstance(model, nn.Sequential) and len(model) > 1 and isinstance(model[0], PublicFeatures):
        return model[0], model[1:]
    return None, model


def scatter_linear(input_shape: tuple[int, ...], num_classes: int, **_) -> nn.Module:
    front = ScatterNet(input_shape)
    k, h, w = front.output_shape()
    head = nn.Sequential(nn.GroupNorm(SCATTER_GROUPS, k, affine=False), nn.Flatten(), nn.Linear(k * h * w, num_classes))
    return nn.Sequential(front, head)


def scatter_cnn(input_shape: tuple[int, ...], num_classes: int, activation: str = "tanh", **_) -> nn.Module:
    """Tramèr & Boneh's CNN on scattering features (for 28×28 inputs: 81×7×7)."""
    front = ScatterNet(input_shape)
    k, h, w = front.output_shape()
    body = nn.Sequential(
        nn.GroupNorm(SCATTER_GROUPS, k, affine=False),
        nn.Conv2d(k, 16, 3, stride=2, padding=1),
        make_activation(activation),
        nn.Conv2d(16, 32, 3, stride=1, padding=1),
        make_activation(activation),
        nn.Flatten(),
    )
    with torch.no_grad():
        flat = body(torch.zeros(2, k, h, w)).shape[1]
    head = nn.Sequential(*body, nn.Linear(flat, 32), make_activation(activation), nn.Linear(32, num_classes))
    return nn.Sequential(front, head)


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


ARCHITECTURE_OPTIONS = {  # which models take which options
    "mlp": ("activation",),
    "small_cnn": ("activation", "groupnorm", "weight_standardization"),
    "cnn": ("activation", "groupnorm", "weight_standardization"),
    "scatter_cnn": ("activation",),
}


# model name (catalog.MODELS) -> builder; "tv:<name>" is any torchvision model
MODEL_BUILDERS = {
    "mlp": mlp,
    "small_cnn": small_cnn,
    "cnn": mnist_cnn,
    "resnet9": resnet9,
    "wrn16_4": wide_resnet,
    "scatter_linear": scatter_linear,
    "scatter_cnn": scatter_cnn,
}


def build_model(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    replace_batchnorm: bool = False,
    activation: str | None = None,
    groupnorm: bool = False,
    weight_standardization: bool = False,
) -> nn.Module:
    """Build ``name`` for ``input_shape`` [C, H, W] and ``num_classes`` (see module doc)."""
    builders = MODEL_BUILDERS
    given = {
        "activation": activation,
        "groupnorm": groupnorm or None,
        "weight_standardization": weight_standardization or None,
    }
    unused = [k for k, v in given.items() if v is not None and k not in ARCHITECTURE_OPTIONS.get(name, ())]
    if unused:
        takers = sorted(m for m, opts in ARCHITECTURE_OPTIONS.items() if unused[0] in opts)
        raise DPConfigError(f"{unused[0]} has no effect on model={name!r}; it applies to {', '.join(takers)}.")
    if name in builders:
        model = builders[name](tuple(input_shape), num_classes, **{k: v for k, v in given.items() if v is not None})
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
    if cfg.model.startswith("hf:"):
        from .text.hf import load_classifier

        return load_classifier(cfg.model, num_classes, cfg.lora(), getattr(cfg, "pooling", "auto"))[0]
    options = {k: getattr(cfg, k, None) for k in ("activation", "groupnorm", "weight_standardization")}
    options = {k: v for k, v in options.items() if v is not None}
    if not getattr(cfg, "pca_components", 0):
        return build_model(cfg.model, input_shape, num_classes, cfg.replace_batchnorm, **options)
    from dpcore import PCAProjection

    k, d = cfg.pca_components, math.prod(input_shape)
    comps = torch.zeros(k, d) if pca_components is None else pca_components
    return nn.Sequential(
        PCAProjection(comps), build_model(cfg.model, (k,), num_classes, cfg.replace_batchnorm, **options)
    )

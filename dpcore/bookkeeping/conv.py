"""``nn.Conv2d`` (groups = 1, zero padding given as numbers).

Per-example weight gradients are materialised while they fit (for small patch sizes, the MNIST
CNN's, by the compiled kernel of :mod:`dpcore.native`, which also gives their float64 squared
norms and skips exactly-zero output gradients; elsewhere by torch's grouped weight gradient, or
by patches and one batched matrix product where that is faster, by shape: :func:`patches_first`).
Over budget, the ghost form from the patches and the output gradients.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from .. import native
from .base import (
    Context,
    LayerForm,
    MaterialisedPart,
    bias_per_example,
    refuse_frozen_weight,
    weight_and_bias,
)
from .norms import row_sq_norms


def conv_per_example(m: nn.Conv2d, a: torch.Tensor, g: torch.Tensor, native_ok: bool = True):
    """``(W, sq)``: per-example weight gradients ``W`` [B, out, in·kh·kw] of a plain Conv2d
    (groups=1) from its input ``a`` [B, in, H, W] and output gradient ``g`` [B, out, H', W'],
    and their squared norms in float64 where the compiled kernel (:mod:`dpcore.native`) gave
    them, else ``None``."""
    W, sq, last = per_example_gradients(m, a, g, native_ok)
    return (weight_order(m, W) if last else W), sq


def per_example_gradients(m: nn.Conv2d, a: torch.Tensor, g: torch.Tensor, native_ok: bool = True):
    """``(W, sq, channels_last)``: :func:`conv_per_example`'s two, with each row of W in the
    order that was fastest to form: the weight's (in, kh, kw), or with ``channels_last`` (kh, kw,
    in), which :func:`weight_order` maps back (norms do not depend on the order)."""
    if native_ok and native.worthwhile(m, g):
        got = native.conv2d_per_example(m, a, g)
        if got is not None:
            return (*got, False)
    if m.in_channels > 1 and patches_first(m, g.shape[2] * g.shape[3]):
        # W_i = G_i·P_i: output gradients [out, T] times patches [T, kh·kw·in].
        return torch.bmm(g.reshape(g.shape[0], m.out_channels, -1), patches_last(m, a)), None, True
    return conv_per_example_torch(m, a, g), None, False


def weight_order(m: nn.Conv2d, W: torch.Tensor) -> torch.Tensor:
    """Rows [..., out, kh·kw·in] in the weight's order [..., out, in·kh·kw] (a copy)."""
    (kh, kw), c = m.kernel_size, m.in_channels
    lead = W.shape[:-1]
    return W.reshape(*lead, kh, kw, c).movedim(-1, -3).reshape(*lead, c * kh * kw)


def patches_last(m: nn.Conv2d, a: torch.Tensor) -> torch.Tensor:
    """The patches of ``m``'s input as [B, H'·W', kh·kw·in]: each position's patch contiguous,
    its channels innermost (the order of :func:`weight_order`'s rows). Made from a channels-last
    copy of the padded input by one strided copy, and multiplied as the right operand of a
    batched product without any transpose: both faster than the [B, in·kh·kw, T] patches of
    :func:`patches` (ResNet-9's 256→512 on 8×8 at batch 64: 61 against 79 ms for the patches and
    the product; 2026-12-01, 2 cores, docs/benchmarks/README.md)."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = m.kernel_size, m.stride, m.padding, m.dilation
    ap = (F.pad(a, (pw, pw, ph, ph)) if (ph or pw) else a).permute(0, 2, 3, 1).contiguous()  # [B, H, W, in]
    B, H, W, C = ap.shape
    oh, ow = (H - dh * (kh - 1) - 1) // sh + 1, (W - dw * (kw - 1) - 1) // sw + 1
    s = ap.stride()
    view = ap.as_strided((B, oh, ow, kh, kw, C), (s[0], sh * s[1], sw * s[2], dh * s[1], dw * s[2], s[3]))
    return view.reshape(B, oh * ow, kh * kw * C)


def patch_view(m: nn.Conv2d, a: torch.Tensor, channels_last_batch: bool = False) -> torch.Tensor:
    """The patches of ``m``'s input ``a`` [B, in, H, W] as a strided view of its zero-padded copy,
    no values copied: [B, in, kh, kw, H', W'], or with ``channels_last_batch`` [in, kh, kw, B, H',
    W'] (the layout of :func:`~dpcore.bookkeeping.base.by_channel`). Entry (i, c, p, q, y, x) is
    a_pad[i, c, s_h·y + d_h·p, s_w·x + d_w·q]: what ``F.unfold`` lists, as a view."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = m.kernel_size, m.stride, m.padding, m.dilation
    ap = F.pad(a, (pw, pw, ph, ph)) if (ph or pw) else a
    B, C, H, W = ap.shape
    oh, ow = (H - dh * (kh - 1) - 1) // sh + 1, (W - dw * (kw - 1) - 1) // sw + 1
    s = ap.stride()
    view = ap.as_strided((B, C, kh, kw, oh, ow), (s[0], s[1], dh * s[2], dw * s[3], sh * s[2], sw * s[3]))
    return view.permute(1, 2, 3, 0, 4, 5) if channels_last_batch else view


def patches(m: nn.Conv2d, a: torch.Tensor) -> torch.Tensor:
    """``F.unfold(a, ...)`` for ``m``: the patches [B, in·kh·kw, H'·W'], the same values in the same
    order, made by one strided copy (torch's unfold, an im2col loop, took 4–9 times as long on
    ResNet-9's layers: 2026-12-01, 2 cores, docs/benchmarks/README.md)."""
    view = patch_view(m, a)
    B, C, kh, kw, oh, ow = view.shape
    return view.reshape(B, C * kh * kw, oh * ow)


# Below this many output positions a convolution's ghost form is cheaper than materialising,
# however much memory there is (see ghost_first).
GHOST_POSITIONS = 48


def ghost_first(m: nn.Conv2d, g: torch.Tensor) -> bool:
    """Whether the ghost form is faster than materialised per-example gradients for ``m`` (whose
    output gradient ``g`` gives the map's size): on maps of fewer than ``GHOST_POSITIONS``
    positions, where the compiled kernel does not apply. There a per-example product has only T
    terms per entry, and writing B·out·in·kh·kw floats costs as much as or more than the ghost
    form's float64 products (ResNet-9's 512→512 on 4×4, measured 2026-12-01 in the private step,
    2 cores: at batch 64, 361 against 125 ms; at batch 32 they tie, 85 and 86 ms; on its
    256→512 on 8×8, 64 positions, materialising took 118 ms against 222 at batch 64). By shape
    only."""
    positions = g.shape[2] * g.shape[3] if g.dim() == 4 else 0
    return positions < GHOST_POSITIONS and not native.worthwhile(m, g)


def patches_first(m: nn.Conv2d, positions: int) -> bool:
    """Whether the per-example weight gradients of ``m`` are faster as patches (:func:`patches`)
    and one batched matrix product than as torch's grouped weight gradient: on maps of at most
    256 output positions, for layers of up to 4 input channels, and where the layer has few
    output positions for its input channels (``in_channels ≥ 2·positions``). Measured on CPU
    (2 threads, batch 64, 3×3 kernels, ``docs/benchmarks/conv_per_example.py``, 2026-12-01):
    1.0–2.6× faster there (ResNet-9's 128→256 on 16×16: 52.8 against 65.4 ms; its 3→64 on
    32×32: 2.6 against 5.1), and up to 1.5× slower on 32×32 maps of 16–64 input channels,
    where the grouped form is kept. Decided by the layer's shape only."""
    return positions <= 256 or m.in_channels <= 4 or m.in_channels >= 2 * positions


def conv_per_example_torch(m: nn.Conv2d, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The torch form of :func:`conv_per_example` (any device and dtype): ``W`` only."""
    batch = a.shape[0]
    if m.in_channels == 1:
        # W_i[o, p, q] = Σ_{y,x} a_pad[i, s_h·y + d_h·p, s_w·x + d_w·q] · g[i, o, y, x]: a forward
        # convolution of the padded input with g as the kernel (stride and dilation swap
        # roles), one group per example. With one input channel this is about twice as fast
        # as the grouped weight gradient below (measured: docs/benchmarks/README.md).
        (ph, pw), (kh, kw), (sh, sw), (dh, dw) = m.padding, m.kernel_size, m.stride, m.dilation
        out_h, out_w = g.shape[2], g.shape[3]
        ap = F.pad(a, (pw, pw, ph, ph)) if (ph or pw) else a
        ap = ap[:, :, : (out_h - 1) * sh + (kh - 1) * dh + 1, : (out_w - 1) * sw + (kw - 1) * dw + 1]
        W = F.conv2d(
            ap.reshape(1, batch, ap.shape[2], ap.shape[3]),
            g.reshape(batch * m.out_channels, 1, out_h, out_w),
            stride=(dh, dw),
            dilation=(sh, sw),
            groups=batch,
        )
        return W.reshape(batch, m.out_channels, kh * kw)
    if patches_first(m, g.shape[2] * g.shape[3]):
        W = torch.bmm(g.reshape(batch, m.out_channels, -1), patches_last(m, a))
        return weight_order(m, W)
    # One convolution-weight gradient with the batch as groups.
    return torch.nn.grad.conv2d_weight(
        a.reshape(1, -1, *a.shape[2:]),
        (batch * m.out_channels, m.in_channels, *m.kernel_size),
        g.reshape(1, -1, *g.shape[2:]),
        stride=m.stride,
        padding=m.padding,
        dilation=m.dilation,
        groups=batch,
    ).reshape(batch, m.out_channels, -1)


class ConvForm(LayerForm):
    def accepts(self, m: nn.Conv2d) -> bool:
        return m.groups == 1 and m.padding_mode == "zeros" and not isinstance(m.padding, str)

    def problems(self, m: nn.Conv2d) -> list[str]:
        return refuse_frozen_weight(m)

    def per_example(self, m: nn.Conv2d, a, g, sq, ctx: Context):
        batch = a.shape[0]
        G = g.reshape(batch, g.shape[1], -1)  # [B, c, T]
        if ctx.materialises(m.weight.numel(), batch) and not ghost_first(m, g):
            return self.materialised(m, a, g, G, sq, ctx)
        # Output gradients [B, c, T]; the form makes the patches it needs from the input.
        return self.ghost_input(m, a, G, sq, ctx)

    def materialised(self, m: nn.Conv2d, a, g, G, sq, ctx: Context):
        """The part with per-example weight gradients [B, out, in·kh·kw], their norms added into ``sq``."""
        W, w_sq, last = per_example_gradients(m, a, g)
        sq += w_sq if w_sq is not None else row_sq_norms(W.reshape(W.shape[0], -1), ctx)
        post = partial(weight_order, m) if last else None
        return MaterialisedPart(m, W, bias_per_example(m, G.sum(2), sq), post=post)

    def ghost_input(self, m: nn.Conv2d, a, G, sq, ctx: Context):
        """:meth:`ghost` from the layer's input ``a``, whose patches it makes."""
        return self.ghost(m, patches(m, a), G, sq, ctx)

    def ghost(self, m: nn.Conv2d, A, G, sq, ctx: Context):
        """The ghost form from patches ``A`` [B, in·kh·kw, T] and output gradients ``G`` [B, out, T]."""
        return weight_and_bias(m, A, G, True, sq, ctx)

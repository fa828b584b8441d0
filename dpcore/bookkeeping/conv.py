"""``nn.Conv2d`` (groups = 1, zero padding given as numbers).

Per-example weight gradients are materialised while they fit (for small patch sizes, the MNIST
CNN's, by the compiled kernel of :mod:`dpcore.native`, which also gives their float64 squared
norms and skips exactly-zero output gradients; elsewhere by torch's grouped weight gradient, or
by patches and one batched matrix product where the layer has few output positions for its
input channels).
Over budget, the ghost form from the unfolded patches and the output gradients.
"""

from __future__ import annotations

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
    row_sq_norms,
    weight_and_bias,
)


def conv_per_example(m: nn.Conv2d, a: torch.Tensor, g: torch.Tensor, native_ok: bool = True):
    """``(W, sq)``: per-example weight gradients ``W`` [B, out, in·kh·kw] of a plain Conv2d
    (groups=1) from its input ``a`` [B, in, H, W] and output gradient ``g`` [B, out, H', W'],
    and their squared norms in float64 where the compiled kernel (:mod:`dpcore.native`) gave
    them, else ``None``."""
    if native_ok and native.worthwhile(m, g):
        got = native.conv2d_per_example(m, a, g)
        if got is not None:
            return got
    return conv_per_example_torch(m, a, g), None


def patches_first(m: nn.Conv2d, positions: int) -> bool:
    """Whether the per-example weight gradients of ``m`` are faster as unfolded patches and one
    batched matrix product than as torch's grouped weight gradient: where the layer has few
    output positions for its input channels (``in_channels ≥ 2·positions``: deep layers on
    small maps, strided layers). Measured on CPU (2 threads, batches of 32 and 64, 3×3 kernels,
    ``docs/benchmarks/conv_per_example.py``): up to 9× faster there (0.9× at worst), and up to
    7× slower on wide maps with few channels, where the grouped form is kept. Decided by the
    layer's shape only."""
    return m.in_channels >= 2 * positions


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
    out_h, out_w = g.shape[2], g.shape[3]
    if patches_first(m, out_h * out_w):
        # W_i = G_i·A_iᵀ: output gradients [out, T] times unfolded patches [T, in·kh·kw].
        A = F.unfold(a, m.kernel_size, dilation=m.dilation, padding=m.padding, stride=m.stride)
        return torch.bmm(g.reshape(batch, m.out_channels, -1), A.transpose(1, 2))
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
        if ctx.materialises(m.weight.numel(), batch):
            W, w_sq = self.weight_per_example(m, a, g)  # [B, out, in·kh·kw]
            sq += w_sq if w_sq is not None else row_sq_norms(W.reshape(batch, -1), ctx)
            return MaterialisedPart(m, W, bias_per_example(m, G.sum(2), sq))
        # Patches [B, d, T] and output gradients [B, c, T]: both in their natural layout.
        A = F.unfold(a, m.kernel_size, dilation=m.dilation, padding=m.padding, stride=m.stride)
        return self.ghost(m, A, G, sq, ctx)

    def weight_per_example(self, m: nn.Conv2d, a, g):
        """(per-example gradients of the weight, their float64 squared norms or None)."""
        return conv_per_example(m, a, g)

    def ghost(self, m: nn.Conv2d, A, G, sq, ctx: Context):
        return weight_and_bias(m, A, G, True, sq, ctx)

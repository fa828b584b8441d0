"""The convolution forms of dpcore.bookkeeping.conv: single-input-channel convolutions give the
vmap clipped sum; every per-example gradient form (the compiled kernel, forward convolution,
patches and a batched product, grouped weight gradient) equals autograd run on each example
alone; the strided-copy patches (and the weight-standardised form's centred patches) are
F.unfold's exactly for any memory layout; and small maps take the ghost form within the memory
budget, larger ones the materialised form, with the reference's clipped sum."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpcore import native
from dpcore.bookkeeping import BookKeepingClipper

from ._common import _reference, ce


def one_channel_zoo():
    """Single-input-channel convolutions (the forward-convolution form of the per-example
    gradient) with padding, unequal strides and dilation, then an ordinary one."""
    return nn.Sequential(
        nn.Conv2d(1, 4, (5, 3), stride=(2, 3), padding=(2, 1), dilation=(1, 2)),
        nn.Tanh(),
        nn.Conv2d(4, 1, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(1, 3, 2, stride=1, bias=False),
        nn.Flatten(),
        nn.LazyLinear(4),
    )


@pytest.mark.parametrize("clip", [0.05, 1e3])
def test_single_channel_convolutions_equal_the_vmap_clipped_sum(clip):
    torch.manual_seed(11)
    model = one_channel_zoo()
    x = torch.randn(20, 1, 13, 17)
    model(x[:1])
    y = torch.randint(0, 4, (20,))
    ref, _ = _reference(model, x, y, clip)
    out = {}
    BookKeepingClipper(model, ce).clipped_sum(x, y, clip, out)
    for k in ref:
        assert torch.allclose(out[k], ref[k], atol=1e-5, rtol=1e-5), (k, (out[k] - ref[k]).abs().max())


@pytest.mark.parametrize("native_ok", [True, False], ids=["native", "torch"])
def test_per_example_conv_gradients_equal_autograd_per_example(native_ok):
    """Every per-example form (the compiled kernel; forward convolution for one input channel,
    patches and a batched matrix product for small maps and layers with few output positions,
    grouped weight gradient otherwise) against autograd run on each example alone, with sparse and dense output
    gradients; and the kernel's squared norms against float64."""
    from dpcore.bookkeeping.conv import conv_per_example as _conv_per_example
    from dpcore.bookkeeping.conv import patches_first

    forms = set()

    torch.manual_seed(12)
    for conv, shape in [
        (nn.Conv2d(1, 5, (4, 3), stride=(3, 2), padding=(1, 2), dilation=(2, 1)), (1, 15, 14)),
        (nn.Conv2d(3, 4, 3, stride=2, padding=1, dilation=2), (3, 11, 9)),
        (nn.Conv2d(1, 16, 8, stride=2, padding=3), (1, 28, 28)),  # the MNIST CNN's layers
        (nn.Conv2d(16, 32, 4, stride=2), (16, 13, 13)),
        (nn.Conv2d(5, 3, (1, 6), stride=(1, 3), padding=(0, 4)), (5, 4, 17)),
        (nn.Conv2d(70, 2, 1), (70, 3, 3)),  # D = 70: a 64-wide block and a tail
        (nn.Conv2d(8, 3, 3, stride=2, padding=1), (8, 4, 4)),  # 4 output positions, 8 channels: patches
        (nn.Conv2d(9, 2, (2, 3), stride=(2, 1), padding=(1, 0), dilation=(1, 2)), (9, 3, 6)),
        (nn.Conv2d(6, 4, 3, padding=1), (6, 17, 17)),  # 289 positions, 6 channels: grouped
    ]:
        x = torch.randn(6, *shape)
        z = conv(x)
        forms.add(patches_first(conv, z.shape[2] * z.shape[3]))
        for density in (1.0, 0.25, 0.0):
            g = torch.randn_like(z) * (torch.rand_like(z) < density)
            got, sq = _conv_per_example(conv, x, g, native_ok=native_ok)
            if native_ok and native.load() is not None and native.worthwhile(conv, g):
                assert sq is not None  # the kernel was used
            for i in range(6):
                (w,) = torch.autograd.grad(conv(x[i : i + 1]), conv.weight, g[i : i + 1])
                assert torch.allclose(got[i], w.reshape(conv.out_channels, -1), atol=1e-5), (conv, density, i)
            if sq is not None:
                ref = got.double().reshape(6, -1).square().sum(1)
                assert torch.allclose(sq, ref, rtol=1e-12, atol=0), (conv, density)
    assert forms == {True, False}  # both torch forms for several input channels were run


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "sliced"])
def test_patches_are_torch_unfold_exactly(layout):
    """The strided-copy patches equal F.unfold's, value for value, for strides, padding,
    dilation and rectangular kernels, whatever the input's memory layout."""
    from dpcore.bookkeeping.conv import patches
    from dpcore.bookkeeping.wsconv import centred, centred_patches

    torch.manual_seed(11)
    convs = [
        nn.Conv2d(3, 4, 3, padding=1),
        nn.Conv2d(3, 4, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2)),
        nn.Conv2d(3, 4, 1, stride=2),
        nn.Conv2d(3, 4, 5, padding=0, dilation=2),
    ]
    a = torch.randn(5, 3, 11, 12)
    if layout == "channels_last":
        a = a.contiguous(memory_format=torch.channels_last)
    elif layout == "sliced":
        a = torch.randn(7, 3, 13, 12)[1:6, :, 2:, :]
    for m in convs:
        ref = F.unfold(a, m.kernel_size, dilation=m.dilation, padding=m.padding, stride=m.stride)
        assert torch.equal(patches(m, a), ref)
        # The centred float64 patches made from the input in one pass, against centring F.unfold's.
        g = torch.randn(5, 4, ref.shape[2])
        got, g64 = centred_patches(m, a, g)
        want, _ = centred(ref, g)
        assert got.shape == want.shape and g64.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=0, atol=1e-13)


def test_convolutions_on_small_maps_take_the_ghost_form_within_the_memory_budget():
    """A convolution on a map of fewer than GHOST_POSITIONS positions gets the ghost form even
    where its per-example gradients would fit the budget (materialising them costs as much or
    more there; the compiled kernel's layers excepted); on a larger map, the materialised form.
    The clipped sum is the reference's."""
    from dpcore.bookkeeping.base import GhostPart, MaterialisedPart
    from dpcore.bookkeeping.conv import GHOST_POSITIONS
    from dpcore.layers import WSConv2d

    torch.manual_seed(21)
    assert 6 * 6 < GHOST_POSITIONS <= 8 * 8
    model = nn.Sequential(
        WSConv2d(3, 8, 3, padding=1, bias=False),  # 8 × 8: materialised
        nn.GroupNorm(2, 8),
        nn.ReLU(),
        nn.Conv2d(8, 6, (2, 3), stride=2, padding=2),  # 6 × 5: ghost
        nn.ReLU(),
        WSConv2d(6, 4, 3, padding=1, bias=False),  # 6 × 5: ghost
        nn.Flatten(),
        nn.Linear(120, 5),
    )
    x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 5, (6,))
    bk = BookKeepingClipper(model, ce)
    assert bk.MAX_PER_EXAMPLE_ELEMENTS > 6 * 8 * 8 * 9  # every convolution fits the budget
    _, parts = bk.measure(x, y, 1.0)
    kinds = {name: type(part) for name, part in parts}
    assert kinds["0"] is MaterialisedPart and kinds["3"] is GhostPart and kinds["5"] is GhostPart
    ref, _ = _reference(model, x, y, 1.0)
    out = {}
    bk.clipped_sum(x, y, 1.0, out)
    for k in ref:
        assert torch.allclose(out[k], ref[k], atol=1e-5), (k, (out[k] - ref[k]).abs().max())

"""The book-keeping fast path (dpcore.bookkeeping) gives the reference clipped sum, keeps each
example's share ≤ C, skips non-finite examples the same way, and falls back to the vmap path
for anything it cannot handle."""

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcore
from dpcore import native
from dpcore.bookkeeping import BookKeepingClipper, Unsupported, supports, unsupported_parameters
from dpcore.clipping import clip_factors, clipped_sum, per_sample_norms
from dpcore.grad_sample import PerSampleGradients
from pipelines.models import build_model, resnet9

ce = F.cross_entropy


class SeqModel(nn.Module):
    """Linear layers applied to a sequence (T positions per example), then pooled."""

    def __init__(self, d=6, hidden=12):
        super().__init__()
        self.a = nn.Linear(d, hidden)
        self.b = nn.Linear(hidden, 4, bias=False)

    def forward(self, x):  # x [B, T=5, d]
        return self.b(torch.tanh(self.a(x))).mean(1)


def conv_zoo():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, (3, 2), dilation=(1, 2), padding=(2, 1), bias=False),
        nn.Tanh(),
        nn.Flatten(),
        nn.LazyLinear(5),
    )


def ws_gn_net():
    """Weight-standardised convolutions (with and without bias, strided, one input channel),
    GroupNorm with and without frozen parts, a residual, GroupNorm on flat features."""
    from dpcore.layers import WSConv2d

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = WSConv2d(1, 6, 3, padding=1)
            self.g1 = nn.GroupNorm(3, 6)
            self.c2 = WSConv2d(6, 6, 3, padding=1, bias=False)
            self.g2 = nn.GroupNorm(2, 6)
            self.g2.bias.requires_grad_(False)
            self.c3 = WSConv2d(6, 4, 2, stride=2)
            self.head = nn.Linear(4 * 4 * 5, 8)
            self.g3 = nn.GroupNorm(2, 8)
            self.out = nn.Linear(8, 5)

        def forward(self, x):
            h = torch.relu(self.g1(self.c1(x)))
            h = h + torch.tanh(self.g2(self.c2(h)))
            h = self.c3(h).flatten(1)
            return self.out(torch.relu(self.g3(self.head(h))))

    return Net()


class NormSeq(nn.Module):
    """LayerNorm over a sequence's last dimension (one with a frozen bias, one without affine
    parameters), over its last two dimensions, and on flat features."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 12)
        self.n1 = nn.LayerNorm(12)
        self.n1.bias.requires_grad_(False)
        self.n2 = nn.LayerNorm((5, 12))
        self.n3 = nn.LayerNorm(12, elementwise_affine=False)
        self.head = nn.Linear(12, 8)
        self.n4 = nn.LayerNorm(8)
        self.out = nn.Linear(8, 4)
        with torch.no_grad():  # not the identity's γ = 1, β = 0
            for n in (self.n1, self.n2, self.n4):
                n.weight.normal_(1.0, 0.3)
                n.bias.normal_(0.0, 0.3)

    def forward(self, x):  # x [B, T=5, 6]
        h = torch.tanh(self.n1(self.a(x)))
        h = self.n3(self.n2(h)).mean(1)
        return self.out(torch.relu(self.n4(self.head(h))))


def _scaled_ws(model, scale):
    from dpcore.layers import WSConv2d

    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, WSConv2d):
                m.weight.mul_(scale)
    return model


CASES = [
    ("mlp", lambda: build_model("mlp", (1, 8, 8), 10), (1, 8, 8), 10),
    ("ws_gn", ws_gn_net, (1, 8, 10), 5),
    # σ² ~ ε, so κ = σ²/(σ² + ε) is far from 1; gradients of ~1e3 then need float64 to be
    # compared at 1e-5.
    ("ws_gn_tiny_weights", lambda: _scaled_ws(ws_gn_net(), 3e-3).double(), (1, 8, 10), 5),
    ("resnet9", lambda: resnet9((3, 8, 8), 10, width=16), (3, 8, 8), 10),
    ("small_cnn", lambda: build_model("small_cnn", (1, 8, 8), 10), (1, 8, 8), 10),
    ("mnist_cnn", lambda: build_model("cnn", (1, 28, 28), 10), (1, 28, 28), 10),
    ("sequence", SeqModel, (5, 6), 4),
    ("layernorm", NormSeq, (5, 6), 4),
    ("conv_zoo", conv_zoo, (3, 9, 10), 5),
]


def _reference(model, x, y, clip):
    return clipped_sum(PerSampleGradients(model, ce)(x, y), clip)


@pytest.mark.parametrize("ghost", [False, True], ids=["materialised", "ghost"])
@pytest.mark.parametrize("clip", [0.01, 1.0, 1e4])
@pytest.mark.parametrize("name, make, shape, classes", CASES, ids=[c[0] for c in CASES])
def test_bookkeeping_equals_the_vmap_clipped_sum(name, make, shape, classes, clip, ghost):
    torch.manual_seed(0)
    model = make()
    x = torch.randn(24, *shape, dtype=next(model.parameters()).dtype)
    model(x[:1])  # materialise lazy layers
    y = torch.randint(0, classes, (24,))
    assert supports(model)
    bk = BookKeepingClipper(model, ce)
    if ghost:
        bk.MAX_PER_EXAMPLE_ELEMENTS = 0  # force the ghost-norm forms
    ref, ref_bad = _reference(model, x, y, clip)
    out = {}
    bad = bk.clipped_sum(x, y, clip, out)
    assert bad == ref_bad == 0
    assert set(out) == set(ref)
    for k in ref:
        assert torch.allclose(out[k], ref[k], atol=1e-5, rtol=1e-5), (k, (out[k] - ref[k]).abs().max())


@pytest.mark.parametrize("ghost", [False, True])
def test_each_examples_share_has_norm_at_most_C_even_for_huge_gradients(ghost):
    torch.manual_seed(1)
    model = build_model("small_cnn", (1, 8, 8), 10)
    bk = BookKeepingClipper(model, ce)
    if ghost:
        bk.MAX_PER_EXAMPLE_ELEMENTS = 0
    clip = 0.3
    for i in range(20):
        x = torch.randn(1, 1, 8, 8) * 10.0 ** (i % 5)  # up to 1e4: large gradients
        y = torch.randint(0, 10, (1,))
        out = {}
        bk.clipped_sum(x, y, clip, out)
        norm = math.sqrt(sum(float(v.double().square().sum()) for v in out.values()))
        assert norm <= clip, (i, norm)


def test_a_gradient_that_overflows_float32_squares_is_clipped_not_skipped():
    """Per-example gradients of about 1e20 (finite in float32, their squares not): the batch's
    norms are measured again in float64, once per batch, and every example is clipped as by the
    reference; none is counted as non-finite."""
    torch.manual_seed(2)
    model = SeqModel(d=32, hidden=32)  # a Linear over 5 positions: per-example gradients materialised
    with torch.no_grad():
        model.a.weight.mul_(1e-20)  # inputs of 1e20, moderate activations: the first weight's gradients are huge
    x, y = torch.randn(8, 5, 32) * 1e20, torch.randint(0, 4, (8,))
    bk = BookKeepingClipper(model, ce)
    sq, _ = bk.measure(x, y, 1.0)
    assert torch.isfinite(sq).all() and sq.min() > 1e39
    got: dict = {}
    assert bk.clipped_sum(x, y, 1.0, got) == 0
    want, bad = _reference(model, x, y, 1.0)
    assert bad == 0
    for k, w in want.items():
        torch.testing.assert_close(got[k], w, rtol=1e-5, atol=1e-6)


def test_nonfinite_examples_are_skipped_and_counted_like_the_reference():
    torch.manual_seed(2)
    model = build_model("mlp", (1, 8, 8), 10)
    x = torch.randn(8, 1, 8, 8)
    x[3, 0, 0, 0] = float("nan")
    x[5, 0, 1, 1] = float("inf")
    y = torch.randint(0, 10, (8,))
    ref, ref_bad = _reference(model, x, y, 1.0)
    out = {}
    bad = BookKeepingClipper(model, ce).clipped_sum(x, y, 1.0, out)
    assert bad == ref_bad == 2
    for k in ref:
        assert torch.isfinite(out[k]).all()
        assert torch.allclose(out[k], ref[k], atol=1e-5)


def test_nonfinite_examples_in_ghost_weight_standardised_layers_contribute_zero_like_the_reference():
    # The ghost form of a weight-standardised convolution keeps its patches centred in float64
    # for the clipped sum; a non-finite example's rows of them must still contribute exactly zero.
    torch.manual_seed(3)
    model = ws_gn_net()
    x = torch.randn(8, 1, 8, 10)
    x[2, 0, 3, 3] = float("nan")
    x[6, 0, 0, 1] = float("-inf")
    y = torch.randint(0, 5, (8,))
    ref, ref_bad = _reference(model, x, y, 1.0)
    bk = BookKeepingClipper(model, ce)
    bk.MAX_PER_EXAMPLE_ELEMENTS = 0  # the ghost forms
    out = {}
    assert bk.clipped_sum(x, y, 1.0, out) == ref_bad == 2
    for k in ref:
        assert torch.isfinite(out[k]).all()
        assert torch.allclose(out[k], ref[k], atol=1e-5), (k, (out[k] - ref[k]).abs().max())


def test_unsupported_layers_are_named_and_vmap_is_the_default():
    model = nn.Sequential(nn.Linear(4, 8), nn.PReLU(8), nn.Linear(8, 3))
    assert unsupported_parameters(model) == ["1.weight"]
    opt = dict(
        noise_multiplier=1.0,
        clip_norm=1.0,
        sample_rate=0.1,
        dataset_size=100,
        randomness=dpcore.SeededRandomness(0),
        ledger=dpcore.PrivacyLedger(None, 1e-5),
    )
    auto = dpcore.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, loss_fn=ce, **opt)
    assert auto.clipping == "vmap"
    with pytest.raises(dpcore.DPConfigError, match="1.weight"):
        dpcore.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model=model, loss_fn=ce, clipping="bookkeeping", **opt
        )

    # A Conv2d subclass with its own forward is not the plain function of its weight.
    class Scaled(nn.Conv2d):
        def forward(self, x):
            return super().forward(x) * 2.0

    assert unsupported_parameters(nn.Sequential(Scaled(1, 2, 3))) == ["0.weight", "0.bias"]
    # Weight-standardised convolutions and GroupNorm are handled.
    assert supports(build_model("resnet9", (3, 8, 8), 10))


def test_a_layer_used_twice_falls_back_at_run_time_and_the_sum_is_still_right():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(5, 5)  # registered once, called twice: only the run shows it
            self.head = nn.Linear(5, 3)

        def forward(self, x):
            return self.head(self.layer(torch.tanh(self.layer(x))))

    model = Twice()
    assert supports(model)
    # The same module registered twice is a tied parameter: refused up front.
    layer = nn.Linear(5, 5)
    assert not supports(nn.Sequential(layer, nn.Tanh(), layer))
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    with pytest.raises(Unsupported):
        BookKeepingClipper(model, ce).clipped_sum(x, y, 1.0, {})
    opt = dpcore.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        loss_fn=ce,
        noise_multiplier=1.0,
        clip_norm=1.0,
        sample_rate=0.1,
        dataset_size=100,
        randomness=dpcore.SeededRandomness(0),
        ledger=dpcore.PrivacyLedger(None, 1e-5),
        clipping="bookkeeping",
    )
    assert opt.clipping == "bookkeeping"
    with pytest.warns(UserWarning, match="using the vmap path"):
        opt.accumulate(x, y)
    assert opt.clipping == "vmap"
    ref, _ = _reference(model, x, y, 1.0)
    for k, v in ref.items():
        assert torch.allclose(opt._sum[k].to(v.dtype), v, atol=1e-6)


def test_a_private_step_is_the_same_with_either_path():
    def step(mode):
        torch.manual_seed(0)
        model = build_model("small_cnn", (1, 8, 8), 10)
        opt = dpcore.DPOptimizer(
            torch.optim.Adam(model.parameters(), lr=0.01),
            model=model,
            loss_fn=ce,
            noise_multiplier=1.0,
            clip_norm=1.0,
            sample_rate=0.1,
            dataset_size=640,
            randomness=dpcore.SeededRandomness(7),
            ledger=dpcore.PrivacyLedger(None, 1e-5),
            clipping=mode,
            physical_batch_size=16,
        )
        g = torch.Generator().manual_seed(3)
        x, y = torch.randn(64, 1, 8, 8, generator=g), torch.randint(0, 10, (64,), generator=g)
        opt.accumulate(x, y)
        opt.step()
        assert opt.clipping == mode
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(step("vmap"), step("bookkeeping")):
        assert torch.allclose(a, b, atol=1e-5)


def test_bench_command_prints_its_table():
    """The benchmark runs and prints ratios (a smoke test: timings are not asserted)."""
    import subprocess
    import sys

    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipelines.cli",
            "bench",
            "--models",
            "mnist_cnn",
            "--rounds",
            "1",
            "--threads",
            "1",
            "--no-opacus",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "| mnist_cnn (256) | non-private |" in res.stdout and "clipping=bookkeeping" in res.stdout


def test_layers_with_hooks_or_a_replaced_forward_are_left_to_the_reference_path():
    """A forward hook can change a layer's output, and then z = Wa + b no longer holds: the
    book-keeping formula would be wrong, so such layers are not handled, even when the hook
    arrives after the optimizer was built."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    x, y = torch.randn(10, 5), torch.randint(0, 3, (10,))
    opt = dpcore.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        loss_fn=ce,
        noise_multiplier=1.0,
        clip_norm=0.5,
        sample_rate=0.1,
        dataset_size=100,
        randomness=dpcore.SeededRandomness(0),
        ledger=dpcore.PrivacyLedger(None, 1e-5),
        clipping="bookkeeping",
    )
    assert opt.clipping == "bookkeeping"
    handle = model[0].register_forward_hook(lambda m, inp, out: out * 3.0)
    assert not supports(model) and "0.weight (the layer has hooks or a replaced forward)" in unsupported_parameters(
        model
    )
    with pytest.warns(UserWarning, match="using the vmap path"):
        opt.accumulate(x, y)
    ref, _ = _reference(model, x, y, 0.5)  # the reference runs the hook too
    for k, v in ref.items():
        assert torch.allclose(opt._sum[k].to(v.dtype), v, atol=1e-6)
    handle.remove()
    patched = nn.Linear(5, 3)
    patched.forward = lambda inp: nn.functional.linear(inp, patched.weight * 2.0, patched.bias)
    assert not supports(nn.Sequential(patched))


class Center(nn.Module):
    """Mixes the examples of a batch (no parameters, so dpcore.validate_model cannot see it)."""

    def forward(self, x):
        return x - x.mean(0, keepdim=True)


class CenterLargeBatches(nn.Module):
    """Mixes the examples of batches of more than 8 only (helper-34): the float64 check's batch of
    8 passed it, and a lot's sum then moved by 2.52·C when one example was added."""

    def forward(self, x):
        return x - x.mean(0, keepdim=True) if x.shape[0] > 8 else x


def _bk_optimizer(model, clip=0.01):
    return dpcore.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        loss_fn=ce,
        noise_multiplier=1.0,
        clip_norm=clip,
        sample_rate=0.1,
        dataset_size=100,
        randomness=dpcore.SeededRandomness(0),
        ledger=dpcore.PrivacyLedger(None, 1e-5),
        clipping="bookkeeping",
        physical_batch_size=16,
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.Sequential(nn.Linear(4, 8), Center(), nn.Tanh(), nn.Linear(8, 3)),  # mixes examples
        lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 3)),  # in place on an output
        lambda: nn.Sequential(nn.Linear(4, 8), CenterLargeBatches(), nn.Tanh(), nn.Linear(8, 3)),  # at 16, not 8
    ],
    ids=["batch-mixing", "inplace-relu", "mixing-above-8"],
)
def test_book_keeping_is_verified_against_vmap_before_it_is_trusted(make):
    """Book-keeping runs one batched forward; a model that mixes examples, or modifies a layer's
    output in place, breaks its formula. The first batch is computed both ways: on any
    difference the optimizer warns and stays on vmap, and what it added is the reference sum."""
    torch.manual_seed(6)
    model = make()
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    opt = _bk_optimizer(model)
    with pytest.warns(UserWarning, match="using the vmap path"):
        opt.accumulate(x, y)
    assert opt.clipping == "vmap"
    ref = {}
    for i in range(0, 32, 16):  # the reference, in the optimizer's physical batches
        part, _ = _reference(model, x[i : i + 16], y[i : i + 16], 0.01)
        for k, v in part.items():
            ref[k] = ref.get(k, 0) + v
    for k, v in ref.items():
        assert torch.allclose(opt._sum[k].to(v.dtype), v, atol=1e-7)


def test_verified_book_keeping_stays_on_and_matches_the_reference():
    torch.manual_seed(7)
    model = build_model("small_cnn", (1, 8, 8), 10)
    opt = _bk_optimizer(model, clip=0.5)
    x, y = torch.randn(48, 1, 8, 8), torch.randint(0, 10, (48,))
    opt.accumulate(x, y)
    assert opt.clipping == "bookkeeping" and opt._fast_verified
    ref, _ = _reference(model, x, y, 0.5)
    for k, v in ref.items():
        assert torch.allclose(opt._sum[k].to(v.dtype), v, atol=1e-5)


def test_tied_parameters_are_not_handled():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(8, 8)
            self.body = nn.Linear(8, 8)
            self.body.weight = self.head.weight  # registered after the head: deduplicated away by named_parameters()

        def forward(self, x):
            return self.head(torch.tanh(self.body(x)))

    assert any("tied" in p or "shared" in p for p in unsupported_parameters(Tied()))


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


@pytest.mark.parametrize("channels_first", [False, True], ids=["linear", "conv"])
def test_a_ghost_norm_is_never_below_the_exact_one_when_positions_cancel(channels_first):
    """An example whose two positions' terms almost cancel (g₂ = −(1 − 2⁻²²)·g₁ at the same
    input): its gradient is 2⁻²² of its terms, and float64 rounding of the Gram form, relative to
    the terms, is then not small next to its squared norm. The ghost norm carries an allowance
    for that rounding, which the form adds through SquaredNorms.add_allowance, so that what it
    adds is what the check against vmap expects: the norms to clip on are never below the exact
    norm (float64, from the same numbers) in 20 draws, where those without it often are."""
    from dpcore.bookkeeping.base import Context, GhostPart, SquaredNorms, weight_and_bias

    torch.manual_seed(21)
    m = nn.Linear(64, 32, bias=False)
    below = 0
    for _ in range(20):
        a, g = torch.randn(64) * 100, torch.randn(32) * 100
        A = torch.stack([a, a], 1 if channels_first else 0).unsqueeze(0)  # [1, d, 2] or [1, 2, d]
        G = torch.stack([g, -(g * (1 - 2.0**-22))], 1 if channels_first else 0).unsqueeze(0)
        Ad, Gd = (A[0].T, G[0].T) if channels_first else (A[0], G[0])
        exact = float((Gd.double().T @ Ad.double()).norm())
        sq = SquaredNorms(1, A.device)
        part = weight_and_bias(m, A, G, channels_first, sq, Context(clip_norm=1.0, max_elements=0))
        assert isinstance(part, GhostPart) and len(sq.allowances) == 1  # the ghost form, with its allowance
        below += float(sq.terms[0].sqrt()) < exact
        assert float(sq.measured()[0].sqrt()) >= exact
        assert float(sq.total().sqrt()) >= exact
    assert below >= 5  # without the allowance the norm is below the exact one (12 of the 20 draws)


@pytest.mark.parametrize("J", [2.0**30, 2.0**45, 2.0**53, 2.0**60])
def test_an_example_whose_gradient_rounds_to_zero_cannot_swallow_another_examples_share(J):
    """Neighbouring batches through the ghost form's clipped sum: example j's two positions have
    the same input and gradients J and −J, so its gradient is exactly 0 and, without an
    allowance for rounding in its ghost norm, its factor would be 1; its terms of size J in the
    one product over all (example, position) rows then swallow example i's share (C·1, rounded
    away next to J: the sum moved by 1.43·C when i was removed, at J = 2⁵³, before the allowance).
    With it, removing i moves the clipped sum by at most C."""
    from dpcore.bookkeeping.base import Context, SquaredNorms, weight_and_bias

    C = 1.4
    m = nn.Linear(1, 1, bias=False)
    A = torch.tensor([[[1.0], [0.0]], [[1.0], [1.0]]])  # [B=2, T=2, d=1]: i = example 0, j = 1
    G = torch.tensor([[[C], [0.0]], [[J], [-J]]])

    def clipped(G):
        ctx = Context(clip_norm=C, max_elements=0)
        sq = SquaredNorms(2, A.device)
        part = weight_and_bias(m, A, G, False, sq, ctx)
        factors, _ = clip_factors(sq.total().sqrt(), C)
        return part.contributions(factors, lambda t: t)[0][1]

    without_i = G.clone()
    without_i[0] = 0.0
    assert float((clipped(G) - clipped(without_i)).norm()) <= C


def test_float32_chunked_norms_are_within_the_clipping_margin():
    """Squared norms summed in float32 over chunks of 16 (then float64) stay within the error
    bound the clipping margin allows, on adversarial rows (many equal values, a wide range of
    magnitudes); huge rows that overflow float32 squares fall back to float64 instead of
    turning into inf (which would skip the example instead of clipping it)."""
    from dpcore.bookkeeping.base import Context
    from dpcore.bookkeeping.norms import row_sq_norms as _rsn
    from dpcore.clipping import NORM_ERROR

    def _row_sq_norms(w, clip, exact=False):
        return _rsn(w, Context(clip, 0, exact_rows=exact))

    torch.manual_seed(13)
    rows = torch.cat(
        [
            torch.full((1, 8192), 0.1),
            torch.randn(4, 8192) * torch.logspace(-6, 6, 8192),
            torch.randn(3, 8200)[:, :8192],
            torch.rand(2, 8192) * 1e-3 + 1.0,
        ]
    )
    exact = rows.double().square().sum(1)
    got = _row_sq_norms(rows, 1.0)
    rel = ((got - exact).abs() / exact).max().item()
    assert rel / 2 < NORM_ERROR, rel  # squared norm: the norm's error is half of this
    huge = torch.full((2, 4096), 3e20)
    huge[1, 7] = float("nan")
    ctx = Context(1.0, 0)
    assert not torch.isfinite(_rsn(huge, ctx)).any() and ctx.float32_rows  # overflowed, and says it took that path
    got = _row_sq_norms(huge, 1.0, exact=True)  # what the batch is measured with then
    assert math.isfinite(got[0].item()) and abs(got[0].item() / huge[0].double().square().sum().item() - 1) < 1e-12
    assert math.isnan(got[1].item())
    # Short rows, float64 rows and tiny clipping bounds take the float64 sum itself.
    for w, c in [
        (torch.randn(3, 20), 1.0),
        (torch.randn(3, 100, dtype=torch.float64), 1.0),
        (torch.randn(3, 100) * 1e-21, 1e-20),
    ]:
        assert torch.equal(_row_sq_norms(w, c), torch.linalg.vector_norm(w, dim=1, dtype=torch.float64).square())


def test_cross_entropy_shortcut_equals_the_vmapped_loss():
    """Plain cross-entropy's per-example losses are one reduction='none' call; any option
    (class weights, label smoothing) goes through the vmapped loss, and both give the reference
    clipped sum. An ignored label (-100) stays on the reduction: its loss is 0 there and NaN in
    the vmapped mean, its gradient zero in both, and y is never read on the host."""
    torch.manual_seed(14)
    model = build_model("small_cnn", (1, 8, 8), 10)
    x, y = torch.randn(12, 1, 8, 8), torch.randint(0, 10, (12,))
    bk = BookKeepingClipper(model, ce)
    logits = model(x)
    vm = torch.func.vmap(lambda o, t: ce(o.unsqueeze(0), t.unsqueeze(0)))(logits, y)
    assert torch.allclose(bk._per_example_losses(logits, y), vm, atol=1e-6)
    weighted = nn.CrossEntropyLoss(weight=torch.rand(10) + 0.5)
    smooth = nn.CrossEntropyLoss(label_smoothing=0.1)
    from dpcore.bookkeeping.clipper import is_plain_cross_entropy as _is_plain_cross_entropy

    assert _is_plain_cross_entropy(ce) and _is_plain_cross_entropy(nn.CrossEntropyLoss())
    assert not _is_plain_cross_entropy(weighted) and not _is_plain_cross_entropy(smooth)
    for loss in (nn.CrossEntropyLoss(), weighted, smooth):
        ref = clipped_sum(PerSampleGradients(model, loss)(x, y), 0.3)[0]
        out = {}
        BookKeepingClipper(model, loss).clipped_sum(x, y, 0.3, out)
        for k in ref:
            assert torch.allclose(out[k], ref[k], atol=1e-5), (loss, k)
    y_ignored = y.clone()
    y_ignored[2] = -100
    lg = logits.detach().requires_grad_()
    ours = bk._per_example_losses(lg, y_ignored)
    vm = torch.func.vmap(lambda o, t: ce(o.unsqueeze(0), t.unsqueeze(0)))(lg, y_ignored)
    assert ours[2] == 0 and torch.isnan(vm[2]) and torch.allclose(ours[vm == vm], vm[vm == vm], atol=1e-6)
    (g_ours,) = torch.autograd.grad(ours.sum(), lg)
    (g_vm,) = torch.autograd.grad(vm.sum(), lg)
    assert torch.equal(g_ours[2], torch.zeros(10)) and torch.equal(g_vm[2], torch.zeros(10))
    assert torch.allclose(g_ours, g_vm, atol=1e-7)
    ref, ref_bad = clipped_sum(PerSampleGradients(model, ce)(x, y_ignored), 0.3)
    out = {}
    assert bk.clipped_sum(x, y_ignored, 0.3, out) == ref_bad
    for k in ref:
        assert torch.allclose(out[k], ref[k], atol=1e-5)


def test_resnet9_at_the_platforms_initialisation_stays_on_book_keeping():
    """ResNet-9 as a worker builds it (init seed 0; GroupNorm, weight-standardised convolutions,
    32×32) at the benchmark's batch of 64. Its float32 backward is ill-conditioned: the batched
    and the per-example backward give sums up to 30× further apart than the old check allowed
    (twice vmap's distance from float64), so that check refused book-keeping here. In
    float64 the formulas agree to ~1e-15 of the scale, so the check keeps book-keeping, and the
    float32 sum it added is book-keeping's."""
    torch.manual_seed(0)
    model = resnet9((3, 32, 32), 10)
    torch.manual_seed(100)
    x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    opt = _bk_optimizer(model, clip=1.0)
    opt.physical_batch_size = 64
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fall-back warning
        opt.accumulate(x, y)
    assert opt.clipping == "bookkeeping" and opt._fast_verified
    fast = {}
    BookKeepingClipper(model, ce).clipped_sum(x, y, 1.0, fast)
    for k, v in fast.items():
        assert torch.equal(opt._sum[k], v.double()), k  # one batch: its float32 sum, widened exactly
    with monkeypatch_rtol(1e-13):  # the agreement measured, far inside the check's 1e-9
        assert opt._fast.formulas_disagree(x[:8], y[:8]) == ""


class monkeypatch_rtol:
    def __init__(self, rtol):
        self.rtol = rtol

    def __enter__(self):
        from dpcore import fastpath

        self.saved, fastpath.FORMULA_RTOL = fastpath.FORMULA_RTOL, self.rtol

    def __exit__(self, *exc):
        from dpcore import fastpath

        fastpath.FORMULA_RTOL = self.saved


class UnderNormedLinear(nn.Linear):
    """A Linear whose registered form below reports 0.9× each example's norm: a wrong formula
    that a comparison of clipped sums alone cannot see while no example is clipped."""


def test_the_check_compares_norms_so_a_form_that_underestimates_them_is_refused():
    from dpcore.bookkeeping import LAYERS, SquaredNorms, register_layer
    from dpcore.bookkeeping.linear import LinearForm

    class Under(LinearForm):
        def per_example(self, m, a, g, sq, ctx):
            own = SquaredNorms(sq.batch, sq.device)
            part = super().per_example(m, a, g, own, ctx)
            sq += 0.81 * own.total()
            return part

    torch.manual_seed(3)
    model = nn.Sequential(UnderNormedLinear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    register_layer(UnderNormedLinear, Under())
    try:
        big = _bk_optimizer(model, clip=1e6)  # nothing clipped: the two sums are equal
        fast = {}
        big._fast.clipper.clipped_sum(x, y, 1e6, fast)
        ref, _ = _reference(model, x, y, 1e6)
        assert all(torch.allclose(fast[k], ref[k], atol=1e-6) for k in ref)
        assert "per-example norms are below" in big._fast.formulas_disagree(x, y)
        with pytest.warns(UserWarning, match="per-example norms are below.*using the vmap path"):
            big.accumulate(x, y)
        assert big.clipping == "vmap"
    finally:
        LAYERS.pop(UnderNormedLinear)


def test_the_check_refuses_a_norm_short_of_its_own_examples_even_where_the_largest_hides_it(monkeypatch):
    """Norms can spread over many orders of magnitude (here 10⁰ to 10⁻⁷ between the examples'
    inputs): a form whose norms fall 1e-6 short only on the small examples stays far inside
    FORMULA_RTOL of the largest norm, and is refused by the bound on each example's own norm
    (BELOW_RTOL); the same form on honest norms passes."""
    from dpcore import fastpath
    from dpcore.bookkeeping import LAYERS, SquaredNorms, register_layer
    from dpcore.bookkeeping.linear import LinearForm

    class ShortOnSmall(LinearForm):
        short = 1e-6  # ten times BELOW_RTOL

        def per_example(self, m, a, g, sq, ctx):
            own = SquaredNorms(sq.batch, sq.device)
            part = super().per_example(m, a, g, own, ctx)
            t = own.total()
            sq += torch.where(t < 1e-6 * t.max(), t * (1 - self.short), t)
            return part

    torch.manual_seed(3)
    model = nn.Sequential(UnderNormedLinear(4, 3, bias=False))
    x = torch.randn(8, 4) * (10.0 ** -torch.arange(8.0)).unsqueeze(1)
    y = torch.randint(0, 3, (8,))
    form = ShortOnSmall()
    register_layer(UnderNormedLinear, form)
    try:
        check = fastpath.CheckedBookKeeping(model, ce, 1.0)
        assert "below the per-example (vmap) reference's" in check.formulas_disagree(x, y)
        assert "of its own example's" in check.formulas_disagree(x, y)
        form.short = 0.0
        assert check.formulas_disagree(x, y) == ""
    finally:
        LAYERS.pop(UnderNormedLinear)


def test_the_check_refuses_a_clipped_sum_with_a_nan(monkeypatch):
    """A book-keeping sum with a NaN element (on finite examples) differs from the reference:
    the comparison is written so that a NaN fails it (a plain `difference > tolerance` is False
    for a NaN, and let such a sum pass)."""
    from dpcore import fastpath

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    check = fastpath.CheckedBookKeeping(model, ce, 1.0)
    assert check.formulas_disagree(x, y, 8) == ""
    real = BookKeepingClipper.contributions

    def one_nan(self, *args, **kwargs):
        (name, value), *rest = real(self, *args, **kwargs)
        value = value.clone()
        value.view(-1)[0] = float("nan")
        return [(name, value), *rest]

    monkeypatch.setattr(BookKeepingClipper, "contributions", one_nan)
    assert "its clipped sum at bound" in check.formulas_disagree(x, y, 8)


class ToFloat32(nn.Module):
    def forward(self, x):
        return x.float()


@pytest.mark.parametrize("mixing", [False, True], ids=["independent", "mixing"])
def test_a_model_that_cannot_run_in_float64_is_checked_in_float32(mixing):
    """No float64 copy (the model casts to float32 inside): the first batch is compared in
    float32, on the whole batch, with the vmap reference."""
    torch.manual_seed(4)
    layers = [nn.Linear(4, 8), ToFloat32(), *([Center()] if mixing else []), nn.Tanh(), nn.Linear(8, 3)]
    model = nn.Sequential(*layers)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    opt = _bk_optimizer(model)
    assert opt._fast.formulas_disagree(x, y) is None
    if mixing:
        with pytest.warns(UserWarning, match="differs from the per-example"):
            opt.accumulate(x, y)
        assert opt.clipping == "vmap"
    else:
        opt.accumulate(x, y)
        assert opt.clipping == "bookkeeping" and opt._fast_verified
    ref, _ = _reference(model, x, y, 0.01)
    for k, v in ref.items():
        assert torch.allclose(opt._sum[k].to(v.dtype), v, atol=1e-7)


def test_the_float64_check_refuses_a_model_that_mixes_examples():
    torch.manual_seed(5)
    opt = _bk_optimizer(nn.Sequential(nn.Linear(4, 8), Center(), nn.Tanh(), nn.Linear(8, 3)))
    assert "per-example (vmap) reference" in opt._fast.formulas_disagree(torch.randn(8, 4), torch.randint(0, 3, (8,)))


@pytest.mark.parametrize("offset", [0.0, 1e3, 1e6, 1e8])
def test_ws_ghost_norms_never_underestimate_even_when_the_terms_cancel(offset):
    """Patches with a large constant offset make the per-example gradient point almost along
    the mean direction, which the standardisation removes: the ghost identity then subtracts
    nearly equal numbers. The ghost norm must stay ≥ the exact norm of the materialised VJP
    (float64), and within 1e-9 of it when nothing cancels."""
    from dpcore.bookkeeping.wsconv import WSJacobian as _WSJacobian
    from dpcore.bookkeeping.wsconv import centred
    from dpcore.layers import WSConv2d

    torch.manual_seed(16)
    conv = WSConv2d(4, 6, 3)
    jac = _WSJacobian(conv)
    B, n, T = 5, 36, 10
    R = torch.round(torch.randn(B, n, T, dtype=torch.float64) * 1024) / 1024  # exact after + offset
    A = R + offset
    assert torch.equal(A - offset, R)
    G = torch.randn(B, 6, T, dtype=torch.float64)
    # The standardisation's VJP discards the constant direction exactly, so the exact norm is
    # that of the offset-free patches (computed without any cancellation).
    exact = jac.vjp(torch.einsum("bot,bnt->bon", G, R)).square().sum((1, 2))
    ghost = jac.ghost_sq_norms(A, G)
    assert (ghost >= exact * (1 - 1e-12)).all(), ghost - exact
    if offset == 0.0:
        assert torch.allclose(ghost, exact, rtol=1e-9, atol=0)
    else:
        assert (ghost <= exact + 1e-6 * (exact + 1.0) * (offset**2)).all()
    # The allowance it reports (what the float64 check expects above the exact norm) covers
    # what it added: the check does not refuse the layer for its own allowance.
    norms, allowance = jac.centred_sq_norms(*centred(A, G))
    assert torch.equal(norms + allowance, ghost)
    assert (ghost - exact <= 2 * allowance).all()


def test_the_ws_ghost_form_adds_its_allowance_where_the_gradient_lies_along_the_weights():
    """Per-example gradients for ŵ almost along ŵ itself: the standardisation's VJP removes that
    direction, and the ghost identity subtracts nearly equal numbers, so its norms without the
    allowance come out below the exact ones (13 of 16 here). The form adds the allowance
    (SquaredNorms.add_allowance), so the norms it clips on are never below the exact norm of the
    vector its clipped sum adds (the VJP with the same ŵ and s, in long double from the same
    float64 numbers)."""
    import numpy as np

    from dpcore.bookkeeping.base import Context, SquaredNorms
    from dpcore.bookkeeping.wsconv import WSConvForm
    from dpcore.bookkeeping.wsconv import WSJacobian as _WSJacobian
    from dpcore.layers import WSConv2d

    torch.manual_seed(16)
    conv = WSConv2d(4, 6, 3, bias=False).double()
    jac = _WSJacobian(conv)
    B, n, o = 16, 36, 2
    A = 1e3 * jac.w_hat[o].view(1, n, 1).expand(B, n, 1) + 1e-3 * torch.randn(B, n, 1, dtype=torch.float64)
    G = torch.zeros(B, 6, 1, dtype=torch.float64)
    G[:, o] = 1.0
    sq = SquaredNorms(B, A.device)
    WSConvForm().ghost(conv, A, G, sq, Context(clip_norm=1.0, max_elements=0))
    L = np.longdouble
    w_hat, s = jac.w_hat.numpy().astype(L), jac.s.numpy().astype(L)
    exact = []
    for a, g in zip(A.numpy().astype(L), G.numpy().astype(L)):
        v = g @ a.T  # [out, n]
        vjp = (v - v.mean(1, keepdims=True) - w_hat * ((v * w_hat).sum(1, keepdims=True) / n)) / s
        exact.append(float((vjp**2).sum()))
    exact = torch.tensor(exact, dtype=torch.float64)
    assert int((torch.stack(sq.terms).sum(0) < exact).sum()) >= 4  # without the allowance: below
    assert (sq.measured()[0] >= exact).all()
    assert (sq.total() >= exact).all()


def test_auto_clipping_picks_book_keeping_only_where_it_applies():
    """clipping="auto" (the jobs' default): book-keeping for supported models with plain
    per-example L2 clipping; vmap, without an error, for BAM, augmentation multiplicity, L1
    clipping, diagnostics and unsupported layers."""

    def opt(model, **kw):
        return dpcore.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model=model,
            loss_fn=F.cross_entropy,
            noise_multiplier=1.0,
            clip_norm=1.0,
            sample_rate=0.1,
            dataset_size=100,
            randomness=dpcore.SecureRandomness(),
            ledger=dpcore.PrivacyLedger(None, 1e-5),
            clipping="auto",
            **kw,
        )

    mlp = lambda: nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))  # noqa: E731
    assert opt(mlp()).clipping == "bookkeeping"
    assert opt(build_model("cnn", (1, 28, 28), 10)).clipping == "bookkeeping"
    assert opt(mlp(), method="dpsat", ascent=0.1).clipping == "bookkeeping"
    assert opt(mlp(), method="bam", ascent=0.1).clipping == "vmap"
    assert opt(mlp(), noise="laplace", clip_norm_type="l1").clipping == "vmap"
    assert opt(mlp(), augmentation_multiplicity=2, augment=lambda x: torch.stack([x, x], 1)).clipping == "vmap"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto never warns about its choice
        assert opt(mlp(), diagnostics=True).clipping == "vmap"
        assert opt(nn.Sequential(nn.Linear(6, 8), nn.PReLU(8), nn.Linear(8, 3))).clipping == "vmap"
        assert opt(nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))).clipping == "bookkeeping"
    from pipelines.config import TrainConfig

    assert TrainConfig().clipping == "auto"


class Scale(nn.Module):
    """y = x ⊙ w over the last dimension: a layer type with no form of its own (the registry's tests
    register one and remove it)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.bias = None

    def forward(self, x):
        return x * self.weight


def test_a_layer_type_registered_at_run_time_is_clipped_like_vmap():
    """The extension point: a new layer type is a LayerForm and one register_layer call."""
    from dpcore.bookkeeping import LAYERS, LayerForm, register_layer
    from dpcore.bookkeeping.base import NormPart

    class ScaleForm(LayerForm):
        def per_example(self, m, a, g, sq, ctx):
            per_example = (g * a).reshape(a.shape[0], -1, a.shape[-1]).sum(1)  # Σ_positions g ⊙ a
            return NormPart.measured(m, per_example, None, sq)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), Scale(8), nn.Tanh(), nn.Linear(8, 3))
    assert unsupported_parameters(model) == ["1.weight"]
    register_layer(Scale, ScaleForm())
    try:
        assert supports(model)
        x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
        for clip in (0.05, 1e3):
            got: dict = {}
            BookKeepingClipper(model, ce).clipped_sum(x, y, clip, got)
            want, _ = _reference(model, x, y, clip)
            for name, w in want.items():
                torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6)
    finally:
        LAYERS.pop(Scale)
    assert not supports(model)
    with pytest.raises(TypeError, match="LayerForm"):
        register_layer(Scale, object())


def test_a_layer_form_whose_clipped_sum_is_not_float64_is_refused_before_anything_is_added():
    """Sums over examples must be float64 (dpcore.clipping.weighted_sum). A form from outside the
    package that forms its sum in float32 gets Unsupported (the model then runs on vmap), and
    the running sums it would have been added to are left as they were."""
    from dpcore.bookkeeping import LAYERS, LayerForm, Unsupported, register_layer
    from dpcore.bookkeeping.base import Part

    class Float32Part(Part):
        def __init__(self, pe):
            self.pe = pe

        def contributions(self, factors, drop_bad):
            return [("weight", factors.float() @ drop_bad(self.pe))]  # a float32 sum

    class Float32Form(LayerForm):
        def per_example(self, m, a, g, sq, ctx):
            pe = g * a
            sq.add_rows(pe)
            return Float32Part(pe)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), Scale(8), nn.Tanh(), nn.Linear(8, 3))
    register_layer(Scale, Float32Form())
    try:
        x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
        out = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
        with pytest.raises(Unsupported, match="float32 clipped sum for weight; sums over examples must be float64"):
            BookKeepingClipper(model, ce).clipped_sum(x, y, 1.0, out)
        assert all(not v.any() for v in out.values())
    finally:
        LAYERS.pop(Scale)


def test_squared_norms_sum_every_term_and_row_once():
    """The layers' squared-norm terms, scattered terms and rows (float32 and float64) add up to
    each example's squared norm as a direct float64 sum of the same pieces; a term of the
    wrong shape or dtype is refused, not broadcast (Unsupported: the model then runs on vmap)."""
    from dpcore.bookkeeping import SquaredNorms, Unsupported

    g = torch.Generator().manual_seed(0)
    B = 5
    terms = [torch.rand(B, generator=g, dtype=torch.float64) for _ in range(3)]
    rows = [
        torch.randn(B, k, generator=g, dtype=dt)
        for k, dt in ((4, torch.float32), (7, torch.float64), (2, torch.float32))
    ]
    index, source = torch.tensor([0, 3, 3, 4]), torch.rand(4, generator=g, dtype=torch.float64)
    sq = SquaredNorms(B, torch.device("cpu"))
    sq += terms[0]
    sq.add_rows(rows[0])
    sq.index_add_(0, index, source)
    sq += terms[1]
    sq.add_rows(rows[1])
    sq.add_rows(rows[2])
    sq += terms[2]
    expected = sum(terms) + sum(r.double().square().sum(1) for r in rows)
    expected = expected.index_add(0, index, source)
    torch.testing.assert_close(sq.total(), expected, rtol=1e-15, atol=0.0)
    assert torch.equal(SquaredNorms(B, torch.device("cpu")).total(), torch.zeros(B, dtype=torch.float64))
    for bad in (torch.ones(B), torch.ones(B + 1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)):
        with pytest.raises(Unsupported):
            sq += bad
    with pytest.raises(Unsupported):
        sq.add_rows(torch.ones(B + 1, 3))


def test_small_rows_of_several_layers_are_summed_together_as_each_alone():
    """Biases and norm layers' per-example rows, formed into their clipped sums together per
    dtype: each sum equals its own Σ_i f_i·rows_i, float64 in its parameter's shape."""
    from dpcore.bookkeeping.sums import SmallRows, small_rows_sums

    g = torch.Generator().manual_seed(1)
    B = 6
    factors = torch.rand(B, generator=g, dtype=torch.float64)
    pending = [
        SmallRows(torch.randn(B, 4, generator=g), torch.zeros(4)),
        SmallRows(torch.randn(B, 6, generator=g, dtype=torch.float64), torch.zeros(2, 3)),
        SmallRows(torch.randn(B, 1, generator=g), torch.zeros(1)),
        SmallRows(torch.randn(B, 5, generator=g, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)),
    ]
    got = small_rows_sums(factors, pending)
    for r, v in zip(pending, got, strict=True):
        alone = (factors @ r.rows.double()).reshape(r.param.shape)
        assert v.shape == r.param.shape and v.dtype == torch.float64
        # any two summation orders of B products agree within 2·B·u·Σ_i |f_i·rows_i| (Higham's bound)
        bound = (2 * B * torch.finfo(torch.float64).eps * (factors.abs() @ r.rows.double().abs())).reshape(
            r.param.shape
        )
        assert bool(((v.double() - alone.double()).abs() <= bound.double()).all())


def test_the_check_reads_nothing_of_the_first_batch_but_its_shapes():
    """The formula check runs on inputs drawn from a fixed seed in the batch's shapes and dtypes
    (so the path a run takes cannot depend on its private data): the same for two batches of
    different values and sizes, token ids within the model's table, labels 0 or 1, float targets
    in [0, 1); and a first batch of one example is checked like any other."""
    from dpcore.fastpath import CHECK_EXAMPLES, check_inputs

    torch.manual_seed(11)
    model = nn.Sequential(nn.Embedding(7, 4), nn.Flatten(), nn.Linear(12, 3))
    x1, y1 = torch.randint(0, 7, (16, 3)), torch.randint(0, 3, (16,))
    x2, y2 = torch.randint(0, 7, (5, 3)), torch.randint(0, 3, (5,))
    a, b = check_inputs(model, x1, y1), check_inputs(model, x2, y2)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert a[0].shape == (CHECK_EXAMPLES, 3) and a[0].dtype == x1.dtype and 0 <= int(a[0].min()) <= int(a[0].max()) < 7
    assert set(a[1].tolist()) <= {0, 1} and a[1].shape == (CHECK_EXAMPLES,)
    xf, yf = check_inputs(nn.Linear(4, 1), torch.randn(9, 4, dtype=torch.float64), torch.rand(9, 1))
    assert xf.dtype == torch.float64 and yf.dtype == torch.float32 and 0 <= float(yf.min()) <= float(yf.max()) < 1
    opt = _bk_optimizer(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fall-back
        opt.accumulate(x1[:1], y1[:1])
    assert opt._fast_verified and opt.clipping == "bookkeeping"
    ref, _ = _reference(model, x1[:1], y1[:1], 0.01)
    for k, v in ref.items():
        assert torch.allclose(opt._sum[k].to(v.dtype), v, atol=1e-7)


class Sqrt(nn.Module):
    def forward(self, x):
        return torch.sqrt(x)


def test_the_check_runs_on_its_own_inputs_and_a_check_that_compares_nothing_is_not_a_pass(monkeypatch):
    """_verify hands the formula check the inputs of check_inputs, not the batch's; and where
    those inputs give no example a finite gradient (the square root of standard normal features),
    nothing was compared, so the run stays on vmap, with a warning that says why."""
    from dpcore import fastpath

    torch.manual_seed(12)
    model = nn.Sequential(nn.Linear(32, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(16, 32), torch.randint(0, 3, (16,))
    seen = []
    real = fastpath.CheckedBookKeeping.formulas_disagree

    def spy(self, xc, yc, batch_size=None):
        seen.append((xc.clone(), yc.clone(), batch_size))
        return real(self, xc, yc, batch_size)

    monkeypatch.setattr(fastpath.CheckedBookKeeping, "formulas_disagree", spy)
    opt = _bk_optimizer(model)
    opt.accumulate(x, y)
    assert opt._fast_verified
    ((xc, yc, size),) = seen
    want = fastpath.check_inputs(model, x, y)
    assert torch.equal(xc, want[0]) and torch.equal(yc, want[1]) and size == 16
    monkeypatch.undo()
    rooted = nn.Sequential(Sqrt(), nn.Linear(32, 3))
    opt = _bk_optimizer(rooted)
    with pytest.warns(UserWarning, match="gave no example a finite gradient.*using the vmap path"):
        opt.accumulate(x.abs(), y)  # the real batch is fine: the check's inputs are not
    assert opt.clipping == "vmap"


def test_the_check_measures_with_the_training_clippers_element_budget(monkeypatch):
    """The float64 check's clipper takes the training clipper's element budget, so it chooses
    the forms (materialised or ghost) that training will take, not its class default's."""
    from dpcore.bookkeeping import base

    torch.manual_seed(13)
    model = nn.Sequential(nn.Linear(32, 8), nn.Tanh(), nn.Flatten(), nn.Linear(40, 3))
    x, y = torch.randn(16, 5, 32), torch.randint(0, 3, (16,))  # the first Linear runs over 5 positions
    opt = _bk_optimizer(model)
    budget = 7  # below any layer's per-example gradient: every form is the ghost one
    assert budget != opt.lot.fast.clipper.MAX_PER_EXAMPLE_ELEMENTS
    opt.lot.fast.clipper.MAX_PER_EXAMPLE_ELEMENTS = budget
    seen = []
    real = base.Context.materialises

    def spy(self, per_example, batch):
        seen.append(self.max_elements)
        return real(self, per_example, batch)

    monkeypatch.setattr(base.Context, "materialises", spy)
    opt.accumulate(x, y)
    assert opt._fast_verified and seen and set(seen) == {budget}


class Mirror(nn.Module):
    """Each position, then its negation, scaled: a following Linear's terms cancel in pairs, so
    its per-example gradient is zero while its terms' magnitudes β are large."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return torch.cat([x, -x], dim=1) * self.scale


class MeanOverPositions(nn.Module):
    def forward(self, z):
        return z.mean(1)


def test_the_check_expects_the_ghost_forms_allowance_and_measures_sums_by_their_shares(monkeypatch):
    """A wide ghost-form Linear whose positions cancel (as long sequences through wide layers
    do, in part): the allowance the ghost norm adds for its float64 rounding, 2(d + c + 2T + 4)·u·β²,
    is far above FORMULA_RTOL of the norms' scale, and its clipped sums cancel between examples.
    The check expects the allowance and measures the sums against Σ_i f_i·‖g_i‖, so it passes
    (it refused such models, which then ran on vmap); a norm above the exact one by more than
    twice the allowance, or below it by more than FORMULA_RTOL of the scale, still fails it."""

    from dpcore import fastpath
    from dpcore.bookkeeping import base

    torch.manual_seed(0)
    model = nn.Sequential(Mirror(30.0), nn.Linear(2048, 2048, bias=False), MeanOverPositions(), nn.Linear(2048, 2))
    x, y = torch.randn(8, 8, 2048), torch.randint(0, 2, (8,))
    norms = []
    model64 = copy.deepcopy(model).double()
    sq, _ = BookKeepingClipper(model64, F.cross_entropy).measure(x.double(), y, 1.0, 8, norms)
    (allowance,) = norms[0].allowances  # the ghost form of the wide Linear (the head has one position)
    assert float(allowance.min()) > 100 * fastpath.FORMULA_RTOL * float(sq.max())  # the case is exercised
    check = fastpath.CheckedBookKeeping(model, F.cross_entropy, 1.0)
    assert check.formulas_disagree(x, y, 8) == ""

    real = base.weight_sq_norms

    def off_by(k):  # the same form (and the same reported allowance), its norm k allowances off
        def form(A, G, channels_first, ctx):
            s, W, magnitude_sq = real(A, G, channels_first, ctx)
            if magnitude_sq is None:
                return s, W, magnitude_sq
            d, c, T = A.shape[2], G.shape[2], A.shape[1]
            u = torch.finfo(torch.float64).eps / 2
            return s + k * 2 * (d + c + 2 * T + 4) * u * magnitude_sq, W, magnitude_sq

        return form

    monkeypatch.setattr(base, "weight_sq_norms", off_by(3))
    assert "per-example norms are above" in check.formulas_disagree(x, y, 8)
    # The allowance is expected above the exact norm only: a form that reports it but lands
    # below (here by two allowances, inside the width a two-sided test would allow) would let
    # an example's share exceed C, and is refused.
    monkeypatch.setattr(base, "weight_sq_norms", off_by(-2))
    assert "per-example norms are below" in check.formulas_disagree(x, y, 8)


def test_the_check_measures_a_sums_difference_over_all_its_elements(monkeypatch):
    """The clipped sums' difference is one vector over every parameter, measured in ℓ2 as the
    shares are: an error spread thinly over a wide layer (each element under FORMULA_RTOL of
    Σ_i f_i·‖g_i‖, the whole well above it) is refused, though no single element shows it."""
    from dpcore import fastpath

    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 3))
    x, y = torch.randn(8, 256), torch.randint(0, 3, (8,))
    check = fastpath.CheckedBookKeeping(model, ce, 1.0)
    assert check.formulas_disagree(x, y, 8) == ""
    per_example = PerSampleGradients(copy.deepcopy(model).double(), ce)(x.double(), y)
    shares = float(per_sample_norms(per_example).sum())  # Σ_i ‖g_i‖ ≥ Σ_i f_i·‖g_i‖ at any bound
    n = sum(v.numel() for v in per_example.values())
    each = 4 * fastpath.FORMULA_RTOL * shares / n**0.5  # in ℓ2, 4·FORMULA_RTOL of Σ_i ‖g_i‖
    real = BookKeepingClipper.contributions

    def spread(self, *args, **kwargs):
        return [(k, v + each) for k, v in real(self, *args, **kwargs)]

    monkeypatch.setattr(BookKeepingClipper, "contributions", spread)
    assert "clipped sum at bound 1 differs" in check.formulas_disagree(x, y, 8)


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

"""What book-keeping cannot handle is named and left to the per-example (vmap) path: unsupported
layers and subclasses with their own forward, a layer called twice (found at run time, with a
warning and the right sum), hooks or a replaced forward, tied parameters; and clipping="auto"
picks book-keeping only where it applies."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcore
from dpcore.bookkeeping import BookKeepingClipper, Unsupported, supports, unsupported_parameters
from pipelines.models import build_model

from ._common import _reference, ce


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

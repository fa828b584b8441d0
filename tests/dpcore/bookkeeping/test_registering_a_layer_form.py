"""The extension point of dpcore.bookkeeping.registry: a layer type registered at run time with
its own LayerForm is clipped like vmap (and unsupported again once removed), and a form whose
clipped sum is not float64 is refused before anything is added to the running sums."""

import pytest
import torch
from torch import nn

from dpcore.bookkeeping import BookKeepingClipper, supports, unsupported_parameters

from ._common import _reference, ce


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

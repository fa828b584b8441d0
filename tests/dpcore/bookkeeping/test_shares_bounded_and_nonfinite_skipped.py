"""Each example's share of the book-keeping clipped sum has norm at most C, even for huge
gradients; gradients whose float32 squares overflow are measured again in float64 and clipped,
not skipped; and examples with non-finite values (also in the ghost form of weight-standardised
convolutions) are skipped and counted exactly as the per-example (vmap) reference does."""

import math

import pytest
import torch

from dpcore.bookkeeping import BookKeepingClipper
from pipelines.models import build_model

from ._common import SeqModel, _reference, ce, ws_gn_net


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

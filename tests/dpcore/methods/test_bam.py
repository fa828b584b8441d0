"""BAM (``dpcore/methods/bam.py``): the SAM form's per-example gradients at their own ascent
points equal an explicit per-example loop, also once clipped and summed in the optimizer; the exact
form matches a finite-difference Hessian-vector product, and the SAM form agrees with it to first
order in λ; and λ = 0 is DP-SGD bit for bit, with the same ledger, for both variants."""

from __future__ import annotations

import warnings

import pytest
import torch

import dpcore
from dpcore.clipping import CLIP_MARGIN

from ...helpers import ce
from ._common import _train, example_grad, flat_norm, make_opt, mlp64

warnings.simplefilter("ignore", dpcore.SeededRandomnessWarning)


def test_bam_sam_equals_an_explicit_per_example_loop():
    model = mlp64()
    x, y = torch.randn(9, 6, dtype=torch.float64) * 3, torch.randint(0, 3, (9,))
    lam = 0.3
    got, at_theta = dpcore.PerSampleGradients(model, ce).bam(x, y, lam, "sam")
    names = [n for n, _ in model.named_parameters()]
    theta = [p.detach() for p in model.parameters()]
    for i in range(9):
        g = example_grad(model, x[i], y[i])
        norm = flat_norm(g)
        shifted = [t + lam * gi / norm for t, gi in zip(theta, g)]
        ref = example_grad(model, x[i], y[i], shifted)
        for name, r, gi in zip(names, ref, g):
            torch.testing.assert_close(got[name][i], r, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(at_theta[name][i], gi, rtol=1e-10, atol=1e-12)


def test_bam_sam_clipped_sum_in_the_optimizer_equals_the_loop():
    model = mlp64()
    x, y = torch.randn(11, 6, dtype=torch.float64) * 3, torch.randint(0, 3, (11,))
    lam, clip = 0.2, 0.5
    opt = make_opt(model, method="bam", ascent=lam, clip=clip, physical_batch_size=4)
    opt.accumulate(x, y)
    theta = [p.detach().clone() for p in model.parameters()]
    ref = [torch.zeros_like(t) for t in theta]
    for i in range(11):
        g = example_grad(model, x[i], y[i])
        gb = example_grad(model, x[i], y[i], [t + lam * gi / flat_norm(g) for t, gi in zip(theta, g)])
        f = min(1.0, clip * (1 - CLIP_MARGIN) / flat_norm(gb))  # with the clipping margin
        for r, gi in zip(ref, gb):
            r += f * gi
    for (name, _), r in zip(model.named_parameters(), ref):
        torch.testing.assert_close(opt._sum[name].to(r.dtype), r, rtol=1e-5, atol=1e-10)


def test_bam_exact_matches_a_finite_difference_hessian_vector_product():
    model = mlp64(seed=3)
    x, y = torch.randn(5, 6, dtype=torch.float64) * 2, torch.randint(0, 3, (5,))
    lam, h = 0.25, 1e-5
    got, _ = dpcore.PerSampleGradients(model, ce).bam(x, y, lam, "exact")
    theta = [p.detach() for p in model.parameters()]
    names = [n for n, _ in model.named_parameters()]
    for i in range(5):
        g = example_grad(model, x[i], y[i])
        v = [gi / flat_norm(g) for gi in g]
        plus = example_grad(model, x[i], y[i], [t + h * vi for t, vi in zip(theta, v)])
        minus = example_grad(model, x[i], y[i], [t - h * vi for t, vi in zip(theta, v)])
        for name, gi, a, b in zip(names, g, plus, minus):
            hvp = (a - b) / (2 * h)
            torch.testing.assert_close(got[name][i], gi + lam * hvp, rtol=1e-6, atol=1e-8)


def test_bam_sam_is_the_exact_form_to_first_order_in_lambda():
    model = mlp64(seed=5)
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
    gs = dpcore.PerSampleGradients(model, ce)
    errs = []
    for lam in (1e-2, 1e-3):
        sam, _ = gs.bam(x, y, lam, "sam")
        exact, _ = gs.bam(x, y, lam, "exact")
        errs.append(max(float((sam[k] - exact[k]).abs().max()) for k in sam))
    assert errs[1] < errs[0] / 50  # the gap is O(λ²): 10× smaller λ, ~100× smaller gap


@pytest.mark.parametrize("variant", ["sam", "exact"])
def test_bam_with_lambda_zero_is_dpsgd_bit_for_bit(variant):
    ref, ref_private = _train({})
    bam, bam_private = _train({"method": "bam", "ascent": 0.0, "bam_variant": variant})
    for a, b in zip(ref.parameters(), bam.parameters()):
        assert torch.equal(a, b)
    assert [(e.kind, e.sample_rate, e.noise_multiplier, e.step) for e in ref_private.ledger.entries] == [
        (e.kind, e.sample_rate, e.noise_multiplier, e.step) for e in bam_private.ledger.entries
    ]
    other, _ = _train({"method": "bam", "ascent": 0.05, "bam_variant": variant})
    assert any(not torch.equal(a, b) for a, b in zip(ref.parameters(), other.parameters()))

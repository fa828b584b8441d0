"""Extras of the private step outside the methods: the parameter EMA follows De et al.'s average
with its warm-up (and refuses a decay of 1), and the non-private diagnostics (bias, magnitude and
direction errors, the per-example ascent cosine) match an explicit computation and are off by
default."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import dpcore
from dpcore.clipping import CLIP_MARGIN

from .methods._common import example_grad, make_opt, mlp64

warnings.simplefilter("ignore", dpcore.SeededRandomnessWarning)


def test_parameter_ema_follows_de_et_al_with_warmup():
    model = mlp64()
    ema = dpcore.ParameterEMA(model, decay=0.9)
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = make_opt(model)
    for t in range(15):
        x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
        opt.accumulate(x, y)
        opt.step()
        ema.update()
        d = min(0.9, (1 + t) / (10 + t))
        for n, p in model.named_parameters():
            ref[n] = d * ref[n] + (1 - d) * p.detach()
    avg = ema.averaged_state_dict()
    for n in ref:
        torch.testing.assert_close(avg[n], ref[n], rtol=1e-12, atol=1e-14)
    with pytest.raises(dpcore.DPConfigError):
        dpcore.ParameterEMA(model, decay=1.0)


def test_diagnostics_match_an_explicit_computation_and_are_off_by_default():
    model = mlp64()
    x, y = torch.randn(10, 6, dtype=torch.float64) * 4, torch.randint(0, 3, (10,))
    clip = 0.3
    opt = make_opt(model, clip=clip, diagnostics=True, physical_batch_size=4, sigma=0.7)
    theta = [p.detach().clone() for p in model.parameters()]
    opt.accumulate(x, y)
    replay = dpcore.SeededRandomness(0)
    opt.step()
    rec = opt.diagnostics_history[-1]
    grads = [torch.cat([g.reshape(-1) for g in example_grad(model_at(model, theta), x[i], y[i])]) for i in range(10)]
    g = torch.stack(grads)
    g_hat = g.mean(0)
    m = torch.clamp(g.norm(dim=1) / (clip * (1 - CLIP_MARGIN)), min=1.0)  # with the clipping margin
    clipped = (g / m[:, None]).mean(0)
    a = float(((g @ g_hat) / g_hat.norm() ** 2 / m).mean())  # BAM Appendix C: (1/l) Σ η_i / M_i
    noise = torch.cat([replay.normal(p.shape, 0.7 * clip, dtype=torch.float64).reshape(-1) for p in theta])
    released = clipped + noise / 10
    assert rec["bias"] == pytest.approx(float((clipped - g_hat).norm()), rel=1e-5)
    assert rec["magnitude_error_a"] == pytest.approx(a, rel=1e-5)
    assert rec["direction_error_c"] == pytest.approx(float((released - a * g_hat).norm()), rel=1e-5)
    cos = float(((g / g.norm(dim=1, keepdim=True)) @ g_hat).mean() / g_hat.norm())
    assert rec["cos_per_example_ascent"] == pytest.approx(cos, rel=1e-6)
    plain = make_opt(mlp64())
    plain.accumulate(x, y)
    plain.step()
    assert plain.diagnostics_history == []


def model_at(model, theta):
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p, t in zip(m.parameters(), theta):
            p.copy_(t)
    return m

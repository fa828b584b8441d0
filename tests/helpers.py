"""Small shared helpers for tests: tiny models and an explicit per-example reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def tiny_mlp(d_in=6, hidden=5, classes=3):
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, classes))


def tiny_cnn(channels=1, classes=3):
    return nn.Sequential(
        nn.Conv2d(channels, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, classes),
    )


def loop_clipped_sum(model, loss_fn, x, y, clip_norm):
    """Reference: one ordinary backward per example, clip with min(1, C·(1 − m)/‖g‖) (m, the
    clipping margin of dpcore.clipping.CLIP_MARGIN), sum (float64)."""
    from dpcore.clipping import CLIP_MARGIN

    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for i in range(x.shape[0]):
        model.zero_grad()
        loss = loss_fn(model(x[i : i + 1]), y[i : i + 1])
        grads = torch.autograd.grad(loss, params)
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
        factor = min(1.0, clip_norm * (1 - CLIP_MARGIN) / norm.item()) if norm > 0 else 1.0
        for t, g in zip(total, grads):
            t += g.double() * factor
    return total


ce = F.cross_entropy


def small_plan(**fields):
    """A pipelines.plan.RunPlan with placeholder values, for unit tests of worker-side pieces."""
    from pipelines.plan import RunPlan

    defaults = dict(
        config={}, run_name="t", ray_run_name="t-0", storage_path="", run_dir="", journal="", data_dir="",
        input_shape=[1], train_data_dir="", features=None, num_classes=2, split_info={}, dataset_size=100,
        noise_multiplier=1.0, sample_rate=0.1, event_kind="poisson_gaussian", max_releases=None, pca_path=None,
        audit_path=None, steps=1, checkpoint_every=1, epsilon_every=1, tracking_uri="", parameters=1,
    )  # fmt: skip
    return RunPlan(**{**defaults, **fields})


def assert_input_example_is_no_private_row(model_uri: str, rows: torch.Tensor, tmp_path) -> None:
    """The logged model leaves with the run, outside the guarantee: its input example has the
    inputs' shape and is no row of ``rows`` (the model inputs of every split). It once held the
    test split's first 4 inputs."""
    import json
    from pathlib import Path

    import mlflow
    import numpy as np

    local = Path(mlflow.artifacts.download_artifacts(model_uri, dst_path=str(tmp_path / "input-example-model")))
    saved = json.loads((local / "input_example.json").read_text())
    example = torch.tensor(np.asarray(saved["inputs"] if isinstance(saved, dict) else saved), dtype=torch.float64)
    assert example.shape[1:] == rows.shape[1:] and len(example) > 0, (example.shape, rows.shape)
    nearest = torch.cdist(example.flatten(1), rows.flatten(1).double()).min(dim=1).values
    assert (nearest > 1e-3).all(), nearest


def rdp_epsilon(mechanisms, delta: float = 1e-5) -> float:
    """ε at ``delta`` of composing Poisson-subsampled Gaussian mechanisms given as (q, σ,
    releases), by dp_accounting's RDP accountant alone (an independent reference)."""
    import dp_accounting

    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(
        dp_accounting.ComposedDpEvent(
            [
                dp_accounting.SelfComposedDpEvent(
                    dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), releases
                )
                for q, sigma, releases in mechanisms
            ]
        )
    )
    return acc.get_epsilon(delta)


# An unseeded draw (SecureRandomness) cannot be replayed, so a goodness-of-fit test on it must
# hold its false-alarm rate low without losing power: α = 1e-6 (a sound generator fails one run
# in a million), on enough samples that the test still rejects a KS distance of
# sqrt(ln(2/α)/2)/sqrt(n) ≈ 0.0043 at n = 400,000, half the distance the former α = 1e-3 test on
# 40,000 samples could see. (CI saw p = 3.9e-6 once, 2026-11-26, on 40,000 secure Laplace draws;
# 4,000 repeats of that test and KS tests on 4M draws of each distribution, p > 0.5, found the
# generator sound.)
UNSEEDED_ALPHA = 1e-6
UNSEEDED_SAMPLES = 400_000


def assert_unseeded_draw_fits(sample, dist) -> None:
    """KS test of an unseeded draw of at least UNSEEDED_SAMPLES values against ``dist`` (a name
    scipy knows or a CDF) at UNSEEDED_ALPHA."""
    from scipy import stats

    sample = sample.double().flatten().cpu().numpy() if isinstance(sample, torch.Tensor) else sample
    assert sample.size >= UNSEEDED_SAMPLES, f"{sample.size} draws are too few for α = {UNSEEDED_ALPHA}"
    p = stats.kstest(sample, dist).pvalue
    assert p > UNSEEDED_ALPHA, f"KS p = {p:.3g} on {sample.size} unseeded draws"

"""The private step on a CUDA GPU: book-keeping equals the vmap reference there, a whole step keeps
everything on the device with noise of the right scale, and bf16 autocast keeps clipping and
noise in float32. These run where a GPU is (skipped elsewhere: CI has none); the same checks
on the CPU are in tests/dpcore/bookkeeping/ (test_clipped_sum_equals_vmap.py,
test_text_layers_equal_vmap.py) and test_autocast.py. ``DP_TEST_CUDA_ON_CPU=1`` runs them on the CPU instead, to try them out."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F

import dpcore
from dpcore.bookkeeping import BookKeepingClipper
from dpcore.clipping import clipped_sum
from dpcore.grad_sample import PerSampleGradients
from pipelines.models import build_model, resnet9

from .bookkeeping._common import CASES, TinyText
from .test_autocast import TinyText as SpyText

ON_CPU = os.environ.get("DP_TEST_CUDA_ON_CPU") == "1"
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or ON_CPU), reason="no CUDA GPU")
DEVICE = "cpu" if ON_CPU else "cuda"


def _reference(model, x, y, clip):
    return clipped_sum(PerSampleGradients(model, F.cross_entropy)(x, y), clip)


TEXT = ("text", lambda: TinyText(), None, 3)


def _secure_optimizer(model, lr, sigma, clip, q, n, budget=None, **kw) -> dpcore.DPOptimizer:
    """SGD under DPOptimizer with secure noise (drawn for the model's device) and book-keeping."""
    return dpcore.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr),
        model=model,
        loss_fn=F.cross_entropy,
        noise_multiplier=sigma,
        clip_norm=clip,
        sample_rate=q,
        dataset_size=n,
        randomness=dpcore.SecureRandomness(),
        ledger=dpcore.PrivacyLedger(budget, 1e-5),
        clipping="auto",
        **kw,
    )


@pytest.mark.parametrize("ghost", [False, True], ids=["materialised", "ghost"])
@pytest.mark.parametrize("name, make, shape, classes", CASES + [TEXT], ids=[c[0] for c in CASES + [TEXT]])
def test_bookkeeping_equals_vmap_in_float64_on_the_gpu(name, make, shape, classes, ghost):
    """In float64 the two paths differ by rounding alone (float32 would be TF32 in cuDNN's
    convolutions by default, a precision question and not a correctness one)."""
    torch.manual_seed(0)
    model = make().double().to(DEVICE)
    if shape is None:  # token ids
        x = torch.randint(0, 8, (24, 10), device=DEVICE)
    else:
        x = torch.randn(24, *shape, dtype=torch.float64, device=DEVICE)
    model(x[:1])  # materialise lazy layers
    y = torch.randint(0, classes, (24,), device=DEVICE)
    bk = BookKeepingClipper(model, F.cross_entropy)
    if ghost:
        bk.MAX_PER_EXAMPLE_ELEMENTS = 0  # force the ghost-norm forms
    got: dict = {}
    for clip in (0.01, 1e4):
        got.clear()
        bad = bk.clipped_sum(x, y, clip, got)
        want, want_bad = _reference(model, x, y, clip)
        assert bad == want_bad == 0 and set(got) == set(want)
        for k, w in want.items():
            assert got[k].device.type == DEVICE
            torch.testing.assert_close(got[k], w, rtol=1e-10, atol=1e-12 * max(clip, 1.0), msg=f"{name} {k}")


def test_a_private_step_on_the_gpu_stays_there_with_noise_of_std_sigma_c_over_qn():
    """MNIST CNN, book-keeping after its first-batch check, secure noise drawn for the device.
    At σ = 100 the update is nearly the noise alone: −lr·(s + z)/(qN), z ~ N(0, (σC)²) per weight,
    with the clipped sum s of 64 examples (norm ≤ 64·C) spread over 26k weights."""
    torch.manual_seed(0)
    model = build_model("cnn", (1, 28, 28), 10).to(DEVICE)
    before = [p.detach().clone() for p in model.parameters()]
    sigma, clip, q, n, lr = 100.0, 0.5, 0.01, 25_600, 1.0
    opt = _secure_optimizer(model, lr, sigma, clip, q, n)
    x = torch.randn(64, 1, 28, 28, device=DEVICE)
    y = torch.randint(0, 10, (64,), device=DEVICE)
    opt.accumulate(x, y)
    opt.step()
    assert opt.clipping == "bookkeeping"
    assert all(p.device.type == DEVICE and p.grad.device.type == DEVICE for p in model.parameters())
    update = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters())]).double().cpu()
    want = lr * sigma * clip / (q * n)
    assert update.numel() > 20_000
    assert abs(update.std().item() / want - 1) < 0.03  # 26k draws: the std's relative error is about 0.4 %
    assert abs(update.mean().item()) < 4 * want / update.numel() ** 0.5
    assert len(opt.ledger.entries) == 1 and opt.ledger.entries[0].step == 1


def test_bf16_autocast_on_the_gpu_keeps_clipping_and_noise_in_float32(monkeypatch):
    import dpcore.optimizer as optimizer_module

    seen_noise = []
    real_noise = optimizer_module.draw_noise

    def spy_noise(randomness, like, std, laplace):
        noise = real_noise(randomness, like, std, laplace)
        seen_noise.append(({t.dtype for t in like}, {t.dtype for t in noise}, {t.device.type for t in noise}))
        return noise

    monkeypatch.setattr(optimizer_module, "draw_noise", spy_noise)
    torch.manual_seed(0)
    model = SpyText().to(DEVICE)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 50, (24, 12), generator=g).to(DEVICE)
    y = torch.randint(0, 2, (24,), generator=g).to(DEVICE)
    opt = _secure_optimizer(model, 0.1, 1.0, 0.5, 0.1, 240, budget=10.0, autocast="bf16")
    model.seen.clear()
    opt.accumulate(x, y)
    assert opt.clipping == "bookkeeping"
    assert torch.bfloat16 in model.seen  # the training forward ran under bf16 autocast
    assert all(s.dtype == torch.float64 and s.device.type == DEVICE for s in opt.lot.sums.values())  # dpcore/lot.py
    opt.step()
    # the noise is drawn like the lot's sums, in float64 (since 2026-11-29; README, floating-point side channels)
    assert seen_noise == [({torch.float64}, {torch.float64}, {DEVICE})]
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.skipif(ON_CPU, reason="CUDA's own synchronisation debug mode")
def test_book_keeping_waits_for_the_gpu_a_fixed_number_of_times_per_batch():
    """torch.cuda's sync debug mode warns at every operation that makes the host wait for the
    device (reads of values, and those inside torch: torch.unique, boolean masks). A batch's
    clipped sum has at most 2, whatever the number of layers (ResNet-9 and a text model with
    an Embedding). Before 2026-11-27 an H200 profile showed about 55 per batch for
    all-MiniLM-L6-v2 (one per materialised layer, four per Embedding). Passed on an H200 with
    a limit of 2 after the labels' sign check went (2026-11-27, night); since then the float32
    norms' overflow check shares the read of the non-finite count, so the limit is now 1, which
    no GPU has run yet.
    tests/dpcore/test_host_reads.py counts the reads on a CPU (exactly 1)."""
    g = torch.Generator().manual_seed(0)
    cases = [
        (lambda: resnet9((3, 8, 8), 10, width=16), torch.randn(16, 3, 8, 8, generator=g), 10),
        (lambda: TinyText(), torch.randint(0, 8, (16, 10), generator=g), 3),
    ]
    for make, x, classes in cases:
        torch.manual_seed(0)
        model = make().to(DEVICE)
        x, y = x.to(DEVICE), torch.randint(0, classes, (16,), generator=g).to(DEVICE)
        bk = BookKeepingClipper(model, F.cross_entropy)
        bk.clipped_sum(x, y, 1.0, {})  # warm-up
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                bk.clipped_sum(x, y, 1.0, {})
                ours = [str(w.message).splitlines()[0] for w in seen if "synchroniz" in str(w.message)]
                float(x.float().sum())  # a known wait: the mode must report it
        finally:
            torch.cuda.set_sync_debug_mode(0)
        waits = [w for w in seen if "synchroniz" in str(w.message)]
        assert len(waits) > len(ours), "the debug mode reported no wait"
        assert len(ours) <= 1, ours


def test_a_gradient_that_overflows_float32_squares_is_clipped_on_the_gpu():
    """Per-example gradients of about 1e20 (finite in float32, their squares not) on the device:
    the batch is measured again in float64 after the one read of the device, and every example
    is clipped as by the reference (its sums formed in float64); none is counted as
    non-finite. The CPU's own test is in
    bookkeeping/test_shares_bounded_and_nonfinite_skipped.py."""
    from .bookkeeping._common import SeqModel

    torch.manual_seed(2)
    model = SeqModel(d=32, hidden=32).to(DEVICE)
    with torch.no_grad():
        model.a.weight.mul_(1e-20)
    x, y = (torch.randn(8, 5, 32) * 1e20).to(DEVICE), torch.randint(0, 4, (8,)).to(DEVICE)
    got: dict = {}
    assert BookKeepingClipper(model, F.cross_entropy).clipped_sum(x, y, 1.0, got) == 0
    want, bad = _reference(model, x, y, 1.0)
    assert bad == 0
    for k, w in want.items():
        assert got[k].device.type == DEVICE.split(":")[0] and got[k].dtype == torch.float64
        torch.testing.assert_close(got[k], w, rtol=1e-5, atol=1e-6)

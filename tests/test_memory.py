"""dpcore.memory: the physical batch size picked from a memory budget fits it when measured,
takes the largest power of two that does, and probing releases nothing."""
import pytest
import torch
import torch.nn.functional as F

import dpcore
from dpcore import memory
from pipelines.models import build_model

pytestmark = pytest.mark.skipif(not memory.cpu_peak_supported(), reason="needs /proc/self/clear_refs (Linux)")


def _opt(clipping="vmap", physical=256):
    torch.manual_seed(0)
    model = build_model("cnn", (1, 28, 28), 10)
    return dpcore.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model=model, loss_fn=F.cross_entropy, noise_multiplier=1.0,
        clip_norm=1.0, sample_rate=0.01, dataset_size=10_000, randomness=dpcore.SeededRandomness(0),
        ledger=dpcore.PrivacyLedger(None, 1e-5), physical_batch_size=physical, clipping=clipping,
    )


def test_the_picked_batch_fits_the_budget_and_is_the_largest_power_of_two_that_does():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(256, 1, 28, 28, generator=g), torch.randint(0, 10, (256,), generator=g)
    opt = _opt()
    roomy = opt.fit_physical_batch_size(x, y, 64 * 2**30)
    assert roomy["measured"] and opt.physical_batch_size == 256  # never above the configured size
    per_example, fixed = roomy["per_example_bytes"], roomy["fixed_bytes"]
    assert per_example > 26_010 * 4  # at least one float32 per-example gradient per example
    budget = int(fixed + per_example * memory.SAFETY * 40)  # 40 examples' worth: 32 is the answer
    opt = _opt()
    report = opt.fit_physical_batch_size(x, y, budget)
    assert opt.physical_batch_size == report["physical_batch_size"] == 32, report
    # Measured at the picked size, the clipped-sum computation stays inside the budget.
    peak = memory.peak_bytes(lambda: dpcore.clipping.clipped_sum(opt.grad_sampler(x[:32], y[:32]), 1.0), torch.device("cpu"))
    assert peak <= budget, (peak, budget)
    with pytest.raises(dpcore.DPConfigError, match="does not fit one example"):
        _opt().fit_physical_batch_size(x, y, int(fixed // 4) + 1)


def test_probing_releases_nothing_and_training_then_uses_the_picked_size():
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g)
    opt = _opt(clipping="bookkeeping")
    before = [p.detach().clone() for p in opt.params.values()]
    report = opt.fit_physical_batch_size(x, y, 2**40)
    assert report["physical_batch_size"] == 256
    assert opt.steps_taken == 0 and len(opt.ledger.entries) == 0 and not opt._lot_open
    assert all(float(s.abs().sum()) == 0 for s in opt._sum.values())
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, opt.params.values()))
    with pytest.raises(ValueError, match="at least 16 examples"):
        opt.fit_physical_batch_size(x[:8], y[:8], 2**30)


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan"), "lots", True])
def test_the_budget_option_is_checked(bad):
    from pipelines.config import TrainConfig

    with pytest.raises(dpcore.DPConfigError, match="memory_budget_mb"):
        TrainConfig(memory_budget_mb=bad).validate()
    TrainConfig(memory_budget_mb=0).validate()
    TrainConfig(memory_budget_mb=512).validate()

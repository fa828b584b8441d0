"""DP-SAT (``dpcore/methods/dpsat.py``): the lot is evaluated at weights shifted once along the
previous noised release and the shift is removed exactly (a restored copy, not a subtraction, which
would drift), so the update does not depend on the physical batch size; the previous release
survives a checkpoint, and a budget refusal or an error inside a shifted lot gives θ back."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import dpcore

from ...helpers import ce
from ._common import flat_norm, make_opt, mlp64

warnings.simplefilter("ignore", dpcore.SeededRandomnessWarning)


# DP-SAT
class RecordingSampler:
    """Wraps PerSampleGradients and records the weights that each physical batch is evaluated at."""

    def __init__(self, inner, model):
        self.inner, self.model, self.seen = inner, model, []

    def __call__(self, x, y, params=None):
        self.seen.append([p.detach().clone() for p in self.model.parameters()])
        return self.inner(x, y, params)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("physical", [1, 3, 64])
def test_dpsat_shift_is_applied_once_per_lot_and_removed_exactly(physical):
    model = mlp64()
    rho = 0.3
    opt = make_opt(model, method="dpsat", ascent=rho, physical_batch_size=physical, lr=0.0, sigma=0.5)
    rec = RecordingSampler(opt.grad_sampler, model)
    opt.grad_sampler = rec
    theta0 = [p.detach().clone() for p in model.parameters()]
    torch.manual_seed(1)
    for _step in range(5):
        x, y = torch.randn(7, 6, dtype=torch.float64), torch.randint(0, 3, (7,))
        rec.seen.clear()
        prev = (
            None if opt._prev_private is None else [opt._prev_private[n].clone() for n, _ in model.named_parameters()]
        )
        opt.accumulate(x[:4], y[:4])
        opt.accumulate(x[4:], y[4:])  # two accumulate calls in the same lot
        opt.step()
        assert len(rec.seen) == (2 if physical >= 4 else -(-4 // physical) + -(-3 // physical))
        expected = theta0 if prev is None else [t + rho * g / flat_norm(prev) for t, g in zip(theta0, prev)]
        for seen in rec.seen:  # every physical batch of the lot sees the same, once-shifted weights
            for a, b in zip(seen, expected):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-15)
        # lr = 0: after the step the weights are θ exactly, however many batches the lot had.
        assert all(torch.equal(p, t) for p, t in zip(model.parameters(), theta0))
    assert opt.shifts_applied == 4  # no previous gradient before the first step


def test_dpsat_shifting_per_physical_batch_would_drift():
    """What the public DP-SAT code does (shift and unshift around each physical batch) does
    not give θ back bit for bit; the optimizer's restore-from-copy does (test above)."""
    torch.manual_seed(0)
    theta = torch.randn(10_000, dtype=torch.float32)
    e = 0.3 * torch.randn(10_000) / 100
    p = theta.clone()
    for _ in range(50):
        p.add_(e)
        p.sub_(e)
    assert not torch.equal(p, theta)


def test_dpsat_update_is_independent_of_the_physical_batch_size():
    results = []
    for physical in (2, 50):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
        opt = make_opt(model, method="dpsat", ascent=0.2, physical_batch_size=physical, seed=5)
        torch.manual_seed(9)
        for _ in range(4):
            x, y = torch.randn(20, 6, dtype=torch.float64), torch.randint(0, 3, (20,))
            opt.accumulate(x, y)
            opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_dpsat_state_survives_a_checkpoint():
    model = mlp64()
    opt = make_opt(model, method="dpsat", ascent=0.2)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
    opt.accumulate(x, y)
    opt.step()
    state = opt.state_dict()
    other = make_opt(copy.deepcopy(model), method="dpsat", ascent=0.2)
    other.load_state_dict(state)
    for n, g in opt._prev_private.items():
        assert torch.equal(other._prev_private[n], g)


def test_budget_refusal_while_shifted_restores_the_weights():
    model = mlp64()
    ledger = dpcore.PrivacyLedger(6.0, 1e-5)
    opt = make_opt(model, method="dpsat", ascent=0.5, ledger=ledger, sigma=0.8, q=0.5)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
    with pytest.raises(dpcore.BudgetExceededError):
        for _ in range(100):
            before = [p.detach().clone() for p in model.parameters()]
            opt.accumulate(x, y)
            assert opt.shifts_applied == 0 or not torch.equal(next(model.parameters()), before[0])  # shifted now
            opt.step()
    assert opt.shifts_applied >= 1  # the refused lot was evaluated at a shifted point ...
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # ... and θ is back


def test_an_error_inside_a_shifted_lot_restores_the_weights_and_a_restore_keeps_the_checkpoint():
    model = mlp64()
    opt = make_opt(model, method="dpsat", ascent=0.5)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
    opt.accumulate(x, y)
    opt.step()
    checkpoint = ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict())
    theta = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError):
        opt.accumulate(x, torch.full((8,), 7))  # class 7 of 3: cross_entropy raises mid-lot
    assert opt.shifts_applied == 1 and all(torch.equal(p, t) for p, t in zip(model.parameters(), theta))
    # A restart in the same process: model first, then the optimizer, must give the checkpoint.
    opt.accumulate(x, y)  # a lot in flight (shifted) when the worker restores
    model.load_state_dict(checkpoint[0])
    opt.load_state_dict(checkpoint[1])
    assert all(torch.equal(model.state_dict()[k], v) for k, v in checkpoint[0].items())


def test_dpsat_ascends_along_the_noised_released_gradient():
    """The shift direction is the previous *released* gradient (clipped sum + noise)/(qN),
    replayed here from the seeded noise stream, not the clean clipped sum."""
    from dpcore.clipping import clipped_sum

    model = mlp64()
    q, n, sigma, clip = 0.25, 64, 1.0, 1.0
    opt = make_opt(model, method="dpsat", ascent=0.3, q=q, n=n, sigma=sigma, clip=clip, seed=8)
    replay = dpcore.SeededRandomness(8)
    x, y = torch.randn(10, 6, dtype=torch.float64), torch.randint(0, 3, (10,))
    ref, _ = clipped_sum(dpcore.PerSampleGradients(model, ce)(x, y), clip)
    opt.accumulate(x, y)
    opt.step()
    for name, p in model.named_parameters():
        released = (ref[name] + replay.normal(p.shape, sigma * clip, dtype=torch.float64)) / (q * n)
        torch.testing.assert_close(opt._prev_private[name], released, rtol=1e-12, atol=1e-14)
        assert not torch.allclose(opt._prev_private[name], ref[name] / (q * n), rtol=1e-3, atol=0)

"""What a method may change (``dpcore/methods/base.py`` and the ``METHODS`` registry): every
method (BAM, exact BAM, DP-SAT, augmentation, diagnostics, DP-NAdam) writes DP-SGD's ledger events
and spends its ε; and a method added to the registry changes only which vectors are clipped, so
even one that inflates the gradients keeps each example's contribution ≤ C."""

from __future__ import annotations

import warnings

import pytest
import torch

import dpcore
from dpcore.accounting import POISSON_GAUSSIAN

from ._common import _events, _train, example_grad, flat_norm, make_opt, mlp64

warnings.simplefilter("ignore", dpcore.SeededRandomnessWarning)


def _flip_augment(k):
    g = torch.Generator().manual_seed(0)

    def augment(x):
        copies = x.unsqueeze(1).expand(x.shape[0], k, *x.shape[1:]).clone()
        noise = 0.1 * torch.randn(copies.shape, generator=g)
        return copies + noise

    return augment


def test_every_method_writes_the_same_ledger_events_as_dpsgd():
    kw = dict(noise_multiplier=1.3)
    _, ref = _train(kw)
    variants = [
        {"method": "bam", "ascent": 0.05},
        {"method": "bam", "ascent": 0.05, "bam_variant": "exact"},
        {"method": "dpsat", "ascent": 0.05},
        {"augment": _flip_augment(3), "augmentation_multiplicity": 3},
        {"diagnostics": True},
    ]
    for v in variants:
        _, other = _train({**kw, **v})
        assert _events(other) == _events(ref), v
        assert other.ledger.epsilon() == ref.ledger.epsilon()
    _, nadam = _train(kw, optimizer="nadam")  # DP-Adam/NAdam (Gaussian form): post-processing
    assert _events(nadam) == _events(ref)
    assert {e[0] for e in _events(ref)} == {POISSON_GAUSSIAN} and len(_events(ref)) == 6


def test_a_method_added_to_the_registry_changes_only_which_vectors_are_clipped():
    """A method sees the per-example computation and nothing else: whatever vectors it returns
    are clipped to C by the same code, so even one that inflates the gradients 1000× keeps each
    example's contribution ≤ C; and it is refused with book-keeping when it says so."""
    from dpcore.methods import METHODS, Method

    class Inflated(Method):
        name = "inflated"
        bookkeeping_ok = False

        def per_example(self, grad_sampler, xb, yb, step):
            g = grad_sampler(xb, yb)
            return {k: 1000.0 * v for k, v in g.items()}, g

    METHODS["inflated"] = Inflated
    try:
        model = mlp64()
        x, y = torch.randn(12, 6, dtype=torch.float64), torch.randint(0, 3, (12,))
        opt = make_opt(model, method="inflated", clip=0.3)
        assert isinstance(opt.method, Inflated)
        for i in range(12):
            opt.accumulate(x[i : i + 1], y[i : i + 1])
            assert flat_norm(opt._sum.values()) <= 0.3 * (1 + 1e-9)
            opt.lot.reset()
        wide = make_opt(model, method="inflated", clip=1e9)  # no clipping: the method's vectors are the ones summed
        wide.accumulate(x[:1], y[:1])
        assert flat_norm(wide._sum.values()) == pytest.approx(1000.0 * flat_norm(example_grad(model, x[0], y[0])))
        with pytest.raises(dpcore.DPConfigError, match="bookkeeping"):
            make_opt(mlp64(), method="inflated", clipping="bookkeeping")
    finally:
        del METHODS["inflated"]
    with pytest.raises(dpcore.DPConfigError, match="unknown"):
        make_opt(mlp64(), method="inflated")

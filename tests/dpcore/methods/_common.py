"""Helpers shared by the tests of the training methods: a small float64 MLP, one example's
plain autograd gradient (the reference the methods' per-example vectors are checked against),
the flat norm of a list of tensors, a seeded :class:`dpcore.DPOptimizer` over that model, a short
``make_private`` run for comparing methods end to end, and the ledger events such a run wrote."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

import dpcore

from ...helpers import ce


def mlp64(d_in=6, hidden=7, classes=3, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, classes)).double()


def example_grad(model, x, y, params=None):
    """Ordinary autograd gradient of one example's loss (a reference, no torch.func)."""
    m = model
    if params is not None:
        m = copy.deepcopy(model)
        with torch.no_grad():
            for p, v in zip(m.parameters(), params):
                p.copy_(v)
    ps = list(m.parameters())
    return torch.autograd.grad(ce(m(x[None]), y[None]), ps)


def flat_norm(ts):
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in ts))


def make_opt(model, *, seed=0, n=64, q=0.25, sigma=1.0, clip=1.0, lr=0.1, optimizer="sgd", ledger=None, **kw):
    opt = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "nadam": torch.optim.NAdam}[optimizer](
        model.parameters(), lr=lr
    )
    return dpcore.DPOptimizer(
        opt,
        model=model,
        loss_fn=ce,
        noise_multiplier=sigma,
        clip_norm=clip,
        sample_rate=q,
        dataset_size=n,
        randomness=dpcore.SeededRandomness(seed),
        ledger=ledger if ledger is not None else dpcore.PrivacyLedger(None, 1e-5),
        **kw,
    )


def _train(method_kw, steps=6, seed=11, optimizer="sgd"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(200, 6) * 2, torch.randint(0, 3, (200,))
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.5)
        if optimizer == "sgd"
        else torch.optim.NAdam(model.parameters(), lr=0.01)
    )
    private = dpcore.make_private(
        model,
        opt,
        ce,
        dataset_size=200,
        lot_size=40,
        epochs=steps * 40 / 200,
        target_epsilon=5.0,
        target_delta=1e-5,
        clip_norm=0.5,
        seed=seed,
        physical_batch_size=16,
        **{"clipping": "vmap", **method_kw},  # one clipping path for every method compared
    )
    for lot in private.sampler:
        private.optimizer.accumulate(x[lot], y[lot])
        private.optimizer.step()
    return model, private


def _events(private):
    return [(e.kind, e.sample_rate, e.noise_multiplier, e.clip_norm, e.step, e.status) for e in private.ledger.entries]

"""A helper shared by the float-rounding tests: a seeded :class:`dpcore.DPOptimizer` over a small
Linear layer (or the model given), with the dataset size and physical batch size the rounding
bound is taken at."""

import torch
from torch import nn

import dpcore

from ..helpers import ce


def _optimizer(dataset_size, batch, model=None, **kw):
    model = nn.Linear(3, 2) if model is None else model
    return dpcore.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        loss_fn=ce,
        noise_multiplier=1.0,
        clip_norm=1.0,
        sample_rate=0.01,
        dataset_size=dataset_size,
        randomness=dpcore.SeededRandomness(0),
        ledger=dpcore.PrivacyLedger(None, 1e-5),
        physical_batch_size=batch,
        **kw,
    )

"""Per-sample gradients with ``torch.func`` (vmap over grad).

The model is called functionally: trainable parameters are the differentiated argument,
and frozen parameters and buffers ride along as constants. Gradients are computed one
physical batch at a time, so memory is bounded by the physical batch size and never by
the lot size.

``loss_fn(output, target)`` is called on a batch of one example (the leading dimension is
kept), so any ordinary PyTorch loss works (``F.cross_entropy`` with its default reduction).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from .validation import validate_model

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PerSampleGradients:
    """Computes ``{name: tensor[B, *param.shape]}`` of per-example gradients.

    Only parameters with ``requires_grad=True`` get gradients; frozen parameters and all
    buffers are passed to the functional call unchanged. Modules that draw randomness in
    the forward pass (dropout) get an independent draw per example.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn):
        validate_model(model)
        self.model = model
        self.loss_fn = loss_fn
        self.param_names = [n for n, p in model.named_parameters() if p.requires_grad]

        def example_loss(params, consts, x, y):
            out = functional_call(self.model, {**consts, **params}, (x.unsqueeze(0),))
            return self.loss_fn(out, y.unsqueeze(0))

        self._example_loss = example_loss
        self._per_sample = vmap(grad(example_loss), in_dims=(None, None, 0, 0), randomness="different")
        # Per-sample parameters (one set per example), used by methods that evaluate each
        # example at its own perturbed point (BAM's ascent step).
        self._per_sample_at = vmap(grad(example_loss), in_dims=(0, None, 0, 0), randomness="different")

    def params(self) -> dict[str, torch.Tensor]:
        named = dict(self.model.named_parameters())
        return {n: named[n].detach() for n in self.param_names}

    def constants(self) -> dict[str, torch.Tensor]:
        consts = {n: p.detach() for n, p in self.model.named_parameters() if not p.requires_grad}
        consts.update({n: b for n, b in self.model.named_buffers()})
        return consts

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-example gradients at the model's current parameters."""
        return self._per_sample(self.params(), self.constants(), x, y)

    def at(self, params_per_sample: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-example gradients, example i evaluated at ``params_per_sample[·][i]``."""
        return self._per_sample_at(params_per_sample, self.constants(), x, y)

"""Per-sample gradients with ``torch.func`` (vmap over grad).

The model is called functionally: trainable parameters are the differentiated argument,
and frozen parameters and buffers ride along as constants. Gradients are computed one
physical batch at a time, so memory is bounded by the physical batch size and never by
the lot size.

``loss_fn(output, target)`` is called on a batch of one example (the leading dimension is
kept), so any ordinary PyTorch loss works (``F.cross_entropy`` with its default reduction).

Per-example quantities beyond the plain gradient, each one a function of that example alone
(so each one's contribution is still clipped to C and the sensitivity analysis of DP-SGD is
untouched):

* **augmentation multiplicity** (``multiplicity=K``): example i arrives as K augmented
  copies ``x[i] : [K, ...]``; its loss is the mean of the K losses, so its gradient is the
  mean of the K gradients (De et al. 2022), clipped afterwards as one vector;
* **BAM, SAM form** (:meth:`PerSampleGradients.bam`): the gradient at the example's own
  ascent point θ + λ·g_i/‖g_i‖ (per-sample parameters under vmap);
* **BAM, exact form**: ∇L_i + λ·H_i g_i/‖g_i‖, the gradient of L_i + λ‖∇L_i‖, with the
  Hessian-vector product by forward-over-reverse (a ``jvp`` of ``grad``), per example.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call, grad, jvp, vmap

from .precision import check_autocast, forward_autocast
from .validation import validate_model

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Grads = dict[str, torch.Tensor]


# Below this norm a gradient's direction is numerically meaningless (and 1/‖g‖ would overflow
# float32): such an example takes no ascent step, as an exactly zero gradient does.
TINY_NORM = 1e-30


def _joint_norm(g: Grads) -> torch.Tensor:
    """L2 norm of all of one example's gradient tensors together: per-tensor norms in the
    gradient's dtype, combined in float64. (Only the ascent direction uses it; clipping norms
    are computed in float64 by :mod:`dpcore.clipping`.)"""
    return torch.sqrt(sum(torch.linalg.vector_norm(t).double().square() for t in g.values()))


def _inverse_norm(norm: torch.Tensor) -> torch.Tensor:
    ok = torch.isfinite(norm) & (norm > TINY_NORM)
    return torch.where(ok, 1.0 / torch.where(ok, norm, torch.ones_like(norm)), torch.zeros_like(norm))


class PerSampleGradients:
    """Computes ``{name: tensor[B, *param.shape]}`` of per-example gradients.

    Only parameters with ``requires_grad=True`` get gradients; frozen parameters and all
    buffers are passed to the functional call unchanged. Modules that draw randomness in
    the forward pass (dropout) get an independent draw per example.

    With ``multiplicity=K > 1``, inputs are ``[B, K, ...]`` (K augmentations of each example)
    and example i's gradient is the mean over its K copies.

    With ``autocast="bf16"`` the forward runs under bf16 autocast (:mod:`dpcore.precision`);
    the gradients are still in the parameters' dtype.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, multiplicity: int = 1, autocast: str = "none"):
        validate_model(model)
        self.autocast = check_autocast(autocast)
        self.model = model
        self.loss_fn = loss_fn
        self.multiplicity = int(multiplicity)
        self.param_names = [n for n, p in model.named_parameters() if p.requires_grad]

        def one_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.loss_fn(out.unsqueeze(0), y.unsqueeze(0))

        def example_loss(params, consts, x, y):
            if self.multiplicity == 1:
                out = functional_call(self.model, {**consts, **params}, (x.unsqueeze(0),))
                return self.loss_fn(out, y.unsqueeze(0))
            out = functional_call(self.model, {**consts, **params}, (x,))  # the K copies of one example
            return vmap(one_loss, in_dims=(0, None))(out, y).mean()

        example_grad = grad(example_loss)

        def bam_sam(params, consts, x, y, lam):
            g = example_grad(params, consts, x, y)
            scale = lam * _inverse_norm(_joint_norm(g))  # float64, finite: ≤ λ/1e-30
            shifted = {k: params[k] + scale.to(params[k].dtype) * g[k] for k in params}
            return example_grad(shifted, consts, x, y), g

        def bam_exact(params, consts, x, y, lam):
            g = example_grad(params, consts, x, y)
            inv = _inverse_norm(_joint_norm(g))
            direction = {k: inv.to(g[k].dtype) * g[k] for k in g}
            _, hvp = jvp(lambda p: example_grad(p, consts, x, y), (params,), (direction,))
            return {k: g[k] + lam.to(g[k].dtype) * hvp[k] for k in g}, g

        self._example_loss = example_loss
        self._per_sample = vmap(example_grad, in_dims=(None, None, 0, 0), randomness="different")
        # Per-sample parameters (one set per example): each example evaluated at its own point.
        self._per_sample_at = vmap(example_grad, in_dims=(0, None, 0, 0), randomness="different")
        self._bam = {
            "sam": vmap(bam_sam, in_dims=(None, None, 0, 0, None), randomness="different"),
            "exact": vmap(bam_exact, in_dims=(None, None, 0, 0, None), randomness="different"),
        }

    def params(self) -> Grads:
        named = dict(self.model.named_parameters())
        return {n: named[n].detach() for n in self.param_names}

    def constants(self) -> dict[str, torch.Tensor]:
        consts = {n: p.detach() for n, p in self.model.named_parameters() if not p.requires_grad}
        consts.update({n: b for n, b in self.model.named_buffers()})
        return consts

    def __call__(self, x: torch.Tensor, y: torch.Tensor, params: Grads | None = None) -> Grads:
        """Per-example gradients at the model's current parameters (or at ``params``)."""
        with forward_autocast(self.autocast, x):
            return self._per_sample(self.params() if params is None else params, self.constants(), x, y)

    def at(self, params_per_sample: Grads, x: torch.Tensor, y: torch.Tensor) -> Grads:
        """Per-example gradients, example i evaluated at ``params_per_sample[·][i]``."""
        with forward_autocast(self.autocast, x):
            return self._per_sample_at(params_per_sample, self.constants(), x, y)

    def bam(self, x: torch.Tensor, y: torch.Tensor, lam: float, variant: str = "sam") -> tuple[Grads, Grads]:
        """BAM's per-example gradients and the plain per-example gradients at θ they started from.

        ``variant="sam"``: ∇L_i(θ + λ·g_i/‖g_i‖). ``variant="exact"``: ∇L_i + λ·H_i g_i/‖g_i‖.
        An example whose gradient is zero (norm ≤ 1e-30) takes no ascent step; one whose gradient
        is not finite gets a non-finite BAM vector, which the lot skips and counts like any other.
        """
        lam_t = torch.tensor(float(lam), dtype=torch.float64)
        with forward_autocast(self.autocast, x):
            return self._bam[variant](self.params(), self.constants(), x, y, lam_t)

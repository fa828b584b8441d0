"""The private optimizer step.

:class:`DPOptimizer` wraps any ``torch.optim`` optimizer (SGD, Adam, NAdam, ...). One step:

1. :meth:`accumulate` (once or more per lot, one call per physical batch or a whole lot that
   it splits into physical batches): per-sample gradients (vmap), each clipped to C, summed
   into a buffer. Memory is bounded by the physical batch size.
2. :meth:`step`:
   a. ask the ledger whether this release fits in the budget (raises before anything is
      released);
   b. add N(0, σ²C²·I) to the clipped sum — once per lot, and only where ``add_noise`` is
      true (in sharded training, rank 0 only);
   c. ``reduce_fn`` (the all-reduce SUM across ranks; nothing in one process);
   d. divide by the *expected* lot size q·N (never by the realised count);
   e. write the result into ``param.grad`` and call the wrapped optimizer's ``step``;
   f. append the release to the ledger.

The wrapped optimizer's state (momentum, Adam moments) therefore only ever sees the noised
gradient: that is why DP-Adam has exactly DP-SGD's guarantee (post-processing).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

import warnings

from . import fastclip
from .accounting import PrivacyEvent
from .clipping import clipped_sum, per_sample_norms
from .grad_sample import LossFn, PerSampleGradients
from .ledger import PrivacyLedger
from .errors import DPConfigError
from .randomness import Randomness
from .validation import (
    check_clip_norm,
    check_dataset_size,
    check_noise_multiplier,
    check_positive_int,
    check_sample_rate,
)

ReduceFn = Callable[[list[torch.Tensor]], None]
CLIPPING_MODES = ("vmap", "bookkeeping")


class DPOptimizer:
    """Differentially private wrapper of a torch optimizer (see module docstring).

    Args:
        optimizer: a ``torch.optim.Optimizer`` over (a superset of) the model's trainable params.
        model: the ``nn.Module``; validated (no BatchNorm, ...).
        loss_fn: ``loss_fn(output, target)`` for a batch of one example.
        noise_multiplier: σ. Noise std is σ·C.
        clip_norm: C.
        sample_rate: the Poisson rate q used by the sampler.
        dataset_size: N, the size of the whole dataset (all shards together).
        randomness: where the noise comes from (secure or seeded).
        ledger: the run's :class:`PrivacyLedger`; every step is checked and recorded there.
        physical_batch_size: the largest number of examples per vmap call.
        add_noise: False on every rank but one in sharded training.
        reduce_fn: called with the list of summed (noised) gradient tensors, in place.
        clipping: how the clipped sum is computed. ``"vmap"`` (default): per-example gradients
            with torch.func, for any model. ``"bookkeeping"``: :mod:`dpcore.fastclip` (Linear and
            Conv2d parameters only; faster). Book-keeping assumes that the model treats the
            examples of a batch independently along dim 0, which no cheap check can prove, so
            before it is trusted its clipped sum is compared with the vmap path's on the first
            physical batch of two or more examples; on any difference, or anything it cannot
            handle at run time, the optimizer warns and stays on the vmap path.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        model: nn.Module,
        loss_fn: LossFn,
        noise_multiplier: float,
        clip_norm: float,
        sample_rate: float,
        dataset_size: int,
        randomness: Randomness,
        ledger: PrivacyLedger,
        physical_batch_size: int = 256,
        add_noise: bool = True,
        reduce_fn: ReduceFn | None = None,
        clipping: str = "vmap",
    ):
        self.optimizer = optimizer
        self.model = model
        self.noise_multiplier = check_noise_multiplier(noise_multiplier)
        self.clip_norm = check_clip_norm(clip_norm)
        self.sample_rate = check_sample_rate(sample_rate)
        self.dataset_size = check_dataset_size(dataset_size)
        self.expected_lot_size = self.sample_rate * self.dataset_size
        self.physical_batch_size = check_positive_int(physical_batch_size, "physical_batch_size")
        self.randomness = randomness
        self.ledger = ledger
        if not add_noise and reduce_fn is None:
            raise DPConfigError(
                "add_noise=False without a reduce_fn: this worker would step on its clipped sum with no "
                "noise at all. add_noise=False is only for ranks ≥ 1 of sharded training, whose sums are "
                "all-reduced (reduce_fn) with rank 0's noised sum before anyone steps."
            )
        self.add_noise = add_noise
        self.reduce_fn = reduce_fn
        self.grad_sampler = PerSampleGradients(model, loss_fn)
        if clipping not in CLIPPING_MODES:
            raise DPConfigError(f"clipping={clipping!r} is unknown; use one of {', '.join(CLIPPING_MODES)}.")
        self._fast = None
        self._fast_verified = False
        if clipping == "bookkeeping":
            if not fastclip.supports(model):
                raise DPConfigError(
                    "clipping='bookkeeping' handles Linear and Conv2d parameters only; these are not: "
                    f"{fastclip.unsupported_parameters(model)[:5]}. Use clipping='vmap'."
                )
            self._fast = fastclip.BookKeepingClipper(model, loss_fn)
        self.clipping = "bookkeeping" if self._fast is not None else "vmap"
        self.params = dict((n, p) for n, p in model.named_parameters() if p.requires_grad)
        opt_params = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [n for n, p in self.params.items() if id(p) not in opt_params]
        if missing:
            raise ValueError(
                f"the optimizer does not hold these trainable parameters: {missing[:5]}; "
                "build it from model.parameters() or freeze them (requires_grad=False)."
            )
        self.event = PrivacyEvent.dpsgd_step(self.noise_multiplier, self.sample_rate)
        self.steps_taken = 0
        self._sum = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self._examples_in_lot = 0
        self._nonfinite_in_lot = 0
        self._nonfinite_total = 0

    # ----------------------------------------------------------------------------------
    def accumulate(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add the clipped per-example gradients of (x, y) to this lot's sum.

        ``x`` may be larger than a physical batch; it is processed in chunks of
        ``physical_batch_size``.
        """
        n = x.shape[0]
        for start in range(0, n, self.physical_batch_size):
            xb = x[start : start + self.physical_batch_size]
            yb = y[start : start + self.physical_batch_size]
            bad = None
            if self._fast is not None:
                try:
                    if self._fast_verified:
                        bad = self._fast.clipped_sum(xb, yb, self.clip_norm, self._sum)
                    elif xb.shape[0] >= 2:
                        bad = self._verify_fast(xb, yb)
                except fastclip.Unsupported as e:  # raised before anything is added
                    self._leave_fast(str(e))
            if bad is None:
                per_sample = self.grad_sampler(xb, yb)
                _, bad = clipped_sum(per_sample, self.clip_norm, out=self._sum)
            self._nonfinite_in_lot += bad
            self._examples_in_lot += xb.shape[0]

    def _leave_fast(self, why: str) -> None:
        warnings.warn(f"book-keeping clipping cannot be used for this model ({why}); using the vmap path.", stacklevel=3)
        self._fast, self.clipping = None, "vmap"

    def _verify_fast(self, xb: torch.Tensor, yb: torch.Tensor) -> int | None:
        """First use of book-keeping: compute the batch both ways and keep book-keeping only if
        the clipped sums agree (to 1e-5 relative to the sum's scale). Adds the reference sum
        either way. Returns the reference's non-finite count."""
        fast: dict[str, torch.Tensor] = {}
        fast_bad = self._fast.clipped_sum(xb, yb, self.clip_norm, fast)
        ref, bad = clipped_sum(self.grad_sampler(xb, yb), self.clip_norm)
        scale = max(float(v.abs().max()) for v in ref.values()) if ref else 0.0
        agree = fast_bad == bad and set(fast) == set(ref) and all(
            torch.allclose(fast[k], ref[k], rtol=0.0, atol=1e-5 * max(scale, self.clip_norm)) for k in ref
        )
        for k, v in ref.items():
            self._sum[k].add_(v)
        if agree:
            self._fast_verified = True
        else:
            self._leave_fast("its clipped sum differs from the per-example (vmap) reference on this model")
        return bad

    def step(self) -> None:
        """Noise, reduce, normalise by q·N, step the wrapped optimizer, record the release."""
        self.ledger.check(self.event)  # raises before anything leaves
        sums = [self._sum[n] for n in self.params]
        if self.add_noise:
            std = self.noise_multiplier * self.clip_norm
            for s in sums:
                s.add_(self.randomness.normal(s.shape, std, dtype=s.dtype, device=s.device))
        if self.reduce_fn is not None:
            self.reduce_fn(sums)
        for name, p in self.params.items():
            p.grad = self._sum[name].div(self.expected_lot_size)
        self.optimizer.step()
        self.steps_taken += 1
        self.ledger.append(self.event, step=self.steps_taken, clip_norm=self.clip_norm)
        self._nonfinite_total += self._nonfinite_in_lot
        self._reset_lot()

    def _reset_lot(self) -> None:
        for s in self._sum.values():
            s.zero_()
        self._examples_in_lot = 0
        self._nonfinite_in_lot = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # ----------------------------------------------------------------------------------
    def diagnostics(self, x: torch.Tensor | None = None, y: torch.Tensor | None = None) -> dict:
        """NON-PRIVATE statistics, for an explicit diagnostics mode only.

        Returns the count of examples skipped for a non-finite gradient so far, and, when
        (x, y) are given, their per-example gradient norms at the current parameters.
        Nothing here is noised or in the ledger.
        """
        out: dict = {"nonfinite_examples_skipped": self._nonfinite_total + self._nonfinite_in_lot}
        if x is not None:
            out["per_sample_norms"] = per_sample_norms(self.grad_sampler(x, y))
        return out

    def state_dict(self) -> dict:
        """Wrapped optimizer state, steps taken, and the noise stream's state (empty in secure
        mode). The ledger and the sampler have state_dicts of their own."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "steps_taken": self.steps_taken,
            "randomness": self.randomness.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps_taken = int(state["steps_taken"])
        self.randomness.load_state_dict(state["randomness"])
        self._reset_lot()

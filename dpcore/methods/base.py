"""What a method is, to the private step: two hooks around the clipped sum, nothing else.

A method changes only *which* per-example vector is clipped (:meth:`Method.per_example`) or
*where* the lot's gradients are evaluated (:meth:`Method.begin_lot` / :meth:`Method.end_lot`).
Clipping, the one noise draw per lot, the reduce, the division by qN and the ledger are the same
code for every method (:func:`dpcore.release.release`), so no method can change the privacy
analysis: each example's contribution is still one clipped vector of norm ≤ C.

To add a method: one module with a subclass, one entry in ``METHODS`` (``dpcore/methods/__init__.py``),
one test of its per-example vectors against a reference.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..errors import DPConfigError
from .options import AscentArg
from .schedules import as_schedule

Params = dict[str, torch.Tensor]


class Method:
    """DP-SGD (Abadi et al. 2016): the plain per-example gradients at θ."""

    name: ClassVar[str] = "dpsgd"
    # Book-keeping clipping computes norms of plain per-example gradients at θ; a method that
    # clips other vectors (BAM's ascent-point gradients) needs the vmap path.
    bookkeeping_ok: ClassVar[bool] = True
    # It needs the previous released gradient (DP-SAT's direction).
    needs_previous_release: ClassVar[bool] = False

    def __init__(self, ascent: AscentArg = 0.0, bam_variant: str = "sam"):
        self.schedule = as_schedule(ascent)
        self.bam_variant = bam_variant
        self.shifts_applied = 0

    @property
    def tag(self) -> str:
        return self.name

    def ascent(self, step: int) -> float:
        """λ (BAM) or ρ (DP-SAT) for the lot of 0-based ``step``."""
        value = float(self.schedule(step))
        if not (value >= 0 and value < float("inf")):
            raise DPConfigError(f"the ascent schedule gave {value!r} at step {step}; it must be a finite number ≥ 0.")
        return value

    def per_example(self, grad_sampler, xb: torch.Tensor, yb: torch.Tensor, step: int) -> tuple[Params, Params] | None:
        """(the per-example vectors to clip, the plain per-example gradients at θ), or None for
        the plain gradients at the current weights."""
        return None

    def begin_lot(self, params: Params, previous: Params | None, step: int) -> Params | None:
        """Called before the lot's first physical batch. Returns the weights to restore at
        :meth:`end_lot` if it moved them, else None."""
        return None

    @staticmethod
    def end_lot(params: Params, saved: Params | None) -> None:
        """Put the weights back exactly (a saved copy, not a subtraction)."""
        if saved is None:
            return
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(saved[n])

"""Which clipped-sum path a private step uses, and the check that makes book-keeping safe.

Book-keeping clipping (:mod:`dpcore.bookkeeping`) gets each example's norm from one forward and
one activation-only backward. It assumes the model treats the examples of a batch
independently along dim 0, which no cheap check can prove, so :class:`CheckedBookKeeping`
trusts it only after its clipped sum matched the per-example (vmap) reference on the first
real physical batch of two or more examples. On any difference, or anything it cannot handle
at run time, it warns and the step stays on the vmap path for good.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import torch
from torch import nn

from . import bookkeeping
from .clipping import clipped_sum
from .errors import DPConfigError
from .grad_sample import PerSampleGradients
from .methods import bookkeeping_applies

CLIPPING_MODES = ("vmap", "bookkeeping", "auto")
Sums = dict[str, torch.Tensor]


def choose_clipping(
    clipping: str, model: nn.Module, method: str, augmentation_multiplicity: int, clip_norm_type: str, diagnostics: bool
) -> str:
    """``"vmap"`` or ``"bookkeeping"`` for the requested mode. ``"auto"`` picks book-keeping
    where the model's layers and the method allow it, silently; diagnostics need the
    per-example gradients themselves, so they force vmap (with a warning if it was asked for)."""
    if clipping == "auto":
        fits = bookkeeping_applies(method, augmentation_multiplicity, clip_norm_type) and not diagnostics
        clipping = "bookkeeping" if fits and bookkeeping.supports(model) else "vmap"
    if diagnostics and clipping == "bookkeeping":
        warnings.warn("diagnostics need per-example gradients: using the vmap path.", stacklevel=3)
        clipping = "vmap"
    if clipping not in CLIPPING_MODES:
        raise DPConfigError(f"clipping={clipping!r} is unknown; use one of {', '.join(CLIPPING_MODES)}.")
    if clipping == "bookkeeping" and not bookkeeping.supports(model):
        raise DPConfigError(
            "clipping='bookkeeping' handles Linear, Conv2d, WSConv2d and GroupNorm parameters only; these are not: "
            f"{bookkeeping.unsupported_parameters(model)[:5]}. Use clipping='vmap'."
        )
    return clipping


class CheckedBookKeeping:
    """Book-keeping clipping, used once it agreed with the vmap reference on a real batch."""

    def __init__(self, model: nn.Module, loss_fn, clip_norm: float, multiplicity: int = 1):
        self.model, self.loss_fn, self.clip_norm, self.multiplicity = model, loss_fn, clip_norm, multiplicity
        self.clipper = bookkeeping.BookKeepingClipper(model, loss_fn)
        self.verified = False
        self.active = True

    def clipped_sum(self, xb: torch.Tensor, yb: torch.Tensor, out: Sums, reference: Callable) -> int | None:
        """Add the batch's clipped sum to ``out`` and return its count of non-finite examples;
        None when nothing was added and the caller must use the vmap path. ``reference(xb, yb)``
        gives the per-example gradients of the vmap path."""
        try:
            if self.verified:
                return self.clipper.clipped_sum(xb, yb, self.clip_norm, out)
            if xb.shape[0] >= 2:
                return self._verify(xb, yb, out, reference)
        except bookkeeping.Unsupported as e:  # raised before anything is added
            self._leave(str(e))
        return None

    def _leave(self, why: str) -> None:
        warnings.warn(
            f"book-keeping clipping cannot be used for this model ({why}); using the vmap path.", stacklevel=4
        )
        self.active = False

    def _verify(self, xb: torch.Tensor, yb: torch.Tensor, out: Sums, reference: Callable) -> int:
        """Compute the batch both ways; keep book-keeping only if the clipped sums agree (to 1e-5
        of the sum's scale). The sum added is the path that will be used from here on: book-keeping's
        if they agree, else the reference. (So a run restored from a checkpoint, which verifies
        again on its first batch, adds bit for bit what the uninterrupted run added there.)"""
        fast: Sums = {}
        fast_bad = self.clipper.clipped_sum(xb, yb, self.clip_norm, fast)
        ref, bad = clipped_sum(reference(xb, yb), self.clip_norm)
        agree = self._agree(fast, fast_bad, ref, bad)
        if not agree and any(p.dtype != torch.float64 for p in self.model.parameters() if p.requires_grad):
            # A deep float32 model's own rounding (GroupNorm, weight standardisation) can part
            # the two paths by more than 1e-5 while both are equally far from the exact
            # values: then the two formulas are compared on a float64 copy of the model, and
            # the float32 fast sum must be no further from that float64 reference than twice
            # the float32 reference's own distance (plus the 1e-5 tolerance).
            ref64 = self._agree_in_float64(xb, yb)
            agree = ref64 is not None and fast_bad == bad and set(fast) == set(ref)
            if agree:
                scale = max(float(v.abs().max()) for v in ref64.values()) if ref64 else 0.0
                slack = 1e-5 * max(scale, self.clip_norm)
                for k, r64 in ref64.items():
                    own = float((ref[k].double() - r64).abs().max())
                    agree = agree and float((fast[k].double() - r64).abs().max()) <= 2.0 * own + slack
        for k, v in (fast if agree else ref).items():
            out[k].add_(v.to(out[k].dtype))
        if agree:
            self.verified = True
        else:
            self._leave("its clipped sum differs from the per-example (vmap) reference on this model")
        return fast_bad if agree else bad

    def _agree(self, fast: Sums, fast_bad: int, ref: Sums, bad: int) -> bool:
        scale = max(float(v.abs().max()) for v in ref.values()) if ref else 0.0
        tol = 1e-5 * max(scale, self.clip_norm)
        return (
            fast_bad == bad
            and set(fast) == set(ref)
            and all(torch.allclose(fast[k].to(ref[k].dtype), ref[k], rtol=0.0, atol=tol) for k in ref)
        )

    def _agree_in_float64(self, xb: torch.Tensor, yb: torch.Tensor) -> Sums | None:
        """The reference clipped sum on a float64 copy of the model if book-keeping agrees with
        it there (to 1e-5 of its scale), else None."""
        try:
            model64 = copy.deepcopy(self.model).double()
            x64 = xb.double() if xb.is_floating_point() else xb
            fast: Sums = {}
            fast_bad = bookkeeping.BookKeepingClipper(model64, self.loss_fn).clipped_sum(x64, yb, self.clip_norm, fast)
            sampler = PerSampleGradients(model64, self.loss_fn, multiplicity=self.multiplicity)
            ref, bad = clipped_sum(sampler(x64, yb), self.clip_norm)
        except Exception:  # a model that cannot be copied or run in float64: not verified
            return None
        return ref if self._agree(fast, fast_bad, ref, bad) else None

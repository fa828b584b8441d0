"""Which clipped-sum path a private step uses, and the check that makes book-keeping safe.

Book-keeping clipping (:mod:`dpcore.bookkeeping`) gets each example's norm from one forward and
one activation-only backward. It assumes the model treats the examples of a batch
independently along dim 0, which no cheap check can prove, so :class:`CheckedBookKeeping`
trusts it only after its formulas matched the per-example (vmap) reference, in float64, before
the first physical batch is summed: on inputs shaped like that batch's but drawn from a fixed
seed, so that the path a run takes does not depend on its private data. On any difference, or
anything it cannot handle at run time, it warns and the step stays on the vmap path for good.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections.abc import Callable

import torch
from torch import nn

from . import bookkeeping, memory
from .clipping import clip_factors, clipped_sum, kept_rows, per_sample_norms, weighted_sum
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
        layers = ", ".join(t.__name__ for t in bookkeeping.LAYERS)
        raise DPConfigError(
            f"clipping='bookkeeping' handles the parameters of {layers} layers only; these are not: "
            f"{bookkeeping.unsupported_parameters(model)[:5]}. Use clipping='vmap'."
        )
    return clipping


# The check runs the formulas on a float64 copy of the model, on this many examples: enough for any
# mixing of examples to show, and cheap beside the run (the vmap reference in float64 is its cost).
CHECK_EXAMPLES = 8
# The float64 vmap reference of the check is formed this many examples at a time.
REFERENCE_CHUNK = 2
# The check's inputs are drawn from this seed (on the CPU, then moved), in the first batch's shapes
# and dtypes (:func:`check_inputs`).
CHECK_SEED = 20_231


def check_inputs(
    model: nn.Module, xb: torch.Tensor, yb: torch.Tensor, examples: int = CHECK_EXAMPLES
) -> tuple[torch.Tensor, torch.Tensor]:
    """``examples`` inputs and labels for the formula check, made like ``xb`` and ``yb`` but from
    ``CHECK_SEED`` alone: nothing of the batch is read but its shapes, dtypes and device.
    Features are standard normal, token ids lie below the model's smallest token table of two
    rows or more (2 without one; a one-row table, such as RoBERTa's token types, can only be
    read at 0), integer labels are 0 or 1 (valid for any classifier), and float targets lie in
    [0, 1) (valid for a binary cross-entropy as for a regression)."""
    gen = torch.Generator().manual_seed(CHECK_SEED)
    tables = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding) and m.num_embeddings >= 2]

    def draw(like: torch.Tensor, features: bool) -> torch.Tensor:
        shape = (examples, *like.shape[1:])
        if like.is_floating_point():
            t = (torch.randn if features else torch.rand)(shape, generator=gen, dtype=like.dtype)
        else:
            high = min(tables, default=2) if features and like.dtype != torch.bool else 2
            t = torch.randint(0, high, shape, generator=gen).to(like.dtype)
        return t.to(like.device)

    return draw(xb, True), draw(yb, False)


# In float64 the two paths agree to ~1e-16 of the scale where the formulas are right (measured
# on ResNet-9 and WRN-16-4, whose float32 backward is ill-conditioned; docs/benchmarks/README.md);
# a wrong formula, a mixing of examples or an in-place edit parts them by orders of magnitude more.
FORMULA_RTOL = 1e-9
# Nor is any example's norm below the reference's by more than this much of its own (squared):
# loose beside the two paths' float64 rounding of natural examples, and, were a form to fall short
# by it in training, a share would reach at most C·(1 − CLIP_MARGIN)·√(1 + 1e-7), inside the margin.
BELOW_RTOL = 1e-7
# The check at the configured batch size (:meth:`CheckedBookKeeping.batch_mixes`) compares float32
# norms, batched against alone: 4.6e-5 apart at most on WRN-16-4, 2.5e-5 on ResNet-9, 1e-8 on the
# MNIST CNN (2026-11-29); with a bf16 forward, bf16's rounding. Mixing moves them by far more.
BATCH_RTOL = 1e-3
BATCH_RTOL_BF16 = 5e-2


@contextlib.contextmanager
def _no_vmap_fallback_note():
    """Without torch's note that an op (attention) has no vmap rule: the checks run a few examples, once."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented")
        yield


class _NoFloat64Reference(Exception):
    """The vmap reference could not run on the float64 copy of the model."""


class CheckedBookKeeping:
    """Book-keeping clipping, used once its formulas agreed with the vmap reference (on the check's
    inputs, :func:`check_inputs`).

    What the check proves, and what it leaves to rounding. Book-keeping's clip factor for an
    example is computed from the norm of the very vector it adds for that example (the
    materialised per-example gradient, or the float64 ghost norm of the same captured inputs
    and output gradients that the sum contracts), so the bound ‖f_i·g_i‖ ≤ C holds by
    construction whatever the float32 rounding of the network's own forward and backward.
    What can be wrong is the formula: a model that mixes the examples of a batch, edits a
    layer's input in place, or a layer form that does not match its layer. Such an error is
    structural, so it shows in float64, where rounding cannot hide it or pass for it: the check
    compares, on a float64 copy of the model, every example's squared norm with the vmap
    reference: never below it by more than :data:`FORMULA_RTOL` of their scale or
    :data:`BELOW_RTOL` of its own, and above it by no more than that plus twice the allowance a
    ghost form adds for its own float64 rounding (:meth:`norms_disagree`);
    and the clipped sums at two bounds (C, and the median norm, so that the factors differ
    between examples), both paths at book-keeping's factors, their ℓ2 difference to
    :data:`FORMULA_RTOL` of what the shares add up to in magnitude. (Comparing the float32 sums
    with each other instead would measure the two paths' rounding: on an ill-conditioned float32
    network the per-example and the batched backward part by far more than the formulas do.)
    A model that cannot be copied or run in float64 is compared in float32, to 1e-5 of the sum's
    scale. (With a bf16 forward, the float64 check is the same: autocast
    leaves float64 alone.) The float32 kernels are tested on their own
    (``tests/dpcore/test_native_kernel.py``, ``tests/dpcore/bookkeeping/test_conv_forms_equal_vmap.py``,
    ``tests/dpcore/bookkeeping/test_squared_norms_and_sums.py``).
    """

    def __init__(self, model: nn.Module, loss_fn, clip_norm: float, multiplicity: int = 1, autocast: str = "none"):
        self.model, self.loss_fn, self.clip_norm, self.multiplicity = model, loss_fn, clip_norm, multiplicity
        self.clipper = bookkeeping.BookKeepingClipper(model, loss_fn, autocast=autocast)
        self.verified = False
        self.active = True

    def clipped_sum(
        self, xb: torch.Tensor, yb: torch.Tensor, out: Sums, reference: Callable, batch_size: int | None = None
    ) -> int | None:
        """Add the batch's clipped sum to ``out`` and return its count of non-finite examples;
        None when nothing was added and the caller must use the vmap path. ``reference(xb, yb)``
        gives the per-example gradients of the vmap path; ``batch_size``, the configured
        physical batch size (:func:`dpcore.clipping.clipped_sum`)."""
        try:
            if not self.verified:
                try:
                    why = self._verify(xb, yb, reference, batch_size)
                finally:
                    # The check's float64 copy and vmap reference take more than a step's memory
                    # (all-MiniLM-L6-v2 at batch 16: a peak of 3.7 GiB, against 2.7 GiB in the
                    # steps, measured 2026-12-07); where freed memory is kept, it is given back.
                    memory.return_freed(xb.device)
                if why:
                    self._leave(why)
                    return None
                self.verified = True
            return self.clipper.clipped_sum(xb, yb, self.clip_norm, out, batch_size)
        except bookkeeping.Unsupported as e:  # raised before anything is added
            self._leave(str(e))
        return None

    def _leave(self, why: str) -> None:
        warnings.warn(
            f"book-keeping clipping cannot be used for this model ({why}); using the vmap path.", stacklevel=4
        )
        self.active = False

    def _verify(self, xb: torch.Tensor, yb: torch.Tensor, reference: Callable, batch_size: int | None) -> str:
        """Why the formulas disagree with the vmap reference ("" if they agree), checked on
        inputs shaped like the first batch's but drawn from a fixed seed (:func:`check_inputs`),
        never on the batch itself: which path the run takes, and so how its per-example
        gradients are rounded, must not depend on the private data. The check's book-keeping
        takes the forms, and the rounding cap, that training takes at the configured batch size
        ``batch_size``."""
        examples = CHECK_EXAMPLES if batch_size is None else min(CHECK_EXAMPLES, batch_size)
        x, y = check_inputs(self.model, xb, yb, examples)
        why = self.formulas_disagree(x, y, batch_size)
        if why is None:  # no float64 copy: both paths from the float32 model
            fast: Sums = {}
            fast_bad = self.clipper.clipped_sum(x, y, self.clip_norm, fast, batch_size)
            ref, bad = clipped_sum(reference(x, y), self.clip_norm, batch_size=batch_size)
            agree = self._agree(fast, fast_bad, ref, bad)
            why = "" if agree else "its clipped sum differs from the per-example (vmap) reference"
        if not why and batch_size is not None and batch_size > examples:
            why = self.batch_mixes(xb, yb, reference, batch_size)
        return why

    def batch_mixes(self, xb: torch.Tensor, yb: torch.Tensor, reference: Callable, batch_size: int) -> str:
        """ "" if book-keeping's norms, at the configured batch size, are per-example norms: for
        :data:`CHECK_EXAMPLES` of ``batch_size`` seeded inputs (:func:`check_inputs`), spread over
        the batch, each norm equals the vmap reference's of that example alone, to
        :data:`BATCH_RTOL` (the float32 paths' rounding, 5e-5 measured on WRN-16-4). The float64
        check above runs a batch of :data:`CHECK_EXAMPLES`: a model that mixes the examples of
        larger batches only passed it (helper-34: x − x.mean(0) above 8 examples moved a lot's
        sum by 2.52·C). One extra pass of book-keeping, at a training batch's memory."""
        x, y = check_inputs(self.model, xb, yb, batch_size)
        at = torch.linspace(0, batch_size - 1, CHECK_EXAMPLES).round().long().unique().to(x.device)
        sq, _ = self.clipper.measure(x, y, self.clip_norm, batch_size)
        with _no_vmap_fallback_note():
            ref = per_sample_norms(reference(x[at], y[at])).square().to(sq.dtype)
        mine = sq[at]
        finite = torch.isfinite(ref) & torch.isfinite(mine)
        rtol = BATCH_RTOL_BF16 if self.clipper.autocast != "none" else BATCH_RTOL
        if not torch.equal(torch.isfinite(ref), torch.isfinite(mine)) or not bool(
            ((mine - ref).abs() <= rtol * ref.abs() + 1e-30)[finite].all()
        ):
            return f"in a batch of {batch_size} its norms are not each example's own (the model mixes examples)"
        return ""

    def _agree(self, fast: Sums, fast_bad: int, ref: Sums, bad: int) -> bool:
        scale = max(float(v.abs().max()) for v in ref.values()) if ref else 0.0
        tol = 1e-5 * max(scale, self.clip_norm)
        return (
            fast_bad == bad
            and set(fast) == set(ref)
            and all(torch.allclose(fast[k].to(ref[k].dtype), ref[k], rtol=0.0, atol=tol) for k in ref)
        )

    def formulas_disagree(self, x: torch.Tensor, y: torch.Tensor, batch_size: int | None = None) -> str | None:
        """On a float64 copy of the model: "" if book-keeping's squared norms and clipped sums
        (at C and at the median norm) equal the vmap reference's to :data:`FORMULA_RTOL` of
        their scale, else what differs; None if the model cannot be copied or run in float64.
        Book-keeping takes the forms the training clipper takes at ``batch_size`` (its element
        budget, the configured batch size), so the forms the run will use are the ones checked."""
        try:
            model64 = copy.deepcopy(self.model).double()
            x64 = x.double() if x.is_floating_point() else x
            clipper = bookkeeping.BookKeepingClipper(model64, self.loss_fn)
            clipper.MAX_PER_EXAMPLE_ELEMENTS = self.clipper.MAX_PER_EXAMPLE_ELEMENTS
            norms: list = []
            sq, parts = clipper.measure(x64, y, self.clip_norm, batch_size, norms)
        except Exception:  # a model that cannot be copied or run in float64 (its float32 run passed)
            return None
        # Both paths' sums take the same factors (book-keeping's), at C and at the median of
        # book-keeping's norms (so that the factors differ between examples): the norms are
        # compared below, and the sums compare what each path adds for the same factors.
        known = torch.isfinite(sq)
        median = float(sq[known].sqrt().median()) if bool(known.any()) else 0.0
        bounds = list(dict.fromkeys(b for b in (self.clip_norm, median) if b > 0))
        factor_sets = [clip_factors(sq.sqrt(), bound) for bound in bounds]
        try:
            with _no_vmap_fallback_note():
                ref_sq, ref_sums = self._reference64(model64, x64, y, factor_sets)
        except _NoFloat64Reference:  # only the model's own float64 run; any other error is raised
            return None
        finite = torch.isfinite(ref_sq)
        if not torch.equal(finite, torch.isfinite(sq)):
            return "its non-finite examples differ from the per-example (vmap) reference"
        if not bool(finite.any()):  # nothing was compared: not a pass
            return "the check's inputs gave no example a finite gradient"
        if len(norms) != 1:  # a second measuring pass (float32 rows only): not what was compared
            return "its norms took a second pass in float64"
        why = self.norms_disagree(norms[0], ref_sq, finite)
        if why:
            return why
        for bound, (factors, ok), ref in zip(bounds, factor_sets, ref_sums):
            fast = dict(clipper.contributions(parts, factors, ok))
            if set(fast) != set(ref):
                return "it clips other parameters than the per-example (vmap) reference"
            # The scale is what the shares add up to in magnitude, Σ_i f_i·‖g_i‖ (a sum whose
            # shares cancel between examples would make any rounding look large beside it).
            sum_scale = float((factors * ref_sq.sqrt())[finite].sum())
            # The difference is measured as one vector over every parameter (ℓ2), as the shares are.
            worst = math.sqrt(sum(float((fast[k] - ref[k]).square().sum()) for k in ref))
            if not worst <= FORMULA_RTOL * sum_scale:  # a NaN in a sum fails too
                return (
                    f"its clipped sum at bound {bound:.3g} differs from the per-example (vmap) reference, "
                    f"by {worst / max(sum_scale, 1e-300):.1e} of its shares' magnitude in float64"
                )
        return ""

    def _reference64(self, model64: nn.Module, x64: torch.Tensor, y: torch.Tensor, factor_sets: list):
        """(each example's squared norm, [B] float64; for each (factors, kept) of ``factor_sets``,
        Σ_i f_i·g_i per parameter) from the vmap reference's per-example gradients of the float64
        model, formed :data:`REFERENCE_CHUNK` examples at a time, so that all of them never
        live at once (all-MiniLM-L6-v2's 8 examples: 1.4 GB of float64 gradients, 0.75 GB of
        them the token table's)."""
        try:
            grads = PerSampleGradients(model64, self.loss_fn, multiplicity=self.multiplicity)
        except Exception as e:
            raise _NoFloat64Reference from e
        sq_parts: list[torch.Tensor] = []
        sums: list[dict[str, torch.Tensor]] = [{} for _ in factor_sets]
        for at in range(0, x64.shape[0], REFERENCE_CHUNK):
            chunk = slice(at, at + REFERENCE_CHUNK)
            try:
                per_example = grads(x64[chunk], y[chunk])
            except Exception as e:  # the model cannot run in float64 under vmap
                raise _NoFloat64Reference from e
            sq_parts.append(per_sample_norms(per_example).square())
            for (factors, ok), into in zip(factor_sets, sums):
                f, keep = factors[chunk], ok[chunk]
                every = bool(keep.all())  # then the rows are summed as they are, not copied
                for k, g in per_example.items():
                    part = weighted_sum(f, g if every else kept_rows(g, keep))
                    into[k] = into[k].add_(part) if k in into else part
            del per_example
        return torch.cat(sq_parts), sums

    @staticmethod
    def norms_disagree(norms: bookkeeping.SquaredNorms, ref_sq: torch.Tensor, finite: torch.Tensor) -> str:
        """Why book-keeping's squared norms (``norms``, as the forms measured them: with their
        allowances, before any raise for the clipped sum's rounding) disagree with the vmap
        reference's ``ref_sq`` on the ``finite`` examples ("" if they agree).

        A ghost form adds to its norms an allowance for its own float64 rounding
        (:meth:`~dpcore.bookkeeping.base.SquaredNorms.add_allowance`), of about (d + c + 2T)·u·β²,
        β the sum of its terms' magnitudes: where an example's positions cancel (wide layers over
        long sequences) that can exceed FORMULA_RTOL of the scale. The allowance only raises a
        norm (a smaller factor, safe), so it is expected above the reference, twice over (the
        allowance, and the rounding it allows for), and never below it. Below, a norm fails by
        more than FORMULA_RTOL of the largest example's, or by more than :data:`BELOW_RTOL` of
        its own example's (norms can spread over hundreds of orders of magnitude, and a small
        one's shortfall would hide under the largest's scale)."""
        measured, allowance = norms.measured()
        ref, got, allowed = ref_sq[finite], measured[finite], allowance[finite]
        scale = float(ref.max())
        under, over = ref - got, got - ref - 2 * allowed
        # (Where a norm is so small that its square is subnormal, its relative precision is lost:
        # the per-example bound keeps a floor far below any normal number's.)
        own = BELOW_RTOL * ref + torch.finfo(torch.float64).tiny / BELOW_RTOL
        for gap, bound, how, of in (
            (under, FORMULA_RTOL * scale, "below", "their scale"),
            (under, own, "below", "its own example's"),
            (over, FORMULA_RTOL * scale, "above", "their scale"),
        ):
            if not bool((gap <= bound).all()):  # a NaN fails too
                size = scale if of == "their scale" else ref
                worst = float((gap / torch.as_tensor(size, dtype=gap.dtype).clamp_min(1e-300)).max())
                beyond = " beyond its forms' allowance for rounding" if how == "above" else ""
                return (
                    f"its per-example norms are {how} the per-example (vmap) reference's, by {worst:.1e} of "
                    f"{of} in float64{beyond}"
                )
        return ""

"""Per-example L2 clipping and the clipped sum.

Each example's gradient (all trainable parameters together, as one vector) is scaled by
min(1, C/‖g_i‖). To keep the invariant ‖clipped g_i‖ ≤ C true in floating point, norms are
accumulated in float64 and the factor for an example above the bound is
C·(1 − 1e-6)/‖g_i‖: the relative margin of 1e-6 is far larger than float32's rounding
(≈6e-8 per multiply), and changes the clipped norm by one part in a million.

Non-finite gradients (NaN or ±inf anywhere in an example's gradient): the policy is
**skip-and-count**. That example contributes exactly zero to the sum (norm 0 ≤ C, so the
sensitivity analysis is untouched and the step still gets its full noise), and the
number of such examples is counted. The count is a statistic of private data, so it is
exposed only through the explicit diagnostics call of the private optimizer. A NaN is
never folded into the parameters.

Parameters must be float32 or float64 (checked by ``validate_model``): in half precision
the rounding of g·factor can exceed any small margin (bfloat16: up to 0.4 %).

Per-sample norms are available only through :func:`per_sample_norms`, an explicit
diagnostics call: they are not private.
"""

from __future__ import annotations

import contextlib

import torch

from .precision import formulas

CLIP_MARGIN = 1e-6


NORM_ORDERS = (1, 2)


def per_sample_norms(per_sample: dict[str, torch.Tensor], ord: int = 2) -> torch.Tensor:
    """The L2 (or, with ``ord=1``, L1) norm of each example's whole gradient, in float64.

    Used inside the clipped sum; on its own it is a DIAGNOSTICS call (per-example norms are
    not private)."""
    if ord not in NORM_ORDERS:
        raise ValueError(f"ord={ord!r}: clipping norms are L1 (1) or L2 (2).")
    total = None
    for g in per_sample.values():
        flat = g.reshape(g.shape[0], -1)
        if ord == 2:
            s = torch.linalg.vector_norm(flat, dim=1, dtype=torch.float64).square()
        else:
            s = torch.linalg.vector_norm(flat, ord=1, dim=1, dtype=torch.float64)
        total = s if total is None else total + s
    return total.sqrt() if ord == 2 else total


def clip_factors(norms: torch.Tensor, clip_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale factors min(1, C/‖g‖) (with the safety margin), and the mask of finite rows.

    Rows whose norm is not finite get factor 0.
    """
    finite = torch.isfinite(norms)
    bound = clip_norm * (1.0 - CLIP_MARGIN)
    safe = torch.where(finite, norms, torch.ones_like(norms))
    factors = torch.where(safe > bound, bound / safe.clamp_min(1e-300), torch.ones_like(safe))
    factors = torch.where(finite, factors, torch.zeros_like(factors))
    return factors, finite


# The float64 copies of a batch's sums (the lot's sums are float64, dpcore/lot.py) are made and added this
# many bytes at a time (a larger tensor in pieces), so that they never all live at once: all of
# them would add 8 bytes per parameter to the step's peak. (The batch-size probe of
# dpcore/memory.py adds into float64 sums too, so its measured peak includes this group.)
WIDEN_GROUP_BYTES = 16 * 2**20


def add_into(targets: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """``targets[k] += values[k]`` for all k, by multi-tensor adds; a value of another dtype
    than its target is cast first, at most ``WIDEN_GROUP_BYTES`` of casts at a time."""
    group_t, group_v, size = [], [], 0
    for t, v in zip(targets, values, strict=True):
        if v.dtype == t.dtype:
            group_t.append(t)
            group_v.append(v)
            continue
        step = max(1, WIDEN_GROUP_BYTES // t.element_size())
        if v.numel() > step and t.is_contiguous() and v.is_contiguous():
            pieces = zip(t.view(-1).split(step), v.view(-1).split(step))
        else:
            pieces = [(t, v)]
        for tp, vp in pieces:
            group_t.append(tp)
            group_v.append(vp.to(tp.dtype))
            size += tp.numel() * tp.element_size()
            if size >= WIDEN_GROUP_BYTES:
                torch._foreach_add_(group_t, group_v)
                group_t, group_v, size = [], [], 0
    if group_t:
        torch._foreach_add_(group_t, group_v)


def clipped_sum(
    per_sample: dict[str, torch.Tensor], clip_norm: float, out: dict[str, torch.Tensor] | None = None, ord: int = 2
) -> tuple[dict[str, torch.Tensor], int]:
    """Σ_i g_i·min(1, C/‖g_i‖) over the batch, added into ``out`` when given.

    ``ord=1`` clips the L1 norm instead (for Laplace noise, whose sensitivity is in L1); the
    same float64 norms and relative margin keep ‖clipped g_i‖₁ ≤ C.
    Returns ``(sums, nonfinite_count)``. Examples with a non-finite gradient contribute zero.
    """
    first = next(iter(per_sample.values()), None)
    with formulas(first) if first is not None else contextlib.nullcontext():  # autocast off, whatever the caller opened
        return _clipped_sum(per_sample, clip_norm, out, ord)


def _clipped_sum(per_sample, clip_norm, out, ord):
    norms = per_sample_norms(per_sample, ord)
    factors, finite = clip_factors(norms, clip_norm)
    n_bad = int((~finite).sum())
    result = {} if out is None else out
    # A factor below the dtype's smallest normal number loses precision when cast (a gradient
    # of norm ≳1e32·C in float32): those rare rows are scaled in float64. One check per dtype.
    extreme_by_dtype: dict[torch.dtype, tuple[torch.Tensor, bool]] = {}
    for name, g in per_sample.items():
        if n_bad:
            g = torch.where(finite.view(-1, *([1] * (g.dim() - 1))), g, g.new_zeros(()))
        if g.dtype not in extreme_by_dtype:
            mask = factors < torch.finfo(g.dtype).tiny * 2.0**24
            extreme_by_dtype[g.dtype] = (mask, bool(mask.any()))
        extreme, any_extreme = extreme_by_dtype[g.dtype]
        if any_extreme:
            contrib = torch.einsum("i,i...->...", factors[~extreme].to(g.dtype), g[~extreme])
            contrib = contrib + torch.einsum("i,i...->...", factors[extreme], g[extreme].double()).to(g.dtype)
        else:
            contrib = torch.einsum("i,i...->...", factors.to(g.dtype), g)
        if name in result:
            add_into([result[name]], [contrib])
        else:
            result[name] = contrib
    return result, n_bad

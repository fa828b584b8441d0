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

from . import native
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


# Where the compiled kernel does not apply (a GPU, no C compiler), Σ_i f_i·X_i is formed from
# float64 copies of X, this many bytes of copy at a time: on a CPU, pieces that stay in cache
# (4 MiB was the fastest of 0.25–16 MiB, docs/benchmarks/README.md); on a GPU, where the copy is
# cheap and each piece costs two kernel launches, pieces of up to 256 MiB. (The batch-size
# probe of dpcore/memory.py runs this same code, so the copies are in the peak it measures.)
F64_PIECE_BYTES = {"cpu": 4 * 2**20}
F64_PIECE_BYTES_DEFAULT = 256 * 2**20


# A batch's float64 sums are added into the lot's this many bytes at a time (by multi-tensor
# adds: one kernel per group on a GPU), so that they never all live at once: all of them would
# add 8 bytes per parameter to the step's peak (a 2048 × 2048 layer: 32 MiB). (The batch-size
# probe of dpcore/memory.py adds into float64 sums as training does, so it measures this.)
ADD_GROUP_BYTES = 16 * 2**20


def weighted_sum(factors: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """Σ_i factors[i]·X[i] over X's first dimension, in float64, every sum over the examples
    accumulated in float64: a float64 tensor of shape ``X.shape[1:]``.

    Why float64. Each example's share f_i·X_i has norm ≤ C, but the rounding of a float32 sum
    over examples depends on all of them: taking one example out of a lot regroups the sums, and
    the released sum moves by more than C (``docs/benchmarks/float_sensitivity.py``). In
    float64, a sum of k shares is within about (k − 1)·2⁻⁵³ of the sum of their magnitudes
    (k·C at most): inside the clipping margin ``CLIP_MARGIN`` for any lot size below about
    45,000 (the README's "What the guarantee does not cover" gives the bound).
    The factors are never rounded to X's dtype either. Float32 X is read by the compiled kernel
    of :mod:`dpcore.native` on a CPU, else copied to float64 in pieces (``F64_PIECE_BYTES``).
    Rows to be dropped (non-finite examples) must be zero in X or have factor 0 (the kernel
    skips those rows; torch would form 0·NaN)."""
    f = factors.to(device=X.device, dtype=torch.float64)
    flat = X.reshape(X.shape[0], -1)
    if flat.dtype == torch.float64:
        return (f @ flat).reshape(X.shape[1:])
    got = native.weighted_sum(f, flat)
    if got is not None:
        return got.reshape(X.shape[1:])
    piece = F64_PIECE_BYTES.get(X.device.type, F64_PIECE_BYTES_DEFAULT)
    rows = max(1, piece // max(1, 8 * flat.shape[1]))
    out = None
    for k in range(0, flat.shape[0], rows):
        part = f[k : k + rows] @ flat[k : k + rows].to(torch.float64)
        out = part if out is None else out.add_(part)
    if out is None:  # no examples
        out = torch.zeros(flat.shape[1], dtype=torch.float64, device=X.device)
    return out.reshape(X.shape[1:])


def clipped_sum(
    per_sample: dict[str, torch.Tensor], clip_norm: float, out: dict[str, torch.Tensor] | None = None, ord: int = 2
) -> tuple[dict[str, torch.Tensor], int]:
    """Σ_i g_i·min(1, C/‖g_i‖) over the batch, added into ``out`` when given.

    ``ord=1`` clips the L1 norm instead (for Laplace noise, whose sensitivity is in L1); the
    same float64 norms and relative margin keep ‖clipped g_i‖₁ ≤ C.
    Returns ``(sums, nonfinite_count)``; new sums are float64, every sum over examples
    accumulated in float64 (:func:`weighted_sum`). Examples with a non-finite gradient contribute
    zero.
    """
    first = next(iter(per_sample.values()), None)
    with formulas(first) if first is not None else contextlib.nullcontext():  # autocast off, whatever the caller opened
        return _clipped_sum(per_sample, clip_norm, out, ord)


def _clipped_sum(per_sample, clip_norm, out, ord):
    norms = per_sample_norms(per_sample, ord)
    factors, finite = clip_factors(norms, clip_norm)
    n_bad = int((~finite).sum())
    result = {} if out is None else out
    for name, g in per_sample.items():
        if n_bad:
            g = torch.where(finite.view(-1, *([1] * (g.dim() - 1))), g, g.new_zeros(()))
        contrib = weighted_sum(factors, g)  # float64 (see weighted_sum)
        if name in result:
            result[name].add_(contrib)
        else:
            result[name] = contrib
    return result, n_bad

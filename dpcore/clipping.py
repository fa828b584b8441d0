"""Per-example L2 clipping and the clipped sum.

Each example's gradient (all trainable parameters together, as one vector) is scaled by
min(1, C/‖g_i‖). To keep the invariant ‖clipped g_i‖ ≤ C true in floating point, norms are
accumulated in float64 and the factor for an example above the bound is
C·(1 − m)/‖g_i‖ with the relative margin m = ``CLIP_MARGIN`` = 10⁻⁴. The margin absorbs the
rounding of the norms (``NORM_ERROR``) and of the sums over examples: one example moves the lot's
computed sum by at most :func:`float_sensitivity` ·C, which is ≤ C for every lot size up to
:func:`covered_lot_size` (README, "What the guarantee does not cover"). It changes the clipped
norm by one part in ten thousand.

The rounding of a sum over examples is bounded by the magnitudes of its terms. For most layer
forms an example's terms are its share itself, but a ghost form's terms are its per-position
products, whose magnitudes β_i can far exceed the share's norm when positions cancel. Each
example's within-batch rounding R_i (:func:`rounding_floor`) is therefore held to
``ROUNDING_SHARE``·C by clipping on max(‖g_i‖, R_i/ρ): for natural data that is ‖g_i‖.

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
import math
import warnings

import torch

from . import native
from .precision import formulas

# m: the clipped share's norm is at most C·(1 − m) in exact arithmetic (see the module docstring).
CLIP_MARGIN = 1e-4
# The largest relative error of a norm the clip factor is computed from: book-keeping sums a
# materialised layer's squares in float32 chunks (dpcore.bookkeeping.norms.F32_CHUNK), 5.4e-7 of
# the norm at most; float64 norms are far closer.
NORM_ERROR = 5.4e-7
# ρ: the most rounding an example's terms may take within their physical batch, relative to C
# (:func:`rounding_floor`). 2⁻³⁴ ≈ 5.8e-11 is γ_n of a sum of n ≈ 500,000 terms: a materialised
# layer's batch sum (n = B + 2, B the configured physical batch size) never reaches it, and a ghost
# form's (n = :func:`ghost_roundings`) reaches it only where β_i/‖g_i‖ exceeds ρ/γ_n, about 120
# where natural examples give about √T (docs/benchmarks/README.md).
ROUNDING_SHARE = 2.0**-34
UNIT_ROUNDOFF = 2.0**-53  # float64


# A ghost form's clipped sum runs over (example, position) terms in products of whole examples,
# at most this many terms each where T allows (:func:`ghost_chunk` examples), whose results are
# then added: each term passes through :func:`ghost_roundings` roundings, e·T + 1 + ⌈B/e⌉ (4,101
# at B = 256, T = 64), where one product over the batch would take B·T + 1 (16,385 there). With
# one product, ρ/γ_{B·T+1} ≈ 2¹⁹/(B·T) fell below the √T that natural examples give where B·T^1.5
# nears 2¹⁹; in chunks the cap starts near β_i/‖g_i‖ = 128 (up to T = 4,096), above √T for T up to
# about 6,000 positions.
GHOST_CHUNK_TERMS = 4096


def ghost_chunk(positions: int) -> int:
    """How many examples a ghost form's product takes at a time: GHOST_CHUNK_TERMS // T, at least 1."""
    return max(1, GHOST_CHUNK_TERMS // positions)


def ghost_roundings(batch: int, positions: int) -> int:
    """The most roundings a term of a ghost form's clipped sum passes through, in batches of up to
    ``batch`` examples with ``positions`` positions each: its multiply by f_i, its product, the
    additions within its chunk of e = :func:`ghost_chunk` examples (e·T − 1), and those of the
    ⌈batch/e⌉ chunks' results; e·T + 1 + ⌈batch/e⌉ (one to spare), e at most ``batch``."""
    e = min(ghost_chunk(positions), batch)
    return e * positions + 1 + math.ceil(batch / e)


def gamma(n: int) -> float:
    """γ_n = n·u/(1 − n·u), u = 2⁻⁵³: the relative error of a float64 term that passes through
    n roundings, in any order (Higham, *Accuracy and Stability of Numerical Algorithms*, §3.1)."""
    nu = n * UNIT_ROUNDOFF
    if nu >= 1:
        return math.inf
    return nu / (1.0 - nu)


def float_sensitivity(lot: int, batch: int, workers: int = 1, sums: int | None = None) -> float:
    """The most one example can move a lot's computed clipped sum, in units of C: the bound
    S + (2L + 1)·(ρ + γ_n·(1 + ρ)) of the README's "What the guarantee does not cover", for a lot
    of L examples summed in physical batches of ``batch`` on ``workers`` workers, against the
    neighbouring dataset's lot of L + 1 (adding an example; removing one gives L − 1, less).

    S = (1 − m)·(1 + NORM_ERROR) is the largest share; within each physical batch an example's
    terms take at most ρ·C of rounding (``ROUNDING_SHARE``, held by :func:`rounding_floor`);
    each batch's float64 sum then passes through n = s + 2W roundings: the additions of the
    s = ``sums`` batch sums into the lot's sum on a worker (by default ⌈(L + 1)/B⌉, one per full
    physical batch of the larger lot; a lot added in smaller pieces makes more, which
    :class:`dpcore.DPOptimizer` counts, and the larger lot one more; a token table's rows are
    summed per token within the batch first, :mod:`dpcore.bookkeeping.embedding`), and the
    reduction over the workers. Adding an example changes the exact sum by its share, and the
    two computed sums are within L·(ρ + γ_n·(1 + ρ))·C and (L + 1)·(ρ + γ_n·(1 + ρ))·C of
    their exact ones."""
    if lot < 1 or batch < 1 or workers < 1:
        raise ValueError("lot, batch and workers must be positive")
    share = (1.0 - CLIP_MARGIN) * (1.0 + NORM_ERROR)
    n = (math.ceil((lot + 1) / batch) if sums is None else max(1, sums) + 1) + 2 * workers
    return share + (2.0 * lot + 1.0) * (ROUNDING_SHARE + gamma(n) * (1.0 + ROUNDING_SHARE))


def covered_lot_size(batch: int, workers: int = 1) -> int:
    """The largest lot whose :func:`float_sensitivity` is at most 1 (so that the clipping
    margin absorbs every rounding) in physical batches of ``batch`` on ``workers`` workers; 0
    if none is."""
    if float_sensitivity(1, batch, workers) > 1.0:
        return 0
    lo, hi = 1, 2
    while float_sensitivity(hi, batch, workers) <= 1.0:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # the bound grows with the lot
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if float_sensitivity(mid, batch, workers) <= 1.0 else (lo, mid)
    return lo


def warn_if_uncovered(dataset_size: int, batch: int, workers: int = 1) -> float:
    """:func:`float_sensitivity` for the largest lot a dataset of ``dataset_size`` can give (all
    of it), with a warning where it exceeds 1: there the margin does not cover the worst-case
    rounding of the sums, and the guarantee, like other DP-SGD libraries', takes the
    sensitivity to be C. Returns the bound."""
    bound = float_sensitivity(dataset_size, batch, workers)
    if bound > 1.0:
        warnings.warn(
            f"floating point: a lot of up to N={dataset_size:,} examples in physical batches of {batch} on "
            f"{workers} worker(s) could, in the worst case, let one example move the lot's sum by {bound:.7f}·C, "
            f"above the C the accountant assumes; the clipping margin covers lots of up to "
            f"{covered_lot_size(batch, workers):,} examples (README, 'What the guarantee does not cover').",
            stacklevel=3,
        )
    return bound


def warn_if_pieces_uncovered(dataset_size: int, batch: int, workers: int, sums: int) -> bool:
    """Warn where a lot was added in ``sums`` batch sums, more than the ⌈N/B⌉ that
    :func:`warn_if_uncovered` counted (a lot passed to ``accumulate`` in pieces smaller than the
    physical batch: each piece is its own batch sum, and each sum rounds the lot's), and the
    bound for that many exceeds 1. Returns whether it warned. The message states no count and
    no bound: with small pieces their number follows the lot's size, which is private."""
    if sums <= math.ceil(dataset_size / batch) or float_sensitivity(dataset_size, batch, workers, sums) <= 1.0:
        return False
    warnings.warn(
        f"floating point: a lot was added in more pieces than the physical batches of {batch} it needs, and so many "
        "batch sums round the lot's sum by more than the clipping margin covers; pass each lot whole, or in pieces "
        "of at least the physical batch size (README, 'What the guarantee does not cover').",
        stacklevel=3,
    )
    return True


def rounding_floor(sq: torch.Tensor, batch: int, extra: torch.Tensor | None = None) -> torch.Tensor:
    """The squared norms to clip on: max(‖g_i‖², R_i²/ρ²) (ρ = ``ROUNDING_SHARE``), so that each
    example's within-batch rounding f_i·R_i is at most ρ·C, whatever its factor f_i.

    ``sq``: each example's squared norm (float64 [B]). ``batch``: the configured physical batch
    size, which the batch's size never exceeds: R_i then depends on example i alone, not on how
    many examples share its batch (the last batch of a Poisson lot holds a number that depends
    on the data). R_i² = γ_{batch+2}²·‖g_i‖² + ``extra``_i: the first term covers every sum whose
    terms are the example's share (a weighted sum of the batch's rows, with its multiply; a
    ghost form with one position, with its two); ``extra`` adds (γ_k·β_i)² for each ghost form
    whose product runs over k terms per batch with magnitudes β_i
    (:meth:`dpcore.bookkeeping.base.SquaredNorms.add_rounding`). Where R_i ≤ ρ·‖g_i‖ (every
    materialised form below batches of about 10⁶, natural examples in most ghost forms) the
    norms are returned as they are; no value is read on the host. A floor too large for float64
    is +inf: that example is then skipped (it adds zero) like one whose gradient is not finite."""
    g = gamma(batch + 2)
    if extra is None:
        return sq if g <= ROUNDING_SHARE else sq * (g / ROUNDING_SHARE) ** 2
    return torch.maximum(sq, (sq * g**2 + extra) / ROUNDING_SHARE**2)


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


def kept_rows(rows: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``rows`` with each row where ``keep`` ([B] bool) is False set to exactly zero: a
    non-finite example contributes nothing (multiplying it by a factor of 0 would give NaN)."""
    return torch.where(keep.view(-1, *([1] * (rows.dim() - 1))), rows, rows.new_zeros(()))


def weighted_sum(factors: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """Σ_i factors[i]·X[i] over X's first dimension, in float64, every sum over the examples
    accumulated in float64: a float64 tensor of shape ``X.shape[1:]``.

    Why float64. Each example's share f_i·X_i has norm ≤ C, but the rounding of a float32 sum
    over examples depends on all of them: taking one example out of a lot regroups the sums, and
    the released sum moves by more than C (``docs/benchmarks/float_sensitivity.py``). In
    float64, a sum of k shares is within about (k − 1)·2⁻⁵³ of the sum of their magnitudes
    (k·C at most): inside the clipping margin ``CLIP_MARGIN`` for any lot up to
    :func:`covered_lot_size` (:func:`float_sensitivity` gives the bound).
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
    per_sample: dict[str, torch.Tensor],
    clip_norm: float,
    out: dict[str, torch.Tensor] | None = None,
    ord: int = 2,
    batch_size: int | None = None,
) -> tuple[dict[str, torch.Tensor], int]:
    """Σ_i g_i·min(1, C/‖g_i‖) over the batch, added into ``out`` when given.

    ``ord=1`` clips the L1 norm instead (for Laplace noise, whose sensitivity is in L1); the
    same float64 norms and relative margin keep ‖clipped g_i‖₁ ≤ C.
    ``batch_size``: the configured physical batch size, at least this batch's (the default):
    the bound on rounding that :func:`rounding_floor` holds is taken at it, so that an
    example's factor never depends on how many examples share its batch.
    Returns ``(sums, nonfinite_count)``; new sums are float64, every sum over examples
    accumulated in float64 (:func:`weighted_sum`). Examples with a non-finite gradient contribute
    zero.
    """
    first = next(iter(per_sample.values()), None)
    with formulas(first) if first is not None else contextlib.nullcontext():  # autocast off, whatever the caller opened
        return _clipped_sum(per_sample, clip_norm, out, ord, batch_size)


def _clipped_sum(per_sample, clip_norm, out, ord, batch_size):
    norms = per_sample_norms(per_sample, ord)
    batch = rounding_batch_size(norms.shape[0], batch_size)
    # Each term of these sums is an example's share (so R_i = γ_{B+2}·‖g_i‖, in L1 as in L2):
    # rounding_floor changes nothing below batches of about 10⁶.
    g = gamma(batch + 2)
    if g > ROUNDING_SHARE:
        norms = norms * (g / ROUNDING_SHARE)
    factors, finite = clip_factors(norms, clip_norm)
    n_bad = int((~finite).sum())
    result = {} if out is None else out
    for name, grad in per_sample.items():
        if n_bad:
            grad = kept_rows(grad, finite)
        contrib = weighted_sum(factors, grad)  # float64 (see weighted_sum)
        if name in result:
            result[name].add_(contrib)
        else:
            result[name] = contrib
    return result, n_bad


def rounding_batch_size(realised: int, configured: int | None) -> int:
    """The batch size the rounding bound is taken at: the configured physical batch size, which
    must hold the batch (``realised`` examples); the batch's own size where none is given."""
    if configured is None:
        return realised
    if configured < realised:
        raise ValueError(f"a batch of {realised} examples exceeds the physical batch size {configured}")
    return configured

"""The training methods of the papers, as options of the private step, and their checks.

* ``"dpsgd"``: Abadi et al. 2016. Per-example gradients at θ, clipped, summed, noised.
* ``"bam"``: Knolle et al. 2023, Algorithm 2 (bias-aware minimisation). Each example's
  gradient is taken at its own ascent point θ + λ·g_i/‖g_i‖ (``variant="sam"``), or is the exact
  ∇L_i + λ·H_i g_i/‖g_i‖ (``variant="exact"``), then clipped, summed and noised as in DP-SGD.
  The paper's line 7 writes the noise inside the per-example sum; its text says that "all
  quantities are privatised as in DP-SGD", and that is what is done: one N(0, σ²C²I) draw per
  lot, added to the sum of the clipped per-example BAM gradients. λ = 0 is DP-SGD exactly.
* ``"dpsat"``: Park et al. 2023. Before the lot's gradients are computed, the weights move once
  to θ + ρ·ĝ_{t−1}/‖ĝ_{t−1}‖, along the previous step's *privatised* gradient (no extra privacy
  cost: post-processing of a release); every physical batch of the lot is evaluated there, and
  the weights are restored exactly (a saved copy, not a subtraction) before the update.

Noise: ``"gaussian"`` (L2 clipping, N(0, σ²C²)) or ``"laplace"`` (L1 clipping, Laplace of scale
b·C per coordinate, accounted as a Poisson-sampled Laplace mechanism by PLD). The Laplace
form exists to make the DP-Adam paper's mechanism honest; see docs/methods.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ..errors import DPConfigError

BAM_VARIANTS = ("sam", "exact")
NOISE_KINDS = ("gaussian", "laplace")
CLIP_NORM_TYPES = ("l2", "l1")
ASCENT_SCHEDULES = ("constant", "warmup", "cosine")

Schedule = Callable[[int], float]
AscentArg = float | Schedule  # λ / ρ: a number, or a schedule ``step -> value`` (0-based step)


def bookkeeping_applies(method: str, augmentation_multiplicity: int, clip_norm_type: str) -> bool:
    """Whether book-keeping clipping (L2 norms of plain per-example gradients) can serve these
    options: not BAM's ascent point, averaged augmented copies, or L1 clipping."""
    from . import METHODS as classes

    return classes[method].bookkeeping_ok and augmentation_multiplicity == 1 and clip_norm_type != "l1"


def check_method_options(
    *,
    method: str = "dpsgd",
    ascent: float = 0.0,
    bam_variant: str = "sam",
    noise: str = "gaussian",
    clip_norm_type: str = "l2",
    augmentation_multiplicity: int = 1,
    clipping: str = "vmap",
    accountant: str | None = None,
) -> None:
    """Every method option, checked before anything is sampled or released."""
    from . import METHODS  # the registry of method classes

    if method not in METHODS:
        raise DPConfigError(f"method={method!r} is unknown; choose one of {', '.join(METHODS)}.")
    if bam_variant not in BAM_VARIANTS:
        raise DPConfigError(f"bam_variant={bam_variant!r} is unknown; choose one of {', '.join(BAM_VARIANTS)}.")
    if not callable(ascent):
        if isinstance(ascent, bool) or not isinstance(ascent, (int, float)) or not math.isfinite(ascent):
            raise DPConfigError(f"the ascent radius (λ for BAM, ρ for DP-SAT) must be a finite number, not {ascent!r}.")
        if ascent < 0:
            name = "rho (DP-SAT)" if method == "dpsat" else "lambda (BAM)"
            raise DPConfigError(
                f"ascent radius {name} = {ascent} is negative: the ascent step moves *up* the loss, λ ≥ 0 "
                "(0 is plain DP-SGD). A negative value would be a descent step, which neither paper defines."
            )
    if noise not in NOISE_KINDS:
        raise DPConfigError(f"noise={noise!r} is unknown; choose one of {', '.join(NOISE_KINDS)}.")
    if clip_norm_type not in CLIP_NORM_TYPES:
        raise DPConfigError(
            f"clip_norm_type={clip_norm_type!r} is unknown; choose one of {', '.join(CLIP_NORM_TYPES)}."
        )
    if noise == "laplace" and clip_norm_type != "l1":
        raise DPConfigError(
            "noise='laplace' needs clip_norm_type='l1': the Laplace mechanism is calibrated to the L1 "
            "sensitivity, and an L2 clip at C allows an L1 norm of up to C·√d (d parameters). "
            "Set clip_norm_type='l1', or use noise='gaussian' with L2 clipping."
        )
    if (
        isinstance(augmentation_multiplicity, bool)
        or not isinstance(augmentation_multiplicity, int)
        or augmentation_multiplicity < 1
    ):
        raise DPConfigError(
            f"augmentation_multiplicity={augmentation_multiplicity!r} is invalid: it is the number K ≥ 1 of "
            "augmented copies whose gradients are averaged per example (1 = no augmentation)."
        )
    if clipping == "bookkeeping" and not bookkeeping_applies(method, augmentation_multiplicity, clip_norm_type):
        raise DPConfigError(
            "clipping='bookkeeping' computes the L2 norms of plain per-example gradients only; BAM, "
            "augmentation multiplicity and L1 clipping need clipping='vmap'."
        )
    if noise == "laplace" and accountant is not None and accountant != "pld":
        raise DPConfigError(
            f"noise='laplace' is accounted by PLD only (dp_accounting's RDP has no Poisson-sampled Laplace "
            f"event); accountant={accountant!r} cannot be used. Use accountant='pld'."
        )

"""σ for a target (ε, δ), and the largest number of releases that fits a budget.

Both are searches over an accountant's ε. With PLD, each search runs on the accountant's
coarse grid (ten times faster; its ε is above the fine grid's, by about 2e-4 to 4e-3 in
2026-11-29's measurements) and its answer is then
checked, and corrected if needed, on the fine grid that the ledger uses: the guarantees stated
below are always those of the fine grid.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

from ..errors import DPConfigError
from ..events import POISSON_GAUSSIAN, POISSON_LAPLACE, PrivacyEvent
from ..validation import check_delta, check_epsilon, check_sample_rate
from . import check_accountant, delta, epsilon


def dpsgd_epsilon(
    noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "pld"
) -> float:
    """ε of ``steps`` DP-SGD steps (Poisson rate q, noise multiplier σ) at δ."""
    return epsilon([(PrivacyEvent.dpsgd_step(noise_multiplier, sample_rate), steps)], delta, accountant)


def _eps_fn(groups_of, target_delta: float, accountant: str, coarse: bool):
    """ε as a function of the search variable, with ``accountant`` (a name) on its fine or coarse grid."""
    return lambda x: epsilon(groups_of(x), target_delta, accountant, coarse=coarse)


def calibrate_noise_multiplier(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "pld",
    rel_tol: float = 0.005,
    prior_groups: Sequence[tuple[PrivacyEvent, int]] = (),
    kind: str = POISSON_GAUSSIAN,
) -> float:
    """The smallest σ (to ``rel_tol`` in ε) whose ε after ``steps`` DP-SGD steps is ≤ target.

    ``kind=POISSON_LAPLACE`` calibrates the Laplace form's b/C instead (PLD only).

    Guarantees ε(σ) ≤ target_epsilon on every path, unless no σ can reach the target (then
    :class:`DPConfigError`). Tightness, ε(σ) ≥ (1 − rel_tol)·target_epsilon, holds except where
    σ ≤ 10⁻³ already meets the target (that σ is returned as it is) or the search ends after its
    60 steps (the last σ that met the target is returned). ``prior_groups`` are other events of
    the same run (a DP-PCA release, say) that are composed with the steps.

    Method: a cheap RDP bracket first (RDP is looser, so its σ is an upper end), then
    regula falsi on log ε against log σ, on the accountant's coarse grid; the answer is then
    checked on the fine grid, the one the ledger uses, and only if it fails that check is the
    search repeated on the fine grid. The guarantees above are always those of the fine grid.
    """
    target_epsilon = check_epsilon(target_epsilon)
    target_delta = check_delta(target_delta)
    sample_rate = check_sample_rate(sample_rate)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
        raise DPConfigError(f"steps={steps!r} is invalid: it must be a positive integer.")
    check_accountant(accountant)
    if kind not in (POISSON_GAUSSIAN, POISSON_LAPLACE):
        raise DPConfigError(
            f"kind={kind!r}: only per-step events ({POISSON_GAUSSIAN}, {POISSON_LAPLACE}) are calibrated."
        )
    if kind == POISSON_LAPLACE and accountant != "pld":
        raise DPConfigError(f"Laplace steps are accounted by PLD only, not {accountant!r}.")
    prior = [(e, c) for e, c in prior_groups if int(c) > 0]
    step = PrivacyEvent.of(kind, 1.0, sample_rate)

    def eps_at(coarse: bool):
        def eps(sigma: float, acc: str = accountant) -> float:
            return epsilon(prior + [(step.with_noise(sigma), steps)], target_delta, acc, coarse=coarse)

        return eps

    exact = eps_at(False)
    sigma = _calibrate(eps_at(True), accountant, kind, target_epsilon, rel_tol)
    if (1.0 - rel_tol) * target_epsilon <= exact(sigma) <= target_epsilon:
        return sigma
    return _calibrate(exact, accountant, kind, target_epsilon, rel_tol)


def _calibrate(eps, accountant: str, kind: str, target_epsilon: float, rel_tol: float) -> float:
    """calibrate_noise_multiplier's search with the ε function ``eps(σ, accountant)``."""

    # An upper end: for PLD, RDP's σ (a looser accountant ⇒ a larger σ); grow until ε ≤ target.
    hi = 1.0
    cheap = "rdp" if (accountant == "pld" and kind == POISSON_GAUSSIAN) else accountant
    while eps(hi, cheap) > target_epsilon:
        hi *= 2.0
        if hi > 1e6:
            raise DPConfigError(
                f"target_epsilon={target_epsilon} cannot be met: even σ=1e6 exceeds it "
                f"(other releases of the run may already spend it). Raise target_epsilon or reduce those releases."
            )
    lo = hi / 2.0
    while eps(lo, cheap) <= target_epsilon and lo > 1e-3:
        hi, lo = lo, lo / 2.0
    # Now refine with the requested accountant.
    e_hi = eps(hi)
    while e_hi > target_epsilon:  # possible for 'pld' vs 'rdp' only in pathological cases
        lo, hi = hi, hi * 1.5
        e_hi = eps(hi)
    e_lo = eps(lo)
    while e_lo <= target_epsilon and lo > 1e-3:
        hi, e_hi = lo, e_lo
        lo /= 1.5
        e_lo = eps(lo)
    if e_lo <= target_epsilon:
        return lo
    # Invariant: e_lo > target ≥ e_hi. Illinois regula falsi in log space (an ε that an
    # accountant rounds to 0, at a tiny target, counts as the smallest positive float).
    lt = math.log(target_epsilon)
    f_lo, f_hi = _log(e_lo) - lt, _log(e_hi) - lt
    side = 0
    for _ in range(60):
        if e_hi >= (1.0 - rel_tol) * target_epsilon:
            return hi
        llo, lhi = math.log(lo), math.log(hi)
        x = lhi - f_hi * (lhi - llo) / (f_hi - f_lo) if f_hi != f_lo else 0.5 * (llo + lhi)
        if not (llo < x < lhi):
            x = 0.5 * (llo + lhi)
        mid = math.exp(x)
        e_mid = eps(mid)
        f_mid = _log(e_mid) - lt
        if e_mid <= target_epsilon:
            hi, e_hi, f_hi = mid, e_mid, f_mid
            if side == 1:
                f_lo /= 2.0
            side = 1
        else:
            lo, e_lo, f_lo = mid, e_mid, f_mid
            if side == -1:
                f_hi /= 2.0
            side = -1
    return hi


def _log(e: float) -> float:
    return math.log(max(e, sys.float_info.min))


def max_steps(
    noise_multiplier: float,
    sample_rate: float,
    target_epsilon: float,
    target_delta: float,
    accountant: str = "pld",
    prior_groups: Sequence[tuple[PrivacyEvent, int]] = (),
    event: PrivacyEvent | None = None,
    limit: int = 10**8,
) -> int:
    """The largest T such that T steps (plus ``prior_groups``) keep ε ≤ target. 0 if none fits.

    ``event`` overrides the step event (default: DP-SGD with the given σ and q).
    """
    target_epsilon = check_epsilon(target_epsilon)
    target_delta = check_delta(target_delta)
    ev = event or PrivacyEvent.dpsgd_step(noise_multiplier, sample_rate)
    prior = [(e, c) for e, c in prior_groups if int(c) > 0]
    check_accountant(accountant)

    def fits(coarse: bool):
        return lambda t: epsilon(prior + [(ev, t)], target_delta, accountant, coarse=coarse) <= target_epsilon

    if one_release_exceeds(ev, target_epsilon, target_delta):
        return 0
    # Search on the coarse grid, then settle the answer exactly on the fine one around it.
    guess = _largest_count(fits(True), limit)
    return _largest_count_near(fits(False), guess, limit)


def one_release_exceeds(event: PrivacyEvent, target_epsilon: float, target_delta: float) -> bool:
    """Whether one Poisson-subsampled Gaussian release alone is already above (ε, δ), from
    dp_accounting's closed-form privacy loss (the exact δ at ε, both adjacencies), without
    building a privacy-loss distribution: at a tiny σ (a typo, 0.01 for 1.0) that build takes
    minutes before it says that no step fits (helper-42). Composition only adds loss, so then no
    count of it fits, with or without other releases; every accountant here is at least as
    pessimistic. False for other events, and within a rounding margin of the target (the full
    computation then decides)."""
    if event.kind != POISSON_GAUSSIAN:
        return False
    from dp_accounting.pld import privacy_loss_mechanism as plm

    deltas = [
        plm.GaussianPrivacyLoss(
            event.noise_multiplier, sensitivity=1.0, sampling_prob=event.sample_rate, adjacency_type=adjacency
        ).get_delta_for_epsilon(target_epsilon)
        for adjacency in (plm.AdjacencyType.ADD, plm.AdjacencyType.REMOVE)
    ]
    return max(deltas) > target_delta * (1 + 1e-9)


def _largest_count(fits, limit: int) -> int:
    """The largest T ≤ ``limit`` with ``fits(T)``, for a monotone ``fits``; 0 if not even 1."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    if hi > limit:
        if fits(limit):
            return limit
        hi = limit
    return _bisect(fits, lo, hi)  # fits(lo) and not fits(hi)


def _largest_count_near(fits, guess: int, limit: int) -> int:
    """:func:`_largest_count` for a monotone ``fits``, started from ``guess``: galloping away
    from it, then bisecting. Exact whatever the guess; a few evaluations when it is close."""
    guess = min(max(guess, 1), limit)
    if fits(guess):
        lo, step = guess, 1
        while lo + step <= limit and fits(lo + step):
            lo, step = lo + step, step * 2
        hi = min(lo + step, limit + 1)  # not fits(hi), or hi is past the limit
    else:
        hi, step = guess, 1
        while hi - step >= 1 and not fits(hi - step):
            hi, step = hi - step, step * 2
        lo = hi - step
        if lo < 1:
            return 0 if not fits(1) else _bisect(fits, 1, hi)
    return _bisect(fits, lo, hi)


def _bisect(fits, lo: int, hi: int) -> int:
    """The largest t in [lo, hi) with fits(t), given fits(lo) and not fits(hi) (or hi past the limit)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def max_steps_by_delta(
    event: PrivacyEvent,
    epsilon: float,
    delta_bound: float,
    accountant: str = "pld",
    prior_groups: Sequence[tuple[PrivacyEvent, int]] = (),
    limit: int = 10**8,
) -> int:
    """Geyer et al.'s stopping rule as a count: the largest T such that T releases of ``event``
    (plus ``prior_groups``) keep δ at the fixed ``epsilon`` ≤ ``delta_bound`` (their Q). 0 if
    none fits. Because δ(ε) ≤ Q ⟺ ε(Q) ≤ ε for one privacy-loss distribution, this equals
    :func:`max_steps` with (ε, Q) up to the accountant's discretisation; the ledger enforces
    the latter as well, so a run stops at the smaller of the two."""
    epsilon = check_epsilon(epsilon, "epsilon")
    delta_bound = check_delta(delta_bound, "delta_bound")
    prior = list(prior_groups)
    if one_release_exceeds(event, epsilon, delta_bound):
        return 0

    return _largest_count(lambda t: delta(prior + [(event, t)], epsilon, accountant) <= delta_bound, limit)


def steps_for_epochs(epochs: float, sample_rate: float) -> int:
    """Number of steps in ``epochs`` passes at Poisson rate q: round(epochs / q), at least 1."""
    if not isinstance(epochs, (int, float)) or isinstance(epochs, bool) or not math.isfinite(epochs) or epochs <= 0:
        raise DPConfigError(f"epochs={epochs!r} is invalid: it must be a number > 0.")
    return max(1, int(round(epochs / sample_rate)))

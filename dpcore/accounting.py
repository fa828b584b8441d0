"""Privacy events and accountants, on Google's ``dp_accounting``.

Privacy is data: every noisy release is a :class:`PrivacyEvent`; a run's events are
composed and handed to an accountant, which turns them into ε at a given δ.

Accountants (all for the add/remove-one neighbouring relation, example level):

* ``"pld"`` (default): privacy-loss distributions, ``dp_accounting.pld.PLDAccountant``.
  Tight (pessimistic discretisation, so still an upper bound).
* ``"rdp"``: Rényi DP, ``dp_accounting.rdp.RdpAccountant`` with its default orders and
  the modern RDP→(ε, δ) conversion (Balle et al. 2020). This is the moments accountant of
  Abadi et al. in today's terms; it is 8–20 % looser than PLD.
* ``"moments"``: Abadi et al.'s original moments accountant, computed here independently
  of dp_accounting: integer orders λ = 1…255 of the Poisson-subsampled Gaussian's log
  moment (the exact binomial expansion, Mironov et al. 2019 §3.3) and the paper's tail
  bound ε = min_λ (α(λ) + log 1/δ)/λ. It reproduces the paper's ε ≈ 1.26 for q=0.01,
  σ=4, T=10⁴, δ=1e-5. Gaussian events only.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import dp_accounting
import numpy as np
from dp_accounting.pld import privacy_loss_distribution as _pld

from .errors import DPConfigError
from .validation import check_delta, check_epsilon, check_noise_multiplier, check_sample_rate

ACCOUNTANTS = ("pld", "rdp", "moments")
PLD_VALUE_DISCRETIZATION = 1e-4  # dp_accounting's default for PLDAccountant
# Searches (calibration, the largest count that fits) run on a 10× coarser grid, about ten
# times faster; every answer is then checked, and corrected, on the fine grid above.
PLD_SEARCH_DISCRETIZATION = 1e-3

# Event kinds.
POISSON_GAUSSIAN = "poisson_gaussian"  # one DP-SGD step: Poisson-sampled lot, Gaussian noise
GAUSSIAN = "gaussian"  # a plain Gaussian release on the whole dataset (e.g. DP-PCA)
POISSON_LAPLACE = "poisson_laplace"  # Laplace noise on an L1-clipped Poisson lot
LAPLACE = "laplace"
EVENT_KINDS = (POISSON_GAUSSIAN, GAUSSIAN, POISSON_LAPLACE, LAPLACE)


@dataclass(frozen=True)
class PrivacyEvent:
    """One noisy release.

    ``noise_multiplier`` is noise scale / sensitivity: σ for Gaussian events (std = σ·C) and
    b/Δ₁ for Laplace events. ``sample_rate`` is the Poisson rate q (1.0 for releases on the
    whole dataset).
    """

    kind: str
    noise_multiplier: float
    sample_rate: float = 1.0

    def __post_init__(self):
        if self.kind not in EVENT_KINDS:
            raise DPConfigError(f"event kind {self.kind!r} is unknown; use one of {EVENT_KINDS}.")
        check_noise_multiplier(self.noise_multiplier)
        check_sample_rate(self.sample_rate)
        if self.kind in (GAUSSIAN, LAPLACE) and self.sample_rate != 1.0:
            raise DPConfigError(f"a {self.kind!r} event is a release on the whole dataset: sample_rate must be 1.0.")

    def to_dp_event(self) -> dp_accounting.DpEvent:
        if self.kind == POISSON_GAUSSIAN:
            return dp_accounting.PoissonSampledDpEvent(
                self.sample_rate, dp_accounting.GaussianDpEvent(self.noise_multiplier)
            )
        if self.kind == GAUSSIAN:
            return dp_accounting.GaussianDpEvent(self.noise_multiplier)
        if self.kind == POISSON_LAPLACE:
            return dp_accounting.PoissonSampledDpEvent(
                self.sample_rate, dp_accounting.LaplaceDpEvent(self.noise_multiplier)
            )
        return dp_accounting.LaplaceDpEvent(self.noise_multiplier)

    @staticmethod
    def dpsgd_step(noise_multiplier: float, sample_rate: float) -> PrivacyEvent:
        return PrivacyEvent(POISSON_GAUSSIAN, float(noise_multiplier), float(sample_rate))


def check_accountant(accountant: str) -> str:
    if accountant not in ACCOUNTANTS:
        raise DPConfigError(
            f"accountant={accountant!r} is unknown; choose one of {ACCOUNTANTS} (pld is the tight default)."
        )
    return accountant


def compose(groups: Iterable[tuple[PrivacyEvent, int]]) -> dp_accounting.DpEvent:
    """The dp_accounting event for ``count`` repetitions of each event, all composed."""
    parts = [dp_accounting.SelfComposedDpEvent(e.to_dp_event(), int(c)) for e, c in groups if c > 0]
    if not parts:
        return dp_accounting.NoOpDpEvent()
    return parts[0] if len(parts) == 1 else dp_accounting.ComposedDpEvent(parts)


# ---------------------------------------------------------------------------------------
# PLD with a cache of base distributions. Building the PLD of one subsampled Gaussian is the
# expensive part (≈0.1–0.5 s); self-composition of a cached one gives the same numbers as
# dp_accounting.pld.PLDAccountant (same construction, same discretisation).
# ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _base_pld(event: PrivacyEvent, vdi: float):
    if event.kind == POISSON_GAUSSIAN:
        return _pld.from_gaussian_mechanism(
            standard_deviation=event.noise_multiplier,
            sampling_prob=event.sample_rate,
            value_discretization_interval=vdi,
        )
    if event.kind == POISSON_LAPLACE:
        return _pld.from_laplace_mechanism(
            parameter=event.noise_multiplier, sampling_prob=event.sample_rate, value_discretization_interval=vdi
        )
    if event.kind == LAPLACE:
        return _pld.from_laplace_mechanism(parameter=event.noise_multiplier, value_discretization_interval=vdi)
    return None  # plain Gaussian: dp_accounting folds the count into σ/√count


def _pld_of(groups: Sequence[tuple[PrivacyEvent, int]], vdi: float):
    total = _pld.identity(value_discretization_interval=vdi)
    for event, count in groups:
        if count <= 0:
            continue
        if event.kind == GAUSSIAN:
            part = _pld.from_gaussian_mechanism(
                standard_deviation=event.noise_multiplier / math.sqrt(count), value_discretization_interval=vdi
            )
        else:
            part = _base_pld(event, vdi).self_compose(int(count))
        total = total.compose(part)
    return total


# ---------------------------------------------------------------------------------------
# The moments accountant of Abadi et al. 2016, implemented independently.
# ---------------------------------------------------------------------------------------

MOMENTS_ORDERS = tuple(range(1, 256))  # λ in the paper's notation (Rényi order α = λ + 1)


def _log_moments_poisson_gaussian(q: float, sigma: float, lambdas: Sequence[int]) -> np.ndarray:
    """α(λ) = log E_{z∼μ1}[(μ1(z)/μ0(z))^λ] for one step, exact for integer λ.

    With μ0 = N(0, σ²), μ1 = (1−q)μ0 + q N(1, σ²):
      E[(μ1/μ0)^{λ+1}] under μ0 = Σ_k C(λ+1, k) (1−q)^{λ+1−k} q^k exp((k²−k)/(2σ²)).
    The log moment of the paper equals log of that sum (its Lemma 3 bound is an upper
    bound of this exact value). Computed in log space.
    """
    out = np.empty(len(lambdas))
    log1mq = math.log1p(-q) if q < 1 else -math.inf
    logq = math.log(q)
    for idx, lam in enumerate(lambdas):
        a = lam + 1
        ks = np.arange(a + 1)
        log_binom = np.array([math.lgamma(a + 1) - math.lgamma(k + 1) - math.lgamma(a - k + 1) for k in ks])
        with np.errstate(invalid="ignore"):
            terms = (
                log_binom + np.where(a - ks > 0, (a - ks) * log1mq, 0.0) + ks * logq + (ks * ks - ks) / (2 * sigma**2)
            )
        terms = terms[np.isfinite(terms)]
        m = terms.max()
        out[idx] = m + math.log(np.exp(terms - m).sum())
    return out


def moments_epsilon(
    groups: Sequence[tuple[PrivacyEvent, int]], delta: float, orders: Sequence[int] = MOMENTS_ORDERS
) -> float:
    """ε by Abadi et al.'s moments accountant: min_λ (Σ_t α_t(λ) + log(1/δ)) / λ."""
    lambdas = np.asarray(orders)
    total = np.zeros(len(lambdas))
    for event, count in groups:
        if count <= 0:
            continue
        if event.kind == POISSON_GAUSSIAN:
            total += count * _log_moments_poisson_gaussian(event.sample_rate, event.noise_multiplier, tuple(orders))
        elif event.kind == GAUSSIAN:
            # Plain Gaussian: α(λ) = λ(λ+1)/(2σ²).
            total += count * lambdas * (lambdas + 1) / (2 * event.noise_multiplier**2)
        else:
            raise DPConfigError(
                "the 'moments' accountant handles Gaussian events only; use accountant='pld' for Laplace events."
            )
    return float(np.min((total + math.log(1.0 / delta)) / lambdas))


@contextlib.contextmanager
def _quiet_absl():
    """dp_accounting's RDP logs a warning for every fractional order whose series does not
    converge (it then drops that order, which only loosens ε). Silence those while we call it."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


# ---------------------------------------------------------------------------------------
# The one entry point.
# ---------------------------------------------------------------------------------------


def epsilon(
    groups: Sequence[tuple[PrivacyEvent, int]],
    delta: float,
    accountant: str = "pld",
    value_discretization_interval: float = PLD_VALUE_DISCRETIZATION,
) -> float:
    """ε at ``delta`` after composing ``count`` repetitions of each event."""
    check_accountant(accountant)
    groups = [(e, int(c)) for e, c in groups if int(c) > 0]
    if not groups:
        return 0.0
    if accountant == "pld":
        return float(_pld_of(groups, value_discretization_interval).get_epsilon_for_delta(delta))
    if accountant == "rdp":
        acc = dp_accounting.rdp.RdpAccountant()
        with _quiet_absl():
            acc.compose(compose(groups))
            return float(acc.get_epsilon(delta))
    return moments_epsilon(groups, delta)


def delta(
    groups: Sequence[tuple[PrivacyEvent, int]],
    epsilon: float,
    accountant: str = "pld",
    value_discretization_interval: float = PLD_VALUE_DISCRETIZATION,
) -> float:
    """δ at a fixed ``epsilon`` after composing ``count`` repetitions of each event: the
    quantity of Geyer et al.'s stopping rule (stop before δ at fixed ε would pass a bound Q).

    ``pld``: ``get_delta_for_epsilon`` of the composed PLD. ``rdp``: dp_accounting's
    ``RdpAccountant.get_delta``. ``moments``: Abadi et al.'s tail bound
    δ = min_λ exp(α(λ) − λε).
    """
    check_accountant(accountant)
    epsilon = check_epsilon(epsilon, "epsilon")
    groups = [(e, int(c)) for e, c in groups if int(c) > 0]
    if not groups:
        return 0.0
    if accountant == "pld":
        return float(_pld_of(groups, value_discretization_interval).get_delta_for_epsilon(epsilon))
    if accountant == "rdp":
        acc = dp_accounting.rdp.RdpAccountant()
        with _quiet_absl():
            acc.compose(compose(groups))
            return float(acc.get_delta(epsilon))
    lambdas = np.asarray(MOMENTS_ORDERS)
    total = np.zeros(len(lambdas))
    for event, count in groups:
        if event.kind == POISSON_GAUSSIAN:
            total += count * _log_moments_poisson_gaussian(event.sample_rate, event.noise_multiplier, MOMENTS_ORDERS)
        elif event.kind == GAUSSIAN:
            total += count * lambdas * (lambdas + 1) / (2 * event.noise_multiplier**2)
        else:
            raise DPConfigError(
                "the 'moments' accountant handles Gaussian events only; use accountant='pld' for Laplace events."
            )
    return float(min(1.0, np.exp(np.min(total - lambdas * epsilon))))


def dpsgd_epsilon(
    noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "pld"
) -> float:
    """ε of ``steps`` DP-SGD steps (Poisson rate q, noise multiplier σ) at δ."""
    return epsilon([(PrivacyEvent.dpsgd_step(noise_multiplier, sample_rate), steps)], delta, accountant)


# ---------------------------------------------------------------------------------------
# Calibration.
# ---------------------------------------------------------------------------------------


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

    Guarantees ε(σ) ≤ target_epsilon and ε(σ) ≥ (1 − rel_tol)·target_epsilon, unless no σ
    can reach the target (then :class:`DPConfigError`). ``prior_groups`` are other events of
    the same run (a DP-PCA release, say) that are composed with the steps.

    Method: a cheap RDP bracket first (RDP is looser, so its σ is an upper end), then
    regula falsi on log ε against log σ. With PLD, the search runs on a 10× coarser grid
    (:data:`PLD_SEARCH_DISCRETIZATION`, ten times faster, ε within about 1e-5 of the fine one)
    and its answer is then checked on the fine grid, the one the ledger uses; only if it fails
    that check is the search repeated on the fine grid. The guarantees above are always those
    of the fine grid.
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
    prior = list(prior_groups)

    def eps_at(vdi: float):
        def eps(sigma: float, acc: str = accountant) -> float:
            return epsilon(prior + [(PrivacyEvent(kind, float(sigma), sample_rate), steps)], target_delta, acc, vdi)

        return eps

    exact = eps_at(PLD_VALUE_DISCRETIZATION)
    if accountant == "pld":
        sigma = _calibrate(eps_at(PLD_SEARCH_DISCRETIZATION), accountant, kind, target_epsilon, rel_tol)
        e = exact(sigma)
        if (1.0 - rel_tol) * target_epsilon <= e <= target_epsilon:
            return sigma
    return _calibrate(exact, accountant, kind, target_epsilon, rel_tol)


def _calibrate(eps, accountant: str, kind: str, target_epsilon: float, rel_tol: float) -> float:
    """calibrate_noise_multiplier's search with the ε function ``eps(σ, accountant)``."""

    # An upper end: RDP's σ (looser accountant ⇒ larger σ) or grow until ε ≤ target.
    hi = 1.0
    cheap = accountant if (accountant == "moments" or kind == POISSON_LAPLACE) else "rdp"
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
    # Invariant: e_lo > target ≥ e_hi. Illinois regula falsi in log space.
    lt = math.log(target_epsilon)
    f_lo, f_hi = math.log(e_lo) - lt, math.log(e_hi) - lt
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
        f_mid = math.log(e_mid) - lt
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
    prior = list(prior_groups)

    def fits(vdi: float):
        return lambda t: epsilon(prior + [(ev, t)], target_delta, accountant, vdi) <= target_epsilon

    if accountant != "pld":
        return _largest_count(fits(PLD_VALUE_DISCRETIZATION), limit)
    # Search on the coarse grid, then settle the answer exactly on the fine one around it.
    guess = _largest_count(fits(PLD_SEARCH_DISCRETIZATION), limit)
    return _largest_count_near(fits(PLD_VALUE_DISCRETIZATION), guess, limit)


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
    while hi - lo > 1:  # fits(lo) and not fits(hi)
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


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

    return _largest_count(lambda t: delta(prior + [(event, t)], epsilon, accountant) <= delta_bound, limit)


def steps_for_epochs(epochs: float, sample_rate: float) -> int:
    """Number of steps in ``epochs`` passes at Poisson rate q: round(epochs / q), at least 1."""
    if not isinstance(epochs, (int, float)) or isinstance(epochs, bool) or not math.isfinite(epochs) or epochs <= 0:
        raise DPConfigError(f"epochs={epochs!r} is invalid: it must be a number > 0.")
    return max(1, int(round(epochs / sample_rate)))

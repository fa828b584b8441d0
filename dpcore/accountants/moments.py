"""The moments accountant of Abadi et al. 2016, implemented independently of dp_accounting.

Integer orders λ = 1…255 of the Poisson-subsampled Gaussian's log moment (the exact binomial
expansion, Mironov et al. 2019 §3.3) and the paper's tail bound
ε = min_λ (α(λ) + log 1/δ)/λ. It reproduces the paper's ε ≈ 1.26 for q=0.01, σ=4, T=10⁴,
δ=1e-5. Gaussian events only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..errors import DPConfigError
from ..events import Gaussian, PoissonGaussian

ORDERS = tuple(range(1, 256))  # λ in the paper's notation (Rényi order α = λ + 1)


def log_moments_poisson_gaussian(q: float, sigma: float, lambdas: Sequence[int]) -> np.ndarray:
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


def total_log_moments(groups, orders: Sequence[int] = ORDERS) -> np.ndarray:
    """Σ over the releases of α(λ), at each order λ."""
    lambdas = np.asarray(orders)
    total = np.zeros(len(lambdas))
    for event, count in groups:
        if count <= 0:
            continue
        if isinstance(event, PoissonGaussian):
            total += count * log_moments_poisson_gaussian(event.sample_rate, event.noise_multiplier, tuple(orders))
        elif isinstance(event, Gaussian):  # α(λ) = λ(λ+1)/(2σ²)
            total += count * lambdas * (lambdas + 1) / (2 * event.noise_multiplier**2)
        else:
            raise DPConfigError(
                "the 'moments' accountant handles Gaussian events only; use accountant='pld' for Laplace events."
            )
    return total


def moments_epsilon(groups, delta: float, orders: Sequence[int] = ORDERS) -> float:
    """ε by Abadi et al.'s moments accountant: min_λ (Σ_t α_t(λ) + log(1/δ)) / λ."""
    lambdas = np.asarray(orders)
    return float(np.min((total_log_moments(groups, orders) + math.log(1.0 / delta)) / lambdas))


class Moments:
    name = "moments"

    def epsilon(self, groups, delta: float, *, coarse: bool = False) -> float:
        return moments_epsilon(groups, delta)

    def delta(self, groups, epsilon: float) -> float:
        """Abadi et al.'s tail bound δ = min_λ exp(α(λ) − λε)."""
        lambdas = np.asarray(ORDERS)
        return float(min(1.0, np.exp(np.min(total_log_moments(groups) - lambdas * epsilon))))

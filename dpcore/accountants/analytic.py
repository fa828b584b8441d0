"""The exact ε of releases on the whole dataset with Gaussian noise, in closed form.

k Gaussian releases of sensitivity 1 with noise multipliers σ_j compose to one Gaussian
mechanism with μ = √(Σ_j 1/σ_j²) (Dong, Roth & Su 2019, μ-GDP; exact, not a bound), and the
Gaussian mechanism's privacy profile is (Balle & Wang 2018, Theorem 8)

    δ(ε) = Φ(μ/2 − ε/μ) − e^ε·Φ(−μ/2 − ε/μ).

That is the tight ε for these releases, so every valid accountant's ε is at least this one.
:func:`dpcore.plan` uses it to refuse at once a DP-PCA prior that alone spends the budget:
the PLD accountant's cost grows as 1/σ² (σ = 0.03 takes 17 s, σ = 0.01 minutes), and its
answer could only be larger. Sampled releases are not covered (``None``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..events import GAUSSIAN, PrivacyEvent


def gaussian_mu(groups: Sequence[tuple[PrivacyEvent, int]]) -> float | None:
    """μ of the composition, if every event is an unsampled Gaussian release; else None."""
    if not groups or any(e.kind != GAUSSIAN or e.sample_rate != 1.0 for e, _ in groups):
        return None
    return math.sqrt(sum(int(c) / e.noise_multiplier**2 for e, c in groups))


def _log_normal_cdf(x: float) -> float:
    """log Φ(x): from erfc down to x = −30, below that its asymptotic series (relative error of
    the series ≲ 945/x¹⁰ ≈ 2e-12 there), where Φ itself underflows below x ≈ −37."""
    if x > -30.0:
        return math.log(0.5 * math.erfc(-x / math.sqrt(2.0)))
    r = 1.0 / (x * x)
    series = 1.0 - r + 3 * r**2 - 15 * r**3 + 105 * r**4
    return -0.5 * x * x - math.log(-x) - 0.5 * math.log(2 * math.pi) + math.log(series)


def gaussian_delta(mu: float, epsilon: float) -> float:
    """δ(ε) of the Gaussian mechanism with parameter μ (sensitivity / σ)."""
    a, b = mu / 2 - epsilon / mu, -mu / 2 - epsilon / mu
    first = 0.5 * math.erfc(-a / math.sqrt(2.0))
    return max(first - math.exp(epsilon + _log_normal_cdf(b)), 0.0)


def gaussian_epsilon(mu: float, delta: float) -> float:
    """The smallest ε ≥ 0 with δ(ε) ≤ ``delta`` (bisection to 1e-12 relative; δ is decreasing in ε)."""
    if gaussian_delta(mu, 0.0) <= delta:
        return 0.0
    lo, hi = 0.0, max(1.0, mu * mu)
    while gaussian_delta(mu, hi) > delta:
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-12 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gaussian_delta(mu, mid) > delta else (lo, mid)
    return hi

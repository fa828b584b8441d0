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


def gaussian_delta(mu: float, epsilon: float) -> float:
    """δ(ε) of the Gaussian mechanism with parameter μ (sensitivity / σ)."""
    from scipy.special import log_ndtr, ndtr

    a, b = mu / 2 - epsilon / mu, -mu / 2 - epsilon / mu
    return float(max(ndtr(a) - math.exp(epsilon + log_ndtr(b)), 0.0))


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

"""The privacy cost of choosing the best trial (Papernot & Steinke, ICLR 2022).

Releasing the best of K trials, K fixed, costs up to K times one trial's privacy. If instead
the number of trials K is *random* (Poisson, or a truncated negative binomial) and each trial
runs the same randomised algorithm Q (a random hyperparameter draw, DP training, and a DP
score), then releasing only the best (hyperparameters, model, score) costs a small multiple of
Q's privacy. dp_accounting expresses this as ``RepeatAndSelectDpEvent(Q, mean, shape)``,
accounted by RDP.

Q must be the same mechanism in every repetition: the sweep enforces a random sampler, no
pruning, and a fixed lot size and number of epochs (so that every trial has the same
(q, σ, T)). Q's score is the validation accuracy made private: the count of correct
predictions plus N(0, σ_v²) (sensitivity 1 under add/remove of one validation example), a
Gaussian event composed into Q. Q's event is therefore Compose(T × PoissonGaussian(q, σ),
Gaussian(σ_v)), with T the most releases a trial's ledger allows at σ (a trial whose steps
were re-released after a crash can exceed its planned steps up to T; a DP-PCA release is
composed in too): the training split and the validation split are disjoint, so composing both is
a valid (if slightly loose) bound for one example in either.
"""

from __future__ import annotations

import math

import dp_accounting

import dpcore
from dpcore.accountants.rdp import quiet_absl

# What the accounted total does not cover, said where it is recorded (the parent run's and the
# registered model's dp.selection): the bound holds for releasing only the selected trial.
SCOPE = (
    "the child runs, the study's storage and the sweep's progress output and log keep every trial's exact scores "
    "(and its steps and times), "
    "and the parent run and the sweep's output the number of trials K, which it does not cover: "
    "they must stay as private as the data itself"
)


def trial_event(groups, score_noise: float) -> dp_accounting.DpEvent:
    """Q's event: one trial's releases (``groups``: [(PrivacyEvent, count)], the most its ledger
    allows, a DP-PCA release included) and its noisy validation count."""
    return dp_accounting.ComposedDpEvent([dpcore.events.compose(groups), dp_accounting.GaussianDpEvent(score_noise)])


def shape_of(distribution: str, shape: float) -> float:
    if distribution == "poisson":
        return math.inf
    if not (shape > 0 and math.isfinite(shape)):
        raise dpcore.DPConfigError(
            f"selection_shape={shape} must be a finite number > 0 for the negative binomial (1 = geometric)."
        )
    return float(shape)


def selection_event(
    event: dp_accounting.DpEvent, mean: float, distribution: str, shape: float = 1.0
) -> dp_accounting.DpEvent:
    return dp_accounting.dp_event.RepeatAndSelectDpEvent(event, float(mean), shape_of(distribution, shape))


def total_epsilon(event: dp_accounting.DpEvent, delta: float) -> float:
    """ε at δ of a (selection) event, by dp_accounting's RDP accountant."""
    acc = dp_accounting.rdp.RdpAccountant()
    with quiet_absl():
        acc.compose(event)
        return float(acc.get_epsilon(delta))


def _truncated_nb_gamma(mean: float, shape: float) -> float:
    """γ with E[K] = mean for P(K=k) ∝ (1−γ)^k·C(k+η−1, k), k ≥ 1 (Papernot & Steinke's D_{η,γ})."""

    def m(g: float) -> float:
        return shape * (1 - g) / (g * (1 - g**shape))

    lo, hi = 1e-12, 1 - 1e-12
    if m(hi) > mean:
        raise dpcore.DPConfigError(f"selection_mean={mean} is too small for a truncated negative binomial (needs > 1).")
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if m(mid) > mean:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def draw_number_of_trials(mean: float, distribution: str, shape: float, randomness: dpcore.Randomness) -> int:
    """K from the chosen distribution, from ``randomness`` (secure unless the sweep is seeded).
    Inverse-CDF sampling on one 53-bit uniform."""
    if not (mean > 0 and math.isfinite(mean)):
        raise dpcore.DPConfigError(f"selection_mean={mean} must be a finite number > 0.")
    u = float(randomness.uniform(1)[0])
    if distribution == "poisson":
        p = math.exp(-mean)
        k, cdf = 0, p
        while u > cdf and k < 100_000:
            k += 1
            p *= mean / k
            cdf += p
        return k
    eta = shape_of(distribution, shape)
    gamma = _truncated_nb_gamma(mean, eta)
    # P(K=k) = (1−γ)^k·C(k+η−1, k)/(γ^(−η) − 1), k ≥ 1; walk the CDF with the ratio of terms.
    p = (1 - gamma) * eta / (gamma**-eta - 1)
    k, cdf = 1, p
    while u > cdf and k < 10_000_000:
        p *= (1 - gamma) * (k + eta) / (k + 1)
        k += 1
        cdf += p
    return k

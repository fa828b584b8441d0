"""Empirical privacy: lower bounds on ε from what a mechanism actually outputs.

A ledger's ε is an upper bound that holds if the code does what the analysis assumes. An
audit measures: it runs the mechanism on inputs with and without a *canary*, scores the
output, and turns how well the scores separate the two into a lower bound ε_lb that holds
with a stated confidence. ε_lb ≤ ε must always hold; an audit that finds ε_lb > ε has found a
bug (or was unlucky with probability at most 1 − confidence).

Two audits:

* **One run** (Steinke, Nasr and Jagielski, NeurIPS 2023, "Privacy auditing with one (1)
  training run"). m canaries, each included independently with probability ½; one training
  run; the auditor guesses "in" for the k₊ highest scores and "out" for the k₋ lowest, and
  abstains on the rest. If the run is (ε, δ)-DP, the number of correct guesses V among the
  r = k₊ + k₋ made satisfies P[V ≥ v] ≤ P[Binomial(r, e^ε/(1+e^ε)) ≥ v] + 2mδ·α(v), where
  α(v) = max_{1≤i≤v} P[v > Binomial(r, e^ε/(1+e^ε)) ≥ v − i] / i (their Theorem 3.1 and
  Algorithm 2). :func:`one_run_p_value` is that bound; :func:`one_run_epsilon_lower_bound`
  the largest ε it rejects at the given confidence. With r guesses all correct the bound
  saturates at ε = log(q/(1−q)), q = (1 − confidence)^(1/r): about 5.8 for r = 1,000.
* **Distinguishing** (Jagielski et al. 2020; Nasr et al. 2021): many independent runs on a
  pair of neighbouring inputs give scores under "out" and under "in". For a threshold t,
  FPR = P[score_out ≥ t] and TPR = P[score_in ≥ t]; (ε, δ)-DP forces TPR ≤ e^ε·FPR + δ, so
  ε ≥ log((TPR − δ)/FPR). :func:`distinguishing_epsilon_lower_bound` uses Clopper–Pearson
  bounds (a lower bound on TPR, an upper bound on FPR) at a threshold chosen on a separate
  part of the scores (a fifth), so the confidence is exact without a multiple-testing
  correction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import DPConfigError


def _binomial_logpmf(n: int, p: float, upto: int | None = None) -> np.ndarray:
    """log P[Binomial(n, p) = k] for k = 0..upto (default n), by the ratio recursion in log
    space (numpy only: dpcore does not import scipy; the tests compare with scipy)."""
    top = n if upto is None else min(n, int(upto))
    k = np.arange(top + 1, dtype=np.float64)
    if p <= 0.0:
        out = np.full(top + 1, -np.inf)
        out[0] = 0.0
        return out
    if p >= 1.0:
        out = np.full(top + 1, -np.inf)
        if top == n:
            out[n] = 0.0
        return out
    steps = np.log(n - k[:-1]) - np.log(k[:-1] + 1.0) + math.log(p) - math.log1p(-p)
    return np.concatenate(([n * math.log1p(-p)], n * math.log1p(-p) + np.cumsum(steps)))


def _logsumexp(x: np.ndarray) -> float:
    if len(x) == 0:
        return -math.inf
    top = float(np.max(x))
    if not math.isfinite(top):
        return top
    return top + math.log(float(np.exp(x - top).sum()))


def binomial_sf(v: int, n: int, p: float) -> float:
    """P[Binomial(n, p) ≥ v]."""
    if v <= 0:
        return 1.0
    if v > n:
        return 0.0
    below = binomial_cdf(v - 1, n, p) if v - 1 < n * p else 1.0  # few terms when v is below the mean
    if below < 0.5:
        return 1.0 - below
    return min(1.0, math.exp(_logsumexp(_binomial_logpmf(n, p)[v:])))


def binomial_cdf(v: int, n: int, p: float) -> float:
    """P[Binomial(n, p) ≤ v]."""
    if v < 0:
        return 0.0
    if v >= n:
        return 1.0
    return min(1.0, math.exp(_logsumexp(_binomial_logpmf(n, p, upto=v))))


def _check_confidence(confidence: float) -> float:
    if not (isinstance(confidence, (int, float)) and 0.0 < confidence < 1.0):
        raise DPConfigError(f"confidence={confidence!r} must lie in (0, 1); 0.95 is usual.")
    return float(confidence)


def one_run_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """P[≥ v correct of r guesses] bound for an (ε, δ)-DP run with m canaries (Steinke et al.)."""
    if not (0 <= v <= r <= m):
        raise DPConfigError(f"need 0 ≤ correct v={v} ≤ guesses r={r} ≤ canaries m={m}.")
    if epsilon < 0 or not (0.0 <= delta <= 1.0):
        raise DPConfigError(f"need ε ≥ 0 and δ in [0, 1] (got ε={epsilon}, δ={delta}).")
    q = 1.0 / (1.0 + math.exp(-epsilon))  # the accuracy of ε-DP randomised response
    pmf = np.exp(_binomial_logpmf(r, q))
    beta = binomial_sf(v, r, q)  # P[Binomial(r, q) ≥ v]
    if delta == 0.0 or v == 0:
        return min(1.0, beta)
    # α = max_i P[v > B ≥ v − i] / i, accumulated from i = 1 upwards.
    cum = np.cumsum(pmf[v - 1 :: -1])  # P[B = v−1], + P[B = v−2], ...
    alpha = float(np.max(cum / np.arange(1, v + 1)))
    return min(1.0, beta + alpha * delta * 2 * m)


def one_run_epsilon_lower_bound(
    m: int, r: int, v: int, delta: float, confidence: float = 0.95, epsilon_max: float = 50.0
) -> float:
    """The largest ε that the observed v of r correct guesses rejects at ``confidence``: every
    (ε', δ)-DP claim with ε' ≤ this is refuted. 0 if none is."""
    beta = 1.0 - _check_confidence(confidence)
    if one_run_p_value(m, r, v, 0.0, delta) > beta:
        return 0.0
    lo, hi = 0.0, epsilon_max
    if one_run_p_value(m, r, v, hi, delta) <= beta:
        return hi
    for _ in range(60):  # p-value is increasing in ε
        mid = 0.5 * (lo + hi)
        if one_run_p_value(m, r, v, mid, delta) <= beta:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class OneRunResult:
    canaries: int
    guesses: int
    correct: int
    epsilon_lower_bound: float
    confidence: float
    delta: float


def one_run_audit(scores, included, k_plus: int, k_minus: int, delta: float, confidence: float = 0.95) -> OneRunResult:
    """Guess "in" for the ``k_plus`` highest scores and "out" for the ``k_minus`` lowest, count
    the correct guesses against ``included`` (the canaries' true membership), and bound ε.

    ``k_plus`` and ``k_minus`` must be fixed before the scores are seen (choosing them after
    looking voids the confidence)."""
    s = np.asarray(scores, dtype=np.float64)
    inc = np.asarray(included, dtype=bool)
    m = len(s)
    if inc.shape != s.shape:
        raise DPConfigError("scores and included must have one entry per canary.")
    for name, k in (("k_plus", k_plus), ("k_minus", k_minus)):
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise DPConfigError(f"{name}={k!r} must be an integer ≥ 0.")
    if k_plus + k_minus > m or k_plus + k_minus == 0:
        raise DPConfigError(f"k_plus + k_minus = {k_plus + k_minus} guesses must lie in [1, m={m}] canaries.")
    order = np.argsort(s, kind="stable")
    guessed_out, guessed_in = order[:k_minus], order[m - k_plus :]
    correct = int(inc[guessed_in].sum() + (~inc[guessed_out]).sum())
    r = k_plus + k_minus
    eps = one_run_epsilon_lower_bound(m, r, correct, delta, confidence)
    return OneRunResult(m, r, correct, eps, confidence, delta)


def clopper_pearson(successes: int, trials: int, confidence: float) -> tuple[float, float]:
    """One-sided Clopper–Pearson bounds (lower, upper) on a binomial proportion, each holding
    with probability ``confidence``: lower solves P[Bin(n, p) ≥ k] = 1 − confidence and upper
    P[Bin(n, p) ≤ k] = 1 − confidence (bisection on p, to 1e-12; each bound is the bracket's
    conservative end: the lower one's lower end, the upper one's upper end)."""
    a = 1.0 - _check_confidence(confidence)
    k, n = int(successes), int(trials)
    if not (0 <= k <= n and n > 0):
        raise DPConfigError(f"need 0 ≤ successes={k} ≤ trials={n}, trials > 0.")

    def solve(f, target: float) -> tuple[float, float]:  # f increasing in p: a bracket of f(p) = target
        lo, hi = 0.0, 1.0
        for _ in range(45):
            mid = 0.5 * (lo + hi)
            if f(mid) < target:
                lo = mid
            else:
                hi = mid
        return lo, hi

    lower = 0.0 if k == 0 else solve(lambda p: binomial_sf(k, n, p), a)[0]
    upper = 1.0 if k == n else solve(lambda p: 1.0 - binomial_cdf(k, n, p), 1.0 - a)[1]
    return lower, upper


@dataclass(frozen=True)
class DistinguishingResult:
    epsilon_lower_bound: float
    threshold: float
    tpr_lower: float
    fpr_upper: float
    samples_in: int
    samples_out: int
    confidence: float
    delta: float


def distinguishing_epsilon_lower_bound(
    scores_in,
    scores_out,
    delta: float,
    confidence: float = 0.95,
    seed: int = 0,
    min_count: int = 20,
    selection_fraction: float = 0.2,
) -> DistinguishingResult:
    """ε_lb from scores of many independent runs with the canary (``scores_in``) and without it
    (``scores_out``). Higher scores should mean "in"; pass −scores to test the other side.

    A fraction ``selection_fraction`` of each sample (a public random split) picks the
    threshold that maximises a
    conservative estimate of log((TPR − δ)/FPR) (counts shrunk by two standard deviations)
    among thresholds with at least ``min_count`` "out" scores above them; the rest gives
    Clopper–Pearson bounds at that threshold. The two bounds
    each hold with probability √confidence, so the result holds with ``confidence``."""
    confidence = _check_confidence(confidence)
    a, b = np.asarray(scores_in, dtype=np.float64), np.asarray(scores_out, dtype=np.float64)
    if len(a) < 4 or len(b) < 4:
        raise DPConfigError("need at least 4 scores with and 4 without the canary.")
    rng = np.random.default_rng(seed)
    a, b = rng.permutation(a), rng.permutation(b)
    if not (0.0 < selection_fraction < 1.0):
        raise DPConfigError(f"selection_fraction={selection_fraction!r} must lie in (0, 1).")
    na, nb = max(2, int(len(a) * selection_fraction)), max(2, int(len(b) * selection_fraction))
    a_sel, a_eval = a[:na], a[na:]
    b_sel, b_eval = b[:nb], b[nb:]
    b_sorted = np.sort(b_sel)
    a_sorted = np.sort(a_sel)
    # Candidate thresholds: every k-th "out" score from the top (at least min_count above).
    # Each is scored by a conservative estimate on the selection half (counts shrunk by two
    # standard deviations), so that a far tail with a handful of counts does not win by luck.
    idx = np.arange(len(b_sorted) - min_count, -1, -max(1, len(b_sorted) // 4000))
    thresholds = b_sorted[idx]
    k_out = len(b_sorted) - np.searchsorted(b_sorted, thresholds, side="left")
    k_in = len(a_sorted) - np.searchsorted(a_sorted, thresholds, side="left")
    fpr_hi = (k_out + 2.0 * np.sqrt(k_out) + 1.0) / len(b_sorted)
    tpr_lo = np.maximum(k_in - 2.0 * np.sqrt(k_in), 0.0) / len(a_sorted)
    with np.errstate(divide="ignore", invalid="ignore"):
        value = np.where(tpr_lo - delta > 0, np.log(np.maximum(tpr_lo - delta, 1e-300) / fpr_hi), -np.inf)
    best_t = float(thresholds[int(np.argmax(value))]) if np.isfinite(value).any() else math.inf
    if not math.isfinite(best_t):
        return DistinguishingResult(0.0, math.inf, 0.0, 1.0, len(a), len(b), confidence, delta)
    c = math.sqrt(confidence)
    tpr_lo, _ = clopper_pearson(int((a_eval >= best_t).sum()), len(a_eval), c)
    _, fpr_hi = clopper_pearson(int((b_eval >= best_t).sum()), len(b_eval), c)
    eps = math.log((tpr_lo - delta) / fpr_hi) if tpr_lo - delta > 0 else 0.0
    return DistinguishingResult(max(0.0, eps), float(best_t), tpr_lo, fpr_hi, len(a), len(b), confidence, delta)

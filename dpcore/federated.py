"""Client-level differential privacy for federated averaging: the math of DP-FedAvg.

The unit protected is a client (all of one person's data): neighbouring datasets differ by
adding or removing one whole client (Geyer, Klein and Nabi 2017; McMahan et al. 2018).

One round t, with K clients, expected clients per round m and q = m/K:

1. **Sampling.** Each client joins independently with probability q (Poisson, as the
   accountant assumes): :meth:`ClientLevelDP.sample_clients`.
2. **Clients.** Each sampled client trains from w_t and sends its update Δ_k, clipped on the
   client to Δ̄_k = Δ_k · min(1, S_t/‖Δ_k‖₂) by :func:`clip_update` (norm in float64, with
   the relative margin of :mod:`dpcore.clipping`; a non-finite update counts as zero).
3. **Server.** :meth:`ClientLevelDP.release` adds N(0, z_Δ² S_t² I) once to Σ_k Δ̄_k and
   divides by m (the expected count, never the realised one), then the caller applies it
   with a server learning rate (and momentum: FedAvgM).

**Adaptive clipping** (Andrew et al. 2021, "Differentially private learning with adaptive
clipping"). Each sampled client also sends b_k = 1[‖Δ_k‖ ≤ S_t]. The server releases
Σ_k (b_k − ½) + N(0, σ_b²), estimates b̄ = that/m + ½ (the fraction of updates under S_t),
and sets S_{t+1} = S_t · exp(−η (b̄ − γ)) for a target quantile γ.

**Privacy of one round.** The round releases the pair (update sum, bit sum), both computed on
the same Poisson sample. Scaling the first by 1/(z_Δ S_t) and the second by 1/σ_b turns it into
one Gaussian mechanism with unit noise, in which one client moves the mean by a vector of
squared norm ≤ 1/z_Δ² + 1/(2σ_b)² (the centred bit moves the sum by at most ½). So the round
is a Poisson-subsampled Gaussian with noise multiplier z, where z⁻² = z_Δ⁻² + (2σ_b)⁻²
(Andrew et al., Theorem 1): the ledger records one ``poisson_gaussian`` event (q, z) per
round, and the update noise is z_Δ = (z⁻² − (2σ_b)⁻²)^(-1/2) > z. With a fixed S there are
no bits and z_Δ = z.

**Stopping.** Either at a target ε for a fixed δ, or by Geyer et al.'s rule: stop before δ at
a fixed ε would pass a bound Q (:func:`dpcore.accounting.max_steps_by_delta`). Their paper
checks δ *after* a round and may therefore return a model whose δ already exceeds Q; here a
round is released only if it keeps δ ≤ Q (and, through the ledger, ε(Q) ≤ ε).

**Not offered as private:** Geyer et al. set S to the median of the sampled clients' update
norms. That median is a statistic of private data released without noise;
:func:`nonprivate_median_clip_norm` exists for comparison only, and the pipeline allows it
only in its diagnostics mode (tagged non-private).
"""

from __future__ import annotations

import math

import torch

from .clipping import clip_factors
from .errors import DPConfigError
from .events import PoissonGaussian, PrivacyEvent
from .ledger import PrivacyLedger
from .randomness import Randomness
from .release import release
from .sampling import PoissonSampler
from .validation import check_clip_norm, check_noise_multiplier, check_positive_int

CLIP_POLICIES = ("fixed", "adaptive", "median_nonprivate")


def clip_update(update: torch.Tensor, clip_norm: float) -> tuple[torch.Tensor, float, bool]:
    """One client's update, a flat vector, clipped to L2 norm ≤ ``clip_norm``.

    Returns ``(clipped, norm, finite)``: the clipped update in float64, the norm of the
    unclipped update (float64; NaN/inf when not finite) and whether it was finite. A
    non-finite update is replaced by zeros (norm 0 ≤ S: the round keeps its full noise)."""
    if update.dim() != 1:
        raise ValueError(f"an update is a flat vector; got shape {tuple(update.shape)}.")
    u = update.to(torch.float64)
    norm = torch.linalg.vector_norm(u).reshape(1)
    factor, finite = clip_factors(norm, float(clip_norm))
    if not bool(finite[0]):
        return torch.zeros_like(u), float(norm[0]), False
    return u * factor[0], float(norm[0]), True


def split_noise_multiplier(noise_multiplier: float, quantile_noise: float) -> float:
    """z_Δ such that z_Δ⁻² + (2σ_b)⁻² = z⁻²: the update noise when the bits of adaptive
    clipping take part of the round's budget (Andrew et al., Theorem 1)."""
    z = check_noise_multiplier(noise_multiplier)
    sigma_b = check_noise_multiplier(quantile_noise, "quantile_noise")
    rest = z**-2 - (2.0 * sigma_b) ** -2
    if rest <= 0:
        raise DPConfigError(
            f"quantile_noise σ_b={sigma_b:g} is too small for the round's noise multiplier z={z:.4g}: the clipping "
            f"bits alone would spend the whole round (2σ_b must exceed z, here > {z / 2:.4g}). Andrew et al. use "
            "σ_b = m/20 for m expected clients per round; raise quantile_noise or the clients per round."
        )
    return rest**-0.5


def nonprivate_median_clip_norm(norms: list[float]) -> float:
    """NOT PRIVATE. Geyer et al.'s choice of S: the median of the sampled clients' update
    norms, released without noise. For diagnostics and comparison only."""
    finite = [n for n in norms if math.isfinite(n)]
    if not finite:
        raise ValueError("no finite update norms this round")
    return float(torch.tensor(finite, dtype=torch.float64).median())


class AdaptiveClipping:
    """The geometric quantile update of Andrew et al. 2021: S ← S·exp(−η(b̄ − γ))."""

    def __init__(
        self,
        initial_clip_norm: float,
        target_quantile: float = 0.5,
        learning_rate: float = 0.2,
        quantile_noise: float = 1.0,
    ):
        self.clip_norm = check_clip_norm(initial_clip_norm, "clip_norm")
        if not (0.0 < target_quantile < 1.0):
            raise DPConfigError(f"target_quantile={target_quantile!r} must lie in (0, 1); Andrew et al. use 0.5.")
        if not (isinstance(learning_rate, (int, float)) and math.isfinite(learning_rate) and learning_rate > 0):
            raise DPConfigError(f"quantile_lr={learning_rate!r} must be a finite number > 0; Andrew et al. use 0.2.")
        self.target_quantile = float(target_quantile)
        self.learning_rate = float(learning_rate)
        self.quantile_noise = check_noise_multiplier(quantile_noise, "quantile_noise")

    def update(self, noisy_fraction: float) -> float:
        self.clip_norm *= math.exp(-self.learning_rate * (noisy_fraction - self.target_quantile))
        return self.clip_norm

    def state_dict(self) -> dict:
        return {"clip_norm": self.clip_norm}

    def load_state_dict(self, state: dict) -> None:
        self.clip_norm = float(state["clip_norm"])


class ClientLevelDP:
    """The server's private part of DP-FedAvg: client sampling, the budget, the one noise
    draw per round and its ledger entry.

    Args:
        num_clients: K.
        expected_clients: m; the Poisson rate is q = m/K.
        noise_multiplier: z, the round's noise multiplier as the accountant sees it.
        clip_norm: S (the initial S when ``adaptive`` is given).
        ledger: the run's ledger; a round is released only if it fits the budget.
        randomness: the source of the client sample and the noise (secure or seeded).
        adaptive: an :class:`AdaptiveClipping`, or None for a fixed S.

    Use per round: ``clients = dp.sample_clients()`` (refuses when the budget is spent),
    then the clients' clipped sum and bit sum go to ``dp.release(...)``, which ledgers the
    round *before* returning the noised average.
    """

    def __init__(
        self,
        num_clients: int,
        expected_clients: float,
        noise_multiplier: float,
        clip_norm: float,
        ledger: PrivacyLedger,
        randomness: Randomness,
        adaptive: AdaptiveClipping | None = None,
    ):
        self.num_clients = check_positive_int(num_clients, "num_clients")
        if not (isinstance(expected_clients, (int, float)) and 0 < expected_clients <= num_clients):
            raise DPConfigError(
                f"clients_per_round m={expected_clients!r} must lie in (0, K={num_clients}]: the Poisson rate m/K is a probability."
            )
        self.expected_clients = float(expected_clients)
        self.sample_rate = self.expected_clients / self.num_clients
        self.noise_multiplier = check_noise_multiplier(noise_multiplier)
        self.adaptive = adaptive
        self.clip_norm = adaptive.clip_norm if adaptive is not None else check_clip_norm(clip_norm, "clip_norm")
        self.update_noise_multiplier = (
            split_noise_multiplier(self.noise_multiplier, adaptive.quantile_noise)
            if adaptive is not None
            else self.noise_multiplier
        )
        self.ledger = ledger
        self._sampler = PoissonSampler(self.num_clients, self.sample_rate, randomness.spawn("clients"), steps=1)
        self._noise = randomness.spawn("server-noise")
        self.rounds = 0

    @property
    def event(self) -> PrivacyEvent:
        return PoissonGaussian(self.noise_multiplier, self.sample_rate)

    def sample_clients(self) -> torch.Tensor:
        """The next round's clients (sorted ids). Raises BudgetExceededError, before anything
        is drawn, when one more round would not fit the budget."""
        self.ledger.check(self.event)
        return self._sampler.sample()

    def release(
        self, update_sum: torch.Tensor, *, count: int, bits_sum: float | None = None, step: int | None = None
    ) -> torch.Tensor:
        """Release the round (:func:`dpcore.release.release`: check → noise once → ÷ m →
        record) and return (Σ Δ̄_k + N(0, z_Δ²S²I)) / m in float32.

        ``update_sum`` is the sum of the sampled clients' clipped updates (flat) and ``count``
        the number of clients in it (server-side only, never released). With adaptive clipping
        ``bits_sum`` = Σ_k 1[‖Δ_k‖ ≤ S] over the same clients; the centred sum
        Σ_k (b_k − ½) is noised in the same release (its share of the event's noise), and S
        is updated for the next round from it."""
        if (bits_sum is None) != (self.adaptive is None):
            raise ValueError("bits_sum is required with adaptive clipping and must be None without it.")
        step = self.rounds + 1 if step is None else int(step)
        s = self.clip_norm
        sums = [update_sum.to(torch.float64)]
        stds = [self.update_noise_multiplier * s]
        if self.adaptive is not None:
            # Σ(b_k − ½) uses the realised count, which the server knows but never releases:
            # only the noised centred sum leaves.
            sums.append(torch.tensor([float(bits_sum) - 0.5 * int(count)], dtype=torch.float64))
            stds.append(self.adaptive.quantile_noise)

        def noise():
            return [self._noise.normal(t.shape, std=std, dtype=torch.float64) for t, std in zip(sums, stds)]

        out = release(
            sums,
            event=self.event,
            ledger=self.ledger,
            noise=noise,
            expected_size=self.expected_clients,
            step=step,
            clip_norm=s,
        )
        self.rounds += 1
        if self.adaptive is not None:
            self.clip_norm = self.adaptive.update(float(out[1][0]) + 0.5)
        return out[0].to(torch.float32)

    def state_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "clip_norm": self.clip_norm,
            "sampler": self._sampler.state_dict(),
            "noise": self._noise.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.rounds = int(state["rounds"])
        self.clip_norm = float(state["clip_norm"])
        if self.adaptive is not None:
            self.adaptive.clip_norm = self.clip_norm
        self._sampler.load_state_dict(state["sampler"])
        self._noise.load_state_dict(state["noise"])

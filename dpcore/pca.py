"""DP-PCA (Abadi et al. 2016, §4): a private linear projection of the inputs.

1. Flatten the inputs and normalise each row to L2 norm 1 − m, m the clipping margin
   (:data:`dpcore.clipping.CLIP_MARGIN`, room for the float64 product's rounding): the rows
   of A. A zero or non-finite row becomes 0.
2. Release AᵀA + E, with E symmetric: its upper triangle (diagonal included) is i.i.d.
   N(0, σ²) and mirrored below. Adding or removing one example changes AᵀA by aaᵀ, whose
   upper triangle has L2 norm ≤ ‖aaᵀ‖_F = ‖a‖² ≤ (1 − m)² < 1, rounding included: the
   sensitivity is 1, so this is the Gaussian mechanism with noise multiplier σ on the upper
   triangle (which determines the released matrix).
3. The top-k eigenvectors of the released matrix are the projection: the model's first,
   frozen stage (:class:`PCAProjection`, a buffer, so no gradient and no privacy cost).

Sampled variant (``sample_rate=q < 1``): the rows are a Poisson sample at rate q, and the
release is accounted as a Poisson-sampled Gaussian. Either way the release is one event in
the run's ledger (step 0: before training), composed with the training steps.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from .clipping import CLIP_MARGIN, gamma
from .errors import DPConfigError
from .events import Gaussian, PoissonGaussian, PrivacyEvent
from .ledger import PrivacyLedger
from .randomness import Randomness
from .release import release
from .sampling import included
from .validation import check_noise_multiplier, check_sample_rate


def check_pca_components(k, input_dim: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or not (1 <= k <= input_dim):
        raise DPConfigError(
            f"pca_components={k!r} is invalid for inputs of dimension {input_dim}: the projection keeps k "
            f"principal directions, 1 ≤ k ≤ {input_dim}."
        )
    return k


def pca_event(noise_multiplier: float, sample_rate: float = 1.0) -> PrivacyEvent:
    check_noise_multiplier(noise_multiplier, "pca_noise_multiplier")
    check_sample_rate(sample_rate, "pca_sample_rate")
    if sample_rate == 1.0:
        return Gaussian(float(noise_multiplier))
    return PoissonGaussian(float(noise_multiplier), float(sample_rate))


def gram_sensitivity(rows: int) -> float:
    """The most one row can move the computed AᵀA (Frobenius norm) for ``rows`` = N rows of norm
    1 − m, against the neighbouring dataset's N + 1 (adding a row; removing one gives less): its
    own term, (1 − m)², and the rounding of the two computed products, each within
    γ_{K+1}·Σ_i ‖a_i‖² = γ_{K+1}·K·(1 − m)² of its exact value for K rows (K products summed in
    any order, then the symmetrisation's addition; Higham §3.1). At most 1 (the sensitivity the
    accountant takes) up to :func:`covered_rows` rows."""
    return (1.0 - CLIP_MARGIN) ** 2 * (1.0 + rows * gamma(rows + 1) + (rows + 1) * gamma(rows + 2))


def covered_rows() -> int:
    """The most rows whose :func:`gram_sensitivity` is at most 1 (949,132)."""
    lo, hi = 1, 2
    while gram_sensitivity(hi) <= 1.0:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if gram_sensitivity(mid) <= 1.0 else (lo, mid)
    return lo


def normalized_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows scaled to unit L2 norm (float64). A zero row, or one with a NaN/inf, becomes 0:
    it then contributes nothing, which keeps the sensitivity at 1."""
    a = x.reshape(x.shape[0], -1).to(torch.float64)
    finite = torch.isfinite(a).all(dim=1, keepdim=True)
    a = torch.where(finite, a, a.new_zeros(()))
    norms = a.norm(dim=1, keepdim=True)
    return torch.where(norms > 0, a / norms.clamp_min(1e-300), torch.zeros_like(a))


def symmetric_noise(dim: int, std: float, randomness: Randomness) -> torch.Tensor:
    """E with i.i.d. N(0, std²) on and above the diagonal, mirrored below."""
    iu = torch.triu_indices(dim, dim)
    upper = randomness.normal(iu.shape[1], std, dtype=torch.float64)
    e = torch.zeros(dim, dim, dtype=torch.float64)
    e[iu[0], iu[1]] = upper
    return e + e.triu(1).T


@dataclass
class DPPCAResult:
    components: torch.Tensor  # [k, d], orthonormal rows, float32
    eigenvalues: torch.Tensor  # the released matrix's top-k eigenvalues (post-processing of the release)
    released: torch.Tensor  # the released matrix AᵀA + E itself (float64, [d, d])
    event: PrivacyEvent
    rows_used: int | None  # None: not reported (it is the size of a private sample)


def dp_pca(
    x: torch.Tensor,
    k: int,
    noise_multiplier: float,
    randomness: Randomness,
    *,
    ledger: PrivacyLedger | None,
    sample_rate: float = 1.0,
) -> DPPCAResult:
    """The top-k principal directions of the normalised rows of ``x``, privately.

    ``ledger`` is required: the release is checked against its budget first and appended
    (step 0). Pass ``ledger=None`` only if you record ``result.event`` yourself; use the same
    event in :func:`dpcore.plan`'s (or ``make_private``'s) ``prior_groups`` so that σ of the
    training steps is calibrated with the projection's cost included.
    """
    d = x[0].numel() if x.shape[0] else int(torch.tensor(x.shape[1:]).prod())
    check_pca_components(k, d)
    released, event = release_gram(x, noise_multiplier, randomness, ledger=ledger, sample_rate=sample_rate)
    eigvals, eigvecs = torch.linalg.eigh(released)  # ascending; post-processing of the release
    top = torch.argsort(eigvals, descending=True)[:k]
    return DPPCAResult(
        eigvecs[:, top].T.contiguous().to(torch.float32), eigvals[top].to(torch.float32), released, event, None
    )


def release_gram(
    x: torch.Tensor,
    noise_multiplier: float,
    randomness: Randomness,
    *,
    ledger: PrivacyLedger | None,
    sample_rate: float = 1.0,
) -> tuple[torch.Tensor, PrivacyEvent]:
    """DP-PCA's release: AᵀA + E (float64, exactly symmetric) for the normalised rows A of
    ``x`` (Poisson-sampled at ``sample_rate``). Checked against the ledger's budget first and
    appended at step 0 after; everything :func:`dp_pca` does next is post-processing."""
    d = x[0].numel() if x.shape[0] else int(torch.tensor(x.shape[1:]).prod())
    event = pca_event(noise_multiplier, sample_rate)
    if ledger is not None:
        ledger.check(event)  # before the rows are even sampled
    # Each row's term a·aᵀ has Frobenius norm ‖a‖² = 1 exactly, but the float64 product's
    # rounding depends on every row (about N²·2⁻⁵³ of the sum); rows scaled to 1 − m, the
    # clipping margin, leave it that room up to covered_rows() rows (gram_sensitivity).
    if gram_sensitivity(x.shape[0]) > 1.0:  # N, like a dataset's size, is public
        warnings.warn(
            f"floating point: DP-PCA over {x.shape[0]:,} rows could, in the worst case, let one row move the "
            f"computed AᵀA by {gram_sensitivity(x.shape[0]):.7f}, above the sensitivity 1 the accountant "
            f"assumes; the clipping margin covers up to {covered_rows():,} rows. Pass fewer rows (a public "
            "subsample) to stay within it.",
            stacklevel=2,
        )
    a = normalized_rows(x) * (1.0 - CLIP_MARGIN)
    if sample_rate < 1.0:
        a = a[included(randomness.uniform(a.shape[0]), sample_rate)]
    gram = a.T @ a
    sums = [0.5 * (gram + gram.T)]  # exactly symmetric, and so is the noise
    noise = lambda: [symmetric_noise(d, noise_multiplier, randomness)]  # noqa: E731
    if ledger is None:  # the caller records ``event`` itself
        return sums[0] + noise()[0], event
    (released,) = release(sums, event=event, ledger=ledger, noise=noise, step=0, clip_norm=1.0)
    return released, event


class PCAProjection(nn.Module):
    """x ↦ flatten(x) @ componentsᵀ: the frozen first stage of a model (a buffer, not a parameter)."""

    def __init__(self, components: torch.Tensor):
        super().__init__()
        self.register_buffer("components", components.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], -1) @ self.components.T

    def extra_repr(self) -> str:
        k, d = self.components.shape
        return f"{d} -> {k} (DP-PCA, frozen)"

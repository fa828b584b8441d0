"""DP-PCA (``dpcore/pca.py``): the released Gram matrix's rows keep the clipping margin, and it
warns above the rows that margin covers (the bound checked in exact rationals and against the
documents); its noise has the stated scale and is symmetric; the projection is the top-k
eigenvectors and is ledgered; its cost is composed with training in the plan; a bad dimension is
refused before the release."""

from __future__ import annotations

import math
import warnings
from fractions import Fraction
from pathlib import Path

import pytest
import scipy.stats
import torch

import dpcore
from dpcore.accounting import GAUSSIAN, POISSON_GAUSSIAN
from dpcore.clipping import CLIP_MARGIN
from dpcore.pca import normalized_rows

warnings.simplefilter("ignore", dpcore.SeededRandomnessWarning)


def test_dp_pcas_rows_keep_the_clipping_margin():
    """Each row's term in the released Gram matrix has Frobenius norm (1 − m)², m = CLIP_MARGIN:
    the room the float64 product's rounding needs (σ made negligible here to read it)."""
    from dpcore.clipping import CLIP_MARGIN

    x = torch.randn(50, 6)
    with pytest.warns(dpcore.SeededRandomnessWarning):
        released, _ = dpcore.pca.release_gram(x, 1e-12, dpcore.SeededRandomness(0), ledger=None)
    assert float(torch.trace(released)) == pytest.approx(50 * (1 - CLIP_MARGIN) ** 2, rel=1e-12)


def test_dp_pca_warns_above_the_rows_its_margin_covers():
    """The Gram product's worst-case rounding grows as N²·u: the margin covers it up to
    covered_rows() (about 950,000), and DP-PCA warns above that. The bound is checked on its
    own, in exact rationals: (1 − m)²·(1 + N·γ_{N+1} + (N + 1)·γ_{N+2}) (N rows against the
    neighbour's N + 1) crosses 1 between covered_rows() and one more row."""
    from dpcore.clipping import UNIT_ROUNDOFF
    from dpcore.pca import covered_rows, gram_sensitivity

    n = covered_rows()
    assert 900_000 < n < 1_000_000

    u = Fraction(UNIT_ROUNDOFF)

    def by_hand(rows):
        def g(k):
            return k * u / (1 - k * u)

        return (1 - Fraction(CLIP_MARGIN)) ** 2 * (1 + rows * g(rows + 1) + (rows + 1) * g(rows + 2))

    assert by_hand(n) <= 1 < by_hand(n + 1)
    for rows in (n, n + 1):
        assert gram_sensitivity(rows) == pytest.approx(float(by_hand(rows)), rel=1e-15)
    for rows, warns in ((n, False), (n + 1, True)):
        x = torch.ones(rows, 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dpcore.pca.release_gram(x, 1.0, dpcore.SeededRandomness(0), ledger=None)
        said = [str(w.message) for w in caught if "DP-PCA over" in str(w.message)]
        assert bool(said) == warns, said
        if warns:
            assert f"covers up to {n:,} rows" in said[0]
    root = Path(__file__).resolve().parents[2]
    for doc in ("README.md", "docs/methods.md"):  # the documents state the number the function gives
        assert f"{n:,} rows" in " ".join((root / doc).read_text().split()), doc


def test_dp_pca_noise_has_the_stated_scale_and_is_symmetric():
    torch.manual_seed(0)
    x = torch.randn(500, 1, 8, 8) * 7 + 2
    sigma, d = 4.0, 64
    a = normalized_rows(x)
    assert torch.allclose(a.norm(dim=1), torch.ones(500, dtype=torch.float64))
    a = a * (1 - CLIP_MARGIN)  # the released rows keep the clipping margin
    exact = a.T @ a
    exact = 0.5 * (exact + exact.T)
    devs = []
    for seed in range(4):
        res = dpcore.dp_pca(x, 10, sigma, dpcore.SeededRandomness(seed), ledger=None)
        assert torch.equal(res.released, res.released.T)
        e = res.released - exact
        iu = torch.triu_indices(d, d)
        devs.append(e[iu[0], iu[1]])
    z = torch.cat(devs).numpy() / sigma  # 4 × 2080 independent entries
    se = 1 / math.sqrt(2 * z.size)
    assert abs(z.std() - 1) < 5 * se and abs(z.mean()) < 5 / math.sqrt(z.size)
    assert scipy.stats.kstest(z, "norm").pvalue > 1e-3
    # the secure generator gives the same scale
    e = dpcore.dp_pca(x, 10, sigma, dpcore.SecureRandomness(), ledger=None).released - exact
    iu = torch.triu_indices(d, d)
    assert abs(float(e[iu[0], iu[1]].std()) / sigma - 1) < 5 / math.sqrt(2 * iu.shape[1])


def test_dp_pca_projection_is_the_top_k_eigenvectors_and_is_ledgered():
    torch.manual_seed(0)
    basis = torch.linalg.qr(torch.randn(20, 3))[0]
    x = torch.randn(2000, 3) @ basis.T * 10 + 0.01 * torch.randn(2000, 20)
    ledger = dpcore.PrivacyLedger(5.0, 1e-5)
    res = dpcore.dp_pca(x, 3, 2.0, dpcore.SeededRandomness(0), ledger=ledger)
    assert torch.allclose(res.components @ res.components.T, torch.eye(3), atol=1e-5)
    overlap = torch.linalg.svdvals(res.components @ basis)
    assert overlap.min() > 0.99  # the signal subspace is found through the noise
    assert [(e.kind, e.noise_multiplier, e.sample_rate, e.step) for e in ledger.entries] == [(GAUSSIAN, 2.0, 1.0, 0)]
    assert ledger.committed_steps() == []
    sampled = dpcore.dp_pca(x, 3, 2.0, dpcore.SeededRandomness(0), sample_rate=0.1, ledger=ledger)
    assert sampled.event == dpcore.PrivacyEvent(POISSON_GAUSSIAN, 2.0, 0.1)
    assert ledger.epsilon() == pytest.approx(
        dpcore.epsilon(
            [(dpcore.PrivacyEvent(GAUSSIAN, 2.0), 1), (dpcore.PrivacyEvent(POISSON_GAUSSIAN, 2.0, 0.1), 1)], 1e-5
        )
    )
    proj = dpcore.PCAProjection(res.components)
    assert list(proj.parameters()) == [] and proj(x[:5]).shape == (5, 3)


def test_pca_cost_is_composed_with_training_in_the_plan():
    pca = [(dpcore.PrivacyEvent(GAUSSIAN, 8.0), 1)]
    plain = dpcore.plan(dataset_size=1000, lot_size=100, epochs=5, target_epsilon=2.0, target_delta=1e-5)
    with_pca = dpcore.plan(
        dataset_size=1000, lot_size=100, epochs=5, target_epsilon=2.0, target_delta=1e-5, prior_groups=pca
    )
    assert with_pca[0] > plain[0]
    total = dpcore.epsilon(pca + [(dpcore.PrivacyEvent.dpsgd_step(with_pca[0], with_pca[1]), with_pca[2])], 1e-5)
    assert 0.99 * 2.0 <= total <= 2.0
    with pytest.raises(dpcore.DPConfigError, match="nothing is left"):
        dpcore.plan(
            dataset_size=1000,
            lot_size=100,
            epochs=5,
            target_epsilon=0.1,
            target_delta=1e-5,
            prior_groups=[(dpcore.PrivacyEvent(GAUSSIAN, 1.0), 1)],
        )


@pytest.mark.parametrize("k", [0, -3, 65, 2.5])
def test_bad_pca_dimension_is_refused_before_the_release(k):
    ledger = dpcore.PrivacyLedger(1.0, 1e-5)
    with pytest.raises(dpcore.DPConfigError, match="pca_components"):
        dpcore.dp_pca(torch.randn(50, 64), k, 4.0, dpcore.SeededRandomness(0), ledger=ledger)
    assert len(ledger) == 0

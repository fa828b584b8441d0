"""The bound on floating-point rounding that the clipping margin covers (README, "What the
guarantee does not cover"): the bound's arithmetic against an exact rational computation, the lot
sizes it covers (and the README's numbers for them), the optimizer's warnings where a dataset could
form an uncovered lot or a lot arrives in more pieces than physical batches, and the clip norm's
float64 floor."""

import math
import warnings
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from dpcore.clipping import (
    CLIP_MARGIN,
    NORM_ERROR,
    ROUNDING_SHARE,
    covered_lot_size,
    float_sensitivity,
    gamma,
    warn_if_pieces_uncovered,
)

from ._float_common import _optimizer

U = Fraction(1, 2**53)


def _rounding(size: int, n: int) -> Fraction:
    """A computed sum of ``size`` shares, each through at most n roundings: its error over C."""
    g = n * U / (1 - n * U)
    return size * (Fraction(ROUNDING_SHARE) + g * (1 + Fraction(ROUNDING_SHARE)))


SHARE = (1 - Fraction(CLIP_MARGIN)) * (1 + Fraction(NORM_ERROR))


def exact_bound(lot: int, batch: int, workers: int) -> Fraction:
    """The README's bound in exact rational arithmetic: S + (2L + 1)·(ρ + γ_n·(1 + ρ)),
    n = ⌈(L + 1)/B⌉ + 2W (a lot of L against its neighbour's of L + 1)."""
    n = -(-(lot + 1) // batch) + 2 * workers
    return SHARE + _rounding(2 * lot + 1, n)


def pair_bound(lot: int, batch: int, workers: int) -> Fraction:
    """The same pair with each lot's own count of roundings (⌈L/B⌉ and ⌈(L + 1)/B⌉ sums)."""
    return (
        SHARE
        + _rounding(lot, -(-lot // batch) + 2 * workers)
        + _rounding(lot + 1, -(-(lot + 1) // batch) + 2 * workers)
    )


@pytest.mark.parametrize("lot,batch,workers", [(1, 1, 1), (60_000, 256, 1), (456_000, 1, 1), (800_000, 64, 8)])
def test_the_bound_matches_an_exact_rational_computation(lot, batch, workers):
    assert float_sensitivity(lot, batch, workers) == pytest.approx(float(exact_bound(lot, batch, workers)), rel=1e-14)
    # It covers the neighbour with one more example (adding one; removing one gives less).
    assert exact_bound(lot, batch, workers) >= pair_bound(lot, batch, workers) > pair_bound(lot - 1, batch, workers)
    assert gamma(10) == pytest.approx(float(10 * U / (1 - 10 * U)), rel=1e-15)


@pytest.mark.parametrize("batch,workers", [(1, 1), (16, 1), (64, 1), (256, 1), (256, 8)])
def test_the_covered_lot_size_is_where_the_bound_reaches_C(batch, workers):
    L = covered_lot_size(batch, workers)
    assert exact_bound(L, batch, workers) <= 1 < exact_bound(L + 1, batch, workers)


def test_the_readme_states_the_covered_lot_sizes_it_computes():
    """The README's numbers are the function's (rounded down to thousands)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for batch in (1, 16, 256):
        stated = f"{covered_lot_size(batch) // 1000:,},000"
        assert stated in readme, (batch, stated)


def test_the_optimizer_warns_where_the_dataset_could_form_an_uncovered_lot():
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="floating point")
        opt = _optimizer(60_000, 1)
    assert opt.float_sensitivity == float_sensitivity(60_000, 1) < 1
    with pytest.warns(UserWarning, match="covers lots of up to 848,"):
        opt = _optimizer(10_000_000, 256)
    assert opt.float_sensitivity > 1
    with pytest.warns(UserWarning, match="floating point"):  # a smaller physical batch covers less
        _optimizer(600_000, 256).physical_batch_size = 1


def test_a_lot_added_in_more_pieces_than_physical_batches_warns_without_counting_them():
    """Each piece passed to accumulate is its own batch sum, one more rounding of the lot's: the
    optimizer counts them (on the host) and warns where a lot took more than ⌈N/B⌉ and the bound
    for that many exceeds 1. The warning states no count (with small pieces it is the lot's
    size, which is private), and the recorded bound stays the data-independent one."""
    opt = _optimizer(100, 4)
    x, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    for k in range(3):
        opt.accumulate(x[2 * k : 2 * k + 2], y[2 * k : 2 * k + 2])
    assert opt.lot.batch_sums == 3
    opt.step()
    assert opt.lot.batch_sums == 0 and opt.float_sensitivity == float_sensitivity(100, 4)
    n = 100_000
    assert not warn_if_pieces_uncovered(n, 256, 1, math.ceil(n / 256))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="floating point")
        assert not warn_if_pieces_uncovered(n, 256, 1, n)  # pieces of 1: still inside the margin
    assert float_sensitivity(n, 256, sums=5_000_000) > 1
    with pytest.warns(UserWarning, match="more pieces than the physical batches of 256") as caught:
        assert warn_if_pieces_uncovered(n, 256, 1, 5_000_000)
    assert not any(ch.isdigit() for ch in str(caught[0].message).replace("256", ""))
    opt = _optimizer(n, 256)
    opt.accumulate(x, y)
    opt.lot.batch_sums = 5_000_000  # as if the lot had come in that many pieces
    with pytest.warns(UserWarning, match="more pieces than the physical batches"):
        opt.step()
    assert opt.float_sensitivity == float_sensitivity(n, 256)


def test_a_clip_norm_below_the_float64_floor_is_refused():
    from dpcore.errors import DPConfigError
    from dpcore.validation import MIN_CLIP_NORM, check_clip_norm

    assert check_clip_norm(MIN_CLIP_NORM) == MIN_CLIP_NORM
    with pytest.raises(DPConfigError, match="at least"):
        check_clip_norm(MIN_CLIP_NORM / 2)

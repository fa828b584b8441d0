"""The pieces every layer form adds to: float32 chunked row norms (dpcore.bookkeeping.norms)
stay within the clipping margin and fall back to float64 where squares overflow; SquaredNorms
sums every term and row once and refuses pieces of the wrong shape or dtype; and the small
rows of several layers (dpcore.bookkeeping.sums) are summed together as each alone."""

import math

import pytest
import torch


def test_float32_chunked_norms_are_within_the_clipping_margin():
    """Squared norms summed in float32 over chunks of 16 (then float64) stay within the error
    bound the clipping margin allows, on adversarial rows (many equal values, a wide range of
    magnitudes); huge rows that overflow float32 squares fall back to float64 instead of
    turning into inf (which would skip the example instead of clipping it)."""
    from dpcore.bookkeeping.base import Context
    from dpcore.bookkeeping.norms import row_sq_norms as _rsn
    from dpcore.clipping import NORM_ERROR

    def _row_sq_norms(w, clip, exact=False):
        return _rsn(w, Context(clip, 0, exact_rows=exact))

    torch.manual_seed(13)
    rows = torch.cat(
        [
            torch.full((1, 8192), 0.1),
            torch.randn(4, 8192) * torch.logspace(-6, 6, 8192),
            torch.randn(3, 8200)[:, :8192],
            torch.rand(2, 8192) * 1e-3 + 1.0,
        ]
    )
    exact = rows.double().square().sum(1)
    got = _row_sq_norms(rows, 1.0)
    rel = ((got - exact).abs() / exact).max().item()
    assert rel / 2 < NORM_ERROR, rel  # squared norm: the norm's error is half of this
    huge = torch.full((2, 4096), 3e20)
    huge[1, 7] = float("nan")
    ctx = Context(1.0, 0)
    assert not torch.isfinite(_rsn(huge, ctx)).any() and ctx.float32_rows  # overflowed, and says it took that path
    got = _row_sq_norms(huge, 1.0, exact=True)  # what the batch is measured with then
    assert math.isfinite(got[0].item()) and abs(got[0].item() / huge[0].double().square().sum().item() - 1) < 1e-12
    assert math.isnan(got[1].item())
    # Short rows, float64 rows and tiny clipping bounds take the float64 sum itself.
    for w, c in [
        (torch.randn(3, 20), 1.0),
        (torch.randn(3, 100, dtype=torch.float64), 1.0),
        (torch.randn(3, 100) * 1e-21, 1e-20),
    ]:
        assert torch.equal(_row_sq_norms(w, c), torch.linalg.vector_norm(w, dim=1, dtype=torch.float64).square())


def test_squared_norms_sum_every_term_and_row_once():
    """The layers' squared-norm terms, scattered terms and rows (float32 and float64) add up to
    each example's squared norm as a direct float64 sum of the same pieces; a term of the
    wrong shape or dtype is refused, not broadcast (Unsupported: the model then runs on vmap)."""
    from dpcore.bookkeeping import SquaredNorms, Unsupported

    g = torch.Generator().manual_seed(0)
    B = 5
    terms = [torch.rand(B, generator=g, dtype=torch.float64) for _ in range(3)]
    rows = [
        torch.randn(B, k, generator=g, dtype=dt)
        for k, dt in ((4, torch.float32), (7, torch.float64), (2, torch.float32))
    ]
    index, source = torch.tensor([0, 3, 3, 4]), torch.rand(4, generator=g, dtype=torch.float64)
    sq = SquaredNorms(B, torch.device("cpu"))
    sq += terms[0]
    sq.add_rows(rows[0])
    sq.index_add_(0, index, source)
    sq += terms[1]
    sq.add_rows(rows[1])
    sq.add_rows(rows[2])
    sq += terms[2]
    expected = sum(terms) + sum(r.double().square().sum(1) for r in rows)
    expected = expected.index_add(0, index, source)
    torch.testing.assert_close(sq.total(), expected, rtol=1e-15, atol=0.0)
    assert torch.equal(SquaredNorms(B, torch.device("cpu")).total(), torch.zeros(B, dtype=torch.float64))
    for bad in (torch.ones(B), torch.ones(B + 1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)):
        with pytest.raises(Unsupported):
            sq += bad
    with pytest.raises(Unsupported):
        sq.add_rows(torch.ones(B + 1, 3))


def test_small_rows_of_several_layers_are_summed_together_as_each_alone():
    """Biases and norm layers' per-example rows, formed into their clipped sums together per
    dtype: each sum equals its own Σ_i f_i·rows_i, float64 in its parameter's shape."""
    from dpcore.bookkeeping.sums import SmallRows, small_rows_sums

    g = torch.Generator().manual_seed(1)
    B = 6
    factors = torch.rand(B, generator=g, dtype=torch.float64)
    pending = [
        SmallRows(torch.randn(B, 4, generator=g), torch.zeros(4)),
        SmallRows(torch.randn(B, 6, generator=g, dtype=torch.float64), torch.zeros(2, 3)),
        SmallRows(torch.randn(B, 1, generator=g), torch.zeros(1)),
        SmallRows(torch.randn(B, 5, generator=g, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)),
    ]
    got = small_rows_sums(factors, pending)
    for r, v in zip(pending, got, strict=True):
        alone = (factors @ r.rows.double()).reshape(r.param.shape)
        assert v.shape == r.param.shape and v.dtype == torch.float64
        # any two summation orders of B products agree within 2·B·u·Σ_i |f_i·rows_i| (Higham's bound)
        bound = (2 * B * torch.finfo(torch.float64).eps * (factors.abs() @ r.rows.double().abs())).reshape(
            r.param.shape
        )
        assert bool(((v.double() - alone.double()).abs() <= bound.double()).all())

"""Book-keeping clipping on a text model's layers: Embedding (with and without padding_idx),
LayerNorm and Linear over every position of a sequence, each against the per-example (vmap)
reference; what the Embedding form refuses; and the first-batch check keeping it."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcore
from dpcore.bookkeeping import BookKeepingClipper, unsupported_parameters
from dpcore.clipping import per_sample_norms
from dpcore.grad_sample import PerSampleGradients

from ._common import TinyText, _reference


def _tokens(batch=16, length=10, vocab=8, seed=0):
    """Few distinct tokens, so that most examples repeat some (the case the form must sum)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g), torch.randint(0, 3, (batch,), generator=g)


@pytest.mark.parametrize("padding_idx", [0, None], ids=["padding", "no-padding"])
@pytest.mark.parametrize("clip", [0.01, 1.0, 1e3])
def test_text_layers_equal_the_vmap_clipped_sum(padding_idx, clip):
    torch.manual_seed(1)
    model = TinyText(padding_idx=padding_idx)
    assert unsupported_parameters(model) == []
    x, y = _tokens()
    got: dict = {}
    bad = BookKeepingClipper(model, F.cross_entropy).clipped_sum(x, y, clip, got)
    want, want_bad = _reference(model, x, y, clip)
    assert bad == want_bad == 0 and set(got) == set(want)
    for k, w in want.items():
        torch.testing.assert_close(got[k], w, rtol=1e-5, atol=1e-6 * max(clip, 1.0))
    if padding_idx is not None:  # nn.Embedding's padding row gets no gradient
        assert torch.equal(got["emb.weight"][padding_idx], torch.zeros(12))


def test_the_token_tables_rows_add_into_a_running_sum_like_the_reference():
    """A lot of several physical batches: the table's clipped rows go straight into the sum
    already there (no table-sized tensor per batch), and the lot's sum equals the reference's
    sum of the batches; a dense sum is still what contributions() gives by default."""
    torch.manual_seed(2)
    model = TinyText()
    clipper = BookKeepingClipper(model, F.cross_entropy)
    sums = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    want = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for seed in range(3):
        x, y = _tokens(seed=seed)
        clipper.clipped_sum(x, y, 0.5, sums)
        for k, v in _reference(model, x, y, 0.5)[0].items():
            want[k] += v
    for k in want:
        torch.testing.assert_close(sums[k], want[k], rtol=1e-5, atol=1e-6)
    sq, parts = clipper.measure(*_tokens(), 0.5)
    dense = dict(clipper.contributions(parts, torch.ones_like(sq), torch.ones_like(sq, dtype=torch.bool)))
    assert all(isinstance(v, torch.Tensor) and v.shape == sums[k].shape for k, v in dense.items())


def test_embedding_norms_are_exact_in_float64_with_repeated_tokens():
    """Each example's squared norm, repeated tokens summed before squaring, to 1e-12 in float64."""
    torch.manual_seed(2)
    model = TinyText().double()
    x, y = _tokens(vocab=5, length=20)
    assert all(len(set(row.tolist())) < 20 for row in x)  # every example repeats tokens
    sq, _ = BookKeepingClipper(model, F.cross_entropy).measure(x, y, 1.0)
    ref = per_sample_norms(PerSampleGradients(model, F.cross_entropy)(x, y)).square()
    torch.testing.assert_close(sq, ref, rtol=1e-12, atol=0.0)


def test_an_example_with_a_non_finite_embedding_is_skipped_and_counted_like_the_reference():
    torch.manual_seed(3)
    model = TinyText(padding_idx=None)
    x, y = _tokens(vocab=6)
    x[0] = 7  # token 7 appears only in example 0
    with torch.no_grad():
        model.emb.weight[7] = float("nan")
    got: dict = {}
    bad = BookKeepingClipper(model, F.cross_entropy).clipped_sum(x, y, 0.1, got)
    want, want_bad = _reference(model, x, y, 0.1)
    assert bad == want_bad == 1
    for k, w in want.items():
        assert torch.isfinite(got[k]).all()
        torch.testing.assert_close(got[k], w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "kw, reason",
    [
        ({"max_norm": 1.0}, "max_norm"),
        ({"sparse": True}, "sparse"),
        ({"scale_grad_by_freq": True}, "couples the examples"),
    ],
)
def test_embedding_options_that_break_the_form_are_named(kw, reason):
    model = nn.Sequential(nn.Embedding(10, 4, **kw), nn.Flatten(), nn.Linear(12, 2))
    problems = unsupported_parameters(model)
    assert problems and all(p.startswith("0.weight") for p in problems) and reason in problems[0]


def test_a_text_model_stays_on_book_keeping_after_the_first_batch_check():
    torch.manual_seed(4)
    model = TinyText()
    opt = dpcore.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        loss_fn=F.cross_entropy,
        noise_multiplier=1.0,
        clip_norm=0.5,
        sample_rate=0.1,
        dataset_size=160,
        randomness=dpcore.SeededRandomness(0),
        ledger=dpcore.PrivacyLedger(None, 1e-5),
        clipping="auto",
    )
    assert opt.clipping == "bookkeeping"
    x, y = _tokens(batch=24)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fall-back to vmap
        opt.accumulate(x, y)
    assert opt._fast_verified
    want, _ = _reference(model, x, y, 0.5)
    for k, w in want.items():
        torch.testing.assert_close(opt._sum[k].to(w.dtype), w, rtol=1e-5, atol=1e-6)

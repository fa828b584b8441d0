"""bf16 autocast (issue J): the model's forward runs in bfloat16, while clipping, the clipped
sums and the noise stay in float32, on the vmap path and on book-keeping; each example's
contribution still has norm ≤ C; and an unknown mode is refused before anything is spent."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcore
import dpcore.bookkeeping.base as bk_base
import dpcore.clipping as clipping_module
import dpcore.optimizer as optimizer_module
from dpcore.bookkeeping import BookKeepingClipper
from dpcore.clipping import clip_factors, clipped_sum, per_sample_norms
from dpcore.grad_sample import PerSampleGradients


class TinyText(nn.Module):
    """Embedding → LayerNorm → Linear at every position → tanh → mean → head: the layer types of
    a transformer encoder that book-keeping covers."""

    def __init__(self, vocab=50, dim=16, classes=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.norm = nn.LayerNorm(dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, classes)
        self.seen: list[torch.dtype] = []  # the dtype of each Linear output (no hooks: book-keeping refuses those)

    def forward(self, x):
        h = self.mix(self.norm(self.emb(x)))
        out = self.head(torch.tanh(h).mean(1))
        self.seen += [h.dtype, out.dtype]
        return out


def _batch(n=24, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (n, length), generator=g), torch.randint(0, 2, (n,), generator=g)


def _optimizer(model, clipping, autocast, sigma=1.0):
    return dpcore.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        loss_fn=F.cross_entropy,
        noise_multiplier=sigma,
        clip_norm=0.5,
        sample_rate=0.1,
        dataset_size=240,
        randomness=dpcore.make_randomness(0),
        ledger=dpcore.PrivacyLedger(10.0, 1e-5),
        clipping=clipping,
        autocast=autocast,
    )


@pytest.mark.parametrize("clipping", ["vmap", "bookkeeping"])
def test_bf16_forward_with_clipping_and_noise_in_float32_or_wider(clipping, monkeypatch):
    """Clipping and noise in float32 (float64 in the check's copy), the lot's sums in float64
    (dpcore/lot.py), the update in the parameters' float32: none of it in bf16, nor under autocast."""
    torch.manual_seed(0)
    model = TinyText()
    x, y = _batch()
    # What the clipping and the noise are computed from, and whether autocast is on then.
    seen_clip, seen_noise, seen_forms = [], [], []
    real_factors, real_noise = clipping_module.clip_factors, optimizer_module.draw_noise

    def spy_factors(norms, clip_norm):
        seen_clip.append((norms.dtype, torch.is_autocast_enabled("cpu")))
        return real_factors(norms, clip_norm)

    def spy_noise(randomness, like, std, laplace):
        noise = real_noise(randomness, like, std, laplace)
        seen_noise.append(([t.dtype for t in like], [t.dtype for t in noise], torch.is_autocast_enabled("cpu")))
        return noise

    real_wab = bk_base.weight_and_bias

    def spy_forms(m, A, G, channels_first, sq, ctx):
        seen_forms.append((A.dtype, G.dtype, torch.is_autocast_enabled("cpu")))
        return real_wab(m, A, G, channels_first, sq, ctx)

    monkeypatch.setattr(clipping_module, "clip_factors", spy_factors)
    monkeypatch.setattr(optimizer_module, "draw_noise", spy_noise)
    import dpcore.bookkeeping.clipper as clipper_module
    import dpcore.bookkeeping.linear as linear_module

    monkeypatch.setattr(clipper_module, "clip_factors", spy_factors)
    monkeypatch.setattr(linear_module, "weight_and_bias", spy_forms)

    opt = _optimizer(model, clipping, "bf16")
    model.seen.clear()
    opt.accumulate(x, y)
    assert opt.clipping == clipping  # book-keeping passed its float64 check under a bf16 forward
    # the training forward ran in bf16 (book-keeping's float64 check runs a float64 copy)
    assert torch.bfloat16 in model.seen and set(model.seen) <= {torch.bfloat16, torch.float64}
    assert all(s.dtype == torch.float64 for s in opt.lot.sums.values())
    assert seen_clip and all(d in (torch.float32, torch.float64) and not on for d, on in seen_clip)
    if clipping == "bookkeeping":  # the formulas get widened inputs, outside autocast (float64: the check's copy)
        assert (torch.float32, torch.float32, False) in seen_forms
        assert all(a == g and a in (torch.float32, torch.float64) and not on for a, g, on in seen_forms)
    opt.step()
    ((like, noise, on),) = seen_noise
    assert set(like) == set(noise) == {torch.float64} and not on  # the sums' dtype (helper-33), outside autocast
    assert all(p.grad.dtype == torch.float32 and p.dtype == torch.float32 for p in model.parameters())


def test_bf16_per_example_gradients_are_float32_and_close_to_the_float32_ones():
    """The vmap path under bf16: gradients in the parameters' dtype, within bf16's precision of
    the float32 ones (bf16 keeps 8 significant bits, ~0.4 %; a few layers of rounding stay
    within 5 % of the gradient's scale), and not equal to them (bf16 did run)."""
    torch.manual_seed(1)
    model = TinyText()
    x, y = _batch(seed=1)
    g32 = PerSampleGradients(model, F.cross_entropy)(x, y)
    g16 = PerSampleGradients(model, F.cross_entropy, autocast="bf16")(x, y)
    for k in g32:
        assert g16[k].dtype == torch.float32
        scale = float(g32[k].abs().max())
        diff = float((g16[k] - g32[k]).abs().max())
        assert diff <= 0.05 * scale, (k, diff, scale)
    assert any(not torch.equal(g16[k], g32[k]) for k in g32 if k != "emb.weight")


@pytest.mark.parametrize("clip", [0.01, 0.5, 100.0])
def test_bf16_bookkeeping_clips_each_example_to_c(clip):
    """Invariant 1 under a bf16 forward: book-keeping's clipped sum equals the sum of the
    vectors it measured, each scaled to norm ≤ C. The per-example vectors are recovered by
    giving one example a factor of 1 and the others 0."""
    torch.manual_seed(2)
    model = TinyText()
    x, y = _batch(n=6, seed=2)
    clipper = BookKeepingClipper(model, F.cross_entropy, autocast="bf16")
    sq, parts = clipper.measure(x, y, clip)
    factors, finite = clip_factors(sq.sqrt(), clip)
    for i in range(x.shape[0]):
        onehot = torch.zeros_like(factors)
        onehot[i] = factors[i]
        share = dict(clipper.contributions(parts, onehot, finite))
        norm = torch.sqrt(sum(v.double().square().sum() for v in share.values()))
        assert float(norm) <= clip * (1 + 1e-6)
        unit = torch.zeros_like(factors)
        unit[i] = 1.0
        raw = dict(clipper.contributions(parts, unit, finite))  # the vector whose norm was measured
        raw_sq = sum(v.double().square().sum() for v in raw.values())
        torch.testing.assert_close(raw_sq, sq[i], rtol=1e-5, atol=0.0)


def test_bf16_bookkeeping_equals_bf16_vmap_up_to_bf16_rounding():
    torch.manual_seed(3)
    model = TinyText()
    x, y = _batch(seed=3)
    got: dict = {}
    BookKeepingClipper(model, F.cross_entropy, autocast="bf16").clipped_sum(x, y, 0.5, got)
    want, _ = clipped_sum(PerSampleGradients(model, F.cross_entropy, autocast="bf16")(x, y), 0.5)
    exact, _ = clipped_sum(PerSampleGradients(model, F.cross_entropy)(x, y), 0.5)
    for k in want:
        scale = float(exact[k].abs().max())
        assert float((got[k] - exact[k]).abs().max()) <= 0.05 * scale
        assert float((want[k] - exact[k]).abs().max()) <= 0.05 * scale
    assert per_sample_norms(PerSampleGradients(model, F.cross_entropy, autocast="bf16")(x, y)).dtype == torch.float64


def test_an_unknown_autocast_mode_is_refused_before_anything_is_spent(tmp_path):
    model = TinyText()
    with pytest.raises(dpcore.DPConfigError, match="autocast='fp8' is unknown"):
        dpcore.make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            F.cross_entropy,
            dataset_size=1000,
            lot_size=100,
            epochs=1,
            target_epsilon=2.0,
            target_delta=1e-5,
            clip_norm=1.0,
            journal=str(tmp_path / "journal"),
            autocast="fp8",
        )
    assert not (tmp_path / "journal").exists()


@pytest.mark.parametrize("path", ["bookkeeping", "vmap"])
def test_an_autocast_region_opened_by_the_caller_does_not_reach_the_clipping_formulas(path):
    """A caller who wraps the step in ``torch.autocast`` (bf16) gets a bf16 forward, but the clip
    factors and clipped sums still run in float64: each example's share stays ≤ C. (With
    book-keeping's formulas under the caller's autocast, a factor multiplied in bf16 gave shares
    up to 1.00057·C on this model; the vmap path's sum did not show it here.) One example per
    batch, so the sum is its share."""
    torch.manual_seed(0)
    C = 0.05
    worst = 0.0
    for _ in range(30):
        model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        x, y = torch.randn(1, 1, 8, 8), torch.randint(0, 10, (1,))
        out: dict[str, torch.Tensor] = {}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if path == "bookkeeping":
                BookKeepingClipper(model, F.cross_entropy).clipped_sum(x, y, C, out)
            else:
                clipped_sum(PerSampleGradients(model, F.cross_entropy)(x, y), C, out)
        assert all(v.dtype == torch.float64 for v in out.values())
        worst = max(worst, float(torch.sqrt(sum(v.double().square().sum() for v in out.values()))) / C)
    assert 0.5 < worst <= 1.0

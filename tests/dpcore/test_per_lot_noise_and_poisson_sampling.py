"""Invariants 2, 3 and 4: the optimizer's noise is N(0, σ²C²) per coordinate in both randomness modes,
added once per lot (an empty lot still takes a noise-only step), drawn in the sums' float64 and
divided by the expected lot size qN; Poisson lot sizes are Binomial(N, q), sharded too (disjoint,
covering shards, independent rank streams, a union that is a Poisson sample of the whole dataset);
and make_private accounts with PLD at the sampler's rate. Statistical tests fix their seeds and
derive their tolerances from the sample size."""

import math

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn

import dpcore
from dpcore.clipping import clipped_sum
from dpcore.grad_sample import PerSampleGradients

from ..helpers import assert_unseeded_draw_fits, ce, tiny_mlp


def _optimizer(model, *, sigma, clip, q, n, randomness, ledger=None, opt=None, **kw):
    return dpcore.DPOptimizer(
        opt or torch.optim.SGD(model.parameters(), lr=0.0),
        model=model,
        loss_fn=ce,
        noise_multiplier=sigma,
        clip_norm=clip,
        sample_rate=q,
        dataset_size=n,
        randomness=randomness,
        ledger=dpcore.PrivacyLedger(None, 1e-6) if ledger is None else ledger,
        **kw,
    )


@pytest.mark.parametrize(
    "make_randomness", [lambda: dpcore.SeededRandomness(7), dpcore.SecureRandomness], ids=["seeded", "secure"]
)
def test_noise_std_is_sigma_times_C(make_randomness):
    randomness = make_randomness()
    # An empty lot: the update is noise only. p.grad·qN is then N(0, σ²C²) per coordinate.
    model = nn.Linear(800, 500)  # 400,500 coordinates
    sigma, clip, q, n = 1.7, 0.6, 0.01, 5000
    opt = _optimizer(model, sigma=sigma, clip=clip, q=q, n=n, randomness=randomness)
    opt.step()
    noise = torch.cat([p.grad.flatten() for p in model.parameters()]).double() * (q * n)
    m = noise.numel()
    target = sigma * clip
    # Sample std of m normals: relative standard error 1/sqrt(2(m-1)). Allow 5 SE (≈1.1%).
    tol = 5 / math.sqrt(2 * (m - 1))
    assert abs(noise.std().item() / target - 1) < tol
    assert abs(noise.mean().item()) < 5 * target / math.sqrt(m)
    # The same measurement rejects a noise scale off by √2 either way (power of the check).
    for wrong in (target * math.sqrt(2), target / math.sqrt(2)):
        assert abs(noise.std().item() / wrong - 1) > 10 * tol
    # Gaussian shape (KS against N(0, σC)).
    assert_unseeded_draw_fits(noise / target, "norm")


def test_noise_is_added_once_and_update_is_divided_by_expected_lot_size():
    """Replay the seeded noise stream: p.grad == (clipped sum + one noise draw) / (q·N),
    where the realised lot size differs from q·N."""
    torch.manual_seed(0)
    model = tiny_mlp()
    sigma, clip, q, n = 0.8, 0.5, 0.05, 400  # qN = 20
    x, y = torch.randn(13, 6), torch.randint(0, 3, (13,))  # realised lot: 13 ≠ 20
    ref_sum, _ = clipped_sum(PerSampleGradients(model, ce)(x, y), clip)
    opt = _optimizer(model, sigma=sigma, clip=clip, q=q, n=n, randomness=dpcore.SeededRandomness(11).spawn("noise"))
    opt.accumulate(x[:5], y[:5])
    opt.accumulate(x[5:], y[5:])  # two physical batches, one lot
    opt.step()
    replay = dpcore.SeededRandomness(11).spawn("noise")
    for name, p in model.named_parameters():
        noise = replay.normal(p.shape, sigma * clip, dtype=torch.float64)  # drawn in the sums' float64
        expected = (ref_sum[name].double() + noise) / (q * n)
        assert p.grad.dtype == p.dtype and torch.allclose(p.grad, expected.to(p.dtype), atol=1e-6), name
    assert opt.expected_lot_size == pytest.approx(20.0)


def test_empty_lot_still_takes_a_noise_only_step():
    torch.manual_seed(0)
    model = tiny_mlp()
    before = [p.detach().clone() for p in model.parameters()]
    ledger = dpcore.PrivacyLedger(10.0, 1e-5)
    opt = _optimizer(
        model,
        sigma=1.0,
        clip=1.0,
        q=0.1,
        n=100,
        randomness=dpcore.SeededRandomness(0),
        ledger=ledger,
        opt=torch.optim.SGD(model.parameters(), lr=0.1),
    )
    lot = torch.empty(0, dtype=torch.long)
    x = torch.randn(10, 6)
    opt.accumulate(x[lot], torch.zeros(0, dtype=torch.long))
    opt.step()
    assert len(ledger) == 1
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_a_float32_models_noise_is_drawn_in_float64_like_the_sums(monkeypatch):
    """helper-33: float32 noise lies on a grid 2⁻²³·σC apart, and the float64 sum's bits below it
    survived ÷ qN and the cast to float32: knowing the other examples' sums, one step told
    whether an example was in the lot (20 of 20 in the review's script). The noise is drawn in
    the sums' dtype, on the step and on a replay alike (a seeded stream advances the same)."""
    import dpcore.optimizer as optimizer_module

    seen = []
    real = optimizer_module.draw_noise

    def spy(randomness, like, std, laplace=False):
        out = real(randomness, like, std, laplace)
        seen.append({t.dtype for t in out})
        return out

    monkeypatch.setattr(optimizer_module, "draw_noise", spy)
    torch.manual_seed(0)
    model = tiny_mlp()
    stream = dpcore.SeededRandomness(5, _quiet=True)
    opt = _optimizer(model, sigma=1.0, clip=1.0, q=0.05, n=400, randomness=stream)
    opt.accumulate(torch.randn(7, 6), torch.randint(0, 3, (7,)))
    opt.step()
    after_step = stream.state_dict()["generator"].clone()
    opt.replay([p.grad.clone() for p in model.parameters()], None)
    assert seen == [{torch.float64}, {torch.float64}]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    fresh = dpcore.SeededRandomness(5, _quiet=True)  # float64 draws, tensor by tensor: the step, then the replay
    for states in (after_step, stream.state_dict()["generator"]):
        for p in model.parameters():
            fresh.normal(p.shape, 1.0, dtype=torch.float64)
        assert torch.equal(fresh.state_dict()["generator"], states)


def _binomial_chi2_pvalue(sizes, n, q):
    sizes = np.asarray(sizes)
    lo, hi = int(stats.binom.ppf(0.001, n, q)), int(stats.binom.ppf(0.999, n, q))
    edges = list(range(lo, hi + 1))
    obs = [np.sum(sizes < lo)] + [np.sum(sizes == k) for k in edges] + [np.sum(sizes > hi)]
    probs = [stats.binom.cdf(lo - 1, n, q)] + [stats.binom.pmf(k, n, q) for k in edges] + [stats.binom.sf(hi, n, q)]
    obs, exp = np.array(obs, float), np.array(probs) * len(sizes)
    # Merge bins with expected count < 5 into neighbours (standard chi-square practice).
    o2, e2, acc_o, acc_e = [], [], 0.0, 0.0
    for o, e in zip(obs, exp):
        acc_o += o
        acc_e += e
        if acc_e >= 5:
            o2.append(acc_o)
            e2.append(acc_e)
            acc_o = acc_e = 0.0
    o2[-1] += acc_o
    e2[-1] += acc_e
    return stats.chisquare(o2, e2).pvalue


def test_lot_sizes_follow_binomial():
    n, q, lots = 600, 0.05, 4000
    sampler = dpcore.PoissonSampler(n, q, dpcore.SeededRandomness(5), steps=lots)
    sizes = [len(lot) for lot in sampler]
    assert _binomial_chi2_pvalue(sizes, n, q) > 1e-3
    # Power check: the same test rejects lots drawn at a 20% higher rate.
    wrong = dpcore.PoissonSampler(n, q * 1.2, dpcore.SeededRandomness(5), steps=lots)
    assert _binomial_chi2_pvalue([len(lot) for lot in wrong], n, q) < 1e-6


def test_shards_are_disjoint_cover_the_dataset_and_differ_in_size_by_at_most_one():
    """Invariant 4's union argument needs each example in exactly one rank's shard (helper-32: an
    overlap of one example was caught only at world size 3, by a statistical test)."""
    from dpcore.sampling import shard_indices

    for n in (1, 2, 7, 100, 301, 1024):
        for world in range(1, min(n, 9) + 1):
            shards = [shard_indices(n, r, world) for r in range(world)]
            assert torch.equal(torch.cat(shards), torch.arange(n))  # in order: disjoint and covering
            sizes = [len(s) for s in shards]
            assert max(sizes) - min(sizes) <= 1


def test_rank_streams_are_independent():
    root = dpcore.SeededRandomness(1)
    a = root.spawn("sampling", 0).uniform(1000)
    b = root.spawn("sampling", 1).uniform(1000)
    c = root.spawn("sampling", 0).uniform(1000)
    assert torch.equal(a, c) and not torch.equal(a, b)
    assert abs(np.corrcoef(a.numpy(), b.numpy())[0, 1]) < 5 / math.sqrt(1000)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharded_union_is_a_poisson_sample_of_the_whole_dataset(world):
    n, q, steps = 301, 0.1, 3000
    root = dpcore.SeededRandomness(9)
    shards = [dpcore.shard_indices(n, r, world) for r in range(world)]
    # Shards are disjoint and cover the dataset.
    assert torch.equal(torch.sort(torch.cat(shards)).values, torch.arange(n))
    samplers = [dpcore.PoissonSampler(shards[r], q, root.spawn("sampling", r), steps) for r in range(world)]
    counts = torch.zeros(n)
    sizes = []
    for lots in zip(*samplers):
        union = torch.cat(lots)
        assert len(torch.unique(union)) == len(union)
        counts[union] += 1
        sizes.append(len(union))
    # Union lot sizes ~ Binomial(N, q).
    assert _binomial_chi2_pvalue(sizes, n, q) > 1e-3
    # Every example is included at rate q: its count ~ Binomial(steps, q). Check the overall
    # rate (5 SE) and that no example is far off (Bonferroni over n examples).
    rate = counts.sum().item() / (n * steps)
    assert abs(rate - q) < 5 * math.sqrt(q * (1 - q) / (n * steps))
    z = (counts - steps * q) / math.sqrt(steps * q * (1 - q))
    assert z.abs().max().item() < stats.norm.isf(1e-3 / (2 * n))


def test_make_private_accounts_with_pld_by_default():
    model = tiny_mlp()
    private = dpcore.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), ce, dataset_size=1000, lot_size=100,
        epochs=1, target_epsilon=2.0, target_delta=1e-5, clip_norm=1.0, seed=0,
    )  # fmt: skip
    assert private.ledger.accountant == "pld" and private.optimizer.event.sample_rate == private.sampler.sample_rate


@pytest.mark.parametrize("rate", [0.3, 0.0047, 256 / 60000, 0.5, 1.0, 2.0**-60])
def test_an_example_joins_at_the_rate_rounded_down_to_the_uniforms_grid(rate):
    """The uniforms are multiples of 2⁻⁵³, so ``u < q`` holds for ⌈q·2⁵³⌉ of the 2⁵³ values, up to
    2⁻⁵³ above the q the accountant is told; ``included`` holds for ⌊q·2⁵³⌋ of them, never above."""
    from dpcore.sampling import included

    k = math.floor(rate * 2.0**53)  # how many grid values are included: the rate rounded down
    grid = torch.tensor([k - 1, k, k + 1], dtype=torch.float64) * 2.0**-53
    grid = grid[(grid >= 0) & (grid < 1)]
    got = included(grid, rate).tolist()
    assert got == [u < k * 2.0**-53 for u in grid.tolist()]  # the last included value is (k − 1)·2⁻⁵³
    assert k * 2.0**-53 <= rate
    if k * 2.0**-53 < rate:  # q is off the grid: the plain comparison would include one value more
        assert (grid == k * 2.0**-53).sum() == 1 and bool((grid < rate)[grid == k * 2.0**-53])


def test_the_sampler_leaves_out_the_uniform_at_the_rounded_down_rate():
    """The sampler itself (helper-6: reverted to ``u < q`` it passed every test here): for a rate
    off the 2⁻⁵³ grid, an example whose uniform is ⌊q·2⁵³⌋·2⁻⁵³ (below q) stays out of the lot,
    and one a grid step lower joins it."""

    class Fixed(dpcore.Randomness):
        def __init__(self, values):
            self.values = values

        def uniform(self, n):
            return self.values[:n].clone()

    q = 0.3
    edge = math.floor(q * 2.0**53) * 2.0**-53
    assert edge < q  # 0.3 is off the grid
    u = torch.tensor([edge, edge - 2.0**-53, 0.0, 0.9], dtype=torch.float64)
    lot = dpcore.PoissonSampler(4, q, Fixed(u), steps=1).sample()
    assert lot.tolist() == [1, 2]

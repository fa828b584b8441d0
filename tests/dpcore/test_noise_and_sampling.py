"""Invariants 2, 3, 4 and 9: noise N(0, σ²C²) once per lot, division by qN, Poisson lots
(sharded too), and the two randomness modes. Statistical tests fix their seeds and derive
their tolerances from the sample size; draws that cannot be seeded (secure mode) are tested at
α = 1e-6 on 400,000 values (``assert_unseeded_draw_fits``)."""

import math
import warnings

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn

import dpcore
from dpcore.clipping import clipped_sum
from dpcore.grad_sample import PerSampleGradients

from ..helpers import UNSEEDED_SAMPLES, assert_unseeded_draw_fits, ce, tiny_mlp


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


def test_secure_randomness_uniforms_are_uniform_and_53_bit():
    u = dpcore.SecureRandomness().uniform(UNSEEDED_SAMPLES)
    assert u.dtype == torch.float64 and (u >= 0).all() and (u < 1).all()
    assert_unseeded_draw_fits(u, "uniform")
    # 53 random bits: multiplying by 2^53 gives integers, not all of which are even.
    ints = u * 2.0**53
    assert torch.equal(ints, ints.floor())
    assert (ints % 2 == 1).any()


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


def test_rank_streams_are_independent():
    root = dpcore.SeededRandomness(1)
    a = root.spawn("sampling", 0).uniform(1000)
    b = root.spawn("sampling", 1).uniform(1000)
    c = root.spawn("sampling", 0).uniform(1000)
    assert torch.equal(a, c) and not torch.equal(a, b)
    assert abs(np.corrcoef(a.numpy(), b.numpy())[0, 1]) < 5 / math.sqrt(1000)


def test_secure_mode_accepts_no_seed_and_has_no_state():
    with pytest.raises(dpcore.DPConfigError, match="accepts no seed"):
        dpcore.SecureRandomness(1234)
    r = dpcore.make_randomness(None)
    assert isinstance(r, dpcore.SecureRandomness) and r.secure
    assert r.state_dict() == {"mode": "secure"}
    assert "seed" not in repr(r.state_dict())


def test_seeded_mode_is_never_silent():
    with pytest.warns(dpcore.SeededRandomnessWarning, match="tests and research only"):
        r = dpcore.make_randomness(3)
    assert not r.secure and "seeded" in r.describe()


def test_large_secure_draws_across_rekeys_are_still_iid_normal(monkeypatch):
    """A draw longer than the rekey interval is several AES-CTR keystreams under different OS
    keys: every part must be filled (no zeros, no repeated chunk) and the whole N(0, 1)."""
    from dpcore import randomness as rnd

    monkeypatch.setattr(rnd, "_REKEY_BYTES", 2**20)
    n = 2**20 // 8 * 3 + 12345  # 3+ keys' worth of uniforms, not a multiple of anything
    u = dpcore.SecureRandomness().uniform(n)
    assert u.shape == (n,) and (u > 0).float().mean() > 0.999  # no unfilled (zero) region
    quarters = u.reshape(-1)[: n - n % 4].reshape(4, -1)
    assert len({tuple(q[:64].tolist()) for q in quarters}) == 4  # no chunk repeated

    assert_unseeded_draw_fits(u, "uniform")
    assert_unseeded_draw_fits(dpcore.SecureRandomness().normal((n,), 2.0) / 2.0, "norm")


def _fake_os_entropy(entropy: bytes):
    """(the sizes taken, an os.urandom that hands out ``entropy`` in order, and the openssl
    command line's AES-256-CTR keystream of n bytes under the i-th key and counter taken from it:
    32 + 16 bytes each). Skips without the openssl command line."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl command line not installed")
    taken = []

    def fake_urandom(k):
        start = sum(taken)
        taken.append(k)
        return entropy[start : start + k]

    def keystream(i, n):
        key, iv = entropy[48 * i : 48 * i + 32], entropy[48 * i + 32 : 48 * i + 48]
        return subprocess.run(
            ["openssl", "enc", "-aes-256-ctr", "-K", key.hex(), "-iv", iv.hex(), "-nosalt"],
            input=bytes(n),
            capture_output=True,
            check=True,
        ).stdout

    return taken, fake_urandom, keystream


def test_secure_bits_are_aes_256_ctr_keystream_under_fresh_os_keys(monkeypatch):
    """The wiring, checked against the openssl command line: each 64 MiB (here 100 bytes) of
    output is the AES-256-CTR keystream under the next 32 bytes of OS entropy as the key and
    the 16 after as the initial counter; nothing is reused across draws."""

    from dpcore import randomness as rnd

    entropy = bytes(range(256)) * 4
    taken, fake_urandom, openssl_keystream = _fake_os_entropy(entropy)
    monkeypatch.setattr(rnd, "_REKEY_BYTES", 100)
    monkeypatch.setattr(rnd.os, "urandom", fake_urandom)
    got = bytes(rnd._secure_bytes(250))
    assert taken == [32, 16] * 3  # a fresh key and counter for each of the 3 chunks

    expected = b"".join(openssl_keystream(i, min(100, 250 - 100 * i)) for i in range(3))
    assert got == expected
    monkeypatch.undo()
    a, b = rnd._secure_bytes(64), rnd._secure_bytes(64)
    assert a != b and len(a) == len(b) == 64


def test_secure_uniforms_are_the_keystreams_53_bit_words(monkeypatch):
    """Poisson sampling and the augmentation draws: each uniform is the top 53 bits of the next
    8 keystream bytes (helper-32: torch's global generator in their place went unseen)."""
    from dpcore import randomness as rnd

    taken, fake_urandom, keystream = _fake_os_entropy(bytes((5 * i + 1) % 256 for i in range(1024)))
    monkeypatch.setattr(rnd.os, "urandom", fake_urandom)
    torch.manual_seed(0)  # torch's own generator in any state: not what is read
    got = dpcore.SecureRandomness().uniform(9)
    words = np.frombuffer(keystream(0, 72), dtype="<u8")
    assert got.dtype == torch.float64 and taken == [32, 16]
    np.testing.assert_array_equal(got.numpy(), (words >> np.uint64(11)).astype(np.float64) * 2.0**-53)


def test_secure_normals_are_box_muller_of_the_keystream_chunk_by_chunk(monkeypatch):
    """A draw is made chunk by chunk (``_NORMAL_CHUNK`` normals, here 6; the last chunk odd):
    each chunk's 53-bit uniforms come from the next bytes of one keystream, rekeyed every 64 MiB
    (here 100 bytes, so a chunk straddles two keys), and give (r cos θ, r sin θ)·std. Checked
    against the openssl command line and a Box–Muller written here in numpy."""

    from dpcore import randomness as rnd

    taken, fake_urandom, keystream = _fake_os_entropy(bytes((7 * i + 3) % 256 for i in range(1024)))
    monkeypatch.setattr(rnd, "_REKEY_BYTES", 100)
    monkeypatch.setattr(rnd, "_NORMAL_CHUNK", 6)
    monkeypatch.setattr(rnd.os, "urandom", fake_urandom)
    got = dpcore.SecureRandomness().normal((13,), 2.5, dtype=torch.float64)
    assert taken == [32, 16, 32, 16]  # 6 + 6 + 1 normals: 48 + 48 + 16 = 112 bytes, two keys

    stream = keystream(0, 100) + keystream(1, 12)
    expected = []
    for start, k in ((0, 6), (48, 6), (96, 1)):
        m = (k + 1) // 2
        words = np.frombuffer(stream[start : start + 16 * m], dtype="<u8")
        u = (words >> np.uint64(11)).astype(np.float64) * 2.0**-53
        r = np.sqrt(-2.0 * np.log(1.0 - u[:m]))
        theta = 2.0 * np.pi * u[m:]
        expected.extend(np.concatenate([r * np.cos(theta), r * np.sin(theta)])[:k] * 2.5)
    np.testing.assert_allclose(got.numpy(), np.array(expected), rtol=1e-12, atol=0)
    monkeypatch.undo()
    # and with the real chunk size, a draw of several chunks and an odd remainder is N(0, std²)
    n = 3 * rnd._NORMAL_CHUNK + 12345
    z = dpcore.SecureRandomness().normal((n,), 1.5).double() / 1.5
    assert z.shape == (n,)
    assert_unseeded_draw_fits(z, "norm")
    heads = z.view(-1)[: 3 * rnd._NORMAL_CHUNK].reshape(3, -1)[:, :8]
    assert len({tuple(h.tolist()) for h in heads}) == 3  # no chunk repeats another's stream
    for shape in ((0,), (0, 3), (4, 0)):  # an empty draw is an empty tensor of its shape
        empty = dpcore.SecureRandomness().normal(shape, 1.0, dtype=torch.float64)
        assert empty.shape == shape and empty.dtype == torch.float64


_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", _DEVICES)
def test_secure_normals_for_a_gpu_are_box_muller_there_of_host_keystream_pieces(monkeypatch, device):
    """A draw for a CUDA device: pieces of ``_CUDA_PIECE_PAIRS`` pairs (here 3; the last short),
    each the keystream of its own fresh OS key made on the host, then 53-bit uniforms and
    (r cos θ, r sin θ)·std computed on the device. The pieces are made on several threads; with
    a serial map here they take their keys in order, so openssl's keystreams say what each holds.
    On "cpu" the same function runs without pinned memory (it is reached from ``normal`` only
    for CUDA)."""
    from dpcore import randomness as rnd

    taken, fake_urandom, keystream = _fake_os_entropy(bytes((5 * i + 1) % 256 for i in range(1024)))
    monkeypatch.setattr(rnd, "_CUDA_PIECE_PAIRS", 3)
    monkeypatch.setattr(rnd, "_CUDA_POOL", type("Serial", (), {"map": staticmethod(map)})())
    monkeypatch.setattr(rnd.os, "urandom", fake_urandom)
    if device == "cuda":
        got = dpcore.SecureRandomness().normal((3, 5), 2.5, dtype=torch.float64, device="cuda")
        assert got.device.type == "cuda" and got.shape == (3, 5)
    else:
        got = rnd._normal_on_cuda(15, 2.5, torch.float64, torch.device("cpu"))
    assert taken == [32, 16] * 3  # 8 pairs (15 normals): pieces of 3, 3 and 2 pairs, a key each

    expected = []
    for i, m in enumerate((3, 3, 2)):
        words = np.frombuffer(keystream(i, 16 * m), dtype="<u8")
        u = (words >> np.uint64(11)).astype(np.float64) * 2.0**-53
        r = np.sqrt(-2.0 * np.log(1.0 - u[:m]))
        theta = 2.0 * np.pi * u[m:]
        expected.extend(np.concatenate([r * np.cos(theta), r * np.sin(theta)]) * 2.5)
    np.testing.assert_allclose(got.flatten().cpu().numpy(), np.array(expected[:15]), rtol=1e-12, atol=0)
    monkeypatch.undo()
    # with the real piece size and threads: several pieces and an odd remainder are N(0, std²) in float32
    n = 3 * 2 * rnd._CUDA_PIECE_PAIRS + 12345
    if device == "cuda":
        z = dpcore.SecureRandomness().normal((n,), 1.5, device="cuda")
    else:
        z = rnd._normal_on_cuda(n, 1.5, torch.float32, torch.device("cpu"))
    assert z.shape == (n,) and z.dtype == torch.float32 and z.device.type == device
    z = z.double().cpu() / 1.5
    assert_unseeded_draw_fits(z, "norm")
    heads = z[: 3 * 2 * rnd._CUDA_PIECE_PAIRS].reshape(3, -1)[:, :8]
    assert len({tuple(h.tolist()) for h in heads}) == 3  # no piece repeats another's stream


def test_the_threaded_os_entropy_fallback_fills_every_part():
    """Without ``cryptography`` the bits come from os.urandom, fetched by several threads above
    4 MiB: every part must be filled and no chunk repeated."""
    from dpcore import randomness as rnd

    n = rnd._PARALLEL_BYTES * 3 + 12345
    raw = torch.frombuffer(rnd._urandom(n), dtype=torch.uint8)
    assert raw.shape == (n,)
    parts = raw[: n - n % 4].reshape(4, -1)
    assert len({tuple(p[:64].tolist()) for p in parts}) == 4
    counts = torch.bincount(raw[: 2**22].long(), minlength=256).double()
    expected = 2**22 / 256
    assert stats.chi2.sf(float(((counts - expected) ** 2 / expected).sum()), 255) > 1e-4


def test_a_gpu_draw_falls_back_to_pageable_memory_when_pinned_memory_is_refused(monkeypatch):
    """Pinned host memory can be refused (a container's locked-memory limit, or no driver): the
    keystream then goes through pageable memory, with one warning, and the draw is the same
    Box–Muller of the same kind of pieces."""
    from dpcore import randomness as rnd

    real_empty = torch.empty

    def refuse_pinned(*a, pin_memory=False, **k):
        if pin_memory:
            raise RuntimeError("cannot pin memory (locked-memory limit)")
        return real_empty(*a, **k)

    monkeypatch.setattr(rnd, "_PIN_FAILED", None, raising=False)
    monkeypatch.setattr(rnd.torch, "empty", refuse_pinned)
    with pytest.warns(RuntimeWarning, match="pinned host memory is not available"):
        first = rnd._keystream_piece(4, pin=True)
    assert first.shape == (64,) and not first.is_pinned()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: later pieces do not try again, nor warn again
        second = rnd._keystream_piece(4, pin=True)
    assert second.shape == (64,) and not torch.equal(first, second)


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


def test_a_forked_child_draws_after_its_parent_used_the_thread_pool():
    """helper-33: a child forked after the parent filled a large request through the thread
    pool hung on that pool (its threads do not survive the fork); the child now makes its own."""
    import os
    import signal

    from dpcore import randomness

    randomness._urandom(randomness._PARALLEL_BYTES * 2)  # the parent's pool exists now
    if os.cpu_count() == 1:
        pytest.skip("one CPU: no pool")
    pid = os.fork()
    if pid == 0:  # the child: draw through the pool, or die by the alarm
        signal.alarm(20)
        ok = False
        try:
            ok = len(randomness._urandom(randomness._PARALLEL_BYTES * 2)) == randomness._PARALLEL_BYTES * 2
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


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


def test_make_private_accounts_with_pld_by_default():
    model = tiny_mlp()
    private = dpcore.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), ce, dataset_size=1000, lot_size=100,
        epochs=1, target_epsilon=2.0, target_delta=1e-5, clip_norm=1.0, seed=0,
    )  # fmt: skip
    assert private.ledger.accountant == "pld" and private.optimizer.event.sample_rate == private.sampler.sample_rate


def test_torch_seed_gives_64_secret_bits_in_secure_mode_and_a_fixed_seed_when_seeded():
    from dpcore.randomness import torch_seed

    seeds = [torch_seed(dpcore.SecureRandomness()) for _ in range(16)]
    assert len(set(seeds)) == 16 and all(0 <= s < 2**64 for s in seeds) and max(seeds) >= 2**32
    torch.manual_seed(max(seeds))  # torch accepts the whole range
    same = [torch_seed(dpcore.SeededRandomness(3, _quiet=True).spawn("model", 1)) for _ in range(2)]
    assert same[0] == same[1] != torch_seed(dpcore.SeededRandomness(3, _quiet=True).spawn("model", 0))

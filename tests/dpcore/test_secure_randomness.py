"""dpcore/randomness.py, invariant 9: secure mode takes no seed and keeps no state, seeded mode is never
silent; secure bits are the AES-256-CTR keystream under fresh OS keys (checked against the openssl
command line), uniforms are its 53-bit words and normals its Box–Muller, chunk by chunk on the host
and piece by piece for a GPU; large draws across rekeys, the threaded os.urandom fallback, refused
pinned memory and a forked child all still give full, unrepeated, iid draws (unseeded draws are
tested at α = 1e-6 on 400,000 values, ``assert_unseeded_draw_fits``); and torch_seed gives 64 secret
bits in secure mode, a fixed seed when seeded."""

import math
import warnings

import numpy as np
import pytest
import torch
from scipy import stats

import dpcore

from ..helpers import UNSEEDED_SAMPLES, assert_unseeded_draw_fits


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


def test_secure_randomness_uniforms_are_uniform_and_53_bit():
    u = dpcore.SecureRandomness().uniform(UNSEEDED_SAMPLES)
    assert u.dtype == torch.float64 and (u >= 0).all() and (u < 1).all()
    assert_unseeded_draw_fits(u, "uniform")
    # 53 random bits: multiplying by 2^53 gives integers, not all of which are even.
    ints = u * 2.0**53
    assert torch.equal(ints, ints.floor())
    assert (ints % 2 == 1).any()


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
    (here 100 bytes, so a chunk straddles two keys), and give (r cos θ, r sin θ)·std, the
    radius's 1 − u with the words' low 11 bits too. Checked against the openssl command line and
    a Box–Muller written here in numpy."""

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
        r = np.sqrt(-2.0 * np.log((1.0 - u[:m]) - (words[:m] & np.uint64(2047)).astype(np.float64) * 2.0**-64))
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


def test_the_gaussian_tail_reaches_64_bits_not_a_53_bit_edge():
    """The radius takes 1 − u with each word's low 11 bits as well: the tail that 53-bit uniforms
    put on one radius, 8.5717 standard deviations, mass 2⁻⁵³ a pair (an output a shifted
    neighbour cannot give: helper-4's review), now reaches 9.4193 with mass 2⁻⁶⁴; the same word's
    top 53 bits with other low bits give distinct radii in between."""
    from dpcore import randomness as rnd

    top = 0xFFFF_FFFF_FFFF_F800  # the largest 53-bit uniform, low bits 0
    radius_words = np.array([top, top | 1, top | 0x400, top | 0x7FF, 0, 0x7FF], dtype=np.uint64)
    words = np.concatenate([radius_words, np.zeros(6, dtype=np.uint64)])  # θ = 0: z = (r, 0)
    out = torch.empty(12, dtype=torch.float64)
    rnd._normal_from_words_(torch.from_numpy(words.view(np.int64).copy()), 2.0, out)
    r = out[:6].numpy() / 2.0
    np.testing.assert_allclose(
        r[:4], np.sqrt(-2.0 * np.log([2.0**-53, 2.0**-53 - 2.0**-64, 2.0**-54, 2.0**-64])), rtol=1e-15
    )
    assert r[3] == pytest.approx(9.4193, abs=1e-4) and r[0] == pytest.approx(8.5717, abs=1e-4)
    assert r[0] < r[1] < r[2] < r[3] and r[4] == 0.0 and not out[6:].any()
    assert r[5] == np.sqrt(-2.0 * np.log1p(-(2.0**-53)))  # 1 − 2047·2⁻⁶⁴, rounded: the body keeps float64's grid


def test_the_laplace_tail_reaches_64_bits_too(monkeypatch):
    """A secure Laplace draw takes two words of one keystream, chunk by chunk (``_NORMAL_CHUNK``
    draws, here 4: the chunk's signs, then its magnitudes): the sign from the first word's 53-bit
    uniform, the magnitude −log(1 − u − f·2⁻⁶⁴) from the second's top 53 bits u and its own low
    11 bits f. At the largest 53-bit uniform the magnitude ranges from 36.74 (f = 0) to 44.36
    scales (f = 2047), where 53 bits stopped at 36.74 with the tail's whole mass 2⁻⁵³."""
    from dpcore import randomness as rnd

    top = 0xFFFF_FFFF_FFFF_F800  # the largest 53-bit uniform, low bits 0
    magnitude_words = [top, top | 1, top | 0x400, top | 0x7FF, 0, 1 << 63]
    sign_words = [0, 1 << 63, 0x7FFF_FFFF_FFFF_FFFF, 1 << 63, 0, 0x7FF]  # u < ½: negative
    words = sign_words[:4] + magnitude_words[:4] + sign_words[4:] + magnitude_words[4:]
    stream = np.array(words, dtype=np.uint64).tobytes()
    read = []

    def read_into(self, view, n):  # the keystream, as the bytes above
        start = sum(read)
        view[:n] = stream[start : start + n]
        read.append(n)

    monkeypatch.setattr(rnd._Keystream, "read_into", read_into)
    monkeypatch.setattr(rnd, "_NORMAL_CHUNK", 4)
    got = dpcore.SecureRandomness().laplace((2, 3), 2.0, dtype=torch.float64)
    assert got.shape == (2, 3) and read == [64, 32]
    got = got.flatten().numpy() / 2.0
    t = np.array([2.0**-53, 2.0**-53 - 2.0**-64, 2.0**-54, 2.0**-64])
    np.testing.assert_allclose(np.abs(got[:4]), -np.log(t), rtol=1e-15)
    assert abs(got[0]) == pytest.approx(36.7368, abs=1e-4) and abs(got[3]) == pytest.approx(44.3614, abs=1e-4)
    assert got[4] == 0.0 and got[5] == pytest.approx(-np.log(2.0), rel=1e-15)  # u = ½: −log ½, sign u = 0
    assert list(np.sign(got[:4])) == [-1, 1, -1, 1]
    monkeypatch.undo()
    for shape in ((0,), (0, 3)):  # an empty draw is an empty tensor of its shape
        assert dpcore.SecureRandomness().laplace(shape, 1.0).shape == shape
    n = 3 * rnd._NORMAL_CHUNK + 12_345  # several chunks and a remainder
    z = dpcore.SecureRandomness().laplace((n,), 2.0, dtype=torch.float64).numpy() / 2.0
    # Laplace(0, 1): variance 2, fourth moment 24; 6 standard errors of the mean and the variance
    assert abs(z.mean()) < 6 * math.sqrt(2.0 / n) and abs(z.var() - 2.0) < 6 * math.sqrt((24.0 - 4.0) / n)
    # the sign's P(negative) = ½ and the magnitude's Exp(1) law (its mean 1, 6 standard errors)
    assert abs((z < 0).mean() - 0.5) < 6 * math.sqrt(0.25 / n) and abs(np.abs(z).mean() - 1.0) < 6 / math.sqrt(n)


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
    from dpcore import randomness_cuda as rcuda

    taken, fake_urandom, keystream = _fake_os_entropy(bytes((5 * i + 1) % 256 for i in range(1024)))
    monkeypatch.setattr(rcuda, "_CUDA_PIECE_PAIRS", 3)
    monkeypatch.setattr(rcuda, "_CUDA_POOL", type("Serial", (), {"map": staticmethod(map)})())
    monkeypatch.setattr(rnd.os, "urandom", fake_urandom)
    if device == "cuda":
        got = dpcore.SecureRandomness().normal((3, 5), 2.5, dtype=torch.float64, device="cuda")
        assert got.device.type == "cuda" and got.shape == (3, 5)
    else:
        got = rcuda.normal_on_cuda(15, 2.5, torch.float64, torch.device("cpu"))
    assert taken == [32, 16] * 3  # 8 pairs (15 normals): pieces of 3, 3 and 2 pairs, a key each

    expected = []
    for i, m in enumerate((3, 3, 2)):
        words = np.frombuffer(keystream(i, 16 * m), dtype="<u8")
        u = (words >> np.uint64(11)).astype(np.float64) * 2.0**-53
        r = np.sqrt(-2.0 * np.log((1.0 - u[:m]) - (words[:m] & np.uint64(2047)).astype(np.float64) * 2.0**-64))
        theta = 2.0 * np.pi * u[m:]
        expected.extend(np.concatenate([r * np.cos(theta), r * np.sin(theta)]) * 2.5)
    np.testing.assert_allclose(got.flatten().cpu().numpy(), np.array(expected[:15]), rtol=1e-12, atol=0)
    monkeypatch.undo()
    # with the real piece size and threads: several pieces and an odd remainder are N(0, std²) in float32
    n = 3 * 2 * rcuda._CUDA_PIECE_PAIRS + 12345
    if device == "cuda":
        z = dpcore.SecureRandomness().normal((n,), 1.5, device="cuda")
    else:
        z = rcuda.normal_on_cuda(n, 1.5, torch.float32, torch.device("cpu"))
    assert z.shape == (n,) and z.dtype == torch.float32 and z.device.type == device
    z = z.double().cpu() / 1.5
    assert_unseeded_draw_fits(z, "norm")
    heads = z[: 3 * 2 * rcuda._CUDA_PIECE_PAIRS].reshape(3, -1)[:, :8]
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
    # Every byte's value is uniform over the whole buffer (a part left unfilled, or filled with
    # zeros, is millions of counts off); at α = 1e-6, as every unseeded draw here.
    counts = torch.bincount(raw.long(), minlength=256).double()
    expected = n / 256
    assert stats.chi2.sf(float(((counts - expected) ** 2 / expected).sum()), 255) > 1e-6


def test_a_gpu_draw_falls_back_to_pageable_memory_when_pinned_memory_is_refused(monkeypatch):
    """Pinned host memory can be refused (a container's locked-memory limit, or no driver): the
    keystream then goes through pageable memory, with one warning, and the draw is the same
    Box–Muller of the same kind of pieces."""
    from dpcore import randomness as rnd
    from dpcore import randomness_cuda as rcuda

    real_empty = torch.empty

    def refuse_pinned(*a, pin_memory=False, **k):
        if pin_memory:
            raise RuntimeError("cannot pin memory (locked-memory limit)")
        return real_empty(*a, **k)

    monkeypatch.setattr(rcuda, "_PIN_FAILED", None, raising=False)
    monkeypatch.setattr(rnd.torch, "empty", refuse_pinned)
    with pytest.warns(RuntimeWarning, match="pinned host memory is not available"):
        first = rcuda._keystream_piece(4, pin=True)
    assert first.shape == (64,) and not first.is_pinned()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: later pieces do not try again, nor warn again
        second = rcuda._keystream_piece(4, pin=True)
    assert second.shape == (64,) and not torch.equal(first, second)


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


def test_torch_seed_gives_64_secret_bits_in_secure_mode_and_a_fixed_seed_when_seeded():
    from dpcore.randomness import torch_seed

    seeds = [torch_seed(dpcore.SecureRandomness()) for _ in range(16)]
    assert len(set(seeds)) == 16 and all(0 <= s < 2**64 for s in seeds) and max(seeds) >= 2**32
    torch.manual_seed(max(seeds))  # torch accepts the whole range
    same = [torch_seed(dpcore.SeededRandomness(3, _quiet=True).spawn("model", 1)) for _ in range(2)]
    assert same[0] == same[1] != torch_seed(dpcore.SeededRandomness(3, _quiet=True).spawn("model", 0))

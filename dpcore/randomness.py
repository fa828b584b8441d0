"""Sources of randomness for noise and Poisson sampling.

Two modes:

* :class:`SecureRandomness` (the default outside tests). Every draw is keyed by fresh
  operating-system entropy (``os.urandom``, i.e. ``getrandom(2)`` on Linux): 256 bits of it
  key AES-256 in counter mode (OpenSSL, through ``cryptography``), whose keystream gives the
  random bits: an AES-256-CTR generator in the style of NIST SP 800-90A's CTR_DRBG (not that
  construction itself: no derivation function, no key update per request), with a new key and
  counter for every draw and for every 64 MiB of output, never stored. That is 12–14× faster than reading all the
  bits from the kernel here (docs/benchmarks/README.md) and as unpredictable to anyone
  without the key. Without ``cryptography`` every bit comes from ``os.urandom``. It accepts
  no seed and has no state to save or log: a restart simply draws fresh bits. Uniforms carry
  53 random bits; Gaussians come from the Box–Muller transform of such uniforms in float64, the
  radius's 1 − u with 64 bits where it is small.
  What it does *not* cover: floating-point side channels of sampling in finite precision
  (Mironov 2012; Jin et al. 2022). It makes the noise unpredictable, not bit-exact. Nor the
  bounded support this gives: a Box–Muller radius is at most √(128·ln 2) = 9.4193 standard
  deviations (:func:`_normal_from_words_`) and a Laplace magnitude at most 64·ln 2 = 44.36
  scales; what that costs in δ, which the accountant does not count: README, "The guarantee,
  precisely".
* :class:`SeededRandomness`: for tests and reproducible research only. The seed must be
  passed explicitly; creating one emits :class:`SeededRandomnessWarning` and marks
  ``secure = False`` so that callers record it (the ledger and MLflow do).

Both expose the same small interface: :meth:`normal` for noise, :meth:`uniform` for
sampling, and :meth:`spawn` for independent child streams (one per rank and purpose).
"""

from __future__ import annotations

import hashlib
import math
import os
import warnings
from typing import Any

import numpy as np
import torch

from .errors import DPConfigError, SeededRandomnessWarning

_TWO_POW_M53 = 2.0**-53


class Randomness:
    """Interface of a randomness source."""

    secure: bool = True

    def uniform(self, n: int) -> torch.Tensor:  # float64 in [0, 1)
        raise NotImplementedError

    def normal(self, shape, std: float, dtype=torch.float32, device=None) -> torch.Tensor:
        raise NotImplementedError

    def laplace(self, shape, scale: float, dtype=torch.float32, device=None) -> torch.Tensor:
        """i.i.d. Laplace(0, scale): a random sign times an Exp(1) magnitude, −log(1 − u) with u
        a 53-bit uniform in [0, 1) (finite), from this source's uniforms."""
        shape = torch.Size(shape if not isinstance(shape, int) else (shape,))
        n = shape.numel()
        u = self.uniform(2 * n)
        sign = torch.where(u[:n] < 0.5, -1.0, 1.0).to(torch.float64)
        magnitude = -torch.log1p(-u[n:])  # Exp(1)
        return (sign * magnitude * float(scale)).to(dtype=dtype, device=device).reshape(shape)

    def spawn(self, *key: Any) -> Randomness:
        raise NotImplementedError

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


_PARALLEL_BYTES = 1 << 22  # requests above 4 MiB are split across threads
_POOL = None


def _urandom(nbytes: int) -> bytearray:
    """``nbytes`` from the OS CSPRNG. Large requests are filled by several threads at once
    (``os.urandom`` releases the GIL, and each chunk is an independent draw from the same
    kernel CSPRNG), which roughly halves the time on two cores."""
    global _POOL
    workers = min(4, os.cpu_count() or 1)
    if nbytes <= _PARALLEL_BYTES or workers == 1:
        return bytearray(os.urandom(nbytes))
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dpcore-urandom")
    buf = bytearray(nbytes)
    view = memoryview(buf)
    step = -(-nbytes // workers)

    def fill(start: int) -> None:
        view[start : start + step] = os.urandom(min(step, nbytes - start))

    list(_POOL.map(fill, range(0, nbytes, step)))
    return buf


_REKEY_BYTES = 64 * 2**20  # a new AES key from the OS for every 64 MiB of keystream

try:
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
except ImportError:  # pragma: no cover - cryptography is a dependency (mlflow's too)
    Cipher = None


_ZEROS = bytes(1 << 20)  # the plaintext of the keystream, read in pieces of up to 1 MiB


class _Keystream:
    """AES-256-CTR keystream under keys from the OS CSPRNG: a fresh key and counter on first use
    and after every ``_REKEY_BYTES`` (never stored). Read in pieces into caller buffers, so a
    large draw needs neither a zero plaintext nor a ciphertext of its full size. Without
    ``cryptography``, the bytes are ``os.urandom``'s own."""

    def __init__(self) -> None:
        self._encryptor = None
        self._left = 0

    def read_into(self, view: memoryview, n: int) -> None:
        """Fill ``view[:n]``; ``view`` has 15 spare bytes after ``n`` (AES's block size − 1,
        which ``update_into`` asks for)."""
        if Cipher is None:
            view[:n] = _urandom(n)
            return
        pos = 0
        while pos < n:
            if self._left == 0:
                self._encryptor = Cipher(algorithms.AES(os.urandom(32)), modes.CTR(os.urandom(16))).encryptor()
                self._left = _REKEY_BYTES
            k = min(n - pos, self._left, len(_ZEROS))
            self._encryptor.update_into(memoryview(_ZEROS)[:k], view[pos : pos + k + 15])
            pos += k
            self._left -= k


def _secure_bytes(nbytes: int) -> bytearray:
    """``nbytes`` of one fresh :class:`_Keystream` (a new key per call and per 64 MiB)."""
    out = bytearray(nbytes + 15)
    with memoryview(out) as view:
        _Keystream().read_into(view, nbytes)
    del out[nbytes:]
    return out


def _uniform53_(raw: torch.Tensor) -> torch.Tensor:
    """53-bit uniforms in [0, 1) (float64) from random int64 words, which are overwritten: the
    top 53 bits (a logical shift of the unsigned value), scaled by 2⁻⁵³."""
    raw.bitwise_right_shift_(11).bitwise_and_((1 << 53) - 1)
    return raw.to(torch.float64).mul_(_TWO_POW_M53)


# Gaussians are drawn this many at a time: the chunk's keystream (1 MiB) and its float64
# Box–Muller stay in cache, where one pass over the whole draw would stream it through memory
# for each of the transform's dozen operations (measured 2026-11-25, 2 cores: 22.7M normals in
# about 0.12 s against 0.37 s; docs/benchmarks/README.md).
_NORMAL_CHUNK = 1 << 17


def _box_muller(u: torch.Tensor, std: float, out: torch.Tensor, finer: torch.Tensor) -> None:
    """``out`` (float64, 2m) ← (r cos θ, r sin θ)·std from 2m uniforms ``u`` (overwritten):
    r = sqrt(−2 log(1 − u₁ − f·2⁻⁶⁴)), 1 − u₁ − f·2⁻⁶⁴ in (0, 1], θ = 2π·u₂; ``finer``, m integers
    f in [0, 2¹¹): the radius's further bits (:func:`_normal_from_words_`)."""
    m = u.numel() // 2
    r = u[:m].neg_().add_(1.0).sub_(finer, alpha=_TWO_POW_M64).log_().mul_(-2.0).sqrt_().mul_(float(std))
    theta = u[m:].mul_(2.0 * math.pi)
    torch.cos(theta, out=out[:m]).mul_(r)
    torch.sin(theta, out=out[m:]).mul_(r)


_TWO_POW_M64 = 2.0**-64
_LOW_BITS = (1 << 11) - 1  # the bits of a 64-bit word below its 53-bit uniform


def _normal_from_words_(raw: torch.Tensor, std: float, out: torch.Tensor) -> None:
    """``out`` (float64, 2m) ← Box–Muller of 2m random int64 words (overwritten): 53-bit
    uniforms of their top bits, and for the radius the first m words' low 11 bits too, so that
    1 − u₁ has 64 bits where it is small: 1 − u₁ − low·2⁻⁶⁴, in [2⁻⁶⁴, 1].

    Why: with 53 bits, 1 − u₁ ≥ 2⁻⁵³, so the radius stopped at 8.5717 standard deviations, with
    the whole tail beyond, mass 2⁻⁵³ a pair, on that edge. A neighbour whose sum differs in a pair
    cannot give that pair's outputs near the edge on the far side, a privacy loss the accountant
    does not count (helper-4's review, 2026-12-07). With 64 bits the edge is at 9.4193 standard
    deviations and the mass near it far smaller (README, "The guarantee, precisely")."""
    m = raw.numel() // 2
    finer = raw[:m].bitwise_and(_LOW_BITS)  # before _uniform53_ shifts them out
    _box_muller(_uniform53_(raw), std, out, finer)


def _laplace_from_words_(raw: torch.Tensor, scale: float) -> torch.Tensor:
    """n Laplace(0, ``scale``) draws (float64) from 2n random int64 words (overwritten): the sign
    from the first n words' 53-bit uniforms (< ½: negative), the magnitude −log(1 − u − f·2⁻⁶⁴)
    from the other n, u their top 53 bits and f their low 11, as the Gaussian's radius
    (:func:`_normal_from_words_`): the tail that 53 bits put on one magnitude, 36.74 scales with
    mass 2⁻⁵³, reaches 44.36 with mass 2⁻⁶⁴."""
    n = raw.numel() // 2
    finer = raw[n:].bitwise_and(_LOW_BITS)  # before _uniform53_ shifts them out
    u = _uniform53_(raw)
    magnitude = u[n:].neg().add_(1.0).sub_(finer, alpha=_TWO_POW_M64).log_().neg_().mul_(scale)
    return torch.where(u[:n] < 0.5, magnitude.neg(), magnitude)


def _forget_pool() -> None:
    """In a forked child the parent's thread pool has no threads: make a new one on first use."""
    global _POOL
    _POOL = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


class SecureRandomness(Randomness):
    """Fresh OS entropy for every draw (see the module docstring). Accepts no seed; its state is
    empty by construction."""

    secure = True

    def __init__(self, *args, **kwargs):
        if args or kwargs:
            raise DPConfigError(
                "SecureRandomness accepts no seed or state: it is keyed from the OS CSPRNG at every draw. "
                "For reproducible tests use SeededRandomness(seed=...) explicitly."
            )

    @staticmethod
    def _uniform53(n: int) -> torch.Tensor:
        if n == 0:
            return torch.empty(0, dtype=torch.float64)
        return _uniform53_(torch.frombuffer(_secure_bytes(8 * n), dtype=torch.int64))

    def uniform(self, n: int) -> torch.Tensor:
        return self._uniform53(int(n))

    def laplace(self, shape, scale: float, dtype=torch.float32, device=None) -> torch.Tensor:
        """Laplace draws from the words of one keystream (:func:`_laplace_from_words_`),
        ``_NORMAL_CHUNK`` at a time: two words each, the chunk's signs then its magnitudes."""
        shape = torch.Size(shape if not isinstance(shape, int) else (shape,))
        n = shape.numel()
        out = torch.empty(n, dtype=dtype)
        chunk = max(1, min(_NORMAL_CHUNK, n))
        stream, buf = _Keystream(), bytearray(16 * chunk + 15)
        with memoryview(buf) as view:
            for start in range(0, n, chunk):
                k = min(chunk, n - start)
                stream.read_into(view, 16 * k)
                words = torch.frombuffer(buf, dtype=torch.int64, count=2 * k)
                out[start : start + k].copy_(_laplace_from_words_(words, float(scale)))
        return out.reshape(shape).to(device=device)

    def normal(self, shape, std: float, dtype=torch.float32, device=None) -> torch.Tensor:
        """Box–Muller in float64 on the 64-bit words of one keystream (:func:`_normal_from_words_`),
        ``_NORMAL_CHUNK`` normals at a time (each from its own words; the last chunk may be odd).
        For a CUDA device, the keystream is made on the host and the transform runs there
        (:func:`dpcore.randomness_cuda.normal_on_cuda`)."""
        shape = torch.Size(shape if not isinstance(shape, int) else (shape,))
        n = shape.numel()
        if n == 0:
            return torch.empty(shape, dtype=dtype, device=device)
        if device is not None and torch.device(device).type == "cuda":
            from .randomness_cuda import normal_on_cuda

            return normal_on_cuda(n, std, dtype, torch.device(device)).reshape(shape)
        out = torch.empty(n, dtype=dtype)
        chunk = min(_NORMAL_CHUNK + _NORMAL_CHUNK % 2, n + n % 2)  # even: a pair per two normals
        stream = _Keystream()
        buf = bytearray(8 * chunk + 15)
        z = torch.empty(chunk, dtype=torch.float64)
        with memoryview(buf) as view:
            for start in range(0, n, chunk):
                k = min(chunk, n - start)
                m = (k + 1) // 2
                stream.read_into(view, 16 * m)
                words = torch.frombuffer(buf, dtype=torch.int64, count=2 * m)
                if dtype == torch.float64 and k == 2 * m:  # the sums' dtype: straight into the draw
                    _normal_from_words_(words, std, out[start : start + k])
                else:
                    _normal_from_words_(words, std, z[: 2 * m])
                    out[start : start + k].copy_(z[:k])
        return out.reshape(shape).to(device=device)

    def spawn(self, *key: Any) -> SecureRandomness:
        return SecureRandomness()

    def state_dict(self) -> dict:
        return {"mode": "secure"}

    def load_state_dict(self, state: dict) -> None:
        if state.get("mode") != "secure":
            raise DPConfigError(
                f"Cannot load a {state.get('mode')!r} randomness state into secure mode; "
                "a run keeps the randomness mode it started with."
            )

    def describe(self) -> str:
        return "secure (AES-256-CTR keyed from the OS CSPRNG per draw)" if Cipher is not None else "secure (OS CSPRNG)"


def _key_to_ints(key: tuple) -> list[int]:
    out = []
    for k in key:
        if isinstance(k, int) and not isinstance(k, bool) and k >= 0:
            out.append(int(k))
        else:
            digest = hashlib.sha256(repr(k).encode()).digest()
            out.append(int.from_bytes(digest[:4], "little"))
    return out


class SeededRandomness(Randomness):
    """A seeded torch generator. For tests and reproducible research only.

    Child streams (``spawn(key...)``) are derived with numpy's SeedSequence, so streams for
    different ranks or purposes are statistically independent.
    """

    secure = False

    def __init__(self, seed: int, _spawn_key: tuple = (), _quiet: bool = False):
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise DPConfigError(f"seed={seed!r} is invalid: a seed must be a non-negative integer.")
        self.seed = seed
        self._spawn_key = tuple(_spawn_key)
        ss = np.random.SeedSequence(seed, spawn_key=_key_to_ints(self._spawn_key))
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(int(ss.generate_state(1, dtype=np.uint64)[0] & ((1 << 63) - 1)))
        if not _quiet:
            warnings.warn(
                f"Seeded randomness (seed={seed}): noise and sampling are reproducible and "
                "therefore predictable. Use this for tests and research only; production runs "
                "use secure mode (no seed).",
                SeededRandomnessWarning,
                stacklevel=2,
            )

    def uniform(self, n: int) -> torch.Tensor:
        return torch.rand(int(n), generator=self._generator, dtype=torch.float64)

    def normal(self, shape, std: float, dtype=torch.float32, device=None) -> torch.Tensor:
        shape = torch.Size(shape if not isinstance(shape, int) else (shape,))
        z = torch.randn(shape, generator=self._generator, dtype=dtype)
        if std != 1.0:
            z.mul_(float(std))
        if device is not None and torch.device(device).type == "cuda":  # drawn on the host (the same
            # sequence on any device), copied from pinned memory without a host sync
            return z.pin_memory().to(device, non_blocking=True)
        return z.to(device) if device is not None else z

    def spawn(self, *key: Any) -> SeededRandomness:
        return SeededRandomness(self.seed, _spawn_key=self._spawn_key + key, _quiet=True)

    def state_dict(self) -> dict:
        return {
            "mode": "seeded",
            "seed": self.seed,
            "spawn_key": list(self._spawn_key),
            "generator": self._generator.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("mode") != "seeded":
            raise DPConfigError("Cannot load a secure-mode randomness state into seeded mode.")
        self._generator.set_state(state["generator"])

    def describe(self) -> str:
        return f"seeded (seed={self.seed}; not for production)"


def torch_seed(randomness: Randomness) -> int:
    """A 64-bit seed for torch's own generator (``torch.manual_seed``) from ``randomness``: secret in
    secure mode. Training-time randomness inside a model (dropout) is drawn from torch's global
    generator in batch order, so one example's presence shifts every later example's draws; that
    is harmless only while the generator's seed is secret (see ``pipelines.augment``)."""
    hi, lo = (randomness.uniform(2) * 2.0**32).floor().long().tolist()
    return (hi << 32) | lo


def make_randomness(seed: int | None = None) -> Randomness:
    """Secure randomness unless a seed is given explicitly."""
    return SecureRandomness() if seed is None else SeededRandomness(seed)

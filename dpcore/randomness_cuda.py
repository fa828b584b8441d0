"""Secure normals for a CUDA device (:meth:`dpcore.randomness.SecureRandomness.normal` with a
CUDA ``device``): the keystream is made on the host, the transform on the device."""

from __future__ import annotations

import os
import threading
import warnings

import torch

from .randomness import _Keystream, _normal_from_words_

# A draw for a CUDA device: the host makes the keystream, in pieces of this many normal pairs
# (8 MiB of it, less 16 bytes: with AES's spare 15 a piece fits the pinned allocator's 8 MiB
# block, which rounds sizes up to a power of two), on several threads at once (AES releases the GIL; each piece has its own key,
# from the OS), into pinned buffers that are copied to the device without waiting; the
# uniforms and Box–Muller are then computed there in float64, each piece laid out as the host
# path lays out a chunk. On the host the transform costs about 4 times the keystream (2 cores:
# 0.23 s against 0.05 s for 22.7M normals); a GPU does it in a fraction of a millisecond. The
# radius takes 64 bits of each word (:func:`dpcore.randomness._normal_from_words_`).
_CUDA_PIECE_PAIRS = (1 << 19) - 1
_CUDA_POOL = None


def _forget_pool() -> None:
    """In a forked child the parent's thread pool has no threads: make a new one on first use."""
    global _CUDA_POOL
    _CUDA_POOL = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


_PIN_FAILED: str | None = None  # why pinned host memory could not be had, once it could not
_PIN_LOCK = threading.Lock()  # the pieces are made on several threads: one of them finds out and warns


def _keystream_piece(m: int, pin: bool) -> torch.Tensor:
    """16·m keystream bytes (m pairs' 64-bit words) in a host tensor, pinned if ``pin`` and
    pinned memory can be had (a container's locked-memory limit can refuse it): else in pageable
    memory, whose copy to the device is as correct, only not overlapped with the next piece."""
    global _PIN_FAILED
    size = 16 * m + 15  # AES's block size − 1 spare
    host = None
    if pin and _PIN_FAILED is None:
        try:
            host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as e:
            with _PIN_LOCK:
                first = _PIN_FAILED is None
                if first:
                    _PIN_FAILED = f"{type(e).__name__}: {e}"
            if first:
                warnings.warn(
                    f"pinned host memory is not available ({_PIN_FAILED}); the secure noise's keystream is copied "
                    "to the device from pageable memory (slower, not less secure)",
                    RuntimeWarning,
                    stacklevel=2,
                )
    if host is None:
        host = torch.empty(size, dtype=torch.uint8)
    with memoryview(host.numpy()) as view:
        _Keystream().read_into(view, 16 * m)
    return host[: 16 * m]


def normal_on_cuda(n: int, std: float, dtype, device: torch.device) -> torch.Tensor:
    """``n`` secure normals of ``std`` on ``device``; nothing here waits for the device."""
    global _CUDA_POOL
    if _CUDA_POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        workers = max(1, min(8, (os.cpu_count() or 2) - 1))
        _CUDA_POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dpcore-keystream")
    pairs = (n + 1) // 2
    out = torch.empty(2 * pairs, dtype=dtype, device=device)
    pin = device.type == "cuda"
    starts = range(0, pairs, _CUDA_PIECE_PAIRS)
    pieces = _CUDA_POOL.map(lambda p0: _keystream_piece(min(_CUDA_PIECE_PAIRS, pairs - p0), pin), starts)
    for p0, host in zip(starts, pieces):
        words = host.to(device, non_blocking=pin).view(torch.int64)
        m = words.numel() // 2
        if dtype == torch.float64:
            _normal_from_words_(words, std, out[2 * p0 : 2 * (p0 + m)])
        else:
            z = torch.empty(2 * m, dtype=torch.float64, device=device)
            _normal_from_words_(words, std, z)
            out[2 * p0 : 2 * (p0 + m)].copy_(z)
    return out[:n]

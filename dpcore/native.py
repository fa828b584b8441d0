"""Optional compiled kernels for clipping (``dpcore/csrc/*.c``).

Three kernels, built into one library:

* ``csrc/wsum.c``: the clipped sum Σ_i f_i·X_i of a batch's float32 per-example gradients,
  accumulated in float64, reading X once (:func:`weighted_sum`; used by
  :func:`dpcore.clipping.weighted_sum`). Without it, the CPU makes a float64 copy of X
  (8 bytes written and read again per element: 5–20× slower).
* ``csrc/rowstats.c``: ‖x‖², 1ᵀx and wᵀx of every row of float32 per-example gradients, in
  float64, reading them once (:func:`row_stats`; the norms of weight-standardised layers).
* ``csrc/conv_pe.c``: per-example convolution weight gradients and their norms (below).

The per-example weight gradients of a convolution are the largest cost of a private step on
small CNNs (the MNIST CNN: about 2.9 of 16 ms with torch's grouped convolution and float32
norms). ``csrc/conv_pe.c`` computes them and their squared norms in one pass, skipping the
output-gradient entries that are exactly zero (after ReLU and max pooling, 70–75 % of them).
See :func:`conv2d_per_example` for when it is used.

The C files are compiled on first use, for this CPU, into a private per-user cache
(:mod:`dpcore.native_build`); it takes about half a second, once per machine. After loading,
the kernel is checked against torch on a small convolution with stride, padding and dilation.

Its running time depends on how many output gradients are zero, so a step's duration (and
the throughput a job reports) carries a little information about the data, as with any
data-dependent arithmetic; the released values do not depend on the path taken beyond
float32 rounding, and the path is chosen by layer shape only.

Nothing here is required: with no compiler, a failed build or check, a non-CPU tensor or
another dtype, or ``DP_NATIVE=0``, callers get ``None`` and use the torch path. Either way the
optimizer's first-batch verification compares the fast clipped sum with the reference.
:func:`state` says which it is.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import torch

from .native_build import builds, cache_dir, compiler

log = logging.getLogger(__name__)

_lock = threading.Lock()
_lib = None
_state = "not loaded yet"
_tried = False
calls = 0  # convolutions computed by the kernel in this process
sums = 0  # weighted sums computed by the kernel in this process


def state() -> str:
    """One line: whether the compiled kernel is in use, and why not if it is not."""
    return _state


def _self_check(lib) -> str | None:
    """Compare the kernel with torch on a small strided, padded, dilated convolution with zero
    and non-zero output gradients. Returns a reason if it disagrees."""
    gen = torch.Generator().manual_seed(0)
    conv = torch.nn.Conv2d(3, 5, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2))
    a = torch.randn(4, 3, 9, 7, generator=gen)
    out_shape = conv(a).shape
    g = torch.randn(out_shape, generator=gen) * (torch.rand(out_shape, generator=gen) < 0.4)
    got = _call(lib, conv, a, g)
    if got is None:
        return "the self-check call failed"
    W, sq = got
    ref = torch.nn.grad.conv2d_weight(
        a.double().reshape(1, -1, 9, 7),
        (4 * 5, 3, 3, 2),
        g.double().reshape(1, -1, *out_shape[2:]),
        stride=conv.stride,
        padding=conv.padding,
        dilation=conv.dilation,
        groups=4,
    ).reshape(4, 5, -1)
    ref_sq = ref.reshape(4, -1).square().sum(1)
    if not torch.allclose(W.double(), ref, rtol=1e-5, atol=1e-5) or not torch.allclose(
        sq, ref_sq, rtol=1e-5, atol=1e-5
    ):
        return "the self-check against torch failed"
    # The weighted sum: columns across several blocks and threads, a row with factor 0 holding a
    # NaN (it must add nothing), and fewer than 4 rows left at the end.
    X = torch.randn(7, 1100, generator=gen)
    X[2, 5] = float("nan")
    f = torch.rand(7, generator=gen, dtype=torch.float64)
    f[2] = 0.0
    out = torch.empty(1100, dtype=torch.float64)
    if lib.dp_weighted_sum(X.data_ptr(), f.data_ptr(), out.data_ptr(), 7, 1100, 2) != 0:
        return "the weighted sum's self-check call failed"
    keep = f != 0
    ref = f[keep] @ X[keep].double()
    if not torch.isfinite(out).all() or not torch.allclose(out, ref, rtol=1e-12, atol=1e-12):
        return "the weighted sum's self-check against torch failed"
    # The row sums: rows of two filters over several threads.
    X, w = torch.randn(6, 37, generator=gen), torch.randn(2, 37, generator=gen, dtype=torch.float64)
    out = torch.empty(6, 3, dtype=torch.float64)
    if lib.dp_row_stats(X.data_ptr(), w.data_ptr(), out.data_ptr(), 6, 37, 2, 2) != 0:
        return "the row sums' self-check call failed"
    x = X.double()
    ref = torch.stack([x.square().sum(1), x.sum(1), (x * w.repeat(3, 1)).sum(1)], 1)
    if not torch.allclose(out, ref, rtol=1e-12, atol=1e-12):
        return "the row sums' self-check against torch failed"
    return None


def load():
    """The loaded kernel library, or None (see :func:`state`)."""
    global _lib, _state, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            if os.environ.get("DP_NATIVE", "1") == "0":
                _state = "off (DP_NATIVE=0)"
                return None
            cc = compiler()
            if cc is None:
                _state = "off (no C compiler found; set CC)"
                return None
            reasons = []
            for path, arch in builds(cc, cache_dir()):
                try:
                    lib = ctypes.CDLL(str(path))
                except OSError as e:  # e.g. an OpenMP runtime that does not match: next flags
                    reasons.append(f"{' '.join(arch)}: {e}")
                    continue
                fn = lib.dp_conv2d_per_example
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 16
                fn = lib.dp_weighted_sum
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
                fn = lib.dp_row_stats
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4
                reason = _self_check(lib)
                if reason:
                    reasons.append(f"{' '.join(arch)}: {reason}")
                    continue
                _lib = lib
                _state = f"on ({path})"
                break
            if _lib is None:
                _state = "off (" + "; ".join(reasons) + ")"
        except Exception as e:  # any failure: the torch path is used
            _state = f"off ({type(e).__name__}: {e})"
        finally:
            _tried = True
            log.info("dpcore native convolution kernel: %s", _state)
        return _lib


def _call(lib, m: torch.nn.Conv2d, a: torch.Tensor, g: torch.Tensor):
    B, C, H, Wd = a.shape
    O, OH, OW = g.shape[1:]  # noqa: E741 (output channels)
    (KH, KW), (sh, sw), (ph, pw), (dh, dw) = m.kernel_size, m.stride, m.padding, m.dilation
    a = a.detach().contiguous()
    g = g.detach().contiguous()
    W = torch.empty((B, O, C * KH * KW), dtype=torch.float32)
    sq = torch.empty(B, dtype=torch.float64)
    rc = lib.dp_conv2d_per_example(
        a.data_ptr(),
        g.data_ptr(),
        W.data_ptr(),
        sq.data_ptr(),
        B,
        C,
        H,
        Wd,
        O,
        OH,
        OW,
        KH,
        KW,
        sh,
        sw,
        ph,
        pw,
        dh,
        dw,
        torch.get_num_threads(),
    )
    return (W, sq) if rc == 0 else None


# When the kernel pays (measured on the 2-core development machine, docs/benchmarks): patches
# of one example small enough to stay in cache, and rows of W at least one 64-float block wide.
# Large layers (ResNet-9's: 0.15–2.4 MB of patches per example, dense output gradients after
# GroupNorm) are faster with torch's grouped convolution: 2.8x instead of 3.5x non-private.
# The rule looks at shapes only, never at the data.
MAX_PATCH_FLOATS = 1 << 15
MIN_ROW = 64


def worthwhile(m: torch.nn.Conv2d, g: torch.Tensor) -> bool:
    """Whether :func:`conv2d_per_example` is expected to beat torch for this layer (by shape)."""
    d = m.in_channels * m.kernel_size[0] * m.kernel_size[1]
    positions = g.shape[2] * g.shape[3] if g.dim() == 4 else 0
    return d >= MIN_ROW and positions * d <= MAX_PATCH_FLOATS


def conv2d_per_example(m: torch.nn.Conv2d, a: torch.Tensor, g: torch.Tensor):
    """``(W, sq)``: per-example weight gradients ``W`` [B, out, in·kh·kw] (float32) of a plain
    convolution (groups 1, zero padding: the caller checks) from its input ``a`` and output
    gradient ``g``, and their squared norms ``sq`` [B] (float64, exact squares summed in
    float64). ``None`` where the kernel does not apply (not CPU float32, shapes that are not
    this layer's, unavailable kernel): the caller then uses torch."""
    if a.device.type != "cpu" or g.device.type != "cpu" or a.dtype != torch.float32 or g.dtype != torch.float32:
        return None
    if (
        a.dim() != 4
        or g.dim() != 4
        or a.shape[0] != g.shape[0]
        or a.shape[1] != m.in_channels
        or g.shape[1] != m.out_channels
    ):
        return None
    (KH, KW), (sh, sw), (ph, pw), (dh, dw) = m.kernel_size, m.stride, m.padding, m.dilation
    expect = [
        (a.shape[2 + k] + 2 * p - d * (kk - 1) - 1) // s + 1
        for k, (p, d, kk, s) in enumerate(((ph, dh, KH, sh), (pw, dw, KW, sw)))
    ]
    if list(g.shape[2:]) != expect or min(expect) < 1:
        return None
    lib = load()
    if lib is None:
        return None
    got = _call(lib, m, a, g)
    if got is not None:
        global calls
        calls += 1
    return got


# Below this many elements the weighted sum runs on one thread (starting a second costs more).
WSUM_THREAD_ELEMENTS = 1 << 16


def weighted_sum(factors: torch.Tensor, X: torch.Tensor) -> torch.Tensor | None:
    """Σ_i factors[i]·X[i] (float64 [n]) for float32 ``X`` [B, n] on the CPU and float64
    ``factors`` [B], accumulated in float64 over the rows in order; rows with factor 0 add
    nothing (not even a NaN). ``None`` where the kernel does not apply (another device or dtype,
    or no kernel): the caller then uses torch."""
    if X.device.type != "cpu" or X.dtype != torch.float32 or X.dim() != 2 or factors.device.type != "cpu":
        return None
    lib = load()
    if lib is None:
        return None
    B, n = X.shape
    X = X.contiguous()
    f = factors.detach().to(torch.float64).contiguous()
    if f.shape != (B,):
        return None
    out = torch.empty(n, dtype=torch.float64)
    threads = torch.get_num_threads() if B * n >= WSUM_THREAD_ELEMENTS else 1
    if lib.dp_weighted_sum(X.data_ptr(), f.data_ptr(), out.data_ptr(), B, n, threads) != 0:
        return None
    global sums
    sums += 1
    return out


def row_stats(X: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """[R, 3] float64: (‖x_r‖², Σ_k x_rk, Σ_k w_{r mod F, k}·x_rk) for each row of float32 ``X``
    [R, n] on the CPU, w float64 [F, n] (R a multiple of F: examples × filters), each sum formed
    in float64 from X read once. ``None`` where the kernel does not apply."""
    if X.device.type != "cpu" or X.dtype != torch.float32 or X.dim() != 2 or w.dim() != 2:
        return None
    R, n = X.shape
    if w.shape[1] != n or w.shape[0] < 1 or R % w.shape[0]:
        return None
    lib = load()
    if lib is None:
        return None
    X, w = X.contiguous(), w.detach().to(device="cpu", dtype=torch.float64).contiguous()
    out = torch.empty((R, 3), dtype=torch.float64)
    threads = torch.get_num_threads() if R * n >= WSUM_THREAD_ELEMENTS else 1
    if lib.dp_row_stats(X.data_ptr(), w.data_ptr(), out.data_ptr(), R, n, w.shape[0], threads) != 0:
        return None
    return out

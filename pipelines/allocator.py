"""Keep freed memory in the process between training steps (glibc malloc).

A training step allocates and frees the same large tensors every time. With glibc's defaults,
blocks above a dynamic threshold (128 KiB to 32 MiB) come straight from ``mmap`` and go back
to the kernel when freed, and the top of the heap is trimmed; the next step then takes a fresh
page fault for every 4 KiB page it touches again. Measured on the 2-core development machine
(docs/benchmarks/README.md): about 2,600 minor faults per non-private MNIST-CNN step and 8,700
per private step, several ms each. :func:`keep_freed_memory` raises the mmap threshold to
its maximum, stops trimming and pads heap growth, so that steady-state steps reuse memory.

The threshold cannot go above 32 MiB, and larger blocks (a private step's per-example
gradients and float64 patches on ResNet-9 or WRN-16-4 at batch 64: 38–600 MiB each) still came
from ``mmap`` and were faulted in afresh at every step: measured 2026-12-01 on WRN-16-4 (batch
64, 2 cores), 218,000–232,000 minor faults and 0.7 s of system time per private step. So
``mmap`` is not used for allocations at all (``M_MMAP_MAX`` = 0): every block comes from the
heap and is reused (0 faults per step in the same measurement). glibc still maps memory where
the heap cannot grow, so an allocation never fails for it. The heap holds on to more: peak RSS
3.4–3.8 GiB against 2.8 GiB for ResNet-9's private step at batch 64, 3.8–4.1 against 2.9 GiB
for the text step (docs/benchmarks/README.md, 2026-12-01).

It is a process-wide setting, so the platform applies it where it owns the process (the
training workers, ``dp-platform bench`` for every mode alike), never on import. Set
``DP_MALLOC_TUNE=0`` to keep glibc's defaults. It costs resident memory: the process keeps
its high-water mark instead of returning it between steps.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4

MMAP_THRESHOLD = 32 * 2**20  # glibc's upper limit on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 2**30
TOP_PAD = 64 * 2**20
MMAP_MAX = 0  # no allocation from mmap, whatever its size (see the module docstring)

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the settings once per process. Returns True if glibc accepted them (False on
    other C libraries or platforms, or with ``DP_MALLOC_TUNE=0``)."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("DP_MALLOC_TUNE", "1").strip() == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        gnu_get_libc_version = libc.gnu_get_libc_version  # glibc only (musl's mallopt is a no-op)
    except (OSError, AttributeError):
        return False
    gnu_get_libc_version.restype = ctypes.c_char_p
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (M_TOP_PAD, TOP_PAD),
            (M_MMAP_MAX, MMAP_MAX),
        )
    )
    _applied = ok
    return ok


def describe() -> str:
    if _applied:
        return f"glibc malloc: no mmap, no trim below {TRIM_THRESHOLD >> 20} MiB"
    return "malloc defaults"

"""The clipped sum over a batch's examples, Σ_i f_i·X_i, accumulated in float64
(``dpcore.clipping.weighted_sum``), against the float32 product it replaced.

    python docs/benchmarks/weighted_sum.py [--calls 200] [--threads 2]

Shapes [B, n] of per-example gradients that the platform sums: the MNIST CNN's two
convolutions at batch 256, a ResNet-9 convolution (256 → 256, 3×3) at 64,
and all-MiniLM-L6-v2's feed-forward weight (1,536 × 384) at 32. For each it times, interleaved
call by call (median of ``--calls`` after warm-up): torch's float32 matrix-vector product (what
the platform did before 2026-11-28: its rounding depends on every example), torch's float64 copy
and product (what the platform does without the compiled kernel, in pieces), and the compiled
kernel of ``dpcore/csrc/wsum.c``, which reads X once and accumulates in float64. Each result is
checked against a float64 reference.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from dpcore import native  # noqa: E402
from dpcore.clipping import weighted_sum  # noqa: E402

SHAPES = [
    ("MNIST CNN conv 1 (16 × 1·8·8)", 256, 16 * 64),
    ("MNIST CNN conv 2 (32 × 16·4·4)", 256, 32 * 256),
    ("ResNet-9 conv (256 × 256·3·3)", 64, 256 * 256 * 9),
    ("MiniLM feed-forward (1536 × 384)", 32, 1536 * 384),
]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if native.load() is None:
        sys.exit(f"the compiled kernel is not available: {native.state()}")
    print(f"{platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}")
    print("| per-example gradients | B × n | float32 product ms | float64 copy + product ms | kernel ms |")
    print("|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for name, B, n in SHAPES:
        X = torch.randn(B, n, generator=g)
        f = torch.rand(B, generator=g, dtype=torch.float64)
        ref = f @ X.double()
        assert torch.allclose(weighted_sum(f, X), ref, rtol=1e-12, atol=1e-12)
        f32 = f.float()
        modes = {
            "f32": lambda f32=f32, X=X: f32 @ X,
            "copy": lambda f=f, X=X: f @ X.double(),
            "kernel": lambda f=f, X=X: native.weighted_sum(f, X),
        }
        calls = max(10, args.calls * 8192 * 256 // (B * n))
        times = {k: [] for k in modes}
        for fn in modes.values():
            fn()
        for _ in range(calls):
            for k, fn in modes.items():
                t = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t)
        ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        print(f"| {name} | {B} × {n:,} | {ms['f32']:.3f} | {ms['copy']:.3f} | {ms['kernel']:.3f} |")


if __name__ == "__main__":
    main()

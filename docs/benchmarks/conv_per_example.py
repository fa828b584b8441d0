"""Which torch form of a convolution's per-example weight gradients is faster, by layer shape
(issue I: the conv nets' private step). The rule in ``dpcore.bookkeeping.conv.patches_first``
comes from this table.

    python docs/benchmarks/conv_per_example.py                  # batches 64 and 32, 2 threads
    python docs/benchmarks/conv_per_example.py --batches 64 --threads 1

For 3×3 convolutions (padding 1, stride 1 or 2) of several widths and map sizes, it times the two
exact forms of W_i = ∂loss_i/∂weight for every example of a batch: torch's grouped weight gradient
(``torch.nn.grad.conv2d_weight`` with the batch as groups) and patches (``conv.patches``, one
strided copy) with one batched matrix product (``torch.bmm``), and, for scale, the non-private
weight gradient of the whole batch. Each time is the median of 5 calls after one warm-up, in
milliseconds. "chosen" is what the platform picks for that shape (``conv.patches_first``). Layers
over the book-keeping clipper's budget for materialised gradients (128 Mi elements: B·out·in·9)
and maps of fewer than 48 positions are left out: the clipper uses its ghost form there. Same
allocator settings as ``dp-platform bench``.
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
from torch import nn  # noqa: E402

from dpcore.bookkeeping.clipper import BookKeepingClipper  # noqa: E402
from dpcore.bookkeeping.conv import GHOST_POSITIONS, patches_first  # noqa: E402
from dpcore.bookkeeping.conv import patches as strided_patches  # noqa: E402
from pipelines import allocator  # noqa: E402

SHAPES = [  # (map size, stride)
    (32, 1),
    (32, 2),
    (16, 1),
    (16, 2),
    (8, 1),
    (8, 2),
    (4, 1),
]
WIDTHS = [(16, 32), (32, 64), (64, 64), (64, 128), (128, 128), (128, 256), (256, 256), (256, 512), (512, 512)]


def _median_ms(fn, calls: int = 5) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _time(batch: int, cin: int, cout: int, size: int, stride: int):
    """(grouped ms, patches ms, whole-batch ms, output positions, the layer) for one shape."""
    conv = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
    a = torch.randn(batch, cin, size, size)
    g = torch.randn_like(conv(a[:1])).expand(batch, -1, -1, -1).contiguous()
    g = g * torch.rand_like(g)
    out = g.shape[2]
    positions = out * out

    def grouped():
        return torch.nn.grad.conv2d_weight(
            a.reshape(1, -1, size, size),
            (batch * cout, cin, 3, 3),
            g.reshape(1, -1, out, out),
            stride=stride,
            padding=1,
            groups=batch,
        )

    def patches():
        A = strided_patches(conv, a)  # F.unfold's values, by one strided copy
        return torch.bmm(g.reshape(batch, cout, -1), A.transpose(1, 2))

    def whole():
        return torch.nn.grad.conv2d_weight(a, (cout, cin, 3, 3), g, stride=stride, padding=1)

    t_grouped, t_patches, t_whole = _median_ms(grouped), _median_ms(patches), _median_ms(whole)
    return t_grouped, t_patches, t_whole, positions, conv


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 32])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    allocator.keep_freed_memory()
    torch.manual_seed(0)
    print(
        f"Per-example convolution weight gradients (3×3, padding 1), median of 5 calls, ms; torch {torch.__version__}, "
        f"{args.threads} thread(s), {platform.machine()}, {allocator.describe()}"
    )
    print(
        "| batch | in → out | map, stride | positions | grouped | patches + bmm | non-private (whole batch) | faster | chosen |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for batch in args.batches:
        for size, stride in SHAPES:
            for cin, cout in WIDTHS:
                if batch * cout * cin * 9 > BookKeepingClipper.MAX_PER_EXAMPLE_ELEMENTS:
                    continue
                if (size // stride) ** 2 < GHOST_POSITIONS:  # the clipper's ghost form (conv.ghost_first)
                    continue
                t_grouped, t_patches, t_whole, positions, conv = _time(batch, cin, cout, size, stride)
                faster = "patches" if t_patches < t_grouped else "grouped"
                ratio = max(t_grouped, t_patches) / min(t_grouped, t_patches)
                chosen = "patches" if patches_first(conv, positions) else "grouped"
                print(
                    f"| {batch} | {cin} → {cout} | {size}×{size}, {stride} | {positions} | {t_grouped:.1f} | "
                    f"{t_patches:.1f} | {t_whole:.1f} | {faster} ({ratio:.2f}×) | {chosen} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()

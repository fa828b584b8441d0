"""How much an example's computed gradient depends on the size of the batch it is computed in
(the README's "What the guarantee does not cover", item (3)).

    python docs/benchmarks/batch_dependence.py            # 2 threads
    python docs/benchmarks/batch_dependence.py --threads 1

The guarantee's float bound takes each example's per-example gradient to depend on that example
alone. The forward and backward run over the whole batch in float32, and a kernel may pick its
algorithm, blocking or threading by the batch's size. This script puts the same 300 seeded
examples in batches of every size from 1 to 32 and of 64, 128, 200 and 256 (each batch the first
B of them) and prints, for each way the platform forms per-example gradients, the largest change
of an example's result against the batch of 256, relative to it:

* "conv 1→32 3×3, grouped conv": the torch form for one input channel
  (``dpcore.bookkeeping.conv.conv_per_example_torch``, a grouped convolution);
* "conv 1→32 3×3, patches + bmm": the same gradients as patches and one batched product;
* "conv, compiled kernel": ``dpcore.native.conv2d_per_example`` where it applies;
* "mnist_cnn, book-keeping norms": the whole MNIST CNN's forward and backward and the
  book-keeping clipper's per-example squared norms (``BookKeepingClipper.measure``), the
  number an example's clip factor is computed from.

0 means bit-identical in every batch size tried.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from dpcore import native  # noqa: E402
from dpcore.bookkeeping import conv  # noqa: E402
from dpcore.bookkeeping.clipper import BookKeepingClipper  # noqa: E402
from pipelines.models import mnist_cnn  # noqa: E402

SIZES = list(range(1, 33)) + [64, 128, 200, 256]


def worst_change(fn, n: int = 300) -> tuple[float, int | None]:
    """(the largest ‖r_i(B) − r_i(256)‖ / ‖r_i(256)‖ over examples i and sizes B, that B)."""
    ref = fn(256).double()
    worst, where = 0.0, None
    for b in SIZES:
        r = fn(b).double().reshape(b, -1)
        d = float(((r - ref[:b].reshape(b, -1)).norm(dim=1) / ref[:b].reshape(b, -1).norm(dim=1)).max())
        if d > worst:
            worst, where = d, b
    return worst, where


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    m = nn.Conv2d(1, 32, 3, padding=1)
    a = torch.randn(300, 1, 28, 28)
    with torch.no_grad():
        g = torch.randn_like(m(a))

    def bmm(b):
        return torch.bmm(g[:b].reshape(b, 32, -1), conv.patches_last(m, a[:b]))

    def compiled(b):
        got = native.conv2d_per_example(m, a[:b], g[:b])
        return got[0] if got is not None else None

    model = mnist_cnn((1, 28, 28), 10)
    x, y = torch.randn(300, 1, 28, 28), torch.randint(0, 10, (300,))
    clipper = BookKeepingClipper(model, F.cross_entropy)

    def norms(b):
        return clipper.measure(x[:b], y[:b], 1.0, 256)[0]

    rows = [
        ("conv 1→32 3×3, grouped conv", lambda b: conv.conv_per_example_torch(m, a[:b], g[:b])),
        ("conv 1→32 3×3, patches + bmm", bmm),
    ]
    if native.state() == "loaded" or compiled(1) is not None:
        rows.append(("conv 1→32 3×3, compiled kernel", compiled))
    rows.append(("mnist_cnn (batch 256), book-keeping norms", norms))
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} threads")
    print("| per-example result | largest relative change against B = 256 | at B |")
    print("|---|---|---|")
    for name, fn in rows:
        worst, where = worst_change(fn)
        print(f"| {name} | {worst:.2e} | {where if where is not None else '—'} |")


if __name__ == "__main__":
    main()

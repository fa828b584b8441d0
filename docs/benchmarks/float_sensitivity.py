"""How far one example moves a lot's clipped sum in floating point: the accountant assumes C.

    python docs/benchmarks/float_sensitivity.py [--trials 20] [--lots 1024 4096 16384] [--batches 64 256]

`dpcore.make_private`'s optimizer, as the README uses it, accumulates a lot (book-keeping
clipping in physical batches, into the lot's sums), and the sums are read before the release.
Each trial builds a lot of L examples for a Linear layer (64 → 10, cross-entropy): L − 1 copies
of one input and label, whose clipped gradients are all the same vector of norm C (so that the
lot's partial sums grow to L·C, and their rounding is large), and one other example j, a random
input and label. It sums the lot with and without j, and reports the largest ‖S(D) − S(D′)‖ / C
over the trials. In exact arithmetic it is ‖clip(g_j)‖ / C ≤ 1 − m (m, the clipping margin); a
value above 1 is sensitivity that the accountant does not know of. The same per-example vectors
summed in float64 give the reference column. ``--regroup``: the L − 1 examples distinct but
nearly parallel, and j among the first 8, so that removing it regroups every later physical
batch (their float32 sums then round differently too).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import dpcore  # noqa: E402
from dpcore.clipping import CLIP_MARGIN  # noqa: E402

C, D, K = 1.0, 64, 10


def lot_sums(x: torch.Tensor, y: torch.Tensor, batch: int) -> torch.Tensor:
    """The lot's clipped sum of (x, y), flat, as the optimizer holds it before the release."""
    torch.manual_seed(0)
    model = nn.Linear(D, K, bias=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        private = dpcore.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
            dataset_size=10 * x.shape[0], lot_size=x.shape[0], epochs=1, target_epsilon=8.0,
            target_delta=1e-6, clip_norm=C, seed=0, physical_batch_size=batch,
        )  # fmt: skip
        private.optimizer.accumulate(x, y)
    return torch.cat([s.detach().flatten().clone() for s in private.optimizer.lot.sums.values()])


def clipped_vectors(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each example's clipped gradient in float64, as the clip factors make it (the reference)."""
    torch.manual_seed(0)
    w = nn.Linear(D, K, bias=False).weight.detach().double()
    p = torch.softmax(x.double() @ w.t(), dim=1)
    g = (p - F.one_hot(y, K).double()).unsqueeze(2) * x.double().unsqueeze(1)  # [B, K, D]
    g = g.reshape(x.shape[0], -1)
    norms = g.norm(dim=1, keepdim=True)
    bound = C * (1 - CLIP_MARGIN)
    return torch.where(norms > bound, g * (bound / norms), g)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--lots", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument(
        "--regroup",
        action="store_true",
        help="the L − 1 examples distinct but nearly parallel (base + 0.05·noise), and the other one among the "
        "first 8, so that removing it regroups every later physical batch",
    )
    a = ap.parse_args()
    torch.set_num_threads(2)
    print(f"One example's move of the lot's clipped sum, largest over {a.trials} trials; torch {torch.__version__}")
    print("| lot L | physical batch | the platform's sums: max ‖S(D) − S(D′)‖ / C | the same vectors in float64 |")
    print("|---|---|---|---|")
    for lot in a.lots:
        for batch in a.batches:
            worst = worst64 = 0.0
            for t in range(a.trials):
                g = torch.Generator().manual_seed(1000 * lot + t)
                x = (torch.randn(D, generator=g) * 3).repeat(lot, 1)
                if a.regroup:
                    x += 0.05 * torch.randn(lot, D, generator=g)
                y = torch.full((lot,), int(torch.randint(0, K, (), generator=g)))
                j = int(torch.randint(0, 8 if a.regroup else lot, (), generator=g))
                x[j], y[j] = torch.randn(D, generator=g) * 3, int(torch.randint(0, K, (), generator=g))
                keep = torch.arange(lot) != j
                move = (lot_sums(x, y, batch).double() - lot_sums(x[keep], y[keep], batch).double()).norm()
                v = clipped_vectors(x, y)
                move64 = (v.sum(0) - v[keep].sum(0)).norm()
                worst, worst64 = max(worst, float(move) / C), max(worst64, float(move64) / C)
            print(f"| {lot} | {batch} | {worst:.7f} | {worst64:.9f} |", flush=True)


if __name__ == "__main__":
    main()

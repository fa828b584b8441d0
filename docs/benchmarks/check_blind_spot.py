"""What book-keeping's check against vmap cannot see: a layer form's own float64 rounding where
only the training data makes an example's terms cancel.

A 2,048 → 2,048 Linear (no bias) over two positions, mean-pooled, then a 2-class head. One
training example has positions s·v and −s·v + w (v, w standard normal, w/√D): its gradient is
small next to its terms, and the ghost form's norm, without its allowance for rounding, can be
below the exact one. Each row clips that example alone (physical batch 1) through DPOptimizer
and prints its share's norm in units of C (the lot's sum before noise):

- ``honest``: the library's forms as they are;
- ``takes-back``: the Linear ghost form patched to subtract twice its allowance from its norms,
  so that with the allowance ``SquaredNorms`` adds it ends one allowance below the computed
  norm. The check passes it (its seeded inputs do not cancel), and training clips on it.

The invariant is a share of at most C; the second row shows why every form must carry, and
test on cancelling inputs, its own allowance (docs/architecture.md, "A layer type").

    .venv/bin/python docs/benchmarks/check_blind_spot.py [--scales 2000 5000] [--seeds 3]
"""

from __future__ import annotations

import argparse
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import dpcore
from dpcore import fastpath
from dpcore.bookkeeping import base

D, T, C = 2048, 2, 1e-3


class MeanOverPositions(nn.Module):
    def forward(self, z):
        return z.mean(1)


def model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(D, D, bias=False), MeanOverPositions(), nn.Linear(D, 2))


def share(scale: float, seed: int) -> tuple[str, float]:
    """(the path the step took, the example's share over C)."""
    m = model()
    opt = dpcore.DPOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1),
        model=m,
        loss_fn=F.cross_entropy,
        noise_multiplier=1.0,
        clip_norm=C,
        sample_rate=0.1,
        dataset_size=100,
        randomness=dpcore.SeededRandomness(0),
        ledger=dpcore.PrivacyLedger(None, 1e-5),
        clipping="bookkeeping",
        physical_batch_size=1,
    )
    g = torch.Generator().manual_seed(seed)
    v, w = torch.randn(D, generator=g), torch.randn(D, generator=g) / math.sqrt(D)
    x = torch.stack([scale * v, -scale * v + w]).unsqueeze(0)  # the example's positions cancel
    opt.accumulate(x, torch.tensor([0]))
    return opt.clipping, math.sqrt(sum(float(s.square().sum()) for s in opt.lot.sums.values())) / C


def takes_back(real):
    def form(A, G, channels_first, ctx):
        s, W, magnitude_sq = real(A, G, channels_first, ctx)
        if magnitude_sq is not None:
            s = s - 2 * base.ghost_allowance(A, G, channels_first, magnitude_sq)
        return s, W, magnitude_sq

    return form


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scales", type=float, nargs="+", default=[2000.0, 5000.0])
    p.add_argument("--seeds", type=int, default=3)
    args = p.parse_args()
    warnings.filterwarnings("ignore", category=dpcore.SeededRandomnessWarning)
    torch.set_num_threads(1)
    real = base.weight_sq_norms
    print("| form | check on its seeded inputs | scale s | path | worst share / C |")
    print("|---|---|---|---|---|")
    for name, form in (("honest", real), ("takes-back", takes_back(real))):
        base.weight_sq_norms = form
        try:
            x, y = fastpath.check_inputs(model(), torch.zeros(1, T, D), torch.zeros(1, dtype=torch.long), 1)
            why = fastpath.CheckedBookKeeping(model(), F.cross_entropy, C).formulas_disagree(x, y, 1)
            for scale in args.scales:
                runs = [share(scale, seed) for seed in range(args.seeds)]
                paths = ",".join(sorted({path for path, _ in runs}))
                worst = max(s for _, s in runs)
                print(f"| {name} | {'passes' if why == '' else 'refuses'} | {scale:g} | {paths} | {worst:.6f} |")
        finally:
            base.weight_sq_norms = real


if __name__ == "__main__":
    main()

"""BAM Fig. 3 on this machine: wall time per private step against MLP depth.

For each depth, an MLP (784 → width → … → 10, ReLU) takes private steps on one lot of
``--batch`` generated examples (one physical batch), with each method:

* DP-SGD: per-example gradients (vmap), clip, sum, noise;
* DP-SAT: the same at a once-per-lot shifted point (plus the shift and the exact restore);
* BAM (SAM): per-example gradient, per-example ascent point, per-example gradient there;
* BAM (exact): per-example gradient, then a per-example jvp of grad (forward-over-reverse).

The time is the median of ``--reps`` timed steps after ``--warmup`` untimed ones: accumulate +
step (noise, update, ledger). Noise comes from a seeded generator here so that the table
compares the methods' gradient work; secure-mode noise adds the same time to every method.

    python docs/benchmarks/bam_depth.py                 # depths 2 4 8 16 32, width 256, batch 64
    python docs/benchmarks/bam_depth.py --depths 8 --reps 20
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import dpcore

METHODS = {
    "DP-SGD": {},
    "DP-SAT": {"method": "dpsat", "ascent": 0.05},
    "BAM (SAM)": {"method": "bam", "ascent": 0.01, "bam_variant": "sam"},
    "BAM (exact)": {"method": "bam", "ascent": 0.01, "bam_variant": "exact"},
}


def mlp(depth: int, width: int, d_in: int = 784, classes: int = 10) -> nn.Module:
    layers: list[nn.Module] = []
    d = d_in
    for _ in range(depth - 1):
        layers += [nn.Linear(d, width), nn.ReLU()]
        d = width
    layers.append(nn.Linear(d, classes))
    return nn.Sequential(*layers)


def time_method(depth: int, width: int, batch: int, options: dict, warmup: int, reps: int) -> float:
    torch.manual_seed(0)
    model = mlp(depth, width)
    x, y = torch.randn(batch, 784), torch.randint(0, 10, (batch,))
    opt = dpcore.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        model=model,
        loss_fn=F.cross_entropy,
        noise_multiplier=1.0,
        clip_norm=1.0,
        sample_rate=0.01,
        dataset_size=batch * 100,
        randomness=dpcore.SeededRandomness(0),
        ledger=dpcore.PrivacyLedger(None, 1e-5, epsilon_every=10**9),
        physical_batch_size=batch,
        **options,
    )
    times = []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        opt.accumulate(x, y)
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    warnings.simplefilter("ignore", dpcore.SeededRandomnessWarning)
    torch.set_num_threads(a.threads)
    print(
        f"# BAM Fig. 3: ms per private step, MLP width {a.width}, batch {a.batch}, {a.threads} threads, "
        f"median of {a.reps}; torch {torch.__version__}, {platform.processor() or platform.machine()}"
    )
    names = list(METHODS)
    print(
        "| depth | params | "
        + " | ".join(f"{n} ms" for n in names)
        + " | "
        + " | ".join(f"{n} / DP-SGD" for n in names[1:])
        + " |"
    )
    print("|---" * (2 + 2 * len(names) - 1) + "|")
    for depth in a.depths:
        ms = {n: 1000 * time_method(depth, a.width, a.batch, METHODS[n], a.warmup, a.reps) for n in names}
        params = sum(q.numel() for q in mlp(depth, a.width).parameters())
        row = (
            [str(depth), f"{params:,}"]
            + [f"{ms[n]:.1f}" for n in names]
            + [f"{ms[n] / ms['DP-SGD']:.2f}×" for n in names[1:]]
        )
        print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()

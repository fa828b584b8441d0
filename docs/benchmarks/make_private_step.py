"""`dpcore.make_private` used exactly as the README shows it, timed step by step.

    python docs/benchmarks/make_private_step.py [--rounds 30] [--threads 2]

The MNIST CNN (the platform's `cnn`: 2 conv layers, Abadi et al. / Opacus's example) on
random 1×28×28 inputs, 60,000 examples, expected lot 256, 2 torch threads. Rows, timed in
interleaved rounds (median ms per step, one lot per step):

- a non-private step (the same model, optimizer and lot sizes);
- `make_private(...)` with its defaults, as in the README (ε composed only when asked,
  book-keeping clipping where the model allows it);
- the same with `epsilon_every=1` (an exact PLD ε at every step);
- the defaults until 2026-11-23: `epsilon_every=1, clipping="vmap"`;

each with the README's `accumulate` + `step` loop. The ledger's budget check is exact in all
of them (and its one bisection for the step bound happens before the timed rounds).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import dpcore  # noqa: E402
from pipelines.models import build_model  # noqa: E402

N, LOT, EPOCHS = 60_000, 256, 60


def setup(mode: str, seed: int):
    torch.manual_seed(seed)
    model = build_model("cnn", (1, 28, 28), 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if mode == "non-private":

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()

        return step
    extra = {"epsilon every step": {"epsilon_every": 1}, "old defaults": {"epsilon_every": 1, "clipping": "vmap"}}.get(
        mode, {}
    )
    private = dpcore.make_private(
        model,
        opt,
        F.cross_entropy,
        dataset_size=N,
        lot_size=LOT,
        epochs=EPOCHS,
        target_epsilon=3.0,
        target_delta=1e-5,
        clip_norm=1.0,
        **extra,
    )
    private.ledger.allowance(dpcore.PrivacyEvent.dpsgd_step(private.optimizer.noise_multiplier, LOT / N))

    def step(x, y):
        private.optimizer.accumulate(x, y)
        private.optimizer.step()

    return step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    modes = ("non-private", "make_private (README, defaults)", "epsilon every step", "old defaults")
    steps = {m: setup(m, 0) for m in modes}
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N // 10, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (N // 10,), generator=g)

    def lot():
        idx = torch.nonzero(torch.rand(len(y), generator=g) < LOT * 10 / N).flatten()
        return x[idx], y[idx]

    for m in modes:  # warm-up (and make_private's first-batch checks)
        steps[m](*lot())
    times = {m: [] for m in modes}
    for _ in range(a.rounds):
        for m in modes:
            b = lot()
            t0 = time.perf_counter()
            steps[m](*b)
            times[m].append(time.perf_counter() - t0)
    base = statistics.median(times["non-private"])
    print(
        f"MNIST CNN, expected lot {LOT}, {a.threads} thread(s), {a.rounds} interleaved rounds, median; torch {torch.__version__}"
    )
    print("| step | ms/step | × non-private |")
    print("|---|---|---|")
    for m in modes:
        med = statistics.median(times[m])
        label = {
            "epsilon every step": "make_private(..., epsilon_every=1)",
            "old defaults": "make_private(..., epsilon_every=1, clipping='vmap'): the defaults until 2026-11-23",
        }.get(m, m)
        print(f"| {label} | {1000 * med:.1f} | {med / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

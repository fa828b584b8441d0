"""Accuracy on digits at ε ∈ {1, 2, 8}, δ=1e-5: this platform's main job beside Opacus 1.6.

    .venv/bin/python docs/benchmarks/accuracy_digits.py            # 3 seeds per ε (about 15 min on 2 cores)
    .venv/bin/python docs/benchmarks/accuracy_digits.py --seeds 1

Both sides train the same model (the MLP of `pipelines.models`, same initial weights), with
the same lot size (expected 512, Poisson sampling), epochs (60), optimiser (Adam, lr 0.02),
clipping bound (1.0) and target (ε, δ), on the same train/validation/test split. Ours is the
real main job: 2 Ray Train workers, σ calibrated with the PLD accountant, ε from the ledger.
Opacus calibrates σ with its PRV accountant (tight, like PLD) for its own number of steps
(epochs × len(loader)). Both report test accuracy on the same 359 test images.

Prints a Markdown table (mean ± std over seeds, and each seed's value).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore")

from pipelines.config import TrainConfig  # noqa: E402
from pipelines.data import load_digits  # noqa: E402
from pipelines.models import build_model  # noqa: E402
from pipelines.train import run  # noqa: E402

EPSILONS = (1.0, 2.0, 8.0)
LOT, EPOCHS, LR, CLIP, DELTA = 512, 60, 0.02, 1.0, 1e-5


def ours(eps: float, seed: int, root: str) -> dict:
    cfg = TrainConfig(
        target_epsilon=eps,
        seed=seed,
        lot_size=LOT,
        epochs=EPOCHS,
        lr=LR,
        clip_norm=CLIP,
        target_delta=DELTA,
        storage_path=f"{root}/runs",
        tracking_uri=f"sqlite:///{root}/mlflow.db",
        registered_model="none",
        quiet=True,
    )
    out = run(cfg)
    return {"acc": out["test_accuracy"], "eps": out["epsilon"], "sigma": out["noise_multiplier"], "steps": out["steps"]}


def opacus(eps: float, seed: int) -> dict:
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    data = load_digits()
    torch.manual_seed(0)  # the same initial weights as ours (init_seed=0)
    model = build_model("mlp", data.input_shape, data.num_classes)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    loader = DataLoader(TensorDataset(data.inputs("train"), data.train.y), batch_size=LOT)
    torch.manual_seed(seed)
    engine = PrivacyEngine(accountant="prv")
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        target_epsilon=eps,
        target_delta=DELTA,
        epochs=EPOCHS,
        max_grad_norm=CLIP,
        poisson_sampling=True,
    )
    steps = 0
    for _ in range(EPOCHS):
        for x, y in loader:
            optimizer.zero_grad()
            if len(y):
                F.cross_entropy(model(x), y).backward()
            optimizer.step()
            steps += 1
    model.eval()
    with torch.no_grad():
        acc = (model(data.inputs("test")).argmax(1) == data.test.y).float().mean().item()
    return {"acc": acc, "eps": engine.get_epsilon(DELTA), "sigma": optimizer.noise_multiplier, "steps": steps}


def fmt(rows: list[dict]) -> str:
    accs = [r["acc"] for r in rows]
    sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
    return f"{statistics.mean(accs):.3f} ± {sd:.3f} ({', '.join(f'{a:.3f}' for a in accs)})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    a = p.parse_args()
    import ray

    ray.init(
        num_cpus=2, include_dashboard=True, dashboard_host="127.0.0.1", logging_level=logging.ERROR, log_to_driver=False
    )
    results = {}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as root:
        for eps in EPSILONS:
            for name, fn in (("ours", lambda s, e=eps: ours(e, s, root)), ("opacus", lambda s, e=eps: opacus(e, s))):
                results[(eps, name)] = [fn(seed) for seed in range(a.seeds)]
                r = results[(eps, name)]
                print(
                    f"ε={eps:g} {name:7s} acc {fmt(r)}  σ={r[0]['sigma']:.3f} steps={r[0]['steps']} ε_reported={r[0]['eps']:.4f}",
                    file=sys.stderr,
                )
    ray.shutdown()
    print(
        "| ε (δ=1e-5) | this platform (2 Ray workers, PLD) | Opacus 1.6 (PRV) | σ ours / Opacus | steps ours / Opacus |"
    )
    print("|---|---|---|---|---|")
    for eps in EPSILONS:
        o, q = results[(eps, "ours")], results[(eps, "opacus")]
        print(
            f"| {eps:g} | {fmt(o)} | {fmt(q)} | {o[0]['sigma']:.2f} / {q[0]['sigma']:.2f} | {o[0]['steps']} / {q[0]['steps']} |"
        )
    print(f"\n{a.seeds} seed(s) per cell; test accuracy, mean ± std (each seed). Wall time {time.time() - t0:.0f}s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

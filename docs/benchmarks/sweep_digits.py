"""Issue D, must-show 5: sweeps on digits at ε=2, δ=1e-5.

1. A 20-trial TPE sweep against a 20-trial random sweep of DP-SGD (SGD, momentum 0.9) over
   lr ∈ [1e-3, 1] (log) × lot ∈ {64, 128, 256, 512, 1024}, 30 epochs, σ calibrated per trial:
   the best trial's validation and test accuracy, and the wall time of each sweep.
2. Untuned Opacus 1.6 at ε=2 on the same MLP and split: the defaults of Opacus's MNIST example
   (SGD lr 0.1, no momentum, batch 64 with Poisson sampling, 10 epochs, clip 1.0), 3 seeds.
3. The BAM appendix preset (`--preset bam-appendix`): stage 1 random search over (lr, lot) for
   DP-SGD, then λ for BAM and ρ for DP-SAT with stage 1's lr and lot fixed.

    .venv/bin/python docs/benchmarks/sweep_digits.py                 # about 40 minutes on 2 cores
    .venv/bin/python docs/benchmarks/sweep_digits.py --trials 20 --preset-trials 10

Each trial is the main job on one Ray worker; two trials run at once.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pipelines.config import TrainConfig  # noqa: E402
from pipelines.data import load_digits  # noqa: E402
from pipelines.models import build_model  # noqa: E402
from tuning.config import SweepConfig  # noqa: E402
from tuning.sweep import run_preset, run_sweep  # noqa: E402

SPACE = {"lr": {"low": 1e-3, "high": 1.0, "log": True}, "lot_size": {"choices": [64, 128, 256, 512, 1024]}}


def untuned_opacus(seed: int) -> float:
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    data = load_digits()
    torch.manual_seed(0)
    model = build_model("mlp", data.input_shape, data.num_classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(data.inputs("train"), data.train.y), batch_size=64)
    torch.manual_seed(seed)
    engine = PrivacyEngine(accountant="prv")
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        target_epsilon=2.0,
        target_delta=1e-5,
        epochs=10,
        max_grad_norm=1.0,
        poisson_sampling=True,
    )
    for _ in range(10):
        for x, y in loader:
            optimizer.zero_grad()
            if len(y):
                F.cross_entropy(model(x), y).backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        return (model(data.inputs("test")).argmax(1) == data.test.y).float().mean().item()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--preset-trials", type=int, default=10)
    a = p.parse_args()
    import ray

    ray.init(
        num_cpus=2, include_dashboard=True, dashboard_host="127.0.0.1", logging_level=logging.ERROR, log_to_driver=False
    )
    with tempfile.TemporaryDirectory() as root:
        base = TrainConfig(
            optimizer="sgd",
            momentum=0.9,
            epochs=30,
            target_epsilon=2.0,
            target_delta=1e-5,
            num_workers=1,
            storage_path=f"{root}/runs",
            tracking_uri=f"sqlite:///{root}/mlflow.db",
            registered_model="none",
            quiet=True,
        )
        rows = []
        for sampler in ("tpe", "random"):
            t0 = time.time()
            sweep = SweepConfig(
                study=f"digits-{sampler}",
                storage=f"sqlite:///{root}/optuna.db",
                n_trials=a.trials,
                max_concurrent=2,
                sampler=sampler,
                sampler_seed=0,
                space=SPACE,
                quiet=True,
            )
            s = run_sweep(sweep, base)
            rows.append((sampler, s, time.time() - t0))
            print(f"{sampler}: {s['best']}", file=sys.stderr, flush=True)
        opacus = [untuned_opacus(seed) for seed in range(3)]
        t0 = time.time()
        preset = run_preset(
            SweepConfig(
                study="digits-preset",
                storage=f"sqlite:///{root}/optuna.db",
                n_trials=a.preset_trials,
                max_concurrent=2,
                sampler_seed=1,
                space=SPACE,
                quiet=True,
            ),
            base,
        )
        preset_time = time.time() - t0
    ray.shutdown()
    print(
        f"### {a.trials}-trial sweeps of DP-SGD on digits, ε=2, δ=1e-5 (space: lr 1e-3–1 log × lot {{64…1024}}, 30 epochs)\n"
    )
    print("| sampler | best trial's validation accuracy | its test accuracy | its lr, lot | σ | wall time |")
    print("|---|---|---|---|---|---|")
    for sampler, s, secs in rows:
        b = s["best"]
        print(
            f"| {sampler} | {b['val_accuracy']:.4f} | {b['test_accuracy']:.4f} | {b['params']['lr']:.4g}, {b['params']['lot_size']} | "
            f"{b['noise_multiplier']:.3f} | {secs / 60:.1f} min |"
        )
    print(
        f"\nUntuned Opacus 1.6 at ε=2 (SGD lr 0.1, batch 64, 10 epochs, clip 1.0), test accuracy over seeds 0–2: "
        f"{statistics.mean(opacus):.4f} ± {statistics.stdev(opacus):.4f} ({', '.join(f'{v:.3f}' for v in opacus)})"
    )
    print(f"\n### BAM appendix preset ({a.preset_trials} random trials per stage, {preset_time / 60:.1f} min)\n")
    print("| stage | method | best params | validation accuracy | test accuracy |")
    print("|---|---|---|---|---|")
    stages = [("1", "DP-SGD", preset["stage1"])] + [
        ("2", m, s) for m, s in (("BAM", preset["stage2"]["bam"]), ("DP-SAT", preset["stage2"]["dpsat"]))
    ]
    for stage, m, s in stages:
        b = s["best"]
        print(
            f"| {stage} | {m} | {', '.join(f'{k}={v:.4g}' if isinstance(v, float) else f'{k}={v}' for k, v in b['params'].items())} | "
            f"{b['val_accuracy']:.4f} | {b['test_accuracy']:.4f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""End-to-end training throughput: Ray Train with 1 and 2 workers against one in-process worker.

    .venv/bin/python docs/benchmarks/ray_throughput.py            # about 8 minutes on 2 cores

Data: the `generated` dataset, 28×28 images, 60,000 training examples. Model: the 2-conv MNIST
CNN. Expected lot 1024 (q = 1024/60000), σ = 1, book-keeping clipping, secure
noise. The same number of steps for each setting.

* Ray rows: the real main job (`pipelines.train.run`), its steady-state rate measured from the
  ledger journal's per-step timestamps (first to last release, so that start-up is excluded),
  plus the whole wall time including Ray and worker start-up, checkpoints and MLflow logging.
  Each Ray worker has 1 CPU (so one torch thread).
* In-process row: `dpcore.make_private` in this process with torch using both cores.

Throughput is expected examples per second: steps per second × qN.
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore")

import dpcore  # noqa: E402
from pipelines.config import TrainConfig  # noqa: E402
from pipelines.data import load_dataset  # noqa: E402
from pipelines.models import build_model  # noqa: E402
from pipelines.train import run  # noqa: E402

N_TRAIN, LOT, STEPS, SIGMA = 60_000, 1024, 200, 1.0
DATA = dict(dataset="generated", generated_size=75_000, image_size=28, val_fraction=0.1, test_fraction=0.1)


def ray_row(workers: int, root: str) -> dict:
    q = LOT / N_TRAIN
    cfg = TrainConfig(
        **DATA,
        model="cnn",
        optimizer="sgd",
        lr=0.05,
        lot_size=LOT,
        epochs=STEPS * q,
        noise_multiplier=SIGMA,
        target_epsilon=50.0,
        num_workers=workers,
        checkpoint_every=STEPS // 2,
        clipping="bookkeeping",
        storage_path=f"{root}/runs",
        tracking_uri=f"sqlite:///{root}/mlflow.db",
        registered_model="none",
        quiet=True,
        physical_batch_size=512,
    )
    t0 = time.perf_counter()
    out = run(cfg)
    wall = time.perf_counter() - t0
    records = [json.loads(x) for x in Path(out["spec"].journal).read_text().splitlines()]
    ts = [r["timestamp"] for r in records if r["op"] == "append"]
    rate = (len(ts) - 1) / (ts[-1] - ts[0])
    n = out["spec"].dataset_size
    return {
        "setting": f"Ray Train, {workers} worker(s) × 1 CPU",
        "steps": len(ts),
        "steps_per_s": rate,
        "examples_per_s": rate * out["sample_rate"] * n,
        "wall_s": wall,
    }


def in_process_row() -> dict:
    torch.set_num_threads(2)
    data = load_dataset(
        "generated", generated_size=DATA["generated_size"], image_size=28, val_fraction=0.1, test_fraction=0.1
    )
    x, y = data.inputs("train"), data.train.y
    n = len(y)
    torch.manual_seed(0)
    model = build_model("cnn", data.input_shape, data.num_classes)
    private = dpcore.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        F.cross_entropy,
        dataset_size=n,
        lot_size=LOT,
        epochs=STEPS * LOT / n,
        target_epsilon=50.0,
        target_delta=1e-5,
        clip_norm=1.0,
        noise_multiplier=SIGMA,
        physical_batch_size=512,
        epsilon_every=max(1, STEPS // 20),
        clipping="bookkeeping",  # ε cadence as the main job
    )
    times = []
    for lot in private.sampler:
        t0 = time.perf_counter()
        private.optimizer.accumulate(x[lot], y[lot])
        private.optimizer.step()
        times.append(time.perf_counter() - t0)
    rate = (len(times) - 1) / sum(times[1:])  # the first step also finds the budget's allowance
    return {
        "setting": "in-process, 1 worker, torch on 2 threads",
        "steps": len(times),
        "steps_per_s": rate,
        "examples_per_s": rate * private.sample_rate * n,
        "wall_s": sum(times),
    }


def main() -> int:
    import ray

    ray.init(
        num_cpus=2, include_dashboard=True, dashboard_host="127.0.0.1", logging_level=logging.ERROR, log_to_driver=False
    )
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for workers in (1, 2):
            rows.append(ray_row(workers, root))
            print(rows[-1], file=sys.stderr, flush=True)
    ray.shutdown()
    from pipelines.allocator import keep_freed_memory

    keep_freed_memory()  # as the Ray Train workers do
    rows.append(in_process_row())
    print("| setting | steps | steps/s (steady) | expected examples/s | wall s (incl. start-up) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['setting']} | {r['steps']} | {r['steps_per_s']:.2f} | {r['examples_per_s']:.0f} | {r['wall_s']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

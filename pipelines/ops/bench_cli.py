"""``dp-platform bench``: the private step against a non-private step and Opacus, side by side.

    dp-platform bench                         # all models, 2 threads, 15 interleaved rounds
    dp-platform bench --models mnist_cnn --rounds 30 --threads 1
    dp-platform bench --memory                # peak RSS, lot 128 vs 4096 at physical batch 128

Every mode runs in this process on the same model architecture, the same data and the same
thread count; rounds are interleaved (one step of each mode per round, after warm-up) so that
drifts of the machine hit all modes alike, and the median time per step is reported with the
ratios to the non-private step and to Opacus's fastest mode. Opacus (a test extra) is used if
it is installed.

Modes:
* ``non-private``: forward, backward, SGD step;
* ``ours``: dpcore's DPOptimizer with ``clipping="auto"``: book-keeping where the model is
  made of Linear/Conv2d/WSConv2d/GroupNorm/LayerNorm/Embedding layers (verified against vmap on the first step),
  else vmap; secure noise; no budget check overhead beyond the ledger's cached allowance;
* ``ours-vmap``: the same with the reference vmap per-example path;
* ``opacus-hooks``, ``opacus-ew``, ``opacus-ghost``: Opacus 1.6 with that ``grad_sample_mode``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..config.options import Parser

BENCH_MODELS = ("mnist_cnn", "resnet9", "wrn16_4", "mlp4")


def main(argv: list[str] | None = None) -> int:
    p = Parser(
        prog="dp-platform bench",
        description=__doc__.replace("``", ""),  # the module's doc, without its reST quoting
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--models",
        nargs="*",
        default=list(BENCH_MODELS),
        choices=list(BENCH_MODELS),
        help="models to time (none: skip step timing)",
    )
    p.add_argument("--rounds", type=int, default=15, help="interleaved timed rounds (after 3 warm-up rounds)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (the same for every mode)")
    p.add_argument(
        "--device",
        default="cpu",
        help="where the steps run: cpu, or cuda (timed from a synchronised start to the end of the queued work)",
    )
    p.add_argument("--memory", action="store_true", help="also measure peak RSS for lot 128 and 4096 (mnist_cnn)")
    p.add_argument("--accounting", action="store_true", help="also time σ calibration against a plain PLD bisection")
    p.add_argument("--no-opacus", action="store_true", help="skip Opacus even if installed")
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument(
        "--malloc-defaults",
        action="store_true",
        help="keep glibc's malloc defaults (by default freed memory is kept for reuse, for every mode alike)",
    )
    p.add_argument(
        "--no-native",
        action="store_true",
        help="do not use the compiled per-example convolution kernel (dpcore.native): torch's path instead",
    )
    p.add_argument("--memory-child", nargs=3, metavar=("MODEL", "LOT", "PHYSICAL"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    import torch  # after the flags are parsed: --help imports no torch

    from .. import allocator
    from .bench import accounting_rows, memory_child, memory_rows, print_tables, time_steps

    if a.no_native:
        os.environ["DP_NATIVE"] = "0"  # read when the kernel is first loaded
    if not a.malloc_defaults:
        allocator.keep_freed_memory()
    torch.set_num_threads(a.threads)
    if a.memory_child:
        print(memory_child(a.memory_child[0], int(a.memory_child[1]), int(a.memory_child[2])))
        return 0
    try:
        import opacus  # noqa: F401

        have_opacus = not a.no_opacus
    except ImportError:
        have_opacus = False
        print("Opacus is not installed (pip install -e '.[test]'); its columns are skipped.", file=sys.stderr)
    step_rows = []
    for name in a.models:
        print(f"timing {name} …", file=sys.stderr, flush=True)
        step_rows += time_steps(name, a.rounds, opacus=have_opacus, device=a.device)
    mem_rows = memory_rows("mnist_cnn", threads=a.threads) if a.memory else []
    acc_rows = accounting_rows() if a.accounting else None
    print_tables(step_rows, mem_rows, a.threads, a.rounds, acc_rows, device=a.device)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"steps": step_rows, "memory": mem_rows, "accounting": acc_rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How far each float32 path is from float64 on a model: each parameter's clipped-sum distance
to a float64 copy of the model, for book-keeping, vmap and each example's own backward.

    python docs/benchmarks/bookkeeping_precision.py resnet9 --seed 0

The model is built after ``torch.manual_seed(seed)``, as a worker builds it (``init_seed``), and
fed the step benchmark's 64 random 3×32×32 inputs. The first line is the verdict of today's
first-batch check (``dpcore.fastpath``: the formulas compared in float64). The ``ratio`` column is
book-keeping's distance over the bound of the check it replaced (2× vmap's float32 distance plus
1e-5 of the sum's scale; > 1: that check refused book-keeping there).
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F

from dpcore.clipping import clipped_sum
from dpcore.fastpath import CHECK_EXAMPLES, CheckedBookKeeping
from dpcore.grad_sample import PerSampleGradients
from pipelines.models import build_model


def one_by_one(model, x, y, clip_norm):
    """The clipped sum from each example's own backward (a batch of one), in float32."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), list(params.values()))
        clipped_sum({n: g.unsqueeze(0) for n, g in zip(params, grads)}, clip_norm, out=total)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", choices=["resnet9", "wrn16_4"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows", type=int, default=8)
    a = ap.parse_args()
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn((64, 3, 32, 32), generator=g), torch.randint(0, 10, (64,), generator=g)
    torch.manual_seed(a.seed)
    model = build_model(a.model, (3, 32, 32), 10)
    check = CheckedBookKeeping(model, F.cross_entropy, 1.0)
    fast: dict = {}
    check.clipper.clipped_sum(x, y, 1.0, fast)
    vmap, _ = clipped_sum(PerSampleGradients(model, F.cross_entropy)(x, y), 1.0)
    why = check.formulas_disagree(x[:CHECK_EXAMPLES], y[:CHECK_EXAMPLES])
    print(f"{a.model}, init seed {a.seed}: the first-batch check: {'keeps book-keeping' if why == '' else why}")
    model64 = copy.deepcopy(model).double()
    ref64, _ = clipped_sum(PerSampleGradients(model64, F.cross_entropy)(x.double(), y), 1.0)
    plain = one_by_one(model, x, y, 1.0)
    scale = max(float(v.abs().max()) for v in ref64.values())
    slack = 1e-5 * max(scale, 1.0)
    rows = []
    for k, r64 in ref64.items():
        d = {
            name: float((s[k].double() - r64).abs().max())
            for name, s in (("bk", fast), ("vmap", vmap), ("plain", plain))
        }
        rows.append((d["bk"] / (2 * d["vmap"] + slack), k, d))
    print("| parameter | book-keeping | vmap | each example's own backward | ratio to the old check's bound |")
    print("|---|---|---|---|---|")
    for ratio, k, d in sorted(rows, key=lambda r: r[0])[-a.rows :]:
        print(f"| {k} | {d['bk']:.2e} | {d['vmap']:.2e} | {d['plain']:.2e} | {ratio:.2f} |")


if __name__ == "__main__":
    main()

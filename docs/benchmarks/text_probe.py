"""Why full fine-tuning needs the model's own pooling (docs/text.md): a DP linear probe of
all-MiniLM-L6-v2's sentence vectors on SpamAssassin, pooled the two ways ``pooling`` offers.

    python docs/benchmarks/text_probe.py --corpus ~/spam --model models/all-MiniLM-L6-v2

The pretrained encoder is frozen; each text's vector is what the classifier's Linear layer
reads: with ``cls`` the [CLS] token through BERT's pretrained pooler (Hugging Face's own
sequence classifier), with ``mean`` the mean of the last layer over the text's tokens (what the
model folder's ``1_Pooling`` declares). Only the 384→2 head trains, with the platform's own
mechanism (``dpcore.DPOptimizer``: per-example clipping at C, Gaussian noise σC, division by the
expected lot) and Poisson lots at the rate q, for the steps of
``configs/spamassassin-full-eps3.yaml``: its σ, q and steps come from the platform's plan, so
each probe is (ε=3, δ=1e-5)-DP. The head starts at zero; Adam. Scores are on the validation
split (the test split is not read). The non-private row is the same probe trained to
convergence (full-batch Adam, 2,000 steps), an upper bound on what the vectors hold.

The noise and sampling are seeded here (a diagnosis, not a release): results repeat exactly.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from fashion_mnist import plan_and_data  # noqa: E402

CONFIG = ROOT / "configs" / "spamassassin-full-eps3.yaml"


@torch.no_grad()
def vectors(model, x: torch.Tensor, batch: int = 256) -> torch.Tensor:
    """What the classifier's Linear layer reads, for every text in ``x``."""
    from pipelines.text.hf import _unwrapped

    head = _unwrapped(model.model).classifier
    seen: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda _m, inputs, _out: seen.append(inputs[0].detach()))
    try:
        model.eval()
        for lo in range(0, len(x), batch):
            model(x[lo : lo + batch].long())
    finally:
        hook.remove()
    return torch.cat(seen)


def dp_probe(train, val, spec, cfg, lr: float, seed: int) -> float:
    import dpcore

    (xtr, ytr), (xva, yva) = train, val
    torch.manual_seed(0)
    head = torch.nn.Linear(xtr.shape[1], 2)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    opt = dpcore.DPOptimizer(
        torch.optim.Adam(head.parameters(), lr=lr),
        model=head,
        loss_fn=F.cross_entropy,
        noise_multiplier=spec.noise_multiplier,
        clip_norm=cfg.clip_norm,
        sample_rate=spec.sample_rate,
        dataset_size=len(ytr),
        randomness=dpcore.SeededRandomness(seed),
        ledger=dpcore.PrivacyLedger(None, cfg.target_delta),
    )
    g = torch.Generator().manual_seed(1_000 + seed)
    for _ in range(spec.steps):
        lot = torch.rand(len(ytr), generator=g) < spec.sample_rate
        if lot.any():
            opt.accumulate(xtr[lot], ytr[lot])
        opt.step()
    with torch.no_grad():
        return float((head(xva).argmax(1) == yva).float().mean())


def non_private_probe(train, val) -> float:
    (xtr, ytr), (xva, yva) = train, val
    head = torch.nn.Linear(xtr.shape[1], 2)
    opt = torch.optim.Adam(head.parameters(), lr=0.01)
    for _ in range(2000):
        opt.zero_grad()
        F.cross_entropy(head(xtr), ytr).backward()
        opt.step()
    with torch.no_grad():
        return float((head(xva).argmax(1) == yva).float().mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", default="~/spam")
    p.add_argument("--model", default="models/all-MiniLM-L6-v2")
    p.add_argument("--lrs", nargs="+", type=float, default=[0.0015, 0.005, 0.0153])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--workdir", default="/tmp/text-probe")
    a = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 2)
    warnings.simplefilter("ignore", FutureWarning)
    work = Path(a.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    where = {"data_dir": str(Path(a.corpus).expanduser().resolve()), "model": f"hf:{Path(a.model).resolve()}"}
    os.chdir(work)
    rows = []
    for pooling in ("cls", "mean"):
        cfg, spec, data = plan_and_data(CONFIG, {"init_seed": 0, "pooling": pooling, **where})
        from pipelines.models import build_run_model

        model = build_run_model(cfg, tuple(spec.input_shape), spec.num_classes)
        train = (vectors(model, data["train"][0]), data["train"][1])
        val = (vectors(model, data["val"][0]), data["val"][1])
        for lr in a.lrs:
            accs = [dp_probe(train, val, spec, cfg, lr, s) for s in a.seeds]
            rows.append((pooling, f"DP, lr {lr:g}", accs))
            print(rows[-1], flush=True)
        rows.append((pooling, "non-private", [non_private_probe(train, val)]))
    print(
        f"\nDP linear probe of the frozen encoder: σ={spec.noise_multiplier:.3f}, q={spec.sample_rate:.4f}, "
        f"{spec.steps} steps, C={cfg.clip_norm:g} (ε={cfg.target_epsilon:g}, δ={cfg.target_delta:g}); "
        f"validation accuracy (%), seeds {a.seeds}\n"
    )
    print("| pooling | probe | validation accuracy (%) |\n|---|---|---|")
    for pooling, what, accs in rows:
        print(f"| {pooling} | {what} | {' / '.join(f'{100 * x:.2f}' for x in accs)} |")


if __name__ == "__main__":
    main()

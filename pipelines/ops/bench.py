"""The step benchmark's measurements (see :mod:`.bench_cli` for what it measures and how)."""

from __future__ import annotations

import platform
import resource
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.nn.functional as F

import dpcore
from dpcore import native

from .. import allocator
from ..models import build_model, mlp

MODELS = {  # the names are bench_cli.BENCH_MODELS
    # name: (builder, input shape, batch)
    "mnist_cnn": (lambda: build_model("cnn", (1, 28, 28), 10), (1, 28, 28), 256),
    "resnet9": (lambda: build_model("resnet9", (3, 32, 32), 10), (3, 32, 32), 64),
    "wrn16_4": (lambda: build_model("wrn16_4", (3, 32, 32), 10), (3, 32, 32), 64),
    "mlp4": (lambda: mlp((1, 28, 28), 10, hidden=512, depth=4), (1, 28, 28), 256),
}


def _data(shape, batch, device="cpu"):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn((batch,) + shape, generator=g), torch.randint(0, 10, (batch,), generator=g)
    return x.to(device), y.to(device)


def timed(fn, device: torch.device) -> float:
    """Seconds for ``fn()``; on a GPU from a synchronised start to the end of its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _non_private(make, x, y, autocast: str = "none", pieces: int = 1):
    """One step: ``pieces`` forward/backward passes of (x, y), gradients summed, one update."""
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        opt.zero_grad(set_to_none=True)
        for _ in range(pieces):
            with dpcore.precision.forward_autocast(autocast, x):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
        opt.step()

    return step


def _our_optimizer(model, lot: int, physical: int, **kw) -> dpcore.DPOptimizer:
    """Our DP optimizer as the benchmarks time it: SGD, σ = 1, C = 1, q = 0.01, secure noise,
    and ε never composed (the budget check before each release still runs)."""
    return dpcore.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        model=model,
        loss_fn=F.cross_entropy,
        noise_multiplier=1.0,
        clip_norm=1.0,
        sample_rate=0.01,
        dataset_size=100 * lot,
        randomness=dpcore.SecureRandomness(),
        ledger=dpcore.PrivacyLedger(None, 1e-5, epsilon_every=10**9),
        physical_batch_size=physical,
        **kw,
    )


def _ours(make, x, y, clipping, autocast: str = "none", pieces: int = 1):
    """One step: a lot of ``pieces`` copies of (x, y), clipped in physical batches of len(x),
    then one release (one noise draw) and one update."""
    model = make()
    opt = _our_optimizer(model, pieces * x.shape[0], x.shape[0], clipping=clipping, autocast=autocast)

    def step():
        for _ in range(pieces):
            opt.accumulate(x, y)
        opt.step()

    return step, opt


def _opacus(make, x, y, mode, pieces: int = 1):
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(x, y), batch_size=x.shape[0])
    engine = PrivacyEngine(accountant="prv")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
            grad_sample_mode=mode,
            criterion=torch.nn.CrossEntropyLoss(),
        )
    if mode == "ghost":
        model, opt, criterion, _ = made
    else:
        model, opt, _ = made
        criterion = torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=True)
        for i in range(pieces):  # as Opacus's BatchMemoryManager: clip each piece, noise at the last
            criterion(model(x), y).backward()
            if pieces > 1:
                opt.signal_skip_step(do_skip=i < pieces - 1)
            opt.step()
            if i < pieces - 1:
                opt.zero_grad(set_to_none=True)  # the per-sample gradients; the clipped sum stays

    return step


def time_steps(model_name: str, rounds: int, warmup: int = 3, opacus: bool = True, device: str = "cpu") -> list[dict]:
    with warnings.catch_warnings():  # Opacus's notes (its secure RNG is off, its backward hooks): known, not ours
        warnings.filterwarnings("ignore", module="opacus")
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        return _time_steps(model_name, rounds, warmup, opacus, torch.device(device))


def _time_steps(model_name: str, rounds: int, warmup: int, opacus: bool, device: torch.device) -> list[dict]:
    build, shape, batch = MODELS[model_name]

    def make():
        return build().to(device)

    x, y = _data(shape, batch, device)
    steps: dict[str, object] = {"non-private": _non_private(make, x, y)}
    notes: dict[str, str] = {}
    step, ours_opt = _ours(make, x, y, "auto")
    steps["ours"] = step
    native_calls = native.calls
    steps["ours-vmap"] = _ours(make, x, y, "vmap")[0]
    if opacus:
        for mode in ("hooks", "ew", "ghost"):
            try:
                steps[f"opacus-{mode}"] = _opacus(make, x, y, mode)
                for _ in range(2):
                    steps[f"opacus-{mode}"]()
            except Exception as e:  # a mode that does not support this model
                steps.pop(f"opacus-{mode}", None)
                notes[f"opacus-{mode}"] = f"fails: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    times: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(warmup + rounds):
        for name, fn in steps.items():
            dt = timed(fn, device)
            if r >= warmup:
                times[name].append(dt)
    # After the first step's verification; "native conv kernel" says whether dpcore.native ran.
    notes["ours"] = f"clipping={ours_opt.clipping}"
    if ours_opt.clipping == "bookkeeping" and any(isinstance(m, torch.nn.Conv2d) for m in ours_opt.model.modules()):
        if device.type != "cpu":
            notes["ours"] += f", torch conv path ({device.type}; the native kernel is for CPUs)"
        elif native.calls > native_calls:
            notes["ours"] += ", native conv kernel"
        elif native.state().startswith("off"):
            notes["ours"] += f", native conv kernel {native.state()}"
        else:
            notes["ours"] += ", torch conv path (layer shapes outside the native kernel's)"
    med = {k: statistics.median(v) for k, v in times.items()}
    # Each round runs every mode once, one after another: the ratio within a round compares steps
    # taken moments apart, so a machine that drifts (other tenants, clock changes) moves both.
    paired = {k: [t / n for t, n in zip(v, times["non-private"])] for k, v in times.items()}
    opacus_best = min((v for k, v in med.items() if k.startswith("opacus")), default=float("nan"))
    rows = []
    for name in list(steps) + [k for k in notes if k not in steps]:
        if name not in med:
            rows.append({"model": model_name, "mode": name, "note": notes[name]})
            continue
        rows.append(
            {
                "model": model_name,
                "batch": batch,
                "device": device.type,
                "mode": name,
                "ms_per_step": med[name] * 1e3,
                "samples_per_s": batch / med[name],
                "x_non_private": med[name] / med["non-private"],
                "x_non_private_paired": _quartiles(paired[name]),
                "throughput_vs_opacus_best": opacus_best / med[name],
                "note": notes.get(name, ""),
            }
        )
    return rows


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile); one value gives it three times."""
    if len(values) < 2:
        return (values[0],) * 3
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def memory_child(model_name: str, lot: int, physical: int) -> int:
    """Peak RSS (KiB) of this process after building the model and taking 2 private steps
    with a lot of ``lot`` examples in physical batches of ``physical``."""
    make, shape, _ = MODELS[model_name]
    x, y = _data(shape, lot)
    opt = _our_optimizer(make(), lot, physical)
    for _ in range(2):
        opt.accumulate(x, y)
        opt.step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def memory_rows(model_name: str, lots=(128, 4096), physical: int = 128, threads: int = 2) -> list[dict]:
    rows = []
    for lot in lots:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "pipelines.ops.bench",
                "--memory-child",
                model_name,
                str(lot),
                str(physical),
                "--threads",
                str(threads),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        rows.append(
            {
                "model": model_name,
                "lot": lot,
                "physical_batch": physical,
                "peak_rss_mib": int(out.stdout.strip()) / 1024,
            }
        )
    base = rows[0]["peak_rss_mib"]
    for r in rows:
        r["x_smallest_lot"] = r["peak_rss_mib"] / base
    return rows


def plain_bisection_sigma(eps: float, delta: float, q: float, steps: int, rel_tol: float = 1e-3) -> float:
    """The reference: bisection on σ with dp_accounting's PLDAccountant evaluated from scratch
    at every trial (no caching, no RDP bracket), to ``rel_tol`` in σ."""
    import dp_accounting
    from dp_accounting import pld

    def epsilon(sigma: float) -> float:
        acc = pld.PLDAccountant()
        acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
        return acc.get_epsilon(delta)

    lo, hi = 0.3, 50.0
    while hi / lo > 1 + rel_tol:
        mid = (lo * hi) ** 0.5
        if epsilon(mid) > eps:
            lo = mid
        else:
            hi = mid
    return hi


def accounting_rows(eps: float = 2.0, delta: float = 1e-5, q: float = 4096 / 50000, steps: int = 915) -> list[dict]:
    """σ calibration against a plain bisection over dp_accounting's PLD, and ε after 10⁵ steps."""
    from dpcore.accountants import calibration, pld

    pld.base_pld.cache_clear()
    t0 = time.perf_counter()
    ours = calibration.calibrate_noise_multiplier(eps, delta, q, steps)
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = plain_bisection_sigma(eps, delta, q, steps)
    t_ref = time.perf_counter() - t0
    pld.base_pld.cache_clear()
    t0 = time.perf_counter()
    e_long = dpcore.epsilon([(dpcore.PrivacyEvent.dpsgd_step(ours, q), 100_000)], delta, "pld")
    t_long = time.perf_counter() - t0
    return [
        {
            "what": f"calibrate σ for ε={eps:g}, δ={delta:g}, q={q:.5g}, T={steps} (ours, PLD)",
            "value": ours,
            "seconds": t_ours,
        },
        {"what": "plain bisection over dp_accounting PLDAccountant (σ to 0.1%)", "value": ref, "seconds": t_ref},
        {"what": "ours ÷ plain bisection σ", "value": ours / ref, "seconds": float("nan")},
        {"what": "ε after 10⁵ steps at that σ (PLD, cold cache)", "value": e_long, "seconds": t_long},
    ]


def print_tables(
    step_rows: list[dict],
    mem_rows: list[dict],
    threads: int,
    rounds: int,
    acc_rows: list[dict] | None = None,
    device: str = "cpu",
) -> None:
    where = platform.processor() or platform.machine()
    if torch.device(device).type == "cuda":
        where = f"{torch.cuda.get_device_name(torch.device(device))} (host: {where})"
    print(
        f"\nPrivate step time: {rounds} interleaved rounds, median; torch {torch.__version__}, {threads} thread(s), "
        f"{where}, {allocator.describe()}, {time.strftime('%Y-%m-%d')}"
    )
    print(
        "(× non-private: the ratio of the medians. Per round: the median of each round's own ratio, "
        "with its quartiles; a round runs every mode once, moments apart.)"
    )
    print(
        "| model (batch) | mode | ms/step | samples/s | × non-private | × non-private per round (quartiles) "
        "| throughput ÷ Opacus best | note |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in step_rows:
        if "ms_per_step" not in r:
            print(f"| {r['model']} | {r['mode']} | – | – | – | – | – | {r['note']} |")
            continue
        vs_opacus = r["throughput_vs_opacus_best"]
        vs_opacus = "–" if vs_opacus != vs_opacus else f"{vs_opacus:.2f}"  # NaN: Opacus was not run
        q1, q2, q3 = r["x_non_private_paired"]
        print(
            f"| {r['model']} ({r['batch']}) | {r['mode']} | {r['ms_per_step']:.1f} | {r['samples_per_s']:.0f} | "
            f"{r['x_non_private']:.2f} | {q2:.2f} ({q1:.2f}–{q3:.2f}) | {vs_opacus} | {r['note']} |"
        )
    if acc_rows:
        print("\nAccountant speed")
        print("| what | value | seconds |")
        print("|---|---|---|")
        for r in acc_rows:
            secs = "" if r["seconds"] != r["seconds"] else f"{r['seconds']:.3f}"
            print(f"| {r['what']} | {r['value']:.5g} | {secs} |")
    if mem_rows:
        print("\nPeak RSS of a fresh process after two private steps (ours, default clipping)")
        print("| model | lot | physical batch | peak RSS (MiB) | × lot 128 |")
        print("|---|---|---|---|---|")
        for r in mem_rows:
            print(
                f"| {r['model']} | {r['lot']} | {r['physical_batch']} | {r['peak_rss_mib']:.0f} | {r['x_smallest_lot']:.2f} |"
            )


if __name__ == "__main__":  # the memory child: python -m pipelines.ops.bench --memory-child ...
    from .bench_cli import main

    sys.exit(main())

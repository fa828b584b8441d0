"""Fashion-MNIST, the real benchmark: accuracy against ε beside Opacus, throughput, memory,
start-up and scale. Every number in docs/fashion-mnist.md comes from this script.

    python docs/benchmarks/fashion_mnist.py accuracy            # ours (the configs, via the CLI) and Opacus, ε ∈ {1,2,3,8}, 3 seeds
    python docs/benchmarks/fashion_mnist.py speed               # examples/s over one epoch, time to 85 %, peak memory, ingest
    python docs/benchmarks/fashion_mnist.py startup             # launch to the first step, by phase and CPU per process
    python docs/benchmarks/fashion_mnist.py scale               # 1,000,000 generated 3×32×32 uint8 images: ingest, worker memory
    python docs/benchmarks/fashion_mnist.py report              # the tables and the plot from the saved results

Results go to docs/results/fashion-mnist.json (each command adds its part; `accuracy` resumes
where it stopped). Run from the repository root with the project's virtualenv.

Ours is the platform itself: `dp-platform train configs/fashion-mnist-eps<ε>.yaml
--init-seed <seed>`, exactly the command a user runs. Opacus 1.6 gets the same mechanism and
the same model: the same cached ScatterNet features, the same initial weights (the seed), the
same Poisson rate q, noise multiplier σ (our calibrated one), clip norm, optimizer, learning
rate and number of steps, with Opacus's GradSampleModule and DPOptimizer (hooks) and Opacus's
own Poisson sampler. Both therefore release the same (ε, δ); the ε column is our PLD ledger's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

RESULTS = ROOT / "docs" / "results" / "fashion-mnist.json"
EPSILONS = (1, 2, 3, 8)
SEEDS = (0, 1, 2)
PUBLISHED = [  # test accuracy at (ε, δ=1e-5) on Fashion-MNIST, as published
    {"source": "Tramèr & Boneh 2021, ScatterNet + linear", "epsilon": 3.0, "accuracy": 0.897},
    {"source": "Tramèr & Boneh 2021, ScatterNet + CNN", "epsilon": 3.0, "accuracy": 0.890},
    {"source": "Tramèr & Boneh 2021, end-to-end CNN (tanh)", "epsilon": 3.0, "accuracy": 0.860},
    {"source": "Papernot et al. 2021, tempered sigmoids", "epsilon": 2.93, "accuracy": 0.861},
]
THRESHOLD = 0.85  # "time to 85 % test accuracy"
CLI = [str(ROOT / ".venv" / "bin" / "dp-platform")]


def config_path(eps) -> Path:
    return ROOT / "configs" / f"fashion-mnist-eps{int(eps)}.yaml"


def machine() -> dict:
    import psutil

    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }


def load_results(path: Path = RESULTS) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def save_results(results: dict, path: Path = RESULTS) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2))
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------
# Ours, through the CLI exactly as a user runs it.
def ours_cli(config: Path, seed: int, workdir: Path, extra: list[str] = ()) -> dict:
    """Run `dp-platform train CONFIG --init-seed SEED` and read its summary."""
    cmd = CLI + ["train", str(config), "--init-seed", str(seed), "--quiet", "--registered-model", "none", *extra]
    t0 = time.time()
    child = subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = child.communicate()
    except BaseException:  # interrupted (Ctrl-C, or SIGTERM through stop_on_sigterm): no orphan run
        child.terminate()  # the CLI stops its run and its Ray cluster on SIGTERM
        child.wait()
        raise
    wall = time.time() - t0
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{stdout[-2000:]}\n{stderr[-3000:]}")
    return {**summary_row(stdout), "wall_s": wall, "command": " ".join(["dp-platform"] + cmd[1:])}


def stop_on_sigterm() -> None:
    """Turn SIGTERM (``kill``, ``pkill``) into SystemExit, so a benchmark stopped that way stops
    the training run it started instead of leaving it running."""

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def summary_row(text: str) -> dict:
    """The numbers of a `dp-platform train` summary (its standard output)."""
    run_id = re.search(r"^run ([0-9a-f]{32})", text, re.M).group(1)
    acc = re.search(r"test accuracy: ([0-9.]+).*?validation accuracy: ([0-9.]+)", text)
    f1 = re.search(r"test F1 of class 1 \(.*?\): ([0-9.]+)", text)
    eps = re.search(r"ε spent: ([0-9.]+) at δ=([0-9.e-]+)", text)
    sigma = re.search(r"σ=([0-9.]+)", text)
    steps = re.search(r"steps=(\d+)/(\d+)", text)
    return {
        "run_id": run_id,
        "test_accuracy": float(acc.group(1)),
        "val_accuracy": float(acc.group(2)),
        **({"test_f1": float(f1.group(1))} if f1 else {}),
        "epsilon": float(eps.group(1)),
        "delta": float(eps.group(2)),
        "noise_multiplier": float(sigma.group(1)),
        "steps": int(steps.group(1)),
    }


# ------------------------------------------------------------------------------------------
# Opacus with the same mechanism and model.
def plan_and_data(config: Path, overrides: dict | None = None):
    """The run's plan (σ, q, steps, the feature cache) exactly as the driver computes it, and
    the tensors the workers train on."""
    from pipelines.config import load_config
    from pipelines.data import open_split
    from pipelines.plan import plan_run

    cfg = load_config(config, {"quiet": True, **(overrides or {})})
    spec = plan_run(cfg)

    def tensors(split):
        m = open_split(spec.train_data_dir, split)
        return m.batch(torch.arange(len(m))), m.y

    return cfg, spec, {s: tensors(s) for s in ("train", "val", "test")}


def trained_module(cfg, spec, seed: int):
    from pipelines.models import build_run_model, split_public_front

    torch.manual_seed(seed)  # the workers seed with init_seed before building: the same weights
    model = build_run_model(cfg, tuple(spec.input_shape), spec.num_classes)
    return split_public_front(model)[1] if spec.features else model


@torch.no_grad()
def accuracy(module, x, y, batch: int = 4096) -> float:
    module.eval()
    correct = sum(
        (module(x[i : i + batch]).argmax(1) == y[i : i + batch]).sum().item() for i in range(0, len(y), batch)
    )
    module.train()
    return correct / len(y)


def opacus_train(
    cfg,
    spec,
    data,
    seed: int,
    eval_every: int | None = None,
    t_launch: float | None = None,
    steps: int | None = None,
    stop_at: float | None = None,
    finish=None,
    physical: int | None = None,
    mode: str = "hooks",
) -> dict:
    """Opacus's Poisson sampler, GradSampleModule (hooks) and DPOptimizer at our σ, q and step
    count. ``finish(module, ema)``, if given, returns more results from the trained module.
    ``physical``: each lot is clipped in pieces of at most that many examples and noised once,
    as Opacus's BatchMemoryManager does (skipped steps accumulate the clipped sum); None: each
    lot in one piece. ``mode``: ``hooks`` (GradSampleModule: per-sample gradients) or ``ghost``
    (Opacus's ghost clipping: per-sample norms without per-sample gradients, and a second
    backward pass for the clipped sum); the same mechanism either way."""
    from opacus import GradSampleModule
    from opacus.accountants import PRVAccountant
    from opacus.optimizers import DPOptimizer
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler

    import dpcore
    from pipelines.train.build import make_optimizer

    (xtr, ytr), (xva, yva), (xte, yte) = data["train"], data["val"], data["test"]
    n, q, sigma = len(ytr), spec.sample_rate, spec.noise_multiplier
    steps = steps or spec.steps
    module = trained_module(cfg, spec, seed)
    if mode == "ghost":
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        from opacus.optimizers import DPOptimizerFastGradientClipping
        from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

        gsm = GradSampleModuleFastGradientClipping(module, max_grad_norm=cfg.clip_norm, use_ghost_clipping=True)
        opt = DPOptimizerFastGradientClipping(
            make_optimizer(cfg, module),
            noise_multiplier=sigma,
            max_grad_norm=cfg.clip_norm,
            expected_batch_size=int(round(q * n)),
            loss_reduction="mean",
        )
        # its backward: the norms, then the clipped sum into .grad
        loss_of = DPLossFastGradientClipping(gsm, opt, torch.nn.CrossEntropyLoss(), loss_reduction="mean")
    elif mode == "hooks":
        gsm = GradSampleModule(module)
        opt = DPOptimizer(
            make_optimizer(cfg, module),  # its trainable parameters (LoRA: adapters and head)
            noise_multiplier=sigma,
            max_grad_norm=cfg.clip_norm,
            expected_batch_size=int(round(q * n)),
            loss_reduction="mean",
        )
        loss_of = F.cross_entropy
    else:
        raise ValueError(f"mode={mode!r}: 'hooks' or 'ghost'")
    ema = dpcore.ParameterEMA(module, cfg.ema_decay) if cfg.ema_decay is not None else None
    g = torch.Generator().manual_seed(10_000 + seed)
    sampler = UniformWithReplacementSampler(num_samples=n, sample_rate=q, generator=g)
    timeline, done, t0 = [], 0, time.time()
    while done < steps:
        for idx in sampler:
            if done >= steps:
                break
            idx = torch.as_tensor(idx, dtype=torch.long)
            opt.zero_grad(set_to_none=True)
            pieces = idx.split(physical) if physical and len(idx) > physical else (idx,)
            for i, part in enumerate(pieces):
                loss_of(gsm(xtr[part]), ytr[part]).backward()
                last = i == len(pieces) - 1
                opt.signal_skip_step(do_skip=not last)  # clip and accumulate; noise once, at the last piece
                opt.step()
                if not last:
                    opt.zero_grad(set_to_none=True)  # the per-sample gradients; the clipped sum stays
            if ema is not None:
                ema.update()
            done += 1
            if eval_every and (done % eval_every == 0 or done == steps):
                timeline.append(
                    {
                        "step": done,
                        "seconds": time.time() - (t_launch or t0),
                        "test_accuracy": _eval(module, ema, xte, yte),
                    }
                )
                if stop_at is not None and timeline[-1]["test_accuracy"] >= stop_at:
                    steps = done  # the time to the threshold is all that is asked
    seconds = time.time() - t0
    acc = PRVAccountant()
    acc.history = [(sigma, q, steps)]
    return {
        "test_accuracy": _eval(module, ema, xte, yte),
        "val_accuracy": _eval(module, ema, xva, yva),
        "steps": steps,
        "noise_multiplier": sigma,
        "sample_rate": q,
        "opacus_prv_epsilon": acc.get_epsilon(cfg.target_delta),
        "train_seconds": seconds,
        "timeline": timeline,
        **(finish(module, ema) if finish is not None else {}),
    }


def _eval(module, ema, x, y) -> float:
    if ema is None:
        return accuracy(module, x, y)
    import copy

    m = copy.deepcopy(module)
    m.load_state_dict(ema.averaged_state_dict())
    return accuracy(m, x, y)


# ------------------------------------------------------------------------------------------
def cmd_accuracy(a) -> None:
    torch.set_num_threads(os.cpu_count() or 2)
    results = load_results()
    rows = results.setdefault("accuracy", [])
    results["machine"] = machine()
    have = {(r["impl"], r["epsilon_target"], r["seed"]) for r in rows}
    work = Path(a.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    for eps in a.eps:
        config = config_path(eps)
        for seed in a.seeds:
            if ("ours", eps, seed) not in have:
                r = ours_cli(config, seed, work)
                rows.append({"impl": "ours", "epsilon_target": eps, "seed": seed, **r})
                save_results(results)
                print(
                    f"ours    ε={eps} seed={seed}: test {r['test_accuracy']:.4f} (val {r['val_accuracy']:.4f}), "
                    f"ε={r['epsilon']:.4f}, {r['wall_s']:.0f}s",
                    flush=True,
                )
            if ("opacus", eps, seed) not in have and not a.no_opacus:
                cwd = os.getcwd()
                os.chdir(work)  # the same storage_path (relative) as the CLI runs: the same cached features
                try:
                    cfg, spec, data = plan_and_data(config, {"init_seed": seed})
                    r = opacus_train(cfg, spec, data, seed)
                finally:
                    os.chdir(cwd)
                rows.append({"impl": "opacus", "epsilon_target": eps, "seed": seed, "epsilon": None, **r})
                save_results(results)
                print(
                    f"opacus  ε={eps} seed={seed}: test {r['test_accuracy']:.4f} (val {r['val_accuracy']:.4f}), {r['train_seconds']:.0f}s",
                    flush=True,
                )
    cmd_report(a)


# ------------------------------------------------------------------------------------------
def _journal_rate(spec) -> tuple[float, int]:
    recs = [json.loads(x) for x in Path(spec.journal).read_text().splitlines()]
    ts = [r["timestamp"] for r in recs if r.get("op") == "append" and r["step"] > 0]
    return (len(ts) - 1) / (ts[-1] - ts[0]), len(ts)


def platform_row(config: Path, label: str, workdir: Path, overrides: dict) -> dict:
    """One epoch of the main job; steady-state rate from the ledger journal's per-step times."""
    from pipelines.config import load_config
    from pipelines.train import run

    cfg = load_config(config, {"quiet": True, "registered_model": "none", "log_model": False, **overrides})
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        t0 = time.time()
        out = run(cfg)
        wall = time.time() - t0
    finally:
        os.chdir(cwd)
    rate, steps = _journal_rate(out["spec"])
    mem = [p.get("memory", {}) for p in _placement(out["spec"])]
    return {
        "setting": label,
        "steps": steps,
        "examples_per_s": rate * out["sample_rate"] * out["train_examples"],
        "wall_s": wall,
        "peak_rss_mib": max((m.get("peak_rss_mib", 0) for m in mem), default=None),
        "peak_rss_anon_mib": max((m.get("peak_rss_anon_mib", 0) for m in mem), default=None),
        "rss_file_mib": max((m.get("rss_file_mib", 0) for m in mem), default=None),
        "test_accuracy": out["test_accuracy"],
    }


def _placement(spec):
    from pipelines.train.placement import read_placement

    return read_placement(spec)


def speed_child(mode: str, config: Path, workdir: Path) -> dict:
    """One epoch of lots in this process (2 torch threads): non-private, Opacus or dpcore."""
    import dpcore
    from pipelines.allocator import keep_freed_memory
    from pipelines.train.build import make_optimizer
    from pipelines.train.placement import memory_status

    keep_freed_memory()  # as the workers do
    torch.set_num_threads(2)
    os.chdir(workdir)
    cfg, spec, data = plan_and_data(config)
    (xtr, ytr) = data["train"]
    n, q = len(ytr), spec.sample_rate
    epoch = int(round(1 / q))
    module = trained_module(cfg, spec, 0)
    g = torch.Generator().manual_seed(0)
    lots = [torch.nonzero(torch.rand(n, generator=g) < q).flatten() for _ in range(epoch + 1)]
    if mode == "non-private":
        opt = make_optimizer(cfg, module)

        def step(idx):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(module(xtr[idx]), ytr[idx]).backward()
            opt.step()
    elif mode == "opacus":
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        gsm = GradSampleModule(module)
        opt = DPOptimizer(
            make_optimizer(cfg, module),
            noise_multiplier=spec.noise_multiplier,
            max_grad_norm=cfg.clip_norm,
            expected_batch_size=int(round(q * n)),
        )

        def step(idx):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(gsm(xtr[idx]), ytr[idx]).backward()
            opt.step()
    else:
        ledger = dpcore.PrivacyLedger(
            cfg.target_epsilon, cfg.target_delta, cfg.accountant, epsilon_every=spec.epsilon_every
        )
        ledger.prime_allowance(
            dpcore.PrivacyEvent.dpsgd_step(spec.noise_multiplier, q), [], spec.max_releases
        )  # as the workers do
        private = dpcore.build_private(
            module,
            make_optimizer(cfg, module),
            F.cross_entropy,
            noise_multiplier=spec.noise_multiplier,
            sample_rate=q,
            steps=spec.steps,
            dataset_size=n,
            target_epsilon=cfg.target_epsilon,
            target_delta=cfg.target_delta,
            clip_norm=cfg.clip_norm,
            accountant=cfg.accountant,
            randomness=dpcore.make_randomness(None),
            ledger=ledger,
            shard=torch.arange(n),
            physical_batch_size=cfg.physical_batch_size,
            clipping=cfg.clipping,
        )

        def step(idx):
            private.optimizer.accumulate(xtr[idx], ytr[idx])
            private.optimizer.step()

    step(lots[0])  # warm-up (and dpcore's first-batch check): not timed
    t0 = time.perf_counter()
    examples = 0
    for idx in lots[1:]:
        step(idx)
        examples += len(idx)
    dt = time.perf_counter() - t0
    mem = memory_status()
    return {
        "setting": {
            "non-private": "non-private (in-process, 2 threads)",
            "opacus": "Opacus 1.6 hooks (in-process, 2 threads)",
            "dpcore": "dpcore in-process (2 threads)",
        }[mode],
        "steps": epoch,
        "examples_per_s": examples / dt,
        "wall_s": dt,
        "peak_rss_mib": mem.get("peak_rss_mib"),
        "peak_rss_anon_mib": None,
        "rss_file_mib": mem.get("rss_file_mib"),
    }


def time_to_threshold_ours(config: Path, workdir: Path, every: int, extra: list[str]) -> dict:
    """Launch `dp-platform train` and follow its MLflow test-accuracy history: seconds from the
    launch to the first evaluation at ≥ 85 %."""
    import mlflow

    uri = f"sqlite:///{workdir}/mlflow.db"
    t0 = time.time()
    r = ours_cli(config, 0, workdir, ["--checkpoint-every", str(every), "--tracking-uri", uri, *extra])
    client = mlflow.MlflowClient(uri)
    hist = sorted(client.get_metric_history(r["run_id"], "test_accuracy"), key=lambda m: m.step)
    first = next((m for m in hist if m.value >= THRESHOLD), None)
    label = "ours: dp-platform train " + (" ".join(extra) if extra else "(2 Ray workers)")
    return {
        "impl": label,
        "seconds_to_threshold": None if first is None else first.timestamp / 1000 - t0,
        "at_step": None if first is None else first.step,
        "total_wall_s": r["wall_s"],
        "final_test_accuracy": r["test_accuracy"],
    }


def cmd_opacus_timeline(a) -> None:
    """(child) Opacus from a fresh process: the time from this process's launch to 85 %."""
    t_launch = float(a.t_launch)
    torch.set_num_threads(2)
    os.chdir(a.workdir)
    cfg, spec, data = plan_and_data(Path(a.config))
    r = opacus_train(cfg, spec, data, 0, eval_every=a.every, t_launch=t_launch, stop_at=THRESHOLD)
    first = next((p for p in r["timeline"] if p["test_accuracy"] >= THRESHOLD), None)
    print(
        json.dumps(
            {
                "impl": "Opacus 1.6 (same model and mechanism, a script; stopped at 85 %)",
                "seconds_to_threshold": None if first is None else first["seconds"],
                "at_step": None if first is None else first["step"],
                "total_wall_s": time.time() - t_launch,
                "final_test_accuracy": r["test_accuracy"],
            }
        )
    )


def ingest_row(workdir: Path) -> dict:
    """Ingest of the real files (IDX .gz -> Arrow shards) and the ScatterNet feature cache, from cold."""
    from pipelines.config import TrainConfig
    from pipelines.models import build_run_model
    from pipelines.plan import prepare_data, prepare_features

    storage = workdir / "ingest-probe"
    shutil.rmtree(storage, ignore_errors=True)  # from cold: nothing ingested, no features
    cfg = TrainConfig(
        dataset="fashion-mnist", model="scatter_linear", num_workers=2, storage_path=str(storage), quiet=True
    )
    t0 = time.time()
    data_dir, manifest = prepare_data(cfg)
    t1 = time.time()
    model = build_run_model(cfg, tuple(manifest["input_shape"]), manifest["num_classes"])
    feat_dir, _ = prepare_features(cfg, data_dir, manifest, model)
    t2 = time.time()
    t3 = time.time()
    prepare_data(cfg)  # again: the cached ingest, verified by its stamp
    t4 = time.time()
    from pipelines.data import verify

    verify(data_dir, full=True)
    t5 = time.time()
    size = lambda d: sum(f.stat().st_size for f in Path(d).glob("*.arrow"))  # noqa: E731
    raw = sum(f.stat().st_size for f in Path("/usr/share/datasets/fashion-mnist").glob("*"))
    return {
        "raw_gz_bytes": raw,
        "ingest_s": t1 - t0,
        "ingested_bytes": size(data_dir),
        "dtype": manifest["dtype"],
        "features_s": t2 - t1,
        "features_bytes": size(feat_dir),
        "reuse_verify_s": t4 - t3,
        "full_verify_s": t5 - t4,
    }


def cmd_speed(a) -> None:
    results = load_results()
    results["machine"] = machine()
    work = Path(a.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    config = config_path(3)
    speed = {"config": str(config.relative_to(ROOT)), "rows": []}
    # Warm the caches (ingest, features) once so that every row measures training only.
    subprocess.run([sys.executable, __file__, "warm", "--workdir", str(work)], check=True)
    for mode in ("non-private", "opacus", "dpcore"):
        out = subprocess.run(
            [sys.executable, __file__, "speed-child", mode, "--workdir", str(work)],
            capture_output=True,
            text=True,
            check=True,
        )
        speed["rows"].append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(speed["rows"][-1], flush=True)
    import ray

    # The main job over its whole run (all epochs, with its default cadence of reports and ε),
    # rate from the ledger journal's first to last step: start-up excluded, the rest included.
    for label, over in (
        ("dp-platform train, in-process (2 threads)", {"in_process": True, "num_workers": 1}),
        ("dp-platform train, 1 Ray worker × 1 CPU", {"num_workers": 1}),
        ("dp-platform train, 2 Ray workers × 1 CPU", {"num_workers": 2}),
    ):
        speed["rows"].append(platform_row(config, label, work, over))
        print(speed["rows"][-1], flush=True)
        if ray.is_initialized():
            ray.shutdown()
    speed["time_to_85"] = [
        time_to_threshold_ours(config, work, a.every, []),
        time_to_threshold_ours(config, work, a.every, ["--in-process", "--num-workers", "1"]),
    ]
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "opacus-timeline",
            "--config",
            str(config),
            "--workdir",
            str(work),
            "--every",
            str(a.every),
            "--t-launch",
            str(time.time()),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    speed["time_to_85"].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(speed["time_to_85"], flush=True)
    speed["ingest"] = ingest_row(work)
    print(speed["ingest"], flush=True)
    results["speed"] = speed
    save_results(results)
    cmd_report(a)


def cmd_warm(a) -> None:
    os.chdir(a.workdir)
    plan_and_data(config_path(3))


CPU_GROUPS = ("driver", "Ray Train worker", "Ray Train sync actor", "Ray's own processes")


def _process_table() -> dict[int, tuple[int, str, float]]:
    """pid -> (parent pid, name, CPU seconds so far: user + system), from Linux's /proc."""
    hz = os.sysconf("SC_CLK_TCK")
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()  # from field 3 (state) on
        table[int(entry)] = (int(fields[1]), name, (int(fields[11]) + int(fields[12])) / hz)
    return table


def _cpu_group(pid: int, root: int, name: str) -> str:
    if pid == root:
        return "driver"
    if name.startswith("ray::RayTrainWo"):
        return "Ray Train worker"
    if name.startswith("ray::Synchroniz"):
        return "Ray Train sync actor"
    return "Ray's own processes"  # GCS, raylet, dashboard and its agents, monitors


def cpu_until_first_step(proc: subprocess.Popen, trace: Path) -> dict:
    """CPU seconds that the run's processes (the driver and every process under it: Ray's
    cluster, its workers) used from launch until the trace records the first step, by group,
    sampled every 0.1 s from /proc (a process that ends between samples loses its last 0.1 s).
    Waits for the run to end. Empty where /proc is not there."""
    if not Path("/proc/self/stat").exists():
        proc.wait()
        return {}
    seen: dict[int, tuple[str, float]] = {}
    while proc.poll() is None:
        table = _process_table()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        below, frontier = set(), [proc.pid]
        while frontier:
            pid = frontier.pop()
            below.add(pid)
            frontier.extend(children.get(pid, ()))
        for pid in below & table.keys():
            _, name, cpu = table[pid]
            seen[pid] = (_cpu_group(pid, proc.pid, name), max(cpu, seen.get(pid, ("", 0.0))[1]))
        if trace.exists() and "first step done" in trace.read_text():
            break
        time.sleep(0.1)
    proc.wait()
    by_group = {group: 0.0 for group in CPU_GROUPS}
    for group, cpu in seen.values():
        by_group[group] += cpu
    by_group["total"] = sum(by_group.values())
    by_group["cores"] = os.cpu_count()
    return by_group


def cmd_startup(a) -> None:
    """Launch to the first training step, by phase (DP_TRACE), for one Ray worker (Ray Train's
    controller in the driver, as the platform runs it on a cluster of its own, and as Ray's own
    controller actor, for comparison) and in-process, ``--repeats`` rounds of the three in turn
    (so that a machine's drift falls on each alike), with the ingested data and the ScatterNet
    features already cached (by ``speed`` or ``accuracy``, which share the work folder): the
    start-up of every run after a dataset's first."""
    results = load_results()
    work = Path(a.workdir).resolve()
    rows = []
    settings = (
        ("1 Ray worker", ["--num-workers", "1"], {}),
        ("1 Ray worker, Ray's controller actor", ["--num-workers", "1"], {"DP_TRAIN_CONTROLLER_ACTOR": "1"}),
        ("in-process", ["--num-workers", "1", "--in-process"], {}),
    )
    for attempt in range(a.repeats):
        for label, extra, env_extra in settings:
            trace = work / f"trace-{len(rows)}.txt"
            trace.unlink(missing_ok=True)
            env = {**os.environ, "DP_TRACE": str(trace), **env_extra}
            cmd = CLI + [
                "train",
                str(config_path(3)),
                "--epochs",
                "1",
                "--quiet",
                "--registered-model",
                "none",
                "--no-log-model",
                *extra,
            ]
            work.mkdir(parents=True, exist_ok=True)
            t0 = time.time()
            stderr = work / f"stderr-{len(rows)}.txt"
            with (
                stderr.open("wb") as err,
                subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=err) as proc,
            ):
                cpu = cpu_until_first_step(proc, trace)
            if proc.returncode != 0:
                raise SystemExit(f"{label}: the run failed ({proc.returncode}): {stderr.read_text()[-2000:]}")
            phases = {}
            for line in trace.read_text().splitlines():
                t, _, label_ = line.split(" ", 2)
                phases.setdefault(label_, float(t) - t0)
            rows.append(
                {
                    "setting": label,
                    "attempt": attempt,
                    "phases": phases,
                    "first_step_s": phases.get("first step done"),
                    "cpu_s": cpu,
                }
            )
            print(
                rows[-1]["setting"],
                attempt,
                f"{rows[-1]['first_step_s']:.1f}s",
                f"CPU {cpu.get('total', float('nan')):.1f}s" if cpu else "",
                flush=True,
            )
    results["startup"] = {"config": str(config_path(3).relative_to(ROOT)), "machine": machine(), "rows": rows}
    save_results(results)
    cmd_report(a)


def cmd_scale(a) -> None:
    """1,000,000 generated 3×32×32 uint8 images: ingest time and size, then a few private steps
    of one Ray worker on them (the shards evicted from the page cache first), with its peak
    memory (total, anonymous and file-backed)."""
    results = load_results()
    work = Path(a.workdir).resolve()
    data = work / "generated-1m"
    t0 = time.time()
    subprocess.run(
        CLI
        + [
            "ingest",
            "generated",
            str(data),
            "--generated-size",
            str(a.size),
            "--image-size",
            "32",
            "--generated-channels",
            "3",
            "--num-shards",
            "2",
            "--val-fraction",
            "0.005",
            "--test-fraction",
            "0.005",
        ],
        check=True,
    )
    ingest_s = time.time() - t0
    size = sum(f.stat().st_size for f in data.glob("*.arrow"))
    # The ingest just wrote every page: drop them from the page cache, so that the worker
    # starts as it would on a dataset that does not fit in memory (its faults read from disk).
    for f in data.glob("*.arrow"):
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    from pipelines.config import TrainConfig
    from pipelines.train import run

    n = json.loads((data / "manifest.json").read_text())
    n_train = sum(e["rows"] for e in n["files"] if e["split"] == "train")
    lot = 1024
    cfg = TrainConfig(
        dataset="generated",
        data_dir=str(data),
        model="cnn",
        optimizer="sgd",
        lr=0.05,
        lot_size=lot,
        epochs=a.steps * lot / n_train,
        noise_multiplier=1.0,
        target_epsilon=50.0,
        num_workers=1,
        quiet=True,
        storage_path=str(work / "runs"),
        tracking_uri=f"sqlite:///{work}/mlflow.db",
        registered_model="none",
        log_model=False,
    )
    out = run(cfg)
    mem = _placement(out["spec"])[0].get("memory", {})
    results["scale"] = {
        "images": a.size,
        "shape": [3, 32, 32],
        "dtype": "uint8",
        "ingest_s": ingest_s,
        "ingested_bytes": size,
        "steps": out["steps"],
        "lot_size": lot,
        "worker_memory_mib": mem,
        "train_examples": n_train,
    }
    save_results(results)
    cmd_report(a)


# ------------------------------------------------------------------------------------------
def cmd_report(a=None) -> None:
    import statistics

    r = load_results()
    if r.get("machine"):
        m = r["machine"]
        print(
            f"machine: {m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB, Python {m['python']}, torch {m['torch']}, {m['date']}"
        )
    acc = r.get("accuracy", [])
    if acc:
        print(
            "\n| ε (δ=1e-5) | ours: test accuracy (mean ± std, 3 seeds) | Opacus 1.6, same model and mechanism | σ | "
            "steps | ε spent (ours, PLD) |"
        )
        print("|---|---|---|---|---|---|")
        for eps in sorted({x["epsilon_target"] for x in acc}):
            cell = {}
            for impl in ("ours", "opacus"):
                v = [x["test_accuracy"] for x in acc if x["impl"] == impl and x["epsilon_target"] == eps]
                cell[impl] = (
                    "–"
                    if not v
                    else (
                        f"{100 * statistics.mean(v):.2f} ± {100 * statistics.stdev(v):.2f} % (n={len(v)})"
                        if len(v) > 1
                        else f"{100 * v[0]:.2f} % (n=1)"
                    )
                )
            ours = [x for x in acc if x["impl"] == "ours" and x["epsilon_target"] == eps]
            sig = f"{ours[0]['noise_multiplier']:.3f}" if ours else "–"
            steps = ours[0]["steps"] if ours else "–"
            spent = f"{max(x['epsilon'] for x in ours):.4f}" if ours else "–"
            print(f"| {eps} | {cell['ours']} | {cell['opacus']} | {sig} | {steps} | {spent} |")
        plot(r)
    sp = r.get("speed")
    if sp:
        print(
            f"\nthroughput ({sp['config']}): the in-script rows over one epoch, the dp-platform rows over the whole run:"
        )
        print("| setting | examples/s | peak RSS MiB | anonymous (heap) MiB | file-backed (mapped) MiB |")
        print("|---|---|---|---|---|")
        for row in sp["rows"]:
            f = lambda v: "–" if v is None else f"{v:.0f}"  # noqa: E731
            print(
                f"| {row['setting']} | {row['examples_per_s']:.0f} | {f(row.get('peak_rss_mib'))} | "
                f"{f(row.get('peak_rss_anon_mib'))} | {f(row.get('rss_file_mib'))} |"
            )
        print(
            "\n| implementation | seconds from launch to 85 % test accuracy | at step | final test accuracy | total wall s |"
        )
        print("|---|---|---|---|---|")
        for row in sp.get("time_to_85", []):
            print(
                f"| {row['impl']} | {row['seconds_to_threshold']:.1f} | {row['at_step']} | "
                f"{row['final_test_accuracy']:.4f} | {row['total_wall_s']:.1f} |"
            )
        ing = sp.get("ingest")
        if ing:
            print(
                f"\ningest: {ing['raw_gz_bytes'] / 2**20:.1f} MiB of IDX .gz -> {ing['ingested_bytes'] / 2**20:.1f} "
                f"MiB of {ing['dtype']} Arrow shards in "
                f"{ing['ingest_s']:.1f} s; ScatterNet features {ing['features_bytes'] / 2**20:.0f} MiB in "
                f"{ing['features_s']:.1f} s (once); "
                f"re-use {ing['reuse_verify_s'] * 1000:.0f} ms; full re-verification {ing['full_verify_s']:.2f} s"
            )
    st = r.get("startup")
    if st:
        m = st.get("machine")
        if m:
            print(f"\nstart-up, {m['date']}, {m['cores']} cores ({m['cpu']}):")
        print("\n| setting | attempt | launch → first step s | phases (s since launch) |")
        print("|---|---|---|---|")
        for row in sorted(st["rows"], key=lambda row: row["setting"]):
            ph = ", ".join(f"{k} {v:.1f}" for k, v in row["phases"].items())
            print(f"| {row['setting']} | {row['attempt']} | {row['first_step_s']:.1f} | {ph} |")
        cpu_rows = [row for row in st["rows"] if row.get("cpu_s")]
        if cpu_rows:
            print("\nCPU seconds from launch to the first step, by process (sampled from /proc every 0.1 s):\n")
            print(f"| setting | attempt | {' | '.join(CPU_GROUPS)} | total | total / cores | launch → first step s |")
            print("|---|---|" + "---|" * (len(CPU_GROUPS) + 3))
            for row in sorted(cpu_rows, key=lambda row: row["setting"]):
                c = row["cpu_s"]
                cells = " | ".join(f"{c[g]:.1f}" for g in CPU_GROUPS)
                print(
                    f"| {row['setting']} | {row['attempt']} | {cells} | {c['total']:.1f} | "
                    f"{c['total'] / c['cores']:.1f} | {row['first_step_s']:.1f} |"
                )
    sc = r.get("scale")
    if sc:
        m = sc["worker_memory_mib"]
        print(
            f"\nscale: {sc['images']:,} generated {'×'.join(map(str, sc['shape']))} {sc['dtype']} images -> "
            f"{sc['ingested_bytes'] / 2**30:.2f} GiB "
            f"in {sc['ingest_s']:.0f} s; one Ray worker, {sc['steps']} steps of lot {sc['lot_size']}: peak RSS {m.get('peak_rss_mib')} MiB "
            f"(anonymous {m.get('peak_rss_anon_mib')} MiB; file-backed at the end {m.get('rss_file_mib')} MiB)"
        )


def plot(r: dict) -> None:
    import statistics

    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc = r["accuracy"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for impl, label, marker in (
        ("ours", "ours (ScatterNet + linear, dp-platform)", "o"),
        ("opacus", "Opacus 1.6, same model and mechanism", "s"),
    ):
        eps = sorted({x["epsilon_target"] for x in acc if x["impl"] == impl})
        if not eps:
            continue
        means = [
            statistics.mean(x["test_accuracy"] for x in acc if x["impl"] == impl and x["epsilon_target"] == e)
            for e in eps
        ]
        sds = [
            statistics.stdev([x["test_accuracy"] for x in acc if x["impl"] == impl and x["epsilon_target"] == e])
            if sum(1 for x in acc if x["impl"] == impl and x["epsilon_target"] == e) > 1
            else 0
            for e in eps
        ]
        ax.errorbar(eps, [100 * m for m in means], yerr=[100 * s for s in sds], marker=marker, capsize=3, label=label)
    for p in PUBLISHED:
        ax.scatter([p["epsilon"]], [100 * p["accuracy"]], marker="x", color="gray")
        ax.annotate(
            p["source"],
            (p["epsilon"], 100 * p["accuracy"]),
            fontsize=6,
            textcoords="offset points",
            color="gray",
            xytext=(-6, 6) if p["epsilon"] != 3.0 else (6, -3),
            ha="right" if p["epsilon"] != 3.0 else "left",
        )
    ax.set_xscale("log")
    ax.set_xticks(EPSILONS)
    ax.set_xticklabels([str(e) for e in EPSILONS])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("ε (δ = 1e-5)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Fashion-MNIST under DP: accuracy against ε")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    out = ROOT / "docs" / "figures" / "fashion_mnist_accuracy_vs_epsilon.png"
    fig.savefig(out, dpi=120)
    print(f"\nplot: {out.relative_to(ROOT)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    acc = sub.add_parser("accuracy")
    acc.add_argument("--eps", type=float, nargs="*", default=list(EPSILONS))
    acc.add_argument("--seeds", type=int, nargs="*", default=list(SEEDS))
    acc.add_argument("--no-opacus", action="store_true")
    sp = sub.add_parser("speed")
    sp.add_argument("--every", type=int, default=10, help="steps between test evaluations for the time to 85 %")
    st = sub.add_parser("startup")
    st.add_argument("--repeats", type=int, default=3)
    sc = sub.add_parser("scale")
    sc.add_argument("--size", type=int, default=1_000_000)
    sc.add_argument("--steps", type=int, default=20)
    sub.add_parser("report")
    ch = sub.add_parser("speed-child")
    ch.add_argument("mode", choices=("non-private", "opacus", "dpcore"))
    sub.add_parser("warm")
    ot = sub.add_parser("opacus-timeline")
    ot.add_argument("--config", required=True)
    ot.add_argument("--every", type=int, default=4)
    ot.add_argument("--t-launch", required=True)
    for s in (acc, sp, st, sc, ch, ot, sub.choices["warm"]):
        s.add_argument(
            "--workdir",
            default=str(Path(tempfile.gettempdir()) / "fmnist-bench"),
            help="where runs, caches and mlflow.db go",
        )
    a = p.parse_args(argv)
    stop_on_sigterm()
    if a.cmd == "speed-child":
        print(json.dumps(speed_child(a.mode, config_path(3), Path(a.workdir))))
        return 0
    {
        "accuracy": cmd_accuracy,
        "speed": cmd_speed,
        "startup": cmd_startup,
        "scale": cmd_scale,
        "report": cmd_report,
        "warm": cmd_warm,
        "opacus-timeline": cmd_opacus_timeline,
    }[a.cmd](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())

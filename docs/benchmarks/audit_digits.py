"""The white-box one-run audit (Steinke, Nasr and Jagielski 2023) of the main job on digits at
ε ∈ {1, 2, 8}: ε claimed (the ledger) against ε_lb, and what the audit costs.

Each ε is trained twice with the same seed, with and without 1,000 gradient canaries (each in
the data with probability ½). Guesses: r = 200 (the default: the 100 highest scores "in", the
100 lowest "out") and r = 1,000 (every canary guessed); both were fixed before any run, and
each bound holds at 95 % confidence on its own. Cost: the wall time per training step, from
the ledger's timestamps (first to last release), with and without canaries.

    .venv/bin/python docs/benchmarks/audit_digits.py                # about 5 min on 2 cores
"""

from __future__ import annotations

import logging
import os
import platform
import tempfile
import time
import warnings

import torch

import dpcore
from pipelines.config import TrainConfig
from pipelines.train import run


def per_step_seconds(ledger) -> float:
    ts = [e.timestamp for e in ledger.entries if e.step > 0]
    return (ts[-1] - ts[0]) / (len(ts) - 1)


def main() -> None:
    import ray

    warnings.simplefilter("ignore", dpcore.SeededRandomnessWarning)
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for eps in (1.0, 2.0, 8.0):
            base = dict(
                target_epsilon=eps,
                seed=11,
                quiet=True,
                registered_model="none",
                log_model=False,
                storage_path=f"{tmp}/runs",
                tracking_uri=f"sqlite:///{tmp}/mlflow.db",
            )
            plain = run(TrainConfig(**base))
            audited = run(TrainConfig(**base, audit_canaries=1000, audit_guesses=200))
            a = audited["audit"]
            all_guessed = dpcore.audit.one_run_audit(a["scores"].numpy(), a["membership"].numpy(), 500, 500, delta=1e-5)
            rows.append((eps, audited, a, all_guessed, plain))
            print(
                f"ε={eps:g}: ε_lb {a['epsilon_lower_bound']:.3f} (r=200), {all_guessed.epsilon_lower_bound:.3f} (r=1000)",
                flush=True,
            )
    ray.shutdown()
    print(
        "\nMain job on digits (2 Ray workers, MLP, lot 512, 60 epochs, 147 steps), δ=1e-5, seed 11; 1,000 gradient canaries;"
    )
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {platform.machine()}, {time.strftime('%Y-%m-%d')}\n")
    print(
        "| ε (ledger) | canaries in | ε_lb, r=200 (correct) | ε_lb, r=1000 (correct) | test acc. with / without "
        "canaries | s per step with / without | cost |"
    )
    print("|---|---|---|---|---|---|---|")
    for _eps, audited, a, full, plain in rows:
        with_s, without_s = per_step_seconds(audited["ledger"]), per_step_seconds(plain["ledger"])
        print(
            f"| {audited['epsilon']:.3f} | {a['included']} | {a['epsilon_lower_bound']:.3f} ({a['correct']}/200) | "
            f"{full.epsilon_lower_bound:.3f} ({full.correct}/1000) | {audited['test_accuracy']:.3f} / {plain['test_accuracy']:.3f} | "
            f"{with_s:.4f} / {without_s:.4f} | {100 * (with_s / without_s - 1):+.1f} % |"
        )


if __name__ == "__main__":
    main()

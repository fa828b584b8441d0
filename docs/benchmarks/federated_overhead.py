"""Rounds per second of DP-FedAvg with K = 10,000 clients and m = 100 expected per round, and
the per-round overhead of Ray actors over the same loop in one process.

Every executor runs the same code (pipelines.federated.clients.ClientRunner) with one torch thread per
client process: ``local`` runs the round's shares one after the other in the driver; ``ray``
sends them to 1 or 2 actors. The time per round covers sampling, local training, clipping,
the transfers, the noise and the server step; evaluation and ε reports are outside it.

    .venv/bin/python docs/benchmarks/federated_overhead.py --rounds 60
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import tempfile
import time

import torch

from pipelines.federated import FederatedConfig, run_federated


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--clients", type=int, default=10_000)
    p.add_argument("--per-round", type=int, default=100)
    a = p.parse_args()
    import ray

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level=logging.WARNING)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, executor, actors in (
            ("in-process loop", "local", 1),
            ("Ray, 1 actor", "ray", 1),
            ("Ray, 2 actors", "ray", 2),
            ("in-process loop (2 shares)", "local", 2),
        ):
            cfg = FederatedConfig(
                dataset="generated",
                generated_size=round(60_000 / 0.7),
                num_clients=a.clients,
                clients_per_round=float(a.per_round),
                noise_multiplier=1.0,
                rounds=a.rounds,
                target_epsilon=8.0,
                target_delta=1e-6,
                executor=executor,
                num_actors=actors,
                eval_every=a.rounds,
                log_model=False,
                quiet=True,
                seed=0,
                tracking_uri=f"sqlite:///{tmp}/mlflow.db",
                storage_path=f"{tmp}/runs",
            )
            out = run_federated(cfg)
            secs = out["round_seconds"][5:]  # the first rounds warm up
            results[name] = (statistics.median(secs), out)
            print(f"{name}: {1 / statistics.median(secs):.2f} rounds/s", flush=True)
    ray.shutdown()
    base = results["in-process loop"][0]
    print(
        f"\nK={a.clients:,}, m={a.per_round} expected clients per round (Poisson), {a.rounds} rounds (median of rounds 6–{a.rounds}); "
        f"generated 8×8 data, 6 examples per client (non-IID), MLP, E=1, B=10;"
    )
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {platform.machine()}, {time.strftime('%Y-%m-%d')}\n")
    print("| executor | s per round (median) | rounds/s | vs in-process loop |")
    print("|---|---|---|---|")
    for name, (sec, _) in results.items():
        print(f"| {name} | {sec:.4f} | {1 / sec:.2f} | {sec / base:.2f}× ({(sec - base) * 1000:+.1f} ms) |")


if __name__ == "__main__":
    main()

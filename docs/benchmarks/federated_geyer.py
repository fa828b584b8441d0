"""Geyer et al. (2017), Table 1's shape: client-level DP-FedAvg with K = 100, 1,000 and 10,000
clients at ε = 8 and δ = 1e-3, 1e-5 and 1e-6, stopped by their rule (stop before δ at ε=8
would pass Q). Prints accuracy (ACC), rounds (CR), communication (CC: client uploads, and
bytes both ways), wall time and the ε and δ reached.

Data: the 'generated' dataset (class-conditional Gaussian 8×8 images, 10 classes, public
seed) with 60,000 training examples, split non-IID as in the paper (sorted by label, 2 shards
per client): 600, 60 and 6 examples per client. It is an easy task (a linear model nearly
separates it), so the table shows the shape: more clients per round, less noise per
client, at the same ε. A last row runs K = 100 on the real digits data (1,258 training
images, about 12.6 per client). Model: the MLP (one hidden layer of 128).

    .venv/bin/python docs/benchmarks/federated_geyer.py            # all three (about 10 min here)
    .venv/bin/python docs/benchmarks/federated_geyer.py --only 100
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time

import torch

from pipelines.federated import FederatedConfig, run_federated

# (dataset, K, δ=Q, expected clients per round m, noise multiplier z)
SETTINGS = [
    ("generated", 100, 1e-3, 30, 1.0),
    ("generated", 1_000, 1e-5, 100, 1.0),
    ("generated", 10_000, 1e-6, 500, 1.0),
    ("digits", 100, 1e-3, 30, 1.0),
]
N_TRAIN = 60_000
GENERATED = round(N_TRAIN / 0.7)  # val 0.1 and test 0.2 are held out on the server


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", type=int, nargs="*", help="run only these K")
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--seed", type=int, default=None, help="seeded randomness (default: secure)")
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dataset, K, delta, m, z in SETTINGS:
            if a.only and K not in a.only:
                continue
            cfg = FederatedConfig(
                dataset=dataset,
                generated_size=GENERATED,
                num_clients=K,
                split="noniid",
                shards_per_client=2,
                clients_per_round=float(m),
                noise_multiplier=z,
                rounds=0,
                stopping="delta",
                target_epsilon=8.0,
                target_delta=delta,
                local_epochs=1,
                local_batch_size=10,
                local_lr=0.1,
                server_lr=1.0,
                clip_norm=1.0,
                num_actors=a.actors,
                seed=a.seed,
                log_model=False,
                quiet=True,
                tracking_uri=f"sqlite:///{tmp}/mlflow.db",
                storage_path=f"{tmp}/runs",
            )
            t = time.monotonic()
            out = run_federated(cfg)
            wall = time.monotonic() - t
            rows.append((dataset, K, m, z, out, wall))
            print(f"{dataset} K={K}: done in {wall:.0f}s", flush=True)
    print(
        f"\nDP-FedAvg, ε=8, Geyer et al.'s stopping rule; {N_TRAIN} generated 8×8 training examples, non-IID (2 label shards per client);"
    )
    print(
        f"MLP ({rows[0][4]['parameters']} parameters), E=1, B=10, client lr 0.1, server lr 1, S=1, {a.actors} Ray actors; "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, {platform.machine()}, {time.strftime('%Y-%m-%d')}; "
        "wall includes starting the local Ray cluster (about 20 s)\n"
    )
    print("| data | K | δ (=Q) | m | z | ACC | CR | CC (uploads) | bytes up / down | wall (s) | ε at δ | δ at ε=8 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for dataset, K, m, z, out, wall in rows:
        c = out["comm_realised"]
        print(
            f"| {dataset} | {K:,} | {out['target_delta']:g} | {m} | {z:g} | {out['test_accuracy']:.3f} | "
            f"{out['rounds']} | {c['clients']:,} | "
            f"{c['bytes_up'] / 1e6:.0f} MB / {c['bytes_down'] / 1e6:.0f} MB | {wall:.0f} | {out['epsilon']:.3f} | "
            f"{out['delta_at_target_epsilon']:.2g} |"
        )


if __name__ == "__main__":
    main()

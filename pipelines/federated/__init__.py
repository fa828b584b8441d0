"""Client-level DP federated averaging (DP-FedAvg) on Ray actors, tracked in MLflow.

    dp-platform federated                                  # digits, K=100 non-IID clients, ε=8, δ=1e-3
    dp-platform federated fed.yaml --num-clients 1000      # a YAML config plus flag overrides
    python -m pipelines.federated fed.yaml                 # the same (entrypoint for `ray job submit`)

The unit protected is a client: (ε, δ) holds for adding or removing one client's whole
dataset. The math (client sampling, update clipping, the one noise draw per round, adaptive
clipping, the ledger) is :mod:`dpcore.federated`; this module runs it:

* the driver plans everything before any round: data, split, model, σ (calibrated to (ε, δ)
  and the rounds, or given), the number of rounds that fit the budget;
* clients are simulated on a pool of Ray actors; one actor serves many clients, each round's
  sampled clients are dealt out among the actors, and each actor returns only the sum of its
  clients' clipped updates;
* the server (this driver) adds the noise once, ledgers the round, applies the average with a
  server learning rate (and momentum: FedAvgM), and evaluates on the held-out test split;
* an actor that dies mid-round is replaced and its share of the round is redone with the same
  clients and the same global weights. Nothing is released before every share is in, so a
  crash never releases a partial round, and no client is counted twice;
* the run, its ledger, metrics (ε, δ at the fixed ε, accuracy, S, communication) and model go
  to MLflow with ``dp.level=client``.
"""

_LAZY = {
    "ActorFault": "config",
    "FederatedConfig": "config",
    "plan_federated": "plan",
    "run_federated": "rounds",
}


def __getattr__(name: str):  # loaded on first use: the command line's help imports no torch
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_LAZY)

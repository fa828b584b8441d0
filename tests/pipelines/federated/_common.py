"""Helpers shared by the DP-FedAvg tests (tests/pipelines/federated/): the digits data, a small
federated config whose MLflow store and run folder lie in a test's folder, a client runner over a
split of the clients, and the model's seeded initial weights that the server's updates are measured
from."""

import torch

from pipelines.data import load_digits
from pipelines.federated import FederatedConfig
from pipelines.federated.clients import ClientRunner

DIGITS = load_digits()


def _cfg(root, **over):
    base = dict(
        seed=5,
        rounds=3,
        eval_every=1,
        log_model=False,
        quiet=True,
        executor="local",
        num_actors=2,
        tracking_uri=f"sqlite:///{root}/mlflow.db",
        storage_path=str(root / "runs"),
    )
    return FederatedConfig(**{**base, **over})


def _runner(order, offsets, lr=0.1, epochs=1):
    return ClientRunner(
        DIGITS.inputs("train"), DIGITS.train.y, order, offsets, "mlp", (1, 8, 8), 10, epochs, 10, lr, shuffle_seed=0
    )


def _initial_weights(seed=0):
    from pipelines.models import build_model

    torch.manual_seed(seed)
    m = build_model("mlp", (1, 8, 8), 10)
    return torch.nn.utils.parameters_to_vector(m.parameters()).detach().clone()

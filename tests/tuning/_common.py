"""Helpers shared by the sweep tests (tests/tuning/test_sweep_*.py): the base training config
every sweep's trials start from (digits, 2 epochs at ε=2, one checkpoint per trial, runs and the
MLflow store under the test's folder) and the two-parameter search space (lr, lot size) that the
end-to-end and failing sweeps search."""

from __future__ import annotations

from pathlib import Path

from pipelines.config import TrainConfig


def _base(root: Path, **over) -> TrainConfig:
    # one checkpoint per trial (at its end): each Ray Train report costs ~2 s, and these tests are about the sweep
    values = dict(
        epochs=2,
        target_epsilon=2.0,
        num_workers=1,
        seed=5,
        storage_path=str(root / "runs"),
        tracking_uri=f"sqlite:///{root}/mlflow.db",
        quiet=True,
        registered_model="dp-sweep-test",
        checkpoint_every=1000,
    )
    values.update(over)
    return TrainConfig(**values)


SPACE = {"lr": {"low": 0.005, "high": 0.05, "log": True}, "lot_size": {"choices": [128, 256, 512]}}

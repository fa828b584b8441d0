"""Helpers shared by the bad-input tests of the main job (test_bad_config_and_locked_journal.py,
test_bad_data_and_ingest_cli.py): a config whose runs and MLflow store lie in a test's folder, and
the check that a refused run started nothing (no Ray cluster, no ledger journal, no MLflow run)."""

from pathlib import Path

from pipelines.config import TrainConfig


def _nothing_started(tmp_path: Path, ray_was_up: bool):
    import ray

    assert ray.is_initialized() == ray_was_up  # run() did not start (or join) a cluster
    assert not list((tmp_path / "runs").glob("*/ledger.journal.jsonl"))
    db = tmp_path / "mlflow.db"
    if db.exists():
        import mlflow

        assert (
            mlflow.MlflowClient(f"sqlite:///{db}").search_runs(
                [e.experiment_id for e in mlflow.MlflowClient(f"sqlite:///{db}").search_experiments()]
            )
            == []
        )


def _cfg(tmp_path, **over):
    return TrainConfig(
        storage_path=str(tmp_path / "runs"), tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", quiet=True, **over
    )

"""Bad sweep input, refused before the study or any run is written: the checks of a sweep's plan
(tuning/plan.py) on the search space, the base config, the Optuna storage and the private-selection
options each fail with their message and leave no study and no MLflow run behind; and the
``sweep`` command exits with status 2 and an error line, not a traceback. Nothing here starts
Ray or a trial, so these run in the default suite (about 35 s, most of it the unreachable
storage's connect timeout and the command's start-up)."""

from __future__ import annotations

import subprocess
import sys

import mlflow
import optuna
import pytest

import dpcore
from tuning.config import SweepConfig
from tuning.sweep import run_sweep

from ._common import _base


@pytest.mark.parametrize(
    "sweep_over, base_over, message",
    [
        ({"space": {}}, {}, "the search space is empty"),
        ({}, {"val_fraction": 0.0}, "this dataset has none"),  # helper-41: trials trained, then had no score
        (
            {"space": {"lot_size": {"choices": [256, 4096]}}},
            {},
            "lot_size reaches 4096, beyond the 1258 training examples",
        ),
        (
            {"space": {"lot_size": {"choices": [16, 32]}}},
            {"target_epsilon": 0.01, "epochs": 60},
            "no trial can meet ε=0.01",
        ),
        (
            {"storage": "postgresql://dp@127.0.0.1:9/optuna"},
            {},
            "the Optuna storage postgresql://dp@127.0.0.1:9/optuna is unreachable",
        ),
        (  # DP-PCA's release alone spends more than the budget: every lot size fails with it counted
            {"space": {"lot_size": {"choices": [32, 128]}}},
            {"model": "mlp", "pca_components": 4, "pca_noise_multiplier": 1.0},
            "no trial can meet ε=2 at δ=1e-05",
        ),
        ({"space": {"ascent": {"low": 0.01, "high": 0.1}}}, {}, "method='dpsgd' has no ascent step"),
        ({"private_selection": "poisson"}, {}, "needs --sampler random"),
        (
            {
                "private_selection": "poisson",
                "sampler": "random",
                "space": {"lr": {"low": 0.01, "high": 0.1}, "lot_size": {"choices": [64, 128]}},
            },
            {},
            "take lot_size out of the search space",
        ),
        (
            {"private_selection": "poisson", "sampler": "random", "sampler_seed": 1},
            {},
            "--private-selection and --sampler-seed cannot be combined",
        ),
        ({"space": {"lr": {"low": 0.1, "high": 0.01}}}, {}, "needs low < high"),
        ({"space": {"lora_rank": {"choices": [4, 8]}}}, {}, "lora_rank is searched but the base config"),
        ({"space": {"lora_rank": {"choices": [0, 8]}}}, {}, "lora_rank.choices must be positive integers"),
        ({"space": {"lora_rank": {"low": 0.5, "high": 8}}}, {}, "lora_rank takes whole numbers"),
        # values that only a trial's own config check would refuse, after the study had started
        (
            {"space": {"momentum": {"low": 0.5, "high": 1.5}}},
            {"optimizer": "sgd"},
            "space: momentum=1.5 would make every such trial fail: momentum=1.5 is invalid",
        ),
        ({"space": {"optimizer": {"choices": ["adam", "adamw"]}}}, {}, "space: optimizer='adamw' would make"),
        ({"space": {"clip_norm": {"choices": [1.0, -1.0]}}}, {}, "space: clip_norm=-1.0 would make"),
    ],
)
def test_bad_sweeps_fail_before_anything_is_written(tmp_path, sweep_over, base_over, message):
    sweep = SweepConfig(**{"study": "bad", "storage": f"sqlite:///{tmp_path}/optuna.db", "quiet": True, **sweep_over})
    with pytest.raises(dpcore.DPConfigError) as err:
        run_sweep(sweep, _base(tmp_path, **base_over))
    assert message in str(err.value)
    db = tmp_path / "optuna.db"
    if db.exists():
        assert optuna.get_all_study_summaries(storage=f"sqlite:///{db}") == []
    ml = tmp_path / "mlflow.db"
    if ml.exists():
        client = mlflow.MlflowClient(f"sqlite:///{ml}")
        assert client.search_runs([e.experiment_id for e in client.search_experiments()]) == []


def test_sweep_cli_bad_input_exit_code(tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipelines.cli",
            "sweep",
            "--storage",
            "postgresql://dp@127.0.0.1:9/x",
            "--quiet",
            "--storage-path",
            str(tmp_path / "runs"),
            "--tracking-uri",
            f"sqlite:///{tmp_path}/mlflow.db",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert res.returncode == 2 and "error: the Optuna storage" in res.stderr and "Traceback" not in res.stderr

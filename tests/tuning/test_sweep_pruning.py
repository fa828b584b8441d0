"""Pruning (--pruner median): rank 0 reports each checkpoint's validation accuracy to its trial
and stops when the median pruner says so, the pruner travelling to the worker pickled; trials of
different lot sizes are compared at the same share of their planned steps, not the same step
number; and a pruned sweep whose study is a relative SQLite path reports to that very study from
Ray Train's own working folder."""

from __future__ import annotations

import optuna
import pytest

from tuning.config import SweepConfig
from tuning.sweep import run_sweep

from ._common import _base

pytestmark = pytest.mark.slow


def test_rank0_reports_to_the_trial_and_obeys_the_median_pruner(tmp_path):
    """The worker-side hook of --pruner median: each checkpoint's validation accuracy goes to
    the trial; a trial below the median of earlier trials at that step is told to stop. The
    pruner travels to the worker pickled, as Ray sends it."""
    import pickle

    from tuning.pruning import TrialPruner

    storage = f"sqlite:///{tmp_path}/optuna.db"
    study = optuna.create_study(
        study_name="p",
        storage=storage,
        direction="maximize",
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0),
    )
    for v in (0.8, 0.9):
        t = study.ask()
        t.report(v, 10)
        study.tell(t, v)
    good, bad = study.ask(), study.ask()
    median = {"n_startup_trials": 2, "n_warmup_steps": 0}
    keep = pickle.loads(pickle.dumps(TrialPruner(storage, "p", good._trial_id, median)))
    stop = TrialPruner(storage, "p", bad._trial_id, median)
    assert keep(0.95, 10) is False
    assert stop(0.2, 10) is True
    assert pickle.loads(pickle.dumps(stop))._trial is None  # a used pruner still pickles (without its connection)
    assert optuna.load_study(study_name="p", storage=storage).trials[3].intermediate_values == {10: 0.2}


def test_the_pruner_compares_trials_of_different_lot_sizes_at_the_same_share_of_their_run(tmp_path):
    """helper-41: rank 0 reported at the step number, and the median pruner compares trials at the
    same step, so with the lot size searched a lot-64 trial (step 118: 6 epochs on digits) was
    measured against lot-128 trials at step 118 (12 epochs) and pruned for being early. Trials
    now report at the tenth of their planned steps they have reached. Every trial here learns
    the same curve per epoch, the small-lot one a little better: it is never pruned."""
    import math

    from pipelines.train.report import progress_tenths
    from tuning.config import MEDIAN_PRUNER
    from tuning.pruning import TrialPruner

    storage = f"sqlite:///{tmp_path}/optuna.db"
    study = optuna.create_study(
        study_name="lots", storage=storage, direction="maximize", pruner=optuna.pruners.MedianPruner(**MEDIAN_PRUNER)
    )
    n, epochs = 1258, 60

    def run(lot: int, better: float = 0.0) -> list[bool]:
        trial = study.ask()
        report = TrialPruner(storage, "lots", trial._trial_id, MEDIAN_PRUNER)
        planned = math.ceil(epochs * n / lot)
        every = math.ceil(planned / 10)  # the default checkpoint cadence
        verdicts = []
        for step in range(every, planned, every):
            accuracy = 1 - 0.5 * math.exp(-(step * lot / n) / 20) + better  # the same curve per epoch
            verdicts.append(report(accuracy, progress_tenths(step, planned)))
        study.tell(trial, accuracy)
        return verdicts

    run(128), run(128)
    assert run(64, better=1e-3) == [False] * 9
    assert [progress_tenths(s, 590) for s in range(59, 590, 59)] == list(range(1, 10))
    assert progress_tenths(1, 1180) == 1 and progress_tenths(1180, 1180) == 10


def test_a_pruned_sweep_from_a_relative_sqlite_path_reports_to_its_study(ray_cluster, tmp_path, monkeypatch):
    """The worker side of --pruner median runs in Ray Train's own working folder: a study given
    as a relative SQLite path (the default, sqlite:///optuna.db) must still be the same file
    there. Two trials with several reports each; every report reached the study."""
    monkeypatch.chdir(tmp_path)
    sweep = SweepConfig(
        study="rel",
        storage="sqlite:///optuna.db",
        n_trials=2,
        max_concurrent=1,
        sampler="random",
        sampler_seed=1,
        pruner="median",
        space={"lr": {"low": 0.01, "high": 0.05, "log": True}},
        quiet=True,
    )
    out = run_sweep(
        sweep,
        _base(
            tmp_path,
            epochs=2,
            checkpoint_every=2,
            registered_model="none",
            storage_path="dp_runs",
            tracking_uri="sqlite:///mlflow.db",
        ),
    )
    assert (
        out["complete"]
        + sum(
            1
            for t in optuna.load_study(study_name="rel", storage=f"sqlite:///{tmp_path}/optuna.db").trials
            if t.state == optuna.trial.TrialState.PRUNED
        )
        == 2
    )
    study = optuna.load_study(study_name="rel", storage=f"sqlite:///{tmp_path}/optuna.db")
    for t in study.trials:
        assert len(t.intermediate_values) >= 2, t  # the workers' reports reached this very study
    assert not (tmp_path / "dp_runs" / "optuna.db").exists()

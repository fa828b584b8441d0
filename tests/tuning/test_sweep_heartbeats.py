"""The heartbeats of a sweep's trials come from the driver, from each trial's launch until its
task returns: a trial whose task is slow to start (Ray's worker start-up and torch's import, on
a loaded machine) is not failed as stale while it still runs, which CI at daf4c28 saw; a trial
whose task has returned or died, or whose driver has stopped, goes stale and is failed; and a
trial failed so while it still runs stops at its next report."""

from __future__ import annotations

import time
import warnings

import optuna

from tuning.trials import Heartbeats

RUNNING, FAIL = optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.FAIL


def _states(study) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)  # what the sweep's loop runs before each launch
    return {t.number: t.state for t in study.get_trials()}


def test_the_driver_keeps_a_launched_trial_fresh_until_its_task_returns(tmp_path):
    grace = 2  # seconds: the storage keeps a heartbeat's time to the second
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path}/optuna.db", heartbeat_interval=1, grace_period=grace)
    study = optuna.create_study(study_name="h", storage=storage)
    slow, returned = study.ask(), study.ask()
    with Heartbeats(storage, 0.25) as heartbeats:
        heartbeats.add(slow._trial_id)  # its task has not sent a beat of its own, nor will it
        heartbeats.add(returned._trial_id)
        heartbeats.discard(returned._trial_id)  # its task returned, or its process died
        time.sleep(grace + 1.5)
        assert _states(study) == {0: RUNNING, 1: FAIL}
    # the driver has stopped (as when it dies): its trial goes stale too
    time.sleep(grace + 1.5)
    assert _states(study) == {0: FAIL, 1: FAIL}


def test_a_trial_the_study_has_already_failed_stops_at_its_next_report(tmp_path):
    """Were a trial still failed as stale while it runs (its heartbeat lost for the grace period),
    its retry runs instead: its pruner says stop at the next report, rather than raise and have Ray
    Train restart the run only to fail again."""
    import pytest

    from tuning.config import MEDIAN_PRUNER
    from tuning.pruning import TrialPruner

    storage = f"sqlite:///{tmp_path}/optuna.db"
    study = optuna.create_study(study_name="s", storage=storage, direction="maximize")
    trial = study.ask()
    report = TrialPruner(storage, "s", trial._trial_id, MEDIAN_PRUNER)
    assert report(0.5, 1) is False
    study.tell(trial, state=FAIL)  # what fail_stale_trials does to a stale trial
    with pytest.warns(UserWarning, match="already finished in the study"):
        assert report(0.6, 2) is True
    assert optuna.load_study(study_name="s", storage=storage).trials[0].intermediate_values == {1: 0.5}


def test_beats_that_cannot_be_written_are_retried_with_one_warning(tmp_path, caplog):
    """A storage that refuses the beats (here its heartbeat table is gone) would let the trials go
    stale: the log says so once, not at every interval, and the beats go on being tried."""
    import sqlite3

    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path}/optuna.db", heartbeat_interval=1, grace_period=2)
    study = optuna.create_study(study_name="h", storage=storage)
    trial = study.ask()
    with caplog.at_level("WARNING", logger="tuning.trials"), Heartbeats(storage, 0.1) as heartbeats:
        heartbeats.add(trial._trial_id)
        with sqlite3.connect(tmp_path / "optuna.db") as db:
            db.execute("DROP TABLE trial_heartbeats")
        time.sleep(1.0)  # about 9 beats, every one refused
    said = [r.getMessage() for r in caplog.records if r.name == "tuning.trials"]
    assert len(said) == 1 and "heartbeat could not be recorded" in said[0], said

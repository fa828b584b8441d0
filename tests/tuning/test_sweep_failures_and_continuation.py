"""Trials and sweeps that fail, and sweeps that are continued: trials that keep failing stop the
sweep with their error (and, under private selection, a failed trial is still one of the K runs,
not replaced); an error of Ray's own fails its trial alone; a sweep driver killed with SIGKILL
midway is continued by the same command, its finished trials kept and its running ones failed and
retried; and a continued study tags only one child run as the best. The failing trials run the
``_failing_trial`` hook, which Ray's tasks import from this module."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import optuna
import pytest

from tuning.config import SweepConfig
from tuning.sweep import run_sweep

from ._common import SPACE, _base

pytestmark = pytest.mark.slow


def _failing_trial(cfg_dict):
    raise RuntimeError("injected: this trial cannot train")


def test_trials_that_keep_failing_stop_the_sweep_with_their_error(ray_cluster, tmp_path):
    base = _base(tmp_path, epochs=1, registered_model="none")
    sweep = SweepConfig(
        study="failing",
        storage=f"sqlite:///{tmp_path}/optuna.db",
        n_trials=4,
        max_concurrent=1,
        max_failed_trials=2,
        space=SPACE,
        quiet=True,
    )
    out = run_sweep(sweep, base, trial_hook=_failing_trial)
    trials = optuna.load_study(study_name="failing", storage=sweep.storage).trials
    # two failures, then no more trials: the sweep does not relaunch failing trials for ever
    assert [t.state for t in trials] == [optuna.trial.TrialState.FAIL] * 2
    assert all(t.user_attrs["error"] == "RuntimeError: injected: this trial cannot train" for t in trials)
    assert out["best"] is None and out["stopped"].startswith("2 trials failed (max_failed_trials=2), 0 finished of 4")
    assert "The first error: RuntimeError: injected" in out["stopped"]
    client = mlflow.MlflowClient(base.tracking_uri)
    parent = client.get_run(out["parent_run_id"])
    assert parent.data.tags["sweep.stopped"] == out["stopped"][:5000]
    # the bound's K was fixed before the first trial (4 + 2), whatever then failed
    assert parent.data.tags["dp.search_trials"] == "6" and out["search_trials"] == 6 and out["trials_started"] == 2


def test_with_private_selection_a_failed_trial_is_one_of_the_k_runs(ray_cluster, tmp_path):
    base = _base(tmp_path, lot_size=256, epochs=1, registered_model="none")
    sweep = SweepConfig(
        study="private-failing",
        storage=f"sqlite:///{tmp_path}/optuna.db",
        sampler="random",
        private_selection="poisson",
        selection_mean=3.0,
        space={"lr": {"low": 0.005, "high": 0.05, "log": True}},
        quiet=True,
        max_concurrent=2,
        max_failed_trials=1,  # not what stops it: the K runs are
    )
    out = run_sweep(sweep, base, trial_hook=_failing_trial)
    study = optuna.load_study(study_name="private-failing", storage=sweep.storage)
    k = study.user_attrs["selection_k"]
    # exactly K runs of Q, as the accounting assumes: the failed ones are not replaced by more
    assert len(study.trials) == k == out["n_trials"]
    assert all(t.state == optuna.trial.TrialState.FAIL for t in study.trials)
    assert out["best"] is None and out["stopped"] is None


def test_a_trial_that_ray_ends_with_an_error_of_its_own_fails_alone(ray_cluster, tmp_path):
    """helper-41: only some of Ray's errors were caught; any other (its memory monitor's
    OutOfMemoryError among them) propagated out of the sweep and stopped every trial. A real
    one of Ray's own errors, not the trial's: the actor computing the result was killed
    (ActorDiedError). The trial fails, with the error recorded; the sweep goes on."""
    import ray

    from tuning.results import finish_trial

    @ray.remote(num_cpus=0)
    class Slow:
        def result(self):
            time.sleep(120)

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    parent = client.create_run(client.create_experiment("s")).info.run_id
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/optuna.db", direction="maximize")
    trial = study.ask()
    actor = Slow.remote()
    ref = actor.result.remote()
    ray.kill(actor)
    with pytest.raises(ray.exceptions.RayError) as seen:
        ray.get(ref, timeout=60)
    assert not isinstance(seen.value, ray.exceptions.RayTaskError)  # Ray's error, not the trial's own
    note = finish_trial(study, trial, ref, None, None, client, parent)
    name = type(seen.value).__name__
    assert note.startswith(f"trial {trial.number} FAILED: {name}"), note
    (t,) = study.get_trials()
    assert t.state == optuna.trial.TrialState.FAIL and t.user_attrs["error"].startswith(name)


def test_killed_sweep_driver_continues_with_the_same_command(tmp_path, ray_env):
    """The driver, joined to a running cluster as a submitted job is, is killed with SIGKILL
    after its first finished trial (Ray then ends its tasks); the same command then continues
    the study to its 3 trials."""
    cmd = [
        sys.executable,
        "-m",
        "pipelines.cli",
        "sweep",
        "--study",
        "resume",
        "--storage",
        f"sqlite:///{tmp_path}/optuna.db",
        "--n-trials",
        "3",
        "--max-concurrent",
        "2",
        "--heartbeat-interval",
        "2",
        "--grace-period",
        "10",
        "--epochs",
        "1",
        "--lot-size",
        "256",
        "--seed",
        "3",
        "--sampler-seed",
        "0",
        "--storage-path",
        str(tmp_path / "runs"),
        "--tracking-uri",
        f"sqlite:///{tmp_path}/mlflow.db",
        "--registered-model",
        "none",
        "--quiet",
        "--checkpoint-every",
        "1000",
    ]
    env = ray_env  # the drivers join the session's cluster, as jobs submitted to a cluster do
    sessions_before = set(Path("/tmp/ray").glob("session_2*"))
    first = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env
    )
    storage = f"sqlite:///{tmp_path}/optuna.db"
    deadline = time.time() + 300
    done = 0
    while time.time() < deadline and first.poll() is None:
        time.sleep(1)
        try:
            study = optuna.load_study(study_name="resume", storage=storage)
            done = sum(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
        except Exception:  # noqa: BLE001 - the study is not created yet
            continue
        if done >= 1:
            break
    assert first.poll() is None and done >= 1, "the first driver should still be running after its first trial"
    os.killpg(first.pid, signal.SIGKILL)  # the driver, as a crash would
    first.wait()
    # and a local Ray cluster it may have started, orphaned (Ray names a session after the pid of
    # the process that started it; a cluster another process started meanwhile is left alone)
    for session in set(Path("/tmp/ray").glob(f"session_2*_{first.pid}")) - sessions_before:
        subprocess.run(["pkill", "-9", "-f", session.name], check=False)
    before = optuna.load_study(study_name="resume", storage=storage).trials
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    # K, must-show 4: Optuna's experimental-feature warnings, Ray's and MLflow's logging go to the
    # log file the summary names; no library warning or error on the terminal
    said = res.stdout + res.stderr
    assert not re.search(r"\b(WARNING|ERROR)\b|ExperimentalWarning|Downloading artifacts", said), said[-3000:]
    assert re.search(rf"^logs: {re.escape(str(tmp_path))}/runs/logs/sweep-\S+ \(MLflow, Ray, Optuna", res.stdout, re.M)
    trials = optuna.load_study(study_name="resume", storage=storage).trials
    numbers = [t.number for t in trials]
    assert len(numbers) == len(set(numbers))
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == 3
    # The trials finished before the kill are kept as they were, not re-run.
    kept = {t.number for t in before if t.state == optuna.trial.TrialState.COMPLETE}
    assert kept <= {t.number for t in complete}
    # Those still running at the kill were failed (stale) and retried with their parameters.
    stale = [t for t in before if t.state == optuna.trial.TrialState.RUNNING]
    for t in stale:
        assert [u.state for u in trials if u.number == t.number] == [optuna.trial.TrialState.FAIL]
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    parents = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], filter_string="tags.`sweep.study` = 'resume'"
    )
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"  # one parent run, continued


def test_a_continued_study_tags_one_child_run_as_the_best(tmp_path):
    """helper-41: a study continued with more trials tagged its new best and left the old one
    tagged too. Real MLflow store; the earlier best is untagged, other sweeps' runs untouched."""
    from tuning.results import _untag_earlier_best

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.create_experiment("s")
    parent, other_parent = (client.create_run(exp).info.run_id for _ in range(2))
    old, new, elsewhere = (
        client.create_run(exp, tags={"mlflow.parentRunId": p, "sweep.best": "true"}).info.run_id
        for p in (parent, parent, other_parent)
    )
    _untag_earlier_best(client, parent, new)
    best = {r: client.get_run(r).data.tags["sweep.best"] for r in (old, new, elsewhere)}
    assert best == {old: "false", new: "true", elsewhere: "true"}

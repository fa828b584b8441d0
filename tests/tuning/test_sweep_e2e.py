"""A sweep at a fixed (ε, δ), end to end: 3 trials, 2 at a time, with Optuna on Ray and a SQLite
study, tracked in MLflow, with the first trial's process killed mid-trial. Its parent and child
runs, the registered best model and the whole search's data-independent ε bound (checked against
dp_accounting), every child's own calibrated σ, and the killed trial failed through its stale
heartbeat and retried with its parameters. The module-scoped ``e2e`` fixture runs that sweep once
(about 150 s) for the first three tests. Also the bam-appendix preset end to end: each stage-2
bound covers every lot size stage 1 could have chosen."""

from __future__ import annotations

import os
import signal
import threading
import time

import mlflow
import optuna
import pytest

import dpcore
from dpcore.readout import epsilon_text
from tuning.config import SweepConfig
from tuning.sweep import run_sweep

from ..helpers import rdp_epsilon
from ._common import SPACE, _base

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def e2e(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    sweep = SweepConfig(
        study="e2e",
        storage=f"sqlite:///{root}/optuna.db",
        n_trials=3,
        max_concurrent=2,
        sampler="tpe",
        sampler_seed=0,
        heartbeat_interval=2,
        grace_period=10,
        space=SPACE,
        quiet=True,
    )
    killed = {}

    def kill_first_trial():
        pid_file = root / "runs" / "sweeps" / "e2e" / "trial-0.pid"
        deadline = time.time() + 120
        while not pid_file.exists() and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(4)  # mid-trial: Ray Train has started its worker
        killed["pid"] = int(pid_file.read_text())
        os.kill(killed["pid"], signal.SIGKILL)

    killer = threading.Thread(target=kill_first_trial, daemon=True)
    killer.start()
    out = run_sweep(sweep, _base(root, epochs=1))
    killer.join(timeout=1)
    study = optuna.load_study(study_name="e2e", storage=sweep.storage)
    return {"out": out, "root": root, "study": study, "killed": killed, "base": _base(root, epochs=1)}


def test_sweep_completes_its_trials_with_parent_and_child_runs(e2e):
    out, study = e2e["out"], e2e["study"]
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == 3 and out["complete"] == 3
    client = mlflow.MlflowClient(e2e["base"].tracking_uri)
    parent = client.get_run(out["parent_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.tags["sweep.study"] == "e2e"
    assert "not accounted" in parent.data.tags["dp.selection"]
    assert parent.data.metrics["best_val_accuracy"] == pytest.approx(out["best"]["val_accuracy"])
    # the parent says, without a click, the ε every trial met and that the choice is not accounted
    spent = max(t.user_attrs["epsilon"] for t in complete)
    note = parent.data.tags["mlflow.note.content"]
    assert (
        f"every trial ε ≤ {e2e['base'].target_epsilon:g}" in note
        and f"largest spent {epsilon_text(spent, '.2f')}" in note
    )
    assert "**not** accounted" in note
    assert parent.info.run_name == f"ε≤{e2e['base'].target_epsilon:g} each · sweep-e2e"  # the runs list's first words
    assert float(parent.data.tags["dp.trial_epsilon_max"]) == pytest.approx(spent, rel=1e-5)  # 6 significant digits
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{out['parent_run_id']}'"
    )
    finished = [c for c in children if c.info.status == "FINISHED"]
    assert {c.info.run_id for c in finished} == {t.user_attrs["run_id"] for t in complete}
    best = [c for c in children if c.data.tags.get("sweep.best") == "true"]
    assert len(best) == 1 and best[0].info.run_id == out["best"]["run_id"]
    assert best[0].info.run_id == max(complete, key=lambda t: t.value).user_attrs["run_id"]
    assert out["best"]["registered_model"].startswith("dp-sweep-test v")
    version = client.get_model_version("dp-sweep-test", out["best"]["registered_model"].split(" v")[1])
    # the registry's ε is the whole search's bound (the model was chosen among the trials); the
    # trial's own ε stays beside it
    assert float(version.tags["dp.trial_epsilon"]) == pytest.approx(out["best"]["epsilon"], rel=1e-5)
    assert version.tags["dp.selection"].startswith("Not accounted as a selection, but bounded: chosen among 3")
    assert version.tags["dp.accountant"] == "rdp" and version.tags["dp.epsilon_covers"].startswith("the whole search")
    # the whole search's cost to a training example: bounded from the config alone, for the most
    # trials the sweep may start (n_trials + max_failed_trials = 6, fixed before the first), checked
    # against dp_accounting; 4 were started (the killed one and its retry included)
    k = 6
    assert out["search_trials"] == k and parent.data.tags["dp.search_trials"] == str(k)
    assert out["trials_started"] == len(study.trials) == 4 and parent.data.tags["sweep.trials_started"] == "4"
    bound = parent.data.metrics["search_epsilon_bound"]
    assert out["search_epsilon_bound"] == pytest.approx(bound, rel=1e-9)
    mechs = []
    for lot in (128, 256, 512):
        sigma, q, _ = dpcore.plan(dataset_size=1258, lot_size=lot, epochs=1, target_epsilon=2.0, target_delta=1e-5)
        mechs.append((q, sigma, dpcore.max_steps(sigma, q, 2.0, 1e-5, "pld")))
    assert max(rdp_epsilon([m] * k) for m in mechs) <= bound * (1 + 1e-9)  # k trials of any one lot size
    assert bound < rdp_epsilon(mechs * k)  # and below k trials that each ran all three
    assert parent.data.tags["dp.search_epsilon_bound"].startswith(
        f"ε ≤ {epsilon_text(bound, '.4g')} at δ=1e-05 for the whole search"
    )
    assert (
        f"at most **ε ≤ {epsilon_text(bound, '.2f')}** (a data-independent RDP bound for at most 6 trials; 4 started)"
        in note
    )
    assert float(version.tags["dp.epsilon"]) == pytest.approx(bound, rel=1e-5) and bound > out["best"]["epsilon"]
    assert f"ε is the whole search's bound, ε ≤ {epsilon_text(bound, '.4g')}" in version.tags["dp.selection"]
    assert version.description.startswith(f"Trained with (ε={epsilon_text(bound, '.4g')}, δ=1e-05)-DP (rdp)")
    plots = {f.path for f in client.list_artifacts(out["parent_run_id"], "plots")}
    assert {"plots/optimization_history.png", "plots/param_importances.png", "plots/contour_lr_lot_size.png"} <= plots


def test_every_child_meets_the_target_with_its_own_calibrated_sigma(e2e):
    from pipelines.cli import fetch_ledger

    base, study = e2e["base"], e2e["study"]
    n = 1258  # digits' training split
    sigmas = set()
    for t in study.trials:
        if t.state != optuna.trial.TrialState.COMPLETE:
            continue
        ledger = fetch_ledger(t.user_attrs["run_id"], base.tracking_uri).to_pydict()
        sigma, q, steps = dpcore.plan(
            dataset_size=n,
            lot_size=t.params["lot_size"],
            epochs=base.epochs,
            target_epsilon=base.target_epsilon,
            target_delta=base.target_delta,
        )
        assert set(ledger["noise_multiplier"]) == {sigma} and set(ledger["sample_rate"]) == {q}
        assert len(ledger["step"]) == steps
        assert t.user_attrs["epsilon"] <= base.target_epsilon
        sigmas.add((t.params["lot_size"], sigma))
    assert len({s for _, s in sigmas}) == len({lot for lot, _ in sigmas})  # each lot size: its own σ


def test_a_trial_whose_process_died_is_failed_and_retried(e2e):
    study = e2e["study"]
    assert e2e["killed"].get("pid")
    first = study.trials[0]
    assert first.state == optuna.trial.TrialState.FAIL
    retries = [t for t in study.trials if t.system_attrs.get("failed_trial") == 0]
    assert len(retries) == 1 and retries[0].params == first.params
    assert retries[0].state == optuna.trial.TrialState.COMPLETE
    numbers = [t.number for t in study.trials]
    assert len(numbers) == len(set(numbers)) == 4  # 3 complete + the failed one; nothing lost or doubled


@pytest.mark.slow
def test_the_bam_preset_bounds_stage_two_over_every_choice_of_stage_one(ray_cluster, tmp_path):
    """helper-41: the preset's stage-2 bounds and models covered their own trials at the lot size
    stage 1 chose, which depends on the validation data. End to end (1 trial a stage): each
    stage-2 parent's bound and its registered model's ε are stage 1's K and its own K, every
    trial at the worst of stage 1's mechanisms, and the total is all three stages' trials at
    that worst, whichever lot size won."""
    from tuning import search_cost
    from tuning.sweep import run_preset

    base = _base(tmp_path, epochs=1, registered_model="dp-preset-test")
    sweep = SweepConfig(
        study="preset",
        storage=f"sqlite:///{tmp_path}/optuna.db",
        preset="bam-appendix",
        n_trials=1,
        max_failed_trials=1,
        space={"lr": {"low": 0.01, "high": 0.05, "log": True}, "lot_size": {"choices": [64, 512]}},
        quiet=True,
    )
    out = run_preset(sweep, base)
    b1, k1 = out["stage1"]["_search"]
    assert len(b1.mechanisms) == 2 and k1 == 2
    client = mlflow.MlflowClient(base.tracking_uri)
    total_k = k1
    for stage in out["stage2"].values():
        own, k = stage["_search"]
        assert own.curve == b1.curve  # stage 1's worst over both lot sizes, not the one it picked
        assert stage["search_epsilon_bound"] == pytest.approx(b1.epsilon(k1 + k), rel=1e-9)
        assert stage["search_trials"] == k1 + k
        name, number = stage["best"]["registered_model"].rsplit(" v", 1)
        version = client.get_model_version(name, number)
        assert version.tags["dp.epsilon"] == epsilon_text(stage["search_epsilon_bound"])  # (as the tag writes it)
        total_k += k
    assert out["search_epsilon_bound"] == pytest.approx(b1.epsilon(total_k), rel=1e-9)
    assert out["search_epsilon_bound"] == pytest.approx(search_cost.combined([(b1, total_k)]), rel=1e-9)

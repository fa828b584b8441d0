"""Issue D: sweeps at a fixed (ε, δ) with Optuna on Ray, tracked in MLflow.

* an end-to-end sweep of 3 trials, 2 at a time, on a SQLite study, with one trial's process
  killed mid-trial (it is failed through its stale heartbeat and retried);
* the sweep driver killed midway and the same command run again;
* private selection's total ε, and the search's data-independent bound, against dp_accounting;
* bad input, refused before the study or any run is written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import dp_accounting
import mlflow
import optuna
import pytest

import dpcore
from dpcore.readout import epsilon_text
from pipelines.config import TrainConfig
from tuning import selection
from tuning.config import SweepConfig
from tuning.sweep import run_sweep

from ..helpers import rdp_epsilon

pytestmark = pytest.mark.slow


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


def test_private_selection_total_matches_dp_accounting(ray_cluster, tmp_path, capsys):
    base = _base(tmp_path, lot_size=256, registered_model="dp-private-selection", epochs=1)
    sweep = SweepConfig(
        study="private",
        storage=f"sqlite:///{tmp_path}/optuna.db",
        sampler="random",  # its seed comes from --seed (here) or OS entropy, never a public --sampler-seed
        private_selection="poisson",
        selection_mean=1.5,
        selection_noise_multiplier=3.0,
        space={"lr": {"low": 0.005, "high": 0.05, "log": True}},
        quiet=True,
        max_concurrent=2,
    )
    out = run_sweep(sweep, base)
    sigma, q, _ = dpcore.plan(dataset_size=1258, lot_size=256, epochs=1, target_epsilon=2.0, target_delta=1e-5)
    most = dpcore.max_steps(sigma, q, 2.0, 1e-5, "pld")  # a trial's releases: at most what its ledger allows
    one_trial = dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), most
            ),
            dp_accounting.GaussianDpEvent(3.0),
        ]
    )
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.dp_event.RepeatAndSelectDpEvent(one_trial, 1.5, float("inf")))
    reference = acc.get_epsilon(1e-5)
    assert out["selection_total_epsilon"] == pytest.approx(reference, rel=1e-9)
    client = mlflow.MlflowClient(base.tracking_uri)
    parent = client.get_run(out["parent_run_id"])
    assert float(parent.data.tags["dp.sweep_total_epsilon"]) == pytest.approx(reference, rel=1e-5)
    assert "accounted (Papernot & Steinke 2022)" in parent.data.tags["dp.selection"]
    assert (
        "the child runs, the study's storage and the sweep's progress output and log keep every trial's exact"
        in (parent.data.tags["dp.selection"])
    )
    assert "dp.search_epsilon_bound" not in parent.data.tags  # the accounted total says it all
    assert f"total **ε = {epsilon_text(reference, '.2f')}**" in parent.data.tags["mlflow.note.content"]
    assert parent.info.run_name == f"ε={epsilon_text(reference, '.2f')} in all · sweep-private"
    # the parent carries the noisy score the total covers, not the best trial's exact accuracies
    assert "best_val_accuracy" not in parent.data.metrics and "best_test_accuracy" not in parent.data.metrics
    if out["best"] is not None:
        assert parent.data.metrics["best_value"] == pytest.approx(out["best"]["value"])
    assert not client.list_artifacts(out["parent_run_id"], "plots")  # they would show every trial's score
    from tuning.cli import print_summary

    capsys.readouterr()
    print_summary(out)
    printed = capsys.readouterr().out
    assert "noisy validation score" in printed and " test " not in printed
    study = optuna.load_study(study_name="private", storage=sweep.storage)
    assert out["n_trials"] == study.user_attrs["selection_k"] == len(study.trials)
    assert reference > 2.0  # selection is not free
    # the registered model says the whole search's ε, not its trial's
    assert out["best"] is not None  # the seeded K is ≥ 1
    version = client.get_model_version("dp-private-selection", out["best"]["registered_model"].split(" v")[1])
    assert float(version.tags["dp.epsilon"]) == pytest.approx(reference, rel=1e-5)
    assert version.tags["dp.accountant"] == "rdp" and version.tags["dp.selection"].startswith("Accounted")
    assert "must stay as private as the data itself" in version.tags["dp.selection"]
    # The model was logged in a run of its own holding only what the total covers: the selected
    # settings, the noisy score and ε; no trial, no K, no link to the parent.
    release = client.get_run(version.run_id)
    assert version.run_id not in {out["best"]["run_id"], out["parent_run_id"]}
    assert release.data.metrics == {"noisy_validation_score": pytest.approx(out["best"]["value"])}
    assert release.data.params == {} and json.loads(release.data.tags["sweep.selected_params"]) == out["best"]["params"]
    assert float(release.data.tags["dp.epsilon"]) == pytest.approx(reference, rel=1e-5)
    assert not {k for k in release.data.tags if k.startswith(("sweep.n_", "sweep.trial", "mlflow.parentRunId"))}
    assert release.info.status == "FINISHED"
    assert "the number of trials K" in parent.data.tags["dp.selection"]
    assert "seeded (seed=5; not for production)" in parent.data.tags["dp.selection"]  # base.seed: K and noise seeded
    # The study goes on only with the same K distribution and score noise: the total is computed
    # from them, and K was drawn with them.
    runs_before = len(client.search_runs([parent.info.experiment_id]))
    for change in ({"selection_mean": 8.0}, {"selection_noise_multiplier": 1.0}):
        with pytest.raises(dpcore.DPConfigError, match="different space, base config or private-selection options"):
            run_sweep(dataclasses.replace(sweep, **change), base)
    assert len(optuna.load_study(study_name="private", storage=sweep.storage).trials) == len(study.trials)
    assert len(client.search_runs([parent.info.experiment_id])) == runs_before


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


def test_a_seeded_sweep_gives_each_trial_a_seed_of_its_own():
    from tuning.trials import trial_seed

    seeds = [trial_seed(5, n) for n in range(50)]
    assert len(set(seeds)) == 50 and all(isinstance(s, int) and s >= 0 for s in seeds)
    assert seeds == [trial_seed(5, n) for n in range(50)]  # a resumed sweep gives trial n the same seed
    assert trial_seed(6, 0) != trial_seed(5, 0) and trial_seed(None, 3) is None


def test_the_default_space_of_a_private_selection_searches_one_mechanism():
    """docs/sweeps.md's `dp-platform sweep --sampler random --private-selection poisson
    --lot-size 256` gives no space: its default searches lr alone (the lot size searched by the
    usual default would make the trials different mechanisms, and the command failed)."""
    from tuning.space import default_space

    assert set(default_space("dpsgd")) == {"lr", "lot_size"}
    assert set(default_space("dpsgd", private_selection=True)) == {"lr"}
    assert set(default_space("bam", private_selection=True)) == {"lr", "ascent"}


def test_a_trial_evaluates_the_test_split_at_its_end_only(tmp_path):
    """A trial's reports feed the pruner and the progress line: none of them carries a test
    accuracy; the test split is evaluated at the trial's last report alone (helper-26)."""
    from types import SimpleNamespace

    from tuning.sweep import _trial_args

    base = _base(tmp_path, test_every_report=True)
    sweep = SweepConfig(study="s", storage=f"sqlite:///{tmp_path}/optuna.db", quiet=True)
    cfg = _trial_args(sweep, base, SimpleNamespace(number=3, _trial_id=7), {"lr": 0.02}, "parent")[0]
    assert cfg["test_every_report"] is False and cfg["lr"] == 0.02 and cfg["run_name"] == "s-trial-3"


def test_number_of_trials_follows_the_chosen_distribution():
    r = dpcore.SeededRandomness(0)
    ks = [selection.draw_number_of_trials(4.0, "poisson", 1.0, r) for _ in range(3000)]
    assert abs(sum(ks) / len(ks) - 4.0) < 5 * (4.0 / len(ks)) ** 0.5
    ks = [selection.draw_number_of_trials(4.0, "negative-binomial", 1.0, r) for _ in range(3000)]
    assert min(ks) >= 1 and abs(sum(ks) / len(ks) - 4.0) < 0.35  # geometric on {1, 2, ...}, variance 12


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


# ------------------------------------------------------------------------------------------
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

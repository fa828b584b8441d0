"""Private selection (Papernot & Steinke 2022): a sweep that draws its number of trials K and
releases a noisy score, whose total ε over the whole search matches dp_accounting's
RepeatAndSelectDpEvent, with the parent run, the printed summary and the registered model saying
that total and nothing a trial's exact score would leak; the study continued only with the same
options; the default search space under private selection (one mechanism); and the distributions
K is drawn from."""

from __future__ import annotations

import dataclasses
import json

import dp_accounting
import mlflow
import optuna
import pytest

import dpcore
from dpcore.readout import epsilon_text
from tuning import selection
from tuning.config import SweepConfig
from tuning.sweep import run_sweep

from ._common import _base

pytestmark = pytest.mark.slow


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


def test_the_default_space_of_a_private_selection_searches_one_mechanism():
    """docs/sweeps.md's `dp-platform sweep --sampler random --private-selection poisson
    --lot-size 256` gives no space: its default searches lr alone (the lot size searched by the
    usual default would make the trials different mechanisms, and the command failed)."""
    from tuning.space import default_space

    assert set(default_space("dpsgd")) == {"lr", "lot_size"}
    assert set(default_space("dpsgd", private_selection=True)) == {"lr"}
    assert set(default_space("bam", private_selection=True)) == {"lr", "ascent"}


def test_number_of_trials_follows_the_chosen_distribution():
    r = dpcore.SeededRandomness(0)
    ks = [selection.draw_number_of_trials(4.0, "poisson", 1.0, r) for _ in range(3000)]
    assert abs(sum(ks) / len(ks) - 4.0) < 5 * (4.0 / len(ks)) ** 0.5
    ks = [selection.draw_number_of_trials(4.0, "negative-binomial", 1.0, r) for _ in range(3000)]
    assert min(ks) >= 1 and abs(sum(ks) / len(ks) - 4.0) < 0.35  # geometric on {1, 2, ...}, variance 12

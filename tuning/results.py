"""After each trial and at the end of a sweep: score it (privately with --private-selection), pick
and tag the best, register its model, and draw Optuna's plots on the parent run."""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path

from dpcore.readout import epsilon_text
from pipelines import tracking

from . import search_cost
from .config import SweepConfig
from .selection import SCOPE


def fail_orphan_children(client, parent_id: str, trial_number: int) -> None:
    exp_id = client.get_run(parent_id).info.experiment_id
    for r in client.search_runs(
        [exp_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}' and tags.`optuna.trial_number` = '{trial_number}'",
    ):
        if r.info.status == "RUNNING":
            client.set_terminated(r.info.run_id, status="FAILED")


def best_trial(study) -> tuple | None:
    import optuna

    done = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))]
    if not done:
        return None
    b = max(done, key=lambda t: t.value)
    return b.number, b.value


def finish_trial(study, trial, ref, sel, randomness, client, parent_id) -> str:
    """Tell Optuna how a trial ended. A trial whose process died is left RUNNING: its heartbeat
    goes stale and Optuna's stale-trial callback fails and re-queues it."""
    import optuna
    import ray

    try:
        out = ray.get(ref)
    except (
        ray.exceptions.WorkerCrashedError,
        ray.exceptions.NodeDiedError,
        ray.exceptions.OwnerDiedError,
        ray.exceptions.TaskCancelledError,
        ray.exceptions.OutOfMemoryError,  # killed by Ray's memory monitor (helper-41: it ended the whole sweep)
    ):
        fail_orphan_children(client, parent_id, trial.number)
        return f"trial {trial.number}: its process died; it is retried once its heartbeat is stale"
    # the trial's own error (RayTaskError), or any other of Ray's: this trial fails, not the sweep
    except ray.exceptions.RayError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        fail_orphan_children(client, parent_id, trial.number)
        if study._storage.get_trial(trial._trial_id).state != optuna.trial.TrialState.RUNNING:
            return f"trial {trial.number} failed after it was declared stale (already failed): {type(cause).__name__}"
        # the error first: a finished trial can no longer be updated
        study._storage.set_trial_user_attr(trial._trial_id, "error", f"{type(cause).__name__}: {cause}"[:2000])
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        return f"trial {trial.number} FAILED: {type(cause).__name__}: {str(cause).splitlines()[0][:200]}"
    if study._storage.get_trial(trial._trial_id).state != optuna.trial.TrialState.RUNNING:
        # Its heartbeat went stale before it finished (declared dead too early): the retry counts.
        return f"trial {trial.number} finished after it was declared stale; its retry counts instead"
    for k in (
        "run_id",
        "val_accuracy",
        "test_accuracy",
        "epsilon",
        "noise_multiplier",
        "steps",
        "seconds",
        "checkpoint",
    ):
        study._storage.set_trial_user_attr(trial._trial_id, k, out[k])
    if out["pruned"]:
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        return f"trial {trial.number} pruned at step {out['steps']}"
    value = out["val_accuracy"]
    if value != value:  # NaN: no validation example was scored; Optuna would fail it without a word
        study._storage.set_trial_user_attr(trial._trial_id, "error", "its validation accuracy is not a number")
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        return f"trial {trial.number} FAILED: its validation accuracy is not a number (no validation examples?)"
    if sel is not None:  # the private score: a noisy count of correct validation predictions
        import torch

        n_val = out["val_examples"]
        noise = float(randomness.spawn("score", trial.number).normal(1, sel["score_noise"], dtype=torch.float64)[0])
        value = (value * n_val + noise) / n_val
        study._storage.set_trial_user_attr(trial._trial_id, "private_score", value)
    study.tell(trial, value)
    return (
        f"trial {trial.number}: validation {out['val_accuracy']:.4f}, ε={epsilon_text(out['epsilon'], '.3f')}, "
        f"σ={out['noise_multiplier']:.3f}, {out['seconds']:.0f}s"
    )


def finalise(
    study, sweep: SweepConfig, base, client, parent_id: str, sel, n_trials: int, bound=None, cap: int = 0
) -> dict:
    """Tag the best trial, register its model, log Optuna's plots to the parent run. ``bound``:
    the search's :class:`tuning.search_cost.SearchBound` (or why it has none), for the ``cap``
    trials the sweep could start (more if another driver of the study started more)."""
    import optuna

    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    search = search_cost.log(client, parent_id, bound, max(cap, len(study.trials)))
    search["trials_started"] = len(study.trials)
    client.set_tag(parent_id, "sweep.trials_started", str(len(study.trials)))
    summary = {
        "study": sweep.study,
        "parent_run_id": parent_id,
        "trials": len(study.trials),
        "complete": len(complete),
        "n_trials": n_trials,
        "selection_total_epsilon": None if sel is None else sel["total_epsilon"],
        "delta": base.target_delta,
        **search,
    }
    if sel is None:  # with private selection they would show every trial's score: only the best's is covered
        _log_plots(study, client, parent_id)
    _describe_parent(client, parent_id, sweep.study, base, sel, complete, search)
    if not complete:
        client.set_tag(parent_id, "sweep.best_trial", "none")
        summary["best"] = None
        return summary
    best = max(complete, key=lambda t: t.value)
    attrs = best.user_attrs
    _untag_earlier_best(client, parent_id, attrs["run_id"])
    client.set_tag(attrs["run_id"], "sweep.best", "true")
    for k, v in {
        "sweep.best_trial": best.number,
        "sweep.best_run_id": attrs["run_id"],
        "sweep.best_params": json.dumps(best.params),
    }.items():
        client.set_tag(parent_id, k, str(v))
    if sel is None:
        client.log_metric(parent_id, "best_val_accuracy", float(attrs["val_accuracy"]))
        client.log_metric(parent_id, "best_test_accuracy", float(attrs["test_accuracy"]))
    # With private selection the parent (like the registered model) carries only what the
    # accounted total covers: the best trial's noisy score, not its exact accuracies (those stay
    # in its child run, a working record as private as the data).
    client.log_metric(parent_id, "best_value", float(best.value))
    registered = None
    if base.registered_model is None or base.registered_model.lower() != "none":
        registered = _register_best(client, base, attrs, sel, len(complete), search, (parent_id, sweep.study, best))
    summary["best"] = {
        "number": best.number,
        "value": best.value,
        "params": best.params,
        **{k: attrs[k] for k in ("run_id", "val_accuracy", "test_accuracy", "epsilon", "noise_multiplier")},
        "registered_model": registered,
    }
    return summary


def _untag_earlier_best(client, parent_id: str, best_run_id: str) -> None:
    """A study continued with more trials may have a new best: the child run an earlier finish
    tagged ``sweep.best`` is tagged ``false`` (helper-41: two children read as the best)."""
    exp_id = client.get_run(parent_id).info.experiment_id
    for r in client.search_runs(
        [exp_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}' and tags.`sweep.best` = 'true'"
    ):
        if r.info.run_id != best_run_id:
            client.set_tag(r.info.run_id, "sweep.best", "false")


def _describe_parent(client, parent_id: str, study: str, base, sel, complete, search: dict) -> None:
    """The parent run says, without a click, the ε every trial met and what choosing cost: in its
    description, and at the start of its name in the runs list (``ε≤2 each · sweep-<study>``, or
    ``ε=2.41 in all · ...`` when the choice is accounted)."""
    spent = [float(t.user_attrs["epsilon"]) for t in complete if "epsilon" in t.user_attrs]
    met = f"every trial ε ≤ {base.target_epsilon:g} at δ = {base.target_delta:g}"
    if spent:
        met += f" (largest spent {epsilon_text(max(spent), '.2f')}, over {len(spent)} complete trials)"
        client.set_tag(parent_id, "dp.trial_epsilon_max", epsilon_text(max(spent)))
    if sel is None:
        choice = "choosing the best trial on validation data is **not** accounted"
        if search.get("search_epsilon_bound") is not None:
            choice += (
                f"; the whole search costs a training example at most **ε ≤ {epsilon_text(search['search_epsilon_bound'], '.2f')}** "
                f"(a data-independent RDP bound for at most {search['search_trials']} trials; "
                f"{search['trials_started']} started)"
            )
    else:
        choice = (
            f"choosing the best trial is accounted: total **ε = {epsilon_text(sel['total_epsilon'], '.2f')}** (RDP)"
        )
    client.set_tag(parent_id, "mlflow.note.content", f"**{met}**; {choice}")
    title = (
        f"ε≤{base.target_epsilon:g} each" if sel is None else f"ε={epsilon_text(sel['total_epsilon'], '.2f')} in all"
    )
    client.update_run(parent_id, name=f"{title} · sweep-{study}")


def _release_run(client, base, parent_id: str, study: str, best, sel: dict) -> str:
    """With private selection: a run of its own for what the accounted total covers, and only
    that: the selected trial's settings and noisy score, ε, δ and the scope. It names neither
    the trials nor their number K (the parent and the child runs hold those), so the registered
    model, whose version points at the run it was logged in, leads to nothing the bound leaves out."""
    experiment_id = client.get_run(parent_id).info.experiment_id
    run = client.create_run(
        experiment_id,
        run_name=f"ε={epsilon_text(sel['total_epsilon'], '.2f')} · {study} · selected",
        tags={
            "dp.epsilon": epsilon_text(sel["total_epsilon"]),
            "dp.delta": f"{base.target_delta:g}",
            "dp.accountant": "rdp",
            "dp.selection": "the release of a privately selected trial (Papernot & Steinke 2022): these settings, "
            "this model and this noisy validation score are what the total covers",
            "sweep.selected_params": json.dumps(best.params),
        },
    )
    client.log_metric(run.info.run_id, "noisy_validation_score", float(best.value))
    return run.info.run_id


def _register_best(
    client, base, attrs: dict, sel: dict | None, n_complete: int, search: dict, selected: tuple
) -> str | None:
    """Log the best trial's model (from its final checkpoint) and register it: into its own run,
    or, with private selection, into a run of its own (:func:`_release_run`). Its version states
    what its ε covers: with private selection, the whole search's total (the model included);
    else the trial's own ε, and that the choice among the trials is not in it. ``selected``:
    (the parent run, the study, the best trial)."""
    import mlflow

    from pipelines.config import config_from_dict
    from pipelines.data import model_example
    from pipelines.plan import RunPlan
    from pipelines.train import load_final_model

    run_id = attrs["run_id"]
    spec = RunPlan.from_dict(tracking.read_json_artifact(client.tracking_uri, run_id, "spec.json"))
    model = load_final_model(spec, attrs["checkpoint"])
    example = model_example(spec.data_dir)
    name = base.registered_model or f"dp-sweep-{base.dataset}-{tracking.model_label(base.model)}"
    mlflow.set_tracking_uri(client.tracking_uri)
    trial_cfg = config_from_dict(spec.config)  # the trial's own options (a searched LoRA rank, say)
    trial_epsilon = float(attrs["epsilon"])
    scope = {"dp.trial_epsilon": epsilon_text(trial_epsilon)}
    if sel is None and search.get("search_epsilon_bound") is not None:
        # The model depends on every trial (it was chosen among them): the registry's ε is the
        # whole search's bound, which covers that choice; the trial's own ε stays beside it.
        epsilon, accountant = float(search["search_epsilon_bound"]), "rdp"
        scope["dp.epsilon_covers"] = "the whole search (a data-independent bound), this model's choice included"
        selection = (
            f"Not accounted as a selection, but bounded: chosen among {n_complete} complete trials on the validation "
            f"split; ε is the whole search's bound, ε ≤ {epsilon_text(search['search_epsilon_bound'], '.4g')} at δ={base.target_delta:g} "
            f"for a training example (at most {search['search_trials']} trials; RDP, data-independent). "
            f"This trial's own ε was {epsilon_text(trial_epsilon, '.4g')}."
        )
    elif sel is None:
        epsilon, accountant = trial_epsilon, base.accountant
        scope["dp.epsilon_covers"] = "this trial's training only: not the choice among the trials (no bound)"
        selection = (
            f"Not accounted: chosen among {n_complete} complete trials on the validation split; ε is this trial's "
            "own, and the search's cost (every trial saw the training data) is not in it: a space searched over "
            "ranges has no bound (search it over choices for one)."
        )
    else:
        epsilon, accountant = float(sel["total_epsilon"]), "rdp"
        selection = (
            "Accounted (Papernot & Steinke 2022): the best of a random number of trials; ε is the whole search's, "
            "this model included. It covers what the selection releases (this model, its trial's settings and "
            f"noisy score): {SCOPE}"
        )
    target = run_id if sel is None else _release_run(client, base, *selected, sel)
    version = tracking.log_model(
        target,
        model,
        example,
        name,
        epsilon,
        base.target_delta,
        accountant,
        text=tracking.text_model_meta(trial_cfg, spec.data_dir),
        selection=selection,
        version_tags=scope
        if sel is None
        else {"dp.epsilon_covers": "the whole search (accounted), this model included"},
    )
    if sel is not None:
        client.set_terminated(target)
    return None if version is None else f"{version.name} v{version.version}"


def _log_plots(study, client, parent_id: str) -> None:
    """Optuna's optimisation history, parameter importances and the lr × lot contour, as PNGs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna.visualization.matplotlib as ovm

    names = {t for t in study.trials for t in t.params}
    plots = {
        "optimization_history.png": lambda: ovm.plot_optimization_history(study),
        "param_importances.png": lambda: ovm.plot_param_importances(study),
    }
    if {"lr", "lot_size"} <= names:
        plots["contour_lr_lot_size.png"] = lambda: ovm.plot_contour(study, params=["lr", "lot_size"])
    failed = {}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fname, make in plots.items():
            try:
                ax = make()
                fig = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
                fig.set_size_inches(7, 5)
                fig.tight_layout()
                fig.savefig(Path(tmp) / fname, dpi=100)
                plt.close(fig)
            except Exception as e:  # noqa: BLE001 - e.g. importances need two complete trials
                failed[fname] = f"{type(e).__name__}: {e}"[:300]
        if any(Path(tmp).iterdir()):
            client.log_artifacts(parent_id, tmp, artifact_path="plots")
    if failed:
        client.set_tag(parent_id, "sweep.plots_missing", json.dumps(failed)[:4000])


# ------------------------------------------------------------------------------------------

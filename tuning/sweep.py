"""Hyperparameter sweeps under a fixed (ε, δ): Optuna on Ray, tracked in MLflow.

    dp-platform sweep                                   # 20 TPE trials over lr × lot size, ε=2, on digits
    dp-platform sweep sweep.yaml --n-trials 40          # a YAML file (sweep options, space:, and train options)
    dp-platform sweep --method bam --sampler random     # also searches λ
    dp-platform sweep --preset bam-appendix --n-trials 20   # stage 1 DP-SGD (lr, lot), stage 2 λ (BAM) and ρ (DP-SAT)
    dp-platform sweep --sampler random --private-selection poisson --selection-mean 8 --lot-size 256

Every trial is a full training run of the main job (``pipelines.train.run``) in a Ray task,
nested as a child MLflow run under the sweep's parent run, with its own σ calibrated for its
own lot size and epochs, and its own ledger. The study lives in an RDB storage (a SQLite file
by default, PostgreSQL on a cluster); running the same command again continues it. A trial
whose process dies stops sending heartbeats; once it is stale, Optuna marks it failed and
:class:`optuna.storages.RetryHeartbeatStaleTrialCallback` queues a retry with the same
parameters, which the next free slot runs.

Choosing the best trial looks at the validation split, which is carved out of the private
training data. Without ``--private-selection`` that choice is not accounted, and the parent
run says so (tag ``dp.selection``). With it, the number of trials is random and the total
(ε, δ) of releasing the best trial is accounted by RDP (:mod:`tuning.selection`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dpcore
from pipelines import tracking
from pipelines.tracking import redact

from . import selection
from .pruning import TrialPruner
from .space import SearchSpace, default_space, parse_space

SAMPLERS = ("tpe", "random")
PRUNERS = ("none", "median")
PRESETS = ("bam-appendix",)
MEDIAN_PRUNER = {"n_startup_trials": 2, "n_warmup_steps": 0}


@dataclass(frozen=True)
class SweepConfig:
    study: str = "dp-sweep"
    storage: str = "sqlite:///optuna.db"
    n_trials: int = 20
    max_concurrent: int = 2
    sampler: str = "tpe"
    pruner: str = "none"
    sampler_seed: int | None = None
    heartbeat_interval: int = 10
    grace_period: int = 30
    max_retry: int = 2
    private_selection: str | None = None
    selection_mean: float = 8.0
    selection_shape: float = 1.0
    selection_noise_multiplier: float = 2.0
    preset: str | None = None
    space: dict | None = None
    quiet: bool = False

    def validate(self) -> None:
        err = dpcore.DPConfigError
        if not self.study or any(c in self.study for c in "/\\ "):
            raise err(f"study={self.study!r}: give a name without spaces or slashes.")
        for name in ("n_trials", "max_concurrent", "heartbeat_interval", "grace_period"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise err(f"{name}={v!r} is invalid: it must be an integer ≥ 1.")
        if self.grace_period <= self.heartbeat_interval:
            raise err(f"grace_period={self.grace_period} must exceed heartbeat_interval={self.heartbeat_interval}.")
        if self.sampler not in SAMPLERS:
            raise err(f"sampler={self.sampler!r} is unknown; choose one of {', '.join(SAMPLERS)}.")
        if self.pruner not in PRUNERS:
            raise err(f"pruner={self.pruner!r} is unknown; choose one of {', '.join(PRUNERS)}.")
        if self.preset is not None and self.preset not in PRESETS:
            raise err(f"preset={self.preset!r} is unknown; available: {', '.join(PRESETS)}.")
        if self.private_selection is not None:
            if self.private_selection not in selection.DISTRIBUTIONS:
                raise err(
                    f"private_selection={self.private_selection!r} is unknown; choose one of {', '.join(selection.DISTRIBUTIONS)}."
                )
            if self.sampler != "random" or self.pruner != "none":
                raise err(
                    "--private-selection needs --sampler random and --pruner none: Papernot & Steinke's bound holds for "
                    "independent repetitions of one randomised algorithm; TPE and pruning adapt to earlier trials' private results."
                )
            if not (self.selection_mean >= 1 and math.isfinite(self.selection_mean)):
                raise err(f"selection_mean={self.selection_mean} must be a finite number ≥ 1.")
            dpcore.validation.check_noise_multiplier(self.selection_noise_multiplier, "selection_noise_multiplier")
            if self.preset is not None:
                raise err(
                    "--private-selection and --preset cannot be combined (the preset's stage 2 depends on stage 1's choice)."
                )


SWEEP_FIELDS = {f.name for f in dataclasses.fields(SweepConfig)}


# ------------------------------------------------------------------------------------------
def make_storage(url: str, sweep: SweepConfig):
    """The Optuna RDB storage, with heartbeats and the stale-trial retry. Raises a clear error
    if the database cannot be reached (nothing is written then)."""
    import optuna

    if "://" not in url:
        raise dpcore.DPConfigError(
            f"storage={redact(url)!r} is not a database URL; use sqlite:///path.db or postgresql://user@host/db."
        )
    if url.startswith("sqlite:///"):
        parent = Path(url[len("sqlite:///") :]).expanduser().resolve().parent
        if not parent.is_dir():
            raise dpcore.DPConfigError(f"storage={redact(url)!r}: the folder {parent} does not exist.")
    try:
        import sqlalchemy

        engine = sqlalchemy.create_engine(
            url, connect_args={"connect_timeout": 5} if url.startswith("postgresql") else {}
        )
        with engine.connect():
            pass
        engine.dispose()
    except Exception as e:  # noqa: BLE001 - any driver error means: unreachable
        raise dpcore.DPConfigError(
            f"the Optuna storage {redact(url)} is unreachable ({type(e).__name__}: {str(e).splitlines()[0]}); fix --storage."
        ) from None
    return optuna.storages.RDBStorage(
        url,
        heartbeat_interval=sweep.heartbeat_interval,
        grace_period=sweep.grace_period,
        heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=sweep.max_retry),
    )


def check_feasible(base, space: SearchSpace, dataset_size: int) -> list[int] | None:
    """Every lot size the space can pick must allow σ ≤ max_noise_multiplier at (ε, δ) for the
    longest epochs it can pick. Returns the feasible lot choices (categorical spaces), or raises."""
    lot = space.get("lot_size")
    lots = lot.values_at_extremes() if lot is not None else [base.lot_size]
    ep = space.get("epochs")
    epochs = max(ep.values_at_extremes()) if ep is not None else base.epochs
    ok, bad = [], {}
    for L in lots:
        try:
            dpcore.plan(
                dataset_size=dataset_size,
                lot_size=int(L),
                epochs=epochs,
                target_epsilon=base.target_epsilon,
                target_delta=base.target_delta,
                noise_multiplier=base.noise_multiplier,
                accountant=base.accountant,
                max_noise_multiplier=None if base.noise_multiplier is not None else base.max_noise_multiplier,
                noise=base.noise,
            )
            ok.append(L)
        except dpcore.DPConfigError as e:
            bad[L] = str(e)
    if not ok:
        first = next(iter(bad.values()))
        raise dpcore.DPConfigError(
            f"no trial can meet ε={base.target_epsilon:g} at δ={base.target_delta:g}: calibration fails for every lot size "
            f"({', '.join(map(str, lots))}) at {epochs:g} epochs. For example: {first}"
        )
    if bad and (lot is None or lot.choices is None):
        raise dpcore.DPConfigError(
            f"lot sizes {sorted(bad)} cannot meet ε={base.target_epsilon:g} at {epochs:g} epochs; narrow the lot_size range."
        )
    return ok if (lot is not None and lot.choices is not None) else None


# ------------------------------------------------------------------------------------------
def _trial_task():
    import ray

    @ray.remote(num_cpus=0, max_retries=0)
    def run_trial(
        cfg_dict: dict,
        parent_run_id: str,
        tags: dict,
        pruner: TrialPruner | None,
        heartbeat: dict | None,
        pid_file: str,
    ) -> dict:
        """One trial: the main job as a child run. Sends the trial's heartbeat while it runs
        (first thing, before the heavy imports)."""
        Path(pid_file).write_text(str(os.getpid()))
        stop = threading.Event()
        if heartbeat is not None:
            import optuna

            storage = optuna.storages.RDBStorage(
                heartbeat["storage"], heartbeat_interval=heartbeat["interval"], grace_period=heartbeat["grace"]
            )

            def beat():
                while True:
                    with contextlib.suppress(Exception):
                        storage.record_heartbeat(heartbeat["trial_id"])
                    if stop.wait(heartbeat["interval"]):
                        return

            threading.Thread(target=beat, daemon=True).start()
        import warnings as _w

        from pipelines.config import config_from_dict
        from pipelines.train import run

        try:
            with _w.catch_warnings():
                _w.simplefilter("ignore", dpcore.SeededRandomnessWarning)
                out = run(config_from_dict(cfg_dict), parent_run_id=parent_run_id, extra_tags=tags, pruner=pruner)
        finally:
            stop.set()
        keys = (
            "run_id",
            "val_accuracy",
            "test_accuracy",
            "epsilon",
            "noise_multiplier",
            "sample_rate",
            "steps",
            "seconds",
            "checkpoint",
            "pruned",
        )
        summary = {k: out[k] for k in keys}
        summary["val_examples"] = out["spec"].split_info.get("val_examples")
        summary["ledger_sigmas"] = sorted({e.noise_multiplier for e in out["ledger"].entries if e.step > 0})
        return summary

    return run_trial


class Progress:
    def __init__(self, total: int, enabled: bool, stream=sys.stderr):
        self.total, self.enabled, self.stream = total, enabled, stream
        self.t0 = time.monotonic()

    def show(self, done: int, running: int, best: tuple | None, note: str = "") -> None:
        if not self.enabled:
            return
        b = "–" if best is None else f"{best[1]:.4f} (trial {best[0]})"
        self.stream.write(
            f"[sweep] trials {done}/{self.total} done, {running} running, best validation accuracy {b}, "
            f"{time.monotonic() - self.t0:5.0f}s{('  ' + note) if note else ''}\n"
        )
        self.stream.flush()


def _fail_orphan_children(client, parent_id: str, trial_number: int) -> None:
    exp_id = client.get_run(parent_id).info.experiment_id
    for r in client.search_runs(
        [exp_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}' and tags.`optuna.trial_number` = '{trial_number}'",
    ):
        if r.info.status == "RUNNING":
            client.set_terminated(r.info.run_id, status="FAILED")


def run_sweep(sweep: SweepConfig, base, space_override: dict | None = None, fixed: dict | None = None) -> dict:
    """Run (or continue) one study. ``base`` is the TrainConfig shared by every trial; ``fixed``
    are config values set for every trial on top of it (the preset's stage 2)."""
    import optuna
    import ray
    from mlflow import MlflowClient

    from pipelines.models import build_run_model
    from pipelines.plan import prepare_data, prepare_features
    from pipelines.train import ray_cluster

    # ---- everything that can fail, before the study or any run is written ----------------
    sweep.validate()
    # A relative SQLite path would name a different file in each Ray worker (Ray Train runs
    # them in the run's own folder): resolve it here, once.
    sweep = dataclasses.replace(sweep, storage=tracking.resolve_tracking_uri(sweep.storage))
    if fixed:
        base = dataclasses.replace(base, **fixed)
    base.validate()
    tracking_uri = tracking.resolve_tracking_uri(base.tracking_uri)
    tracking.check_tracking_uri(tracking_uri)
    # Trials run in Ray tasks whose working folder may not be this one (a joined cluster):
    # every relative path of the base config is made absolute here.
    base = dataclasses.replace(
        base,
        tracking_uri=tracking_uri,
        storage_path=str(Path(base.storage_path).expanduser().resolve()),
        data_dir=None if base.data_dir is None else str(Path(base.data_dir).expanduser().resolve()),
    )
    data_dir, manifest = prepare_data(base)
    n = sum(e["rows"] for e in manifest["files"] if e["split"] == "train")
    # A public front end's features (ScatterNet) are computed once here, not by the first trials at once.
    prepare_features(
        base, data_dir, manifest, build_run_model(base, tuple(manifest["input_shape"]), manifest["num_classes"])
    )
    raw_space = (
        space_override
        if space_override is not None
        else (sweep.space if sweep.space is not None else default_space(base.method))
    )
    space = parse_space(raw_space, n)
    if "ascent" in space.names and base.method == "dpsgd":
        raise dpcore.DPConfigError(
            "space: ascent is searched but method='dpsgd' has no ascent step; set --method bam or dpsat."
        )
    lot_choices = check_feasible(base, space, n)
    if lot_choices is not None and len(lot_choices) < len(space.get("lot_size").choices):
        dropped = sorted(set(space.get("lot_size").choices) - set(lot_choices))
        print(
            f"[sweep] lot sizes {dropped} cannot meet ε={base.target_epsilon:g}; searching {lot_choices}",
            file=sys.stderr,
        )
        raw_space = {**raw_space, "lot_size": {"choices": lot_choices}}
        space = parse_space(raw_space, n)
    sel = None
    if sweep.private_selection is not None:
        searched = {"lot_size", "epochs"} & set(space.names)
        if searched:
            raise dpcore.DPConfigError(
                f"--private-selection needs every trial to be the same mechanism: fix {', '.join(sorted(searched))} in the base "
                "config (every trial then has the same q, σ and steps) and search lr, λ/ρ, the clip norm or the optimizer."
            )
        sigma, q, steps = dpcore.plan(
            dataset_size=n,
            lot_size=base.lot_size,
            epochs=base.epochs,
            target_epsilon=base.target_epsilon,
            target_delta=base.target_delta,
            accountant=base.accountant,
            noise_multiplier=base.noise_multiplier,
        )
        event = selection.selection_event(
            selection.trial_event(sigma, q, steps, sweep.selection_noise_multiplier),
            sweep.selection_mean,
            sweep.private_selection,
            sweep.selection_shape,
        )
        sel = {
            "event": event,
            "total_epsilon": selection.total_epsilon(event, base.target_delta),
            "sigma": sigma,
            "q": q,
            "steps": steps,
            "score_noise": sweep.selection_noise_multiplier,
        }
    storage = make_storage(sweep.storage, sweep)

    # ---- the study ---------------------------------------------------------------------
    fingerprint = json.dumps(
        {
            "space": raw_space,
            "base": {k: v for k, v in base.to_dict().items() if k not in ("quiet",)},
            "private_selection": sweep.private_selection,
        },
        sort_keys=True,
        default=str,
    )
    sampler = (
        optuna.samplers.TPESampler(seed=sweep.sampler_seed)
        if sweep.sampler == "tpe"
        else optuna.samplers.RandomSampler(seed=sweep.sampler_seed)
    )
    pruner = optuna.pruners.MedianPruner(**MEDIAN_PRUNER) if sweep.pruner == "median" else optuna.pruners.NopPruner()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name=sweep.study,
        storage=storage,
        sampler=sampler,
        pruner=pruner,
        direction="maximize",
        load_if_exists=True,
    )
    attrs = study.user_attrs
    if "fingerprint" in attrs and attrs["fingerprint"] != fingerprint:
        raise dpcore.DPConfigError(
            f"study {sweep.study!r} in {redact(sweep.storage)} was started with a different space or base config; "
            "use a new --study name, or the same options to continue it."
        )
    if "fingerprint" not in attrs:
        study.set_user_attr("fingerprint", fingerprint)
    n_trials = sweep.n_trials
    if sel is not None:
        if "selection_k" not in attrs:  # drawn once; a resumed sweep keeps it (a redraw would leak)
            k = selection.draw_number_of_trials(
                sweep.selection_mean,
                sweep.private_selection,
                sweep.selection_shape,
                dpcore.make_randomness(base.seed).spawn("selection-count"),
            )
            study.set_user_attr("selection_k", k)
        n_trials = int(study.user_attrs["selection_k"])

    # ---- MLflow parent ------------------------------------------------------------------
    client = MlflowClient(tracking_uri)
    if sel is None:
        selection_tag = (
            "not accounted: the best trial is chosen on a validation split held out from the training data, "
            "whose privacy is not accounted; each trial's ε covers its training only"
        )
    else:
        selection_tag = (
            f"accounted (Papernot & Steinke 2022): K ~ {sweep.private_selection}(mean {sweep.selection_mean:g}"
            f"{'' if sweep.private_selection == 'poisson' else f', shape {sweep.selection_shape:g}'}), noisy validation "
            f"count σ={sweep.selection_noise_multiplier:g}; total ε={sel['total_epsilon']:.4g} at δ={base.target_delta:g} (RDP)"
        )
    parent_tags = {
        "dp.target_epsilon": f"{base.target_epsilon:g}",
        "dp.delta": f"{base.target_delta:g}",
        "dp.selection": selection_tag,
        "sweep.sampler": sweep.sampler,
        "sweep.pruner": sweep.pruner,
        "sweep.space": space.describe(),
        "sweep.n_trials": str(n_trials),
    }
    storage_tag = redact(sweep.storage)
    with tracking.mlflow_run(
        client,
        experiment=base.experiment,
        run_name=f"sweep-{sweep.study}",
        tags={"sweep.study": sweep.study, "sweep.storage": storage_tag, **parent_tags},
        find=f"tags.`sweep.study` = '{sweep.study}' and tags.`sweep.storage` = '{storage_tag}'",
    ) as parent_id:
        for k, v in parent_tags.items():
            client.set_tag(parent_id, k, v)
        if sel is not None:
            client.log_metric(parent_id, "sweep_total_epsilon", sel["total_epsilon"])
            client.set_tag(parent_id, "dp.sweep_total_epsilon", f"{sel['total_epsilon']:.6g}")

        run_dir = Path(base.storage_path).resolve() / "sweeps" / sweep.study
        run_dir.mkdir(parents=True, exist_ok=True)
        progress = Progress(n_trials, not sweep.quiet)
        finished_states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
        randomness = dpcore.make_randomness(base.seed) if sel is not None else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", dpcore.SeededRandomnessWarning)
            with ray_cluster(dataclasses.replace(base, num_workers=max(base.num_workers, sweep.max_concurrent))):
                run_trial = _trial_task()
                inflight: dict = {}  # ObjectRef -> (trial, params)
                while True:
                    optuna.storages.fail_stale_trials(study)
                    trials = study.get_trials(deepcopy=False)
                    done = sum(t.state in finished_states for t in trials)
                    mine = {t.number for t, _ in inflight.values()}
                    foreign = sum(t.state == optuna.trial.TrialState.RUNNING and t.number not in mine for t in trials)
                    launchable = n_trials - done - len(inflight) - foreign
                    while launchable > 0 and len(inflight) < sweep.max_concurrent:
                        trial = study.ask()
                        params = space.suggest(trial)
                        storage.record_heartbeat(trial._trial_id)
                        cfg = dataclasses.replace(
                            base,
                            **params,
                            run_name=f"{sweep.study}-trial-{trial.number}",
                            log_model=False,
                            quiet=True,
                            registered_model="none",
                        )
                        tags = {
                            "optuna.study": sweep.study,
                            "optuna.trial_number": str(trial.number),
                            "optuna.trial_id": str(trial._trial_id),
                        }
                        opt = None
                        if sweep.pruner == "median":
                            opt = TrialPruner(sweep.storage, sweep.study, trial._trial_id, MEDIAN_PRUNER)
                        hb = {
                            "storage": sweep.storage,
                            "interval": sweep.heartbeat_interval,
                            "grace": sweep.grace_period,
                            "trial_id": trial._trial_id,
                        }
                        ref = run_trial.remote(
                            cfg.to_dict(), parent_id, tags, opt, hb, str(run_dir / f"trial-{trial.number}.pid")
                        )
                        inflight[ref] = (trial, params)
                        launchable -= 1
                        progress.show(done, len(inflight), _best(study), f"started trial {trial.number}: {params}")
                    if not inflight:
                        if done >= n_trials:
                            break
                        time.sleep(min(5, sweep.heartbeat_interval))  # foreign running trials: wait until they go stale
                        continue
                    ready, _ = ray.wait(list(inflight), num_returns=1, timeout=sweep.heartbeat_interval)
                    for ref in ready:
                        trial, params = inflight.pop(ref)
                        note = _finish(study, trial, ref, sel, randomness, client, parent_id)
                        trials = study.get_trials(deepcopy=False)
                        progress.show(
                            sum(t.state in finished_states for t in trials), len(inflight), _best(study), note
                        )
        return _finalise(study, sweep, base, client, parent_id, sel, n_trials)


def _best(study) -> tuple | None:
    import optuna

    done = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))]
    if not done:
        return None
    b = max(done, key=lambda t: t.value)
    return b.number, b.value


def _finish(study, trial, ref, sel, randomness, client, parent_id) -> str:
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
    ):
        _fail_orphan_children(client, parent_id, trial.number)
        return f"trial {trial.number}: its process died; it is retried once its heartbeat is stale"
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        study._storage.set_trial_user_attr(trial._trial_id, "error", f"{type(cause).__name__}: {cause}"[:2000])
        _fail_orphan_children(client, parent_id, trial.number)
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
    if sel is not None:  # the private score: a noisy count of correct validation predictions
        import torch

        n_val = out["val_examples"]
        noise = float(randomness.spawn("score", trial.number).normal(1, sel["score_noise"], dtype=torch.float64)[0])
        value = (value * n_val + noise) / n_val
        study._storage.set_trial_user_attr(trial._trial_id, "private_score", value)
    study.tell(trial, value)
    return (
        f"trial {trial.number}: validation {out['val_accuracy']:.4f}, ε={out['epsilon']:.3f}, "
        f"σ={out['noise_multiplier']:.3f}, {out['seconds']:.0f}s"
    )


def _finalise(study, sweep: SweepConfig, base, client, parent_id: str, sel, n_trials: int) -> dict:
    """Tag the best trial, register its model, log Optuna's plots to the parent run."""
    import optuna

    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    summary = {
        "study": sweep.study,
        "parent_run_id": parent_id,
        "trials": len(study.trials),
        "complete": len(complete),
        "n_trials": n_trials,
        "selection_total_epsilon": None if sel is None else sel["total_epsilon"],
    }
    _log_plots(study, client, parent_id)
    if not complete:
        client.set_tag(parent_id, "sweep.best_trial", "none")
        summary["best"] = None
        return summary
    best = max(complete, key=lambda t: t.value)
    attrs = best.user_attrs
    client.set_tag(attrs["run_id"], "sweep.best", "true")
    for k, v in {
        "sweep.best_trial": best.number,
        "sweep.best_run_id": attrs["run_id"],
        "sweep.best_params": json.dumps(best.params),
    }.items():
        client.set_tag(parent_id, k, str(v))
    client.log_metric(parent_id, "best_val_accuracy", float(attrs["val_accuracy"]))
    client.log_metric(parent_id, "best_test_accuracy", float(attrs["test_accuracy"]))
    client.log_metric(parent_id, "best_value", float(best.value))
    registered = None
    if base.registered_model is None or base.registered_model.lower() != "none":
        registered = _register_best(client, base, attrs)
    summary["best"] = {
        "number": best.number,
        "value": best.value,
        "params": best.params,
        **{k: attrs[k] for k in ("run_id", "val_accuracy", "test_accuracy", "epsilon", "noise_multiplier")},
        "registered_model": registered,
    }
    return summary


def _register_best(client, base, attrs: dict) -> str | None:
    """Log the best trial's model (from its final checkpoint) into its run and register it."""
    import mlflow

    from pipelines.data import model_example
    from pipelines.plan import RunPlan
    from pipelines.train import load_final_model

    run_id = attrs["run_id"]
    spec_path = mlflow.artifacts.download_artifacts(
        run_id=run_id, artifact_path="spec.json", tracking_uri=client.tracking_uri
    )
    spec = RunPlan.from_dict(json.loads(Path(spec_path).read_text()))
    model = load_final_model(spec, attrs["checkpoint"])
    example = model_example(spec.data_dir)
    name = base.registered_model or f"dp-sweep-{base.dataset}-{base.model.replace(':', '_')}"
    mlflow.set_tracking_uri(client.tracking_uri)
    version = tracking.log_model(
        run_id, model, example, name, float(attrs["epsilon"]), base.target_delta, base.accountant
    )
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
def run_preset(sweep: SweepConfig, base) -> dict:
    """The BAM appendix protocol: stage 1 is a random search over (lr, lot size) for DP-SGD;
    stage 2 is a random search over λ for BAM and over ρ for DP-SAT, with stage 1's lr and lot
    size fixed. Each stage is its own study (and parent run)."""
    stage1 = dataclasses.replace(
        sweep,
        preset=None,
        sampler="random",
        study=f"{sweep.study}-stage1-dpsgd",
        space=sweep.space or default_space("dpsgd"),
    )
    s1 = run_sweep(stage1, dataclasses.replace(base, method="dpsgd"))
    if s1["best"] is None:
        raise dpcore.DPConfigError("stage 1 finished without a complete trial; stage 2 needs its best lr and lot size.")
    fixed = {k: v for k, v in s1["best"]["params"].items()}
    out = {"stage1": s1, "stage2": {}}
    for method, space in (
        ("bam", {"ascent": {"low": 1e-3, "high": 0.2, "log": True}}),
        ("dpsat", {"ascent": {"low": 1e-3, "high": 0.5, "log": True}}),
    ):
        st = dataclasses.replace(
            sweep, preset=None, sampler="random", study=f"{sweep.study}-stage2-{method}", space=space
        )
        out["stage2"][method] = run_sweep(st, base, fixed={**fixed, "method": method})
    return out


def print_summary(s: dict) -> None:
    print(
        f"study {s['study']}: {s['complete']} complete of {s['trials']} trials (target {s['n_trials']}); MLflow parent "
        f"run {s['parent_run_id']}"
    )
    if s["selection_total_epsilon"] is not None:
        print(
            f"private selection: the sweep's total ε = {s['selection_total_epsilon']:.4f} (best of a random number of trials, RDP)"
        )
    else:
        print("selection: the best trial was chosen on the validation split; that choice is not accounted in ε")
    b = s["best"]
    if b is None:
        print("no complete trial")
        return
    print(
        f"best trial {b['number']}: {b['params']}  validation {b['val_accuracy']:.4f}  test {b['test_accuracy']:.4f}  "
        f"ε={b['epsilon']:.4f}  σ={b['noise_multiplier']:.4f}  run {b['run_id']}"
    )
    if b["registered_model"]:
        print(f"model: {b['registered_model']} in the MLflow registry")


# ------------------------------------------------------------------------------------------
def build_parser(prog: str = "dp-platform sweep") -> argparse.ArgumentParser:
    from pipelines.config import add_config_arguments

    p = argparse.ArgumentParser(
        prog=prog,
        description="Hyperparameter sweep at a fixed (ε, δ): every trial is a DP training run with σ calibrated for its own "
        "lot size and epochs; Optuna chooses, Ray runs, MLflow records (one parent run, a child run per trial).",
        epilog="The YAML file may hold sweep options (study, storage, n_trials, ...), a 'space:' mapping and any training option. "
        "Watch a study live with: optuna-dashboard sqlite:///optuna.db",
    )
    p.add_argument("config", nargs="?", help="YAML file")
    g = p.add_argument_group("sweep")
    defaults = SweepConfig()
    g.add_argument(
        "--study", default=argparse.SUPPRESS, help=f"study name; the same name continues it (default: {defaults.study})"
    )
    g.add_argument(
        "--storage",
        default=argparse.SUPPRESS,
        help=f"Optuna RDB storage URL (default: $DP_OPTUNA_STORAGE, else {defaults.storage}; postgresql://... on a cluster)",
    )
    g.add_argument(
        "--n-trials",
        type=int,
        default=argparse.SUPPRESS,
        help=f"finished trials to reach (default: {defaults.n_trials})",
    )
    g.add_argument(
        "--max-concurrent",
        type=int,
        default=argparse.SUPPRESS,
        help=f"trials running at once (default: {defaults.max_concurrent})",
    )
    g.add_argument("--sampler", choices=SAMPLERS, default=argparse.SUPPRESS, help="tpe (default) or random")
    g.add_argument(
        "--pruner",
        choices=PRUNERS,
        default=argparse.SUPPRESS,
        help="none (default) or median (on intermediate validation accuracy)",
    )
    g.add_argument("--sampler-seed", type=int, default=argparse.SUPPRESS, help="seed of the sampler (public)")
    g.add_argument(
        "--heartbeat-interval",
        type=int,
        default=argparse.SUPPRESS,
        help=f"seconds between trial heartbeats (default {defaults.heartbeat_interval})",
    )
    g.add_argument(
        "--grace-period",
        type=int,
        default=argparse.SUPPRESS,
        help=f"seconds without heartbeat before a trial is stale and retried (default {defaults.grace_period})",
    )
    g.add_argument(
        "--max-retry",
        type=int,
        default=argparse.SUPPRESS,
        help=f"retries of a trial whose process died (default {defaults.max_retry})",
    )
    g.add_argument(
        "--private-selection",
        choices=selection.DISTRIBUTIONS,
        default=argparse.SUPPRESS,
        help="account the choice of the best trial (Papernot & Steinke): a random number of trials from this distribution",
    )
    g.add_argument(
        "--selection-mean",
        type=float,
        default=argparse.SUPPRESS,
        help=f"mean number of trials (default {defaults.selection_mean:g})",
    )
    g.add_argument(
        "--selection-shape",
        type=float,
        default=argparse.SUPPRESS,
        help="negative-binomial shape η (1 = geometric; default 1)",
    )
    g.add_argument(
        "--selection-noise-multiplier",
        type=float,
        default=argparse.SUPPRESS,
        help="σ of the noise on the validation count (default 2)",
    )
    g.add_argument(
        "--preset",
        choices=PRESETS,
        default=argparse.SUPPRESS,
        help="bam-appendix: stage 1 DP-SGD (lr, lot), stage 2 λ for BAM and ρ for DP-SAT",
    )
    add_config_arguments(p)
    return p


def check_args(argv: list[str]) -> None:
    """Parse and validate a sweep's arguments (config file, then flags), as ``dp-platform submit
    --sweep`` does before it uploads anything. Raises SystemExit on bad flags."""
    ns = vars(build_parser().parse_args(argv))
    load_sweep_config(ns.pop("config", None), ns)[1].validate()


def load_sweep_config(path: str | None, args: dict) -> tuple[SweepConfig, Any]:
    """(SweepConfig, base TrainConfig) from the YAML file and the flags (flags win)."""
    from pipelines.config import config_from_dict

    values: dict = {}
    if path is not None:
        import yaml

        p = Path(path)
        if not p.is_file():
            raise dpcore.DPConfigError(f"config file {str(p)!r} does not exist.")
        loaded = yaml.safe_load(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise dpcore.DPConfigError(f"config file {p} must hold a mapping.")
        values.update(loaded)
    values.update(args)
    sweep_vals = {k.replace("-", "_"): values.pop(k) for k in list(values) if k.replace("-", "_") in SWEEP_FIELDS}
    if "storage" not in sweep_vals and os.environ.get("DP_OPTUNA_STORAGE"):
        sweep_vals["storage"] = os.environ["DP_OPTUNA_STORAGE"]  # the cluster's shared study database
    if "num_workers" not in values:
        values["num_workers"] = 1  # a sweep's trials default to one worker each; --num-workers shards them
    return SweepConfig(**sweep_vals), config_from_dict(values)


def main(argv: list[str] | None = None, prog: str = "dp-platform sweep") -> int:
    args = vars(build_parser(prog).parse_args(argv))
    path = args.pop("config")
    try:
        sweep, base = load_sweep_config(path, args)
        if sweep.preset == "bam-appendix":
            out = run_preset(sweep, base)
            for name, s in [("stage 1 (DP-SGD)", out["stage1"])] + [
                (f"stage 2 ({m})", s) for m, s in out["stage2"].items()
            ]:
                print(f"== {name}")
                print_summary(s)
            return 0
        out = run_sweep(sweep, base)
    except dpcore.DPError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TypeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_summary(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

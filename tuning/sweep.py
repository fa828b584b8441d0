"""Hyperparameter sweeps under a fixed (ε, δ): Optuna on Ray, tracked in MLflow.

    dp-platform sweep                                   # 20 TPE trials over lr × lot size, ε=2, on digits
    dp-platform sweep sweep.yaml --n-trials 40          # a YAML file (sweep options, space:, and train options)
    dp-platform sweep --method bam --sampler random     # also searches λ
    dp-platform sweep --preset bam-appendix --n-trials 20   # stage 1 DP-SGD (lr, lot), stage 2 λ (BAM) and ρ (DP-SAT)
    dp-platform sweep --sampler random --private-selection poisson --selection-mean 8 --lot-size 256

Every trial is a full training run of the main job (``pipelines.train.run``) in a Ray task,
nested as a child MLflow run under the sweep's parent run, with its own σ calibrated for its
own lot size and epochs, and its own ledger. The study lives in an RDB storage (a SQLite file
by default, PostgreSQL on a cluster); running the same command again continues it. The driver
sends each running trial's heartbeat (:class:`tuning.trials.Heartbeats`); a trial whose process
dies, or whose driver dies, gets no more; once it is stale, Optuna marks it failed and
:class:`optuna.storages.RetryHeartbeatStaleTrialCallback` queues a retry with the same
parameters, which the next free slot runs.

Choosing the best trial looks at the validation split, which is carved out of the private
training data. Without ``--private-selection`` that choice is not accounted, and the parent
run says so (tag ``dp.selection``); the training split's cost of the whole search is then
bounded from the config alone, before any trial runs, and logged on the parent
(``search_epsilon_bound``, :mod:`tuning.search_cost`). With it, the number of trials is random
and the total (ε, δ) of releasing the best trial is accounted by RDP (:mod:`tuning.selection`).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from pathlib import Path

import dpcore
from dpcore.readout import epsilon_text
from pipelines import tracking
from pipelines.tracking import redact

from . import search_cost, selection
from .config import MEDIAN_PRUNER, SweepConfig
from .plan import SweepPlan, plan_sweep
from .pruning import TrialPruner
from .results import best_trial, finalise, finish_trial
from .selection import SCOPE
from .space import default_space
from .trials import Heartbeats, Progress, trial_seed, trial_task


def run_sweep(
    sweep: SweepConfig,
    base,
    space_override: dict | None = None,
    fixed: dict | None = None,
    *,
    prior: list | None = None,
    trial_hook=None,
) -> dict:
    """Run (or continue) one study. ``base`` is the TrainConfig shared by every trial; ``fixed``
    are config values set for every trial on top of it (the preset's stage 2), which the earlier
    stages ``prior`` (their summaries' ``_search``: (bound, K)) chose: this study's bound, and the
    ε of its registered model, then cover them too (:class:`tuning.search_cost.StagedBound`).
    ``trial_hook``: a test hook, called in each trial's task with its config dict before the
    trial runs."""
    from mlflow import MlflowClient

    plan = plan_sweep(sweep, base, space_override, fixed, prior)  # everything that can fail, first
    sweep, base, sel, bound = plan.sweep, plan.base, plan.sel, plan.bound
    study, n_trials = _open_study(plan)

    tracking.open_store(plan.tracking_uri)
    client = MlflowClient(plan.tracking_uri)
    parent_tags = _parent_tags(sweep, base, plan.space, sel, n_trials)
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
            client.set_tag(parent_id, "dp.sweep_total_epsilon", epsilon_text(sel["total_epsilon"]))
        # The bound holds for at most `cap` trials started, fixed here: the loop starts no more.
        # Without private selection: n_trials finished plus max_failed_trials failed (an error, or
        # a process that died); with it: exactly K (a failed run is one of them, never retried).
        cap = max(n_trials + (sweep.max_failed_trials if sel is None else 0), len(study.trials))
        search_cost.log(client, parent_id, bound, cap)
        stopped = _run_trials(plan, study, n_trials, cap, client, parent_id, trial_hook)
        summary = finalise(study, sweep, base, client, parent_id, sel, n_trials, bound, cap)
        summary["stopped"] = stopped
        own = bound.own if isinstance(bound, search_cost.StagedBound) else bound
        summary["_search"] = (own, max(cap, len(study.trials)))  # for a preset's total; not printed
        return summary


def _open_study(plan: SweepPlan) -> tuple:
    """(the study, created or continued, and how many trials it finishes). A study started with
    another space, base config or private-selection options is refused; with private
    selection the number of trials K is drawn once and kept in the study."""
    import optuna

    sweep, base, sel = plan.sweep, plan.base, plan.sel
    sampler_seed = sweep.sampler_seed
    if sel is not None:  # each trial's hyperparameters a fresh draw: from OS entropy, or --seed's (tests)
        seeded = None if base.seed is None else dpcore.make_randomness(base.seed).spawn("sampler")
        sampler_seed = None if seeded is None else int(seeded.uniform(1)[0] * 2**31)
    sampler = (
        optuna.samplers.TPESampler(seed=sampler_seed)
        if sweep.sampler == "tpe"
        else optuna.samplers.RandomSampler(seed=sampler_seed)
    )
    pruner = optuna.pruners.MedianPruner(**MEDIAN_PRUNER) if sweep.pruner == "median" else optuna.pruners.NopPruner()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name=sweep.study,
        storage=plan.storage,
        sampler=sampler,
        pruner=pruner,
        direction="maximize",
        load_if_exists=True,
    )
    fingerprint, attrs = plan.fingerprint(), study.user_attrs
    if "fingerprint" in attrs and attrs["fingerprint"] != fingerprint:
        raise dpcore.DPConfigError(
            f"study {sweep.study!r} in {redact(sweep.storage)} was started with a different space, base config or "
            "private-selection options (K's distribution, the score's noise); use a new --study name, or the same "
            "options to continue it."
        )
    if "fingerprint" not in attrs:
        study.set_user_attr("fingerprint", fingerprint)
    if sel is None:
        return study, sweep.n_trials
    if "selection_k" not in attrs:  # drawn once; a resumed sweep keeps it (a redraw would leak)
        k = selection.draw_number_of_trials(
            sweep.selection_mean,
            sweep.private_selection,
            sweep.selection_shape,
            dpcore.make_randomness(base.seed).spawn("selection-count"),
        )
        study.set_user_attr("selection_k", k)
    return study, int(study.user_attrs["selection_k"])


def _run_trials(plan: SweepPlan, study, n_trials: int, cap: int, client, parent_id: str, trial_hook) -> str | None:
    """Run the study's trials on Ray, at most ``max_concurrent`` at once and at most ``cap``
    started in all, until ``n_trials`` are finished. Returns why no more were launched (too
    many failed trials; also tagged on the parent run), or None."""
    import optuna
    import ray

    from pipelines.train import ray_cluster

    sweep, base, sel, space, storage = plan.sweep, plan.base, plan.sel, plan.space, plan.storage
    run_dir = Path(base.storage_path).resolve() / "sweeps" / sweep.study
    run_dir.mkdir(parents=True, exist_ok=True)
    progress = Progress(n_trials, not sweep.quiet)
    finished_states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    randomness = dpcore.make_randomness(base.seed) if sel is not None else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dpcore.SeededRandomnessWarning)
        with (
            ray_cluster(dataclasses.replace(base, num_workers=max(base.num_workers, sweep.max_concurrent))),
            Heartbeats(storage, sweep.heartbeat_interval) as heartbeats,
        ):
            run_trial = trial_task()
            inflight: dict = {}  # ObjectRef -> (trial, params)
            while True:
                optuna.storages.fail_stale_trials(study)
                trials = study.get_trials(deepcopy=False)
                done = sum(t.state in finished_states for t in trials)
                failed = [t for t in trials if t.state == optuna.trial.TrialState.FAIL]
                if sel is not None:  # a failed trial is one of the K runs of Q (with no score), not replaced
                    done += len(failed)
                mine = {t.number for t, _ in inflight.values()}
                foreign = sum(t.state == optuna.trial.TrialState.RUNNING and t.number not in mine for t in trials)
                stop = sel is None and (
                    len(failed) >= sweep.max_failed_trials
                    or (len(trials) >= cap and not inflight and not foreign and done < n_trials)
                )
                launchable = 0 if stop else min(n_trials - done - len(inflight) - foreign, cap - len(trials))
                while launchable > 0 and len(inflight) < sweep.max_concurrent:
                    trial = study.ask()
                    heartbeats.add(trial._trial_id)  # at once: Optuna never fails a RUNNING trial without a beat
                    params = space.suggest(trial)
                    ref = run_trial.remote(
                        *_trial_args(sweep, base, trial, params, parent_id),
                        str(run_dir / f"trial-{trial.number}.pid"),
                        trial_hook,
                        1.0 / sweep.max_concurrent,  # trials at once share the nodes' memory
                    )
                    inflight[ref] = (trial, params)
                    launchable -= 1
                    progress.show(done, len(inflight), best_trial(study), f"started trial {trial.number}: {params}")
                if not inflight:
                    if done >= n_trials or stop:
                        break
                    time.sleep(min(5, sweep.heartbeat_interval))  # foreign running trials: wait until they go stale
                    continue
                ready, _ = ray.wait(list(inflight), num_returns=1, timeout=sweep.heartbeat_interval)
                for ref in ready:
                    trial, params = inflight.pop(ref)
                    try:  # beaten while its outcome is written, so that no other driver fails it meanwhile
                        note = finish_trial(study, trial, ref, sel, randomness, client, parent_id)
                    finally:
                        heartbeats.discard(trial._trial_id)
                    trials = study.get_trials(deepcopy=False)
                    progress.show(
                        sum(t.state in finished_states for t in trials), len(inflight), best_trial(study), note
                    )
    if not stop:
        return None
    first = next((t.user_attrs["error"] for t in failed if "error" in t.user_attrs), "its process died")
    stopped = (
        f"{len(failed)} trials failed (max_failed_trials={sweep.max_failed_trials}), {done} finished of "
        f"{n_trials}, {len(study.trials)} started (at most {cap}); no more were launched. The first error: "
        f"{first[:500]}"
    )
    client.set_tag(parent_id, "sweep.stopped", stopped)
    progress.show(done, 0, best_trial(study), f"stopped: {stopped}")
    return stopped


def _trial_args(sweep: SweepConfig, base, trial, params: dict, parent_id: str) -> tuple:
    """The first arguments of :func:`tuning.trials.trial_task`'s task for one trial: its config
    (the base with the trial's parameters and own seed, no model logged, the test split only at
    its end: nothing the search looks at mid-trial, the pruner's reports among them, sees it), the
    parent run, its tags and its pruner."""
    cfg = dataclasses.replace(
        base,
        **params,
        seed=trial_seed(base.seed, trial.number),
        run_name=f"{sweep.study}-trial-{trial.number}",
        log_model=False,
        quiet=True,
        registered_model="none",
        test_every_report=False,
    )
    tags = {
        "optuna.study": sweep.study,
        "optuna.trial_number": str(trial.number),
        "optuna.trial_id": str(trial._trial_id),
    }
    pruner = None
    if sweep.pruner == "median":
        pruner = TrialPruner(sweep.storage, sweep.study, trial._trial_id, MEDIAN_PRUNER)
    return cfg.to_dict(), parent_id, tags, pruner


def _parent_tags(sweep: SweepConfig, base, space, sel: dict | None, n_trials: int) -> dict:
    """The sweep's parent run's tags: the target, how the selection is accounted, the search."""
    if sel is None:
        selection_tag = (
            "not accounted: the best trial is chosen on a validation split held out from the training data, "
            "whose privacy is not accounted; each trial's ε covers its training only"
        )
    else:
        selection_tag = (
            f"accounted (Papernot & Steinke 2022): K ~ {sweep.private_selection}(mean {sweep.selection_mean:g}"
            f"{'' if sweep.private_selection == 'poisson' else f', shape {sweep.selection_shape:g}'}), noisy validation "
            f"count σ={sweep.selection_noise_multiplier:g}; total ε={epsilon_text(sel['total_epsilon'], '.4g')} "
            f"at δ={base.target_delta:g} (RDP), "
            f"for the selected trial's release: {SCOPE}"
            + (
                ""
                if base.seed is None
                else f"; K, the score noise and the trials' draws are seeded (seed={base.seed}; not for production)"
            )
        )
    return {
        "dp.target_epsilon": f"{base.target_epsilon:g}",
        "dp.delta": f"{base.target_delta:g}",
        "dp.selection": selection_tag,
        "sweep.sampler": sweep.sampler,
        "sweep.pruner": sweep.pruner,
        "sweep.space": space.describe(),
        "sweep.n_trials": str(n_trials),
    }


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
        # stage 1 chose the fixed values on the validation split: each stage 2 is bounded over all it could have chosen
        out["stage2"][method] = run_sweep(st, base, fixed={**fixed, "method": method}, prior=[s1.get("_search")])
    # the three studies train on the same split: what they cost a training example together
    stages = [out["stage1"], *out["stage2"].values()]
    out["search_epsilon_bound"] = search_cost.combined([s.get("_search") for s in stages])
    return out

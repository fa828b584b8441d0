"""The main job: sharded DP training on Ray Train, with the run's ledger and model in MLflow.

    dp-platform train                               # digits, 2 workers, ε=2, δ=1e-5, ./mlflow.db
    dp-platform train run.yaml --target-epsilon 8   # a YAML config plus flag overrides
    python -m pipelines.train run.yaml              # the same; also the entrypoint for `ray job submit`
    dp-platform train --resume <mlflow run id>      # continue a run after the driver died

The driver does everything that can fail before any worker starts or any budget is spent:
it validates the config, checks the tracking store, loads (and ingests) the data and verifies
every shard, builds and validates the model, and calibrates σ from (ε, δ), N, the lot size
and the epochs. Then it starts (or joins) a Ray cluster, runs a ``TorchTrainer`` whose workers
run :func:`pipelines.train.worker.train_loop_per_worker`, and finally computes ε from the run's
ledger alone and logs the ledger, plots and model to MLflow.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import dpcore
from dpcore.readout import epsilon_text

from .. import tracking
from .._trace import trace
from ..config import TrainConfig
from ..faults import FaultInjection
from ..plan import RunPlan, plan_run, with_absolute_model
from .canaries import audit_result, ensure_audit
from .checkpoint import final_checkpoint, load_final_model
from .cluster import EarlyCluster, cluster_address, ray_cluster
from .metrics_relay import MetricsForwarder
from .progress import JournalProgress
from .resume import resume_plan
from .run_ledger import plds_for_workers


def _fit(plan: RunPlan, cfg: TrainConfig, pruner=None, faults=None, own_cluster: bool = False):
    """Ray Train's fit of the run; ``own_cluster``: on a cluster this run started (and stops),
    without the services only a shared cluster needs (:mod:`.lean`)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    if own_cluster:  # never in-process: that runs without a cluster
        from .lean import LeanTorchTrainer as TorchTrainer

    from .checkpoint import set_aside_torn_ray_snapshot
    from .entry import train_loop_per_worker

    torn = set_aside_torn_ray_snapshot(plan.run_dir)
    if torn is not None:
        logging.getLogger(__name__).warning(
            "Ray Train's checkpoint record of this run did not parse (a driver killed while Ray wrote it); "
            "moved to %s. The run restores its latest complete checkpoint from its folder.",
            torn,
        )
    # Ray Train's controller looks at its workers every 2 s by default, so each phase change
    # (workers up, training done) waits up to 2 s; half a second costs nothing measurable.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    if cfg.in_process:  # Ray Train's local mode: the training function runs here, in this process
        for name in ("ray.train.v2.api.config", "ray.train.v2._internal.execution.train_fn_utils"):
            logging.getLogger(name).setLevel(logging.WARNING)  # "Running in local mode", "Reported metrics: ..."
        scaling = ScalingConfig(num_workers=0)
    else:
        scaling = ScalingConfig(
            num_workers=cfg.num_workers, use_gpu=cfg.use_gpu, resources_per_worker=None if cfg.use_gpu else {"CPU": 1}
        )
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={  # pruner, faults, plds: not the run's record
            "plan": plan,
            "pruner": pruner,
            "faults": faults,
            "plds": [] if cfg.in_process else plds_for_workers(plan),  # in-process: this process has them
        },
        scaling_config=scaling,
        torch_config=TorchConfig(backend="nccl" if cfg.use_gpu else "gloo"),
        run_config=RunConfig(
            name=plan.ray_run_name,
            storage_path=plan.storage_path,
            failure_config=FailureConfig(max_failures=cfg.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )
    return trainer.fit()


def ensure_pca(plan: RunPlan, cfg: TrainConfig, client, run_id: str) -> None:
    """DP-PCA (Abadi et al. §4) on the driver, before any worker starts: the release is checked
    against the budget and written to the run's ledger journal (step 0) before the components
    are saved for the workers. A resumed run re-uses the saved components; if the driver died
    between the release and the save, the release is made (and ledgered) again."""
    if not cfg.pca_components or Path(plan.pca_path).is_file():
        return
    import torch

    from ..data import open_split

    ledger = open_run_ledger(plan)
    train = open_split(plan.data_dir, "train")
    result = dpcore.dp_pca(
        train.batch(torch.arange(len(train))),
        cfg.pca_components,
        cfg.pca_noise_multiplier,
        dpcore.make_randomness(cfg.seed).spawn("pca"),
        sample_rate=cfg.pca_sample_rate,
        ledger=ledger,
    )
    tmp = Path(plan.pca_path + ".tmp")
    torch.save({"components": result.components, "eigenvalues": result.eigenvalues}, tmp)
    os.replace(tmp, plan.pca_path)
    client.log_artifact(run_id, plan.pca_path, "dp_pca")


def open_run_ledger(plan: RunPlan, read_only: bool = False) -> dpcore.PrivacyLedger:
    """The run's ledger, from its journal (every release, committed or rolled back);
    ``read_only`` where the workers' rank 0 may still hold it (to report, not to record)."""
    cfg = plan.config
    return dpcore.PrivacyLedger(
        cfg["target_epsilon"],
        cfg["target_delta"],
        cfg["accountant"],
        epsilon_every=plan.epsilon_every,
        journal=plan.journal,
        read_only=read_only,
    )


def record_on_failure(client, run_id: str, plan: RunPlan) -> None:
    """A failed run's ε tag and ledger, from its journal as the workers left it (if it exists)."""
    if os.path.exists(plan.journal) and os.path.getsize(plan.journal) > 0:
        tracking.record_released(client, run_id, open_run_ledger(plan, read_only=True))


def run(
    cfg: TrainConfig | None = None,
    resume: str | None = None,
    resume_changes: dict | None = None,
    parent_run_id: str | None = None,
    extra_tags: dict | None = None,
    pruner: Callable[[float, int], bool] | None = None,
    faults: FaultInjection | None = None,
    memory_share: float = 1.0,
) -> dict:
    """Plan, train on Ray, log to MLflow. Returns a summary (run id, ε, accuracy, ...).

    With ``resume`` (an MLflow run id) the earlier run is continued with its own config; its
    tracking URI is ``cfg.tracking_uri``, and ``resume_changes`` may change only the options
    in :data:`RESUME_MAY_CHANGE`. A sweep passes ``parent_run_id`` (the run is nested under
    it), ``extra_tags``, and a ``pruner``: rank 0 then calls ``pruner(validation_accuracy, tenths of the run done)``
    at every checkpoint and stops the run early when it returns True (``summary["pruned"]``).
    The sweep's pruner reports to its Optuna trial (:class:`tuning.pruning.TrialPruner`).
    ``memory_share``: the fraction of each node's memory this run's workers there may plan for
    (``memory_budget_mb: auto``); a sweep running K trials at once gives each 1/K."""
    with EarlyCluster() as early:  # a local Ray cluster starts while the driver plans; stopped on any error
        if resume is not None:
            plan, cfg = resume_plan(resume, (cfg or TrainConfig()).tracking_uri, resume_changes or {})
            early.begin(cfg)
        else:
            cfg = with_absolute_model(cfg or TrainConfig())
            trace("run() start")
            if faults is not None:
                faults.check(cfg)
            plan = plan_run(cfg, on_checked=lambda: early.begin(cfg))
            plan.memory_share = memory_share
            trace("planned")
        return _run_planned(plan, cfg, resume, parent_run_id, extra_tags, pruner, faults, early)


def _run_planned(plan: RunPlan, cfg: TrainConfig, resume, parent_run_id, extra_tags, pruner, faults, early) -> dict:
    """The MLflow run around the fit and the logging of a planned run."""
    import mlflow
    from mlflow import MlflowClient

    tracking.open_store(plan.tracking_uri)
    client = MlflowClient(plan.tracking_uri)
    mlflow.set_tracking_uri(plan.tracking_uri)
    tags = None if resume is not None else {**tracking.dp_tags(cfg, plan), **(extra_tags or {})}
    with tracking.mlflow_run(
        client,
        experiment=cfg.experiment,
        run_name=plan.run_name,
        tags=tags,
        parent_run_id=parent_run_id,
        run_id=plan.run_id if resume is not None else None,
        on_failure=lambda run_id: record_on_failure(client, run_id, plan),
    ) as run_id:
        plan.run_id = run_id
        t0 = time.monotonic()
        if resume is None:
            Path(plan.run_dir).mkdir(parents=True, exist_ok=True)
            open_run_ledger(plan)  # creates the journal (its header): workers refuse to train without it
            client.log_batch(
                run_id, params=[mlflow.entities.Param(k, v) for k, v in tracking.params_of(cfg, plan).items()]
            )
            tracking.write_json_artifact(client, run_id, "config.json", cfg.to_dict())
            tracking.write_json_artifact(client, run_id, "split.json", plan.split_info)
            tracking.write_json_artifact(client, run_id, "spec.json", plan.to_dict())
        ensure_pca(plan, cfg, client, run_id)
        ensure_audit(plan, cfg)
        trace("mlflow run set up")
        with JournalProgress(plan, enabled=not cfg.quiet) as progress:
            return _fit_and_log(plan, cfg, client, run_id, t0, progress, pruner, faults, early)


def _fit_and_log(
    plan: RunPlan, cfg: TrainConfig, client, run_id: str, t0: float, progress, pruner, faults, early=None
) -> dict:
    """Train on Ray, then compute ε from the ledger and log the ledger, plots and model; each
    phase is on the progress line (before the first step) or on a line of its own (after the last)."""
    workers = "training in this process" if cfg.in_process else f"starting {cfg.num_workers} Ray Train worker(s)"
    if not cfg.in_process:
        progress.phase("connecting to Ray" if cluster_address(cfg) else "starting Ray")
    with (
        contextlib.nullcontext("in-process") if cfg.in_process else ray_cluster(cfg, early) as cluster,
        MetricsForwarder(client, run_id, plan.run_dir) as metrics_to_mlflow,
    ):
        trace("cluster ready")
        progress.phase(workers + (" (Ray is up)" if cluster == "started" else ""))
        result = _fit(plan, cfg, pruner, faults, own_cluster=cluster == "started")
        trace("fit returned")
        metrics_to_mlflow.drain()  # rank 0's last metrics, before the plots read them
        progress.steps_done()
        done = "training finished" if cfg.in_process else "Ray Train finished"
        progress.phase(done + ("; stopping the local Ray cluster" if cluster == "started" else ""))
    if result.error is not None:
        raise _worker_dp_error(result.error) or result.error
    ledger = open_run_ledger(plan, read_only=True)
    epsilon = ledger.epsilon()
    progress.phase(
        f"ε = {epsilon_text(epsilon, '.4f')} from the run's ledger ({cfg.accountant}); logging the ledger and plots to MLflow"
    )
    metrics = result.metrics or {}
    checkpoint = final_checkpoint(plan, cfg.num_workers, result.checkpoint)
    committed = ledger.committed_steps()
    meta = json.loads((Path(checkpoint) / "meta.json").read_text())
    if meta["releases"] != len(ledger) or meta["step"] != len(committed):
        raise RuntimeError(
            f"the last checkpoint ({checkpoint}: step {meta['step']}) is not the end of the ledger ({len(committed)} committed steps)"
        )
    model = load_final_model(plan, checkpoint)
    client.set_tag(run_id, "dp.epsilon", epsilon_text(epsilon))
    from .placement import read_placement

    placement = read_placement(plan)
    if placement:
        tracking.write_json_artifact(client, run_id, "placement.json", placement, artifact_path="ray")
        client.set_tag(run_id, "ray.nodes", str(len({p["node_id"] for p in placement})))
    tracking.log_ledger(client, run_id, ledger)
    client.log_metric(run_id, "final_epsilon", epsilon)
    if cfg.audit_canaries:
        progress.phase("scoring the audit's canaries")
    audit = audit_result(plan, cfg, checkpoint) if cfg.audit_canaries else None
    if audit is not None:
        tracking.log_audit(client, run_id, audit, epsilon)
    from ..plots import plot_run

    plot_run(client, run_id, ledger)

    from ..data import model_example

    if cfg.log_model:
        progress.phase("logging the model to MLflow" + ("" if tracking.skips_registry(cfg) else " and registering it"))
    version = tracking.log_run_model(
        run_id, model, model_example(plan.data_dir), epsilon, cfg, prefix="dp", data_dir=plan.data_dir
    )
    accuracy = metrics.get("test_accuracy")
    tracking.describe_run(client, run_id, plan.run_name, epsilon, cfg.target_delta, cfg.accountant, accuracy)
    trace("logged")
    return {
        "run_id": run_id,
        "experiment_id": client.get_run(run_id).info.experiment_id,
        "tracking_uri": plan.tracking_uri,
        "dataset": cfg.dataset,
        "train_examples": plan.dataset_size,
        "num_workers": cfg.num_workers,
        "in_process": bool(cfg.in_process),
        "epochs": cfg.epochs,
        "nodes": len({p["node_id"] for p in placement}),
        "steps": len(committed),
        "planned_steps": plan.steps,
        "releases": len(ledger),
        "rolled_back": sum(e.status != "committed" for e in ledger.entries),
        "replayed": sum(e.replayed for e in ledger.entries),
        "test_accuracy": metrics.get("test_accuracy", float("nan")),
        "val_accuracy": metrics.get("val_accuracy", float("nan")),
        "test_f1": metrics.get("test_f1", float("nan")),  # two-class tasks: F1 of class 1
        "classes": _class_names(plan),
        "epsilon": epsilon,
        "delta": cfg.target_delta,
        "accountant": cfg.accountant,
        "noise_multiplier": plan.noise_multiplier,
        "sample_rate": plan.sample_rate,
        "randomness": "secure" if cfg.seed is None else f"seeded (seed={cfg.seed})",
        "diagnostics": bool(cfg.diagnostics),
        "seconds": time.monotonic() - t0,
        "checkpoint": checkpoint,
        "registered_model": None if version is None else f"{version.name} v{version.version}",
        "pruned": bool(meta.get("pruned", False)),
        "audit": audit,
        "spec": plan,
        "ledger": ledger,
        "model": model,
    }


def _worker_dp_error(error: BaseException) -> dpcore.DPError | None:
    """A DPError raised inside a worker (e.g. a journal that does not match its checkpoint), so
    that its message reaches the user instead of Ray's generic TrainingFailedError."""
    failures = getattr(error, "worker_failures", None) or {}
    for exc in failures.values():
        seen = exc
        while seen is not None:
            if isinstance(seen, dpcore.DPError):
                return seen
            seen = getattr(seen, "cause", None) or seen.__cause__
    return None


def _class_names(plan: RunPlan) -> list[str] | None:
    """The dataset's class names where its manifest has them (text datasets)."""
    from ..data.shards import read_manifest

    return read_manifest(plan.data_dir).get("source", {}).get("classes")

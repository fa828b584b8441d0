"""``--resume``: the plan of an earlier run whose driver died, read back from MLflow."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import dpcore

from .. import tracking
from ..config import TrainConfig, config_from_dict

if TYPE_CHECKING:
    from ..plan import RunPlan

RESUME_MAY_CHANGE = ("quiet", "max_failures", "ray_address")


def resume_plan(run_id: str, tracking_uri: str, changes: dict) -> tuple[RunPlan, TrainConfig]:
    """The plan of an earlier run, to continue it after the driver died."""
    import mlflow
    from mlflow import MlflowClient

    from ..plan import RunPlan

    bad = sorted(set(changes) - set(RESUME_MAY_CHANGE))
    if bad:
        raise dpcore.DPConfigError(f"--resume cannot change {', '.join(bad)}: a resumed run keeps its config.")
    uri = tracking.resolve_tracking_uri(tracking_uri)
    tracking.check_tracking_uri(uri)
    db = tracking.sqlite_file(uri)
    if db is not None and not db.is_file():  # MLflow would make an empty store there, and find no run
        raise dpcore.DPConfigError(
            f"--resume {run_id}: no MLflow store at {db}: give the --tracking-uri the run was tracked in (or "
            "$MLFLOW_TRACKING_URI), or resume from the folder it was started in."
        )
    client = MlflowClient(uri)
    try:
        run = client.get_run(run_id)
    except mlflow.exceptions.MlflowException as e:
        raise dpcore.DPConfigError(f"--resume {run_id}: no such run in {uri} ({e.message.splitlines()[0]}).") from None
    if run.info.status == "FINISHED":
        raise dpcore.DPConfigError(f"run {run_id} is already finished; there is nothing to resume.")
    plan = RunPlan.from_dict(tracking.read_json_artifact(uri, run_id, "spec.json"))
    plan.tracking_uri = uri  # where the run was found (spec.json holds the URI it was started with)
    if not Path(plan.journal).is_file():
        raise dpcore.DPConfigError(
            f"run {run_id}'s ledger journal {plan.journal} is missing; without it the releases cannot be accounted for."
        )
    from .run_ledger import journal_is_locked

    if journal_is_locked(plan.journal):
        raise dpcore.DPConfigError(
            f"run {run_id} is still training somewhere (its ledger journal {plan.journal} is locked by a worker). "
            "Stop that job before resuming; two trainers on one run could spend the budget twice."
        )
    check_same_data(plan)
    plan.config.update(changes)
    cfg = config_from_dict(plan.config)
    recheck_max_releases(plan, cfg)
    return plan, cfg


def recheck_max_releases(plan: RunPlan, cfg: TrainConfig) -> None:
    """The number of steps the budget allows, computed again: the workers' budget check starts
    from ``plan.max_releases`` without composing, and a resumed plan comes from the run's
    ``spec.json`` in MLflow, which anyone who can write the run's artifacts can change (a raised
    count let a run pass its target ε, in helper-39's script 1.49 for a target of 1), or an older
    version may have computed with another accountant's numbers. About a second of the driver."""
    import logging

    allowed = dpcore.max_steps(
        plan.noise_multiplier,
        plan.sample_rate,
        cfg.target_epsilon,
        cfg.target_delta,
        cfg.accountant,
        prior_groups=cfg.prior_groups(),
        event=plan.step_event(),
    )
    if allowed != plan.max_releases:
        logging.getLogger(__name__).warning(
            "the resumed plan allowed %s steps; the budget allows %d, which the run keeps to",
            plan.max_releases,
            allowed,
        )
        plan.max_releases = allowed


def check_same_data(plan: RunPlan) -> None:
    """The dataset a resumed run trains on is the one it was planned on: verified against its
    manifest (every file whose stat changed is hashed again), with the planned N, input shape
    and classes, and the manifest's digest (every shard, so the split too). q = lot/N and σ were
    fixed for that N; a dataset ingested again in place would be trained on under the old plan's
    numbers (helper-31), and one ingested with another split seed would train on examples the
    run had evaluated and logged as held out (helper-36). Cached features (ScatterNet) are
    verified and compared the same way."""
    from ..data import CorruptShardError, data_digest, verify

    def verified(folder: str) -> dict:
        try:
            return verify(folder)
        except (CorruptShardError, OSError, ValueError) as e:
            raise dpcore.DPConfigError(f"--resume: the run's dataset {folder} does not verify: {e}") from None

    manifest = verified(plan.data_dir)
    n = sum(e["rows"] for e in manifest["files"] if e["split"] == "train")
    now = (n, list(manifest["input_shape"]), manifest.get("num_classes", plan.num_classes))
    then = (plan.dataset_size, list(plan.input_shape), plan.num_classes)
    if now != then:
        raise dpcore.DPConfigError(
            f"--resume: the run's dataset {plan.data_dir} changed since the run was planned (training examples, input "
            f"shape, classes: {then[0]}, {then[1]}, {then[2]} then; {now[0]}, {now[1]}, {now[2]} now). A resumed run "
            "keeps its plan (q = lot/N, σ); start a new run on the new data."
        )
    pairs = [(plan.data_dir, getattr(plan, "data_digest", None), manifest)]
    train_dir = getattr(plan, "train_data_dir", None)
    if train_dir and train_dir != plan.data_dir:
        pairs.append((train_dir, getattr(plan, "train_data_digest", None), verified(train_dir)))
    for k, (folder, digest, found) in enumerate(pairs):
        if digest is None:  # a plan from before the digest: pinned now, so the workers check it from here on
            setattr(plan, "data_digest" if k == 0 else "train_data_digest", data_digest(plan.storage_path, found))
            if len(pairs) == 1:
                plan.train_data_digest = plan.data_digest
        elif data_digest(plan.storage_path, found) != digest:
            raise dpcore.DPConfigError(
                f"--resume: the run's dataset {folder} was ingested again since the run was planned: its shards "
                "differ (same N, shape and classes; another split seed or other examples). The run's held-out "
                "splits would no longer be held out; start a new run on the new data."
            )

"""The Ray Train worker loop: sharded DP training with dpcore's step.

Every worker (rank r of W):

1. reads only its own training shards of the ingested Parquet dataset;
2. builds the model from the public ``init_seed`` (identical on every rank) and the private
   pieces from the driver's plan (σ, q, steps): a Poisson sampler over its shard, a
   :class:`dpcore.DPOptimizer` that adds noise on rank 0 only, and an all-reduce SUM of the
   clipped (and, from rank 0, noised) sums;
3. restores the latest checkpoint if there is one. The ledger is restored from its
   journal (rank 0), which also holds the releases made after that checkpoint: they are marked
   rolled back and stay counted. Rank 0 then broadcasts the ledger so that every rank takes
   the same budget decisions;
4. steps until the plan is done or the budget allows no further step, and every
   ``checkpoint_every`` steps reports metrics (rank 0: ε, validation and test accuracy and
   loss, throughput) together with a checkpoint: model, optimizer and ledger from rank 0, the
   sampler and noise-stream state of every rank.

Nothing computed on training data leaves the worker except through the noised update, unless
``diagnostics`` is on.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dpcore
from dpcore.ledger import COMMITTED

from .config import TrainConfig, config_from_dict
from .ingest import read_split
from .models import build_model

MODEL_FILE = "model.pt"
STATE_FILE = "state.pt"
LEDGER_FILE = "ledger.json"


def make_optimizer(cfg: TrainConfig, params) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr)
    return torch.optim.NAdam(params, lr=cfg.lr)


def allreduce_sum(tensors: list[torch.Tensor]) -> None:
    """The one collective of a step: SUM of every rank's (clipped, rank 0: noised) sums.
    The tensors are flattened into one buffer so that it is a single all-reduce."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def param_checksum(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in order: equal iff the parameters are bit-identical."""
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def evaluate(model, x, y, batch: int = 2048) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) on a held-out split."""
    if len(y) == 0:
        return float("nan"), float("nan")
    model.eval()
    correct, loss = 0, 0.0
    for i in range(0, len(y), batch):
        out = model(x[i : i + batch])
        correct += (out.argmax(1) == y[i : i + batch]).sum().item()
        loss += F.cross_entropy(out, y[i : i + batch], reduction="sum").item()
    model.train()
    return correct / len(y), loss / len(y)


def open_ledger(spec: dict, checkpoint_step: int | None, checkpoint_ledger: dict | None, rank: int, world: int) -> dpcore.PrivacyLedger:
    """Rank 0 opens the journal (every release so far), checks it against the checkpoint, marks
    the releases after the checkpoint as rolled back; then every rank gets the same ledger."""
    cfg = spec["config"]
    state = None
    if rank == 0:
        ledger = dpcore.PrivacyLedger(
            cfg["target_epsilon"], cfg["target_delta"], cfg["accountant"], epsilon_every=spec["epsilon_every"], journal=spec["journal"]
        )
        if checkpoint_ledger is not None and len(ledger) < len(checkpoint_ledger["entries"]):
            raise dpcore.DPConfigError(
                f"the ledger journal {spec['journal']} holds {len(ledger)} releases but the checkpoint holds "
                f"{len(checkpoint_ledger['entries'])}: the journal was lost or truncated, so releases after the "
                "checkpoint cannot be accounted for. Refusing to resume."
            )
        after = checkpoint_step or 0
        if any(e.status == COMMITTED and e.step > after for e in ledger.entries):
            ledger.mark_rolled_back(after)
        state = ledger.state_dict()
    if world > 1:
        box = [state]
        dist.broadcast_object_list(box, src=0)
        state = box[0]
    if rank != 0:
        ledger = dpcore.PrivacyLedger(cfg["target_epsilon"], cfg["target_delta"], cfg["accountant"], epsilon_every=spec["epsilon_every"])
        ledger.load_state_dict(state)
    return ledger


def _quiet_ray_train_logs() -> None:
    """Ray Train logs every report and checkpoint at INFO (its loggers are named by file path);
    the driver shows progress from the ledger journal instead."""
    import logging

    import ray.train.v2._internal.execution.context as c
    import ray.train.v2._internal.execution.storage as s

    for mod in (c, s):
        for name in (mod.__file__, mod.__name__):
            logging.getLogger(name).setLevel(logging.WARNING)


def _complete(d: Path, world: int) -> dict | None:
    """The meta of checkpoint directory ``d`` if every file of every rank is there, else None."""
    names = ["meta.json", MODEL_FILE, STATE_FILE, LEDGER_FILE] + [f"rank-{r}.pt" for r in range(world)]
    if not all((d / n).is_file() for n in names):
        return None
    try:
        meta = json.loads((d / "meta.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return meta if meta.get("world_size") == world else None


def complete_checkpoints(run_dir: str, world: int, reported=None) -> list[tuple[int, int, str]]:
    """(releases, step, path) of every complete checkpoint of the run, oldest state first:
    the one Ray reported (if any) and every ``checkpoint_*`` directory in the run's (local) storage."""
    candidates = []
    if reported is not None:
        with reported.as_directory() as d:
            meta = _complete(Path(d), world)
            if meta is not None:
                candidates.append((meta["releases"], meta["step"], str(reported.path)))
    if Path(run_dir).is_dir():
        for d in Path(run_dir).glob("checkpoint_*"):
            meta = _complete(d, world)
            if meta is not None:
                candidates.append((meta["releases"], meta["step"], str(d)))
    return sorted(candidates)


def find_checkpoint(spec: dict, reported, rank: int, world: int):
    """The checkpoint to restore: the latest complete one in the run's storage.

    Ray Train registers a reported checkpoint asynchronously, so a worker that dies right after
    a report can leave the newest checkpoint on disk but unknown to the controller. Rank 0
    therefore also scans the run directory (local storage) and takes the complete checkpoint
    with the most ledger releases — the latest state of the latest timeline — and broadcasts
    its path so that every rank restores the same one.
    """
    import ray.train

    choice = None
    if rank == 0:
        candidates = complete_checkpoints(spec["run_dir"], world, reported)
        choice = candidates[-1][2] if candidates else None
    if world > 1:
        box = [choice]
        dist.broadcast_object_list(box, src=0)
        choice = box[0]
    if choice is None:
        return None
    if reported is not None and str(reported.path) == choice:
        return reported
    return ray.train.Checkpoint.from_directory(choice)


def train_loop_per_worker(spec: dict) -> None:
    """Ray Train entry point. ``spec`` is built by the driver (:func:`pipelines.train.plan_run`)."""
    import ray.train

    cfg = config_from_dict(spec["config"])
    _quiet_ray_train_logs()
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = torch.device(f"cuda:{ctx.get_local_rank()}" if cfg.use_gpu else "cpu")
    if cfg.use_gpu:
        torch.cuda.set_device(device)
    if cfg.seed is not None:
        import warnings

        warnings.simplefilter("ignore", dpcore.SeededRandomnessWarning)  # the driver already warned and tagged the run

    train = read_split(spec["data_dir"], "train", rank, world)
    x_train, y_train = train.x.to(device), train.y.to(device)
    if rank == 0:
        val, test = read_split(spec["data_dir"], "val"), read_split(spec["data_dir"], "test")
        held_out = {k: (s.x.to(device), s.y.to(device)) for k, s in (("val", val), ("test", test))}

    torch.manual_seed(cfg.init_seed)  # public: identical initial weights on every rank
    model = build_model(cfg.model, tuple(spec["input_shape"]), spec["num_classes"], cfg.replace_batchnorm).to(device)
    optimizer = make_optimizer(cfg, model.parameters())

    checkpoint = find_checkpoint(spec, ray.train.get_checkpoint(), rank, world)
    start_step, rank_state, ckpt_ledger = 0, None, None
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            d = Path(d)
            meta = json.loads((d / "meta.json").read_text())
            if meta["world_size"] != world:
                raise dpcore.DPConfigError(f"the checkpoint was written by {meta['world_size']} workers, not {world}; resume with the same num_workers.")
            start_step = meta["step"]
            model.load_state_dict(torch.load(d / MODEL_FILE, map_location=device))
            shared = torch.load(d / STATE_FILE, map_location=device, weights_only=False)
            rank_state = torch.load(d / f"rank-{rank}.pt", weights_only=False)
            ckpt_ledger = json.loads((d / LEDGER_FILE).read_text())

    ledger = open_ledger(spec, start_step if checkpoint is not None else None, ckpt_ledger, rank, world)
    private = dpcore.build_private(
        model,
        optimizer,
        F.cross_entropy,
        noise_multiplier=spec["noise_multiplier"],
        sample_rate=spec["sample_rate"],
        steps=spec["steps"],
        dataset_size=spec["dataset_size"],
        target_epsilon=cfg.target_epsilon,
        target_delta=cfg.target_delta,
        clip_norm=cfg.clip_norm,
        accountant=cfg.accountant,
        randomness=dpcore.make_randomness(cfg.seed),
        ledger=ledger,
        shard=torch.arange(len(y_train)),
        rank=rank,
        reduce_fn=allreduce_sum if world > 1 else None,
        physical_batch_size=cfg.physical_batch_size,
    )
    if checkpoint is not None:
        private.optimizer.load_state_dict({**shared["optimizer"], "randomness": rank_state["noise"]})
        private.sampler.load_state_dict(rank_state["sampler"])
    if private.sampler.step != start_step or private.optimizer.steps_taken != start_step:
        raise RuntimeError(f"inconsistent checkpoint: sampler at {private.sampler.step}, optimizer at {private.optimizer.steps_taken}, meta at {start_step}")

    tracker = _Tracker(spec) if rank == 0 else None
    every = spec["checkpoint_every"]
    event = private.optimizer.event
    t_last, step_last = time.monotonic(), start_step
    step = start_step
    last_reported = start_step if checkpoint is not None else -1
    while step < spec["steps"]:
        if ledger.allowance(event) < 1:  # the budget is spent (e.g. by rolled-back releases)
            break
        lot = private.sampler.sample()
        private.optimizer.accumulate(x_train[lot], y_train[lot])
        private.optimizer.step()
        step += 1
        if cfg.fault_at_step == step and rank == cfg.fault_rank:
            marker = Path(spec["run_dir"]) / "fault-injected"
            if not marker.exists():
                marker.write_text(f"rank {rank} died after step {step}\n")
                os._exit(17)  # a hard crash: no cleanup, no report
        if step % every == 0 or step == spec["steps"]:
            now = time.monotonic()
            rate = (step - step_last) / max(now - t_last, 1e-9)
            t_last, step_last = now, step
            _report(spec, cfg, private, model, rank, world, step, rate, tracker, held_out if rank == 0 else None, x_train, y_train)
            last_reported = step
    if last_reported != step:  # stopped early at the budget
        _report(spec, cfg, private, model, rank, world, step, float("nan"), tracker, held_out if rank == 0 else None, x_train, y_train)


def _report(spec, cfg, private, model, rank, world, step, rate, tracker, held_out, x_train, y_train) -> None:
    import ray.train

    final = step == spec["steps"] or private.ledger.allowance(private.optimizer.event) < 1
    checksum = param_checksum(model)
    metrics: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        torch.save(
            {"sampler": private.sampler.state_dict(), "noise": private.optimizer.randomness.state_dict(), "param_sha256": checksum},
            d / f"rank-{rank}.pt",
        )
        (d / f"rank-{rank}.sha256").write_text(checksum + "\n")
        if rank == 0:
            (val_acc, val_loss), (test_acc, test_loss) = (evaluate(model, *held_out[k]) for k in ("val", "test"))
            metrics = {
                "step": step,
                "epsilon": private.ledger.epsilon(),
                "val_accuracy": val_acc,
                "val_loss": val_loss,
                "test_accuracy": test_acc,
                "test_loss": test_loss,
                "steps_per_second": rate,
                "expected_examples_per_second": rate * spec["sample_rate"] * spec["dataset_size"],
                "committed_steps": len(private.ledger.committed_steps()),
                "releases": len(private.ledger),
                "final": float(final),
            }
            if cfg.diagnostics:  # NON-PRIVATE: computed on rank 0's training shard, not noised
                acc, loss = evaluate(model, x_train, y_train)
                norms = private.optimizer.diagnostics(x_train[:512], y_train[:512])["per_sample_norms"]
                metrics.update(
                    {
                        "diag_train_accuracy": acc,
                        "diag_train_loss": loss,
                        "diag_clip_fraction": float((norms > cfg.clip_norm).float().mean()),
                        "diag_nonfinite_skipped": float(private.optimizer.diagnostics()["nonfinite_examples_skipped"]),
                    }
                )
            torch.save(model.state_dict(), d / MODEL_FILE)
            opt_state = private.optimizer.state_dict()
            torch.save({"optimizer": {"optimizer": opt_state["optimizer"], "steps_taken": opt_state["steps_taken"]}}, d / STATE_FILE)
            (d / LEDGER_FILE).write_text(json.dumps(private.ledger.state_dict()))
            meta = {"step": step, "releases": len(private.ledger), "world_size": world, "final": final, "run_id": spec["run_id"]}
            (d / "meta.json").write_text(json.dumps(meta))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
    if tracker is not None:
        tracker.log(metrics, step)


class _Tracker:
    """Rank 0 logs each report's metrics to the run's MLflow run as they happen."""

    def __init__(self, spec: dict):
        from mlflow import MlflowClient

        self.client = MlflowClient(spec["tracking_uri"])
        self.run_id = spec["run_id"]

    def log(self, metrics: dict, step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        batch = [Metric(k, float(v), ts, step) for k, v in metrics.items() if k not in ("step", "final") and v == v]
        self.client.log_batch(self.run_id, metrics=batch)

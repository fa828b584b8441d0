"""The Ray Train worker loop: sharded DP training with dpcore's step.

Every worker (rank r of W):

1. reads only its own training shards of the ingested dataset (Arrow IPC files);
2. builds the model from the public ``init_seed`` (identical on every rank) and the private
   pieces from the driver's plan (σ, q, steps): a Poisson sampler over its shard, a
   :class:`dpcore.DPOptimizer` that adds noise on rank 0 only, and an all-reduce SUM of the
   clipped (and, from rank 0, noised) sums;
3. restores the latest checkpoint if there is one. The ledger is restored from its
   journal (rank 0), which also holds the releases made after that checkpoint: those whose
   updates the replay log kept are applied again (:mod:`.replay`), the others are marked
   rolled back and stay counted. Rank 0 then broadcasts how many steps are left so that every
   rank takes the same budget decisions;
4. steps until the plan is done or the budget allows no further step, and every
   ``checkpoint_every`` steps reports metrics (rank 0: ε, validation and test accuracy and
   loss, throughput) together with a checkpoint: model, optimizer (with DP-SAT's previous
   released gradient), ledger and, with ``ema_decay``, the EMA state and averaged model from
   rank 0; the sampler, noise-stream and augmentation state of every rank.

Nothing computed on training data leaves the worker except through the noised update, unless
``diagnostics`` is on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..plan import RunPlan

import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dpcore

from .._trace import trace
from ..config import TrainConfig, config_from_dict
from ..data import open_split
from ..models import build_run_model, split_public_front
from . import replay
from .build import ShardInputs, check_planned_data, load_pca, make_optimizer, private_arguments
from .checkpoint import (
    AUDIT_FILE,
    find_checkpoint,
    read_checkpoint,
    remove_stale_scratch,
)
from .metrics_relay import MetricsFile
from .placement import memory_status, record_placement
from .progress import note_phase
from .report import report as _report
from .run_ledger import open_ledger


@torch.no_grad()
def _quiet_ray_train_logs() -> None:
    """Ray Train logs every report and checkpoint at INFO (its loggers are named by file path);
    the driver shows progress from the ledger journal instead."""
    import logging

    import ray.train.v2._internal.execution.context as c
    import ray.train.v2._internal.execution.storage as s

    for mod in (c, s):
        for name in (mod.__file__, mod.__name__):
            logging.getLogger(name).setLevel(logging.WARNING)


def train_loop_per_worker(plan: RunPlan, pruner=None, faults=None) -> None:
    """Ray Train entry point. ``plan`` is built by the driver (:func:`pipelines.plan.plan_run`);
    ``pruner(validation_accuracy, tenths of the run done) -> stop?`` is called by rank 0 at each checkpoint."""
    from ..allocator import keep_freed_memory

    trace("worker entry")
    keep_freed_memory()  # this process is ours: reuse freed memory across steps (DP_MALLOC_TUNE=0: off)
    w = Worker(plan, pruner, faults)  # model, shard and optimizer: the same public start on every rank
    w.restore()  # the latest complete checkpoint, the ledger, the private step, EMA, audit canaries
    step, every = w.start_step, plan.checkpoint_every
    t_last, step_last = time.monotonic(), step
    trace("loop start")
    while step < w.last_step:
        if step == w.start_step + 1:
            trace("first step done")
        w.train_step(step)
        step += 1
        w.maybe_fail(step)  # a test hook: a hard crash of one rank after a given step
        if step % every == 0 or step == w.last_step:
            now = time.monotonic()
            rate = (step - step_last) / max(now - t_last, 1e-9)
            t_last, step_last = now, step
            if w.report(step, rate):  # Optuna's pruner stopped this trial; every rank got the decision
                break
    w.finish(step)


class Worker:
    """One rank's part of a run: built from the plan, restored from the latest checkpoint, then
    stepped and reported by :func:`train_loop_per_worker`."""

    def __init__(self, plan: RunPlan, pruner=None, faults=None):
        import ray.train

        self.plan, self.pruner, self.faults = plan, pruner, faults
        self.cfg = cfg = config_from_dict(plan.config)
        _quiet_ray_train_logs()
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.local_world = ctx.get_local_world_size()  # this run's workers on this node
        record_placement(plan, self.rank)
        if self.rank == 0:
            note_phase(plan, f"{self.world} worker(s) up; loading the data")
        self.device = _device(cfg)
        if cfg.seed is not None:
            import warnings

            warnings.simplefilter("ignore", dpcore.SeededRandomnessWarning)  # the driver already warned and tagged
        torch.manual_seed(cfg.init_seed)  # public: identical initial weights on every rank
        self.model = build_run_model(cfg, tuple(plan.input_shape), plan.num_classes, load_pca(plan)).to(self.device)
        # Then secret: dropout (tv: models) draws from torch's generator in lot order (dpcore.randomness.torch_seed).
        torch.manual_seed(dpcore.randomness.torch_seed(dpcore.make_randomness(cfg.seed).spawn("model", self.rank)))
        # With cached features (ScatterNet), the workers read the features and train the rest of the model.
        self.front, self.trained = split_public_front(self.model) if plan.features else (None, self.model)
        data_dir = plan.train_data_dir or plan.data_dir
        check_planned_data(plan, data_dir)
        self.canaries = torch.load(plan.audit_path) if self.rank == 0 and plan.audit_path else None
        trace("model built")
        self.train = ShardInputs(
            open_split(data_dir, "train", self.rank, self.world), self.device, self._input_canaries()
        )
        trace("data opened")
        self.held_out = {k: open_split(data_dir, k) for k in ("val", "test")} if self.rank == 0 else None
        if self.rank == 0:
            note_phase(plan, f"data loaded ({len(self.train)} training examples on rank 0); the first step")
        self.optimizer = make_optimizer(cfg, self.model)
        self.replay_log = None  # rank 0's writer of the released updates, opened by restore()
        self.peak_anon = 0.0  # the largest anonymous resident set seen at a report (Linux keeps no peak of it)

    def _input_canaries(self):
        """Black-box canaries in the data: rank 0's shard holds them, sampled like any example."""
        if self.canaries is None or self.canaries["kind"] != "input":
            return None
        keep = self.canaries["included"]
        x = self.canaries["x"][keep].to(self.device)
        if self.front is not None:
            with torch.no_grad():
                x = self.front(x)
        return x, self.canaries["y"][keep]

    def restore(self) -> None:
        """The latest complete checkpoint (if any), the run's ledger and how many steps it
        allows, and the private step built on them."""
        import ray.train

        plan, cfg, rank = self.plan, self.cfg, self.rank
        remove_stale_scratch(plan, rank)  # what a killed earlier attempt of this rank left in the temporary directory
        checkpoint = find_checkpoint(plan, ray.train.get_checkpoint(), rank, self.world)
        meta, shared, rank_state, ckpt_ledger = read_checkpoint(checkpoint, rank, self.world, self.device)
        if meta is not None:
            self.model.load_state_dict(shared["model"])
        checkpoint_step = meta["step"] if meta is not None else 0
        self.reported_releases = meta["releases"] if meta is not None else -1
        trace("checkpoint looked up")
        layout = replay.layout_of(replay.trainable(self.trained))
        self.ledger, allowance, upto, segment = open_ledger(plan, meta, ckpt_ledger, rank, self.world, layout)
        self.start_step = upto  # the checkpoint, carried forward by the replay log's releases
        self.last_step = upto + allowance  # the plan, or fewer if rolled-back releases used up budget
        trace("ledger opened")
        self.private = dpcore.build_private(
            self.trained,
            self.optimizer,
            F.cross_entropy,
            **private_arguments(cfg, plan, rank, self.world, len(self.train), self.ledger),
        )
        trace("private built")
        fitted = self._fit_physical_batch(rank_state)
        self.ema = dpcore.ParameterEMA(self.model, cfg.ema_decay) if cfg.ema_decay is not None else None
        if meta is not None:
            self.private.optimizer.load_state_dict({**shared["optimizer"], "randomness": rank_state["noise"]})
            self.private.sampler.load_state_dict(rank_state["sampler"])
            if self.ema is not None:
                self.ema.load_state_dict(shared["ema"])
            if self.private.optimizer.augment is not None and "augment" in rank_state:
                self.private.optimizer.augment.load_state_dict(rank_state["augment"])
        self.audit = self._gradient_canaries(checkpoint)
        if self.faults is not None:  # the crash tests' hook: a second crash in this replay
            self.faults.arm_replay(plan.run_dir, rank, self.private.optimizer)
        replay.apply(self, segment, checkpoint_step, upto)
        trace("replayed")
        self.replay_log = (
            replay.writer(plan, self.private.optimizer.params, checkpoint_step, upto, segment) if rank == 0 else None
        )
        if self.private.sampler.step != self.start_step or self.private.optimizer.steps_taken != self.start_step:
            raise RuntimeError(
                f"inconsistent checkpoint: sampler at {self.private.sampler.step}, optimizer at "
                f"{self.private.optimizer.steps_taken}, meta at {self.start_step}"
            )
        self.tracker = MetricsFile(plan.run_dir) if rank == 0 else None
        if self.tracker is not None:
            # The path clipping="auto" chose from the model and method, before any data was seen.
            # (Whether book-keeping's check later falls back to vmap is decided at the first batch,
            # on inputs drawn from a fixed seed, not the batch: the workers' warning says so.)
            self.tracker.tag("clipping.chosen", self.private.optimizer.clipping)
            # The most one example can move a lot's computed sum, in units of C, with every rounding
            # (dpcore.clipping.float_sensitivity): from N, the physical batch size and the workers.
            self.tracker.tag("clipping.float_sensitivity", f"{self.private.optimizer.float_sensitivity:.7f}")
            if self.cfg.model.startswith("hf:"):  # 'auto' was resolved by the plan, from the model folder (public)
                self.tracker.tag("text.pooling", self.model.pooling)
            if fitted is not None:
                self.tracker.tag("physical_batch_size.fitted", str(fitted["physical_batch_size"]))
                if fitted.get("measured"):
                    mib = fitted["per_example_bytes"] / 2**20
                    self.tracker.tag("physical_batch_size.per_example_mib", f"{mib:.3f}")
                    self.tracker.tag("physical_batch_size.budget_mib", f"{fitted['budget_bytes'] / 2**20:.0f}")
                    peak = fitted.get("checked_peaks", {}).get(fitted["physical_batch_size"])
                    if peak is not None:  # the fitted size itself, measured (above the probes' sizes)
                        self.tracker.tag("physical_batch_size.peak_mib", f"{peak / 2**20:.0f}")
                if fitted.get("over_budget"):  # auto: even one example measured over the budget; run at 1
                    self.tracker.tag("physical_batch_size.over_budget", "true")
                    note_phase(
                        plan, "warning: one example's gradients measure over the auto memory budget; physical batch 1"
                    )

    def _fit_physical_batch(self, rank_state) -> dict | None:
        """The physical batch size (memory, not privacy): the one the checkpoint recorded, so that
        a resumed run sums its lots in the same pieces (a seeded run then stays bit-identical);
        else the largest that fits the memory budget, measured by probes on random data shaped
        like this rank's shard (nothing is released). None: no budget."""
        cfg, opt = self.cfg, self.private.optimizer
        if rank_state is not None and "physical_batch_size" in rank_state:
            opt.physical_batch_size = int(rank_state["physical_batch_size"])
            return {"physical_batch_size": opt.physical_batch_size, "measured": False, "reason": "the checkpoint's"}
        budget = cfg.memory_budget()
        if budget == 0:
            return None
        if budget == "auto":  # this worker's share: the run's share of the node, over its workers there
            budget_bytes = dpcore.memory.auto_budget_bytes(self.device, self.plan.memory_share / self.local_world)
            if budget_bytes is None:
                return None
        else:
            budget_bytes = int(budget * 2**20)
        probe = torch.arange(min(len(self.train), cfg.physical_batch_size))  # each rank fits its own
        return opt.fit_physical_batch_size(
            self.train.batch(probe), self.train.labels(probe), budget_bytes, at_least_one=budget == "auto"
        )

    def _gradient_canaries(self, checkpoint) -> dict | None:
        """White-box canaries live in rank 0's shard: their scores so far, and how they join lots."""
        if self.canaries is None or self.canaries["kind"] != "gradient":
            return None
        coords = self.canaries["coords"]
        audit = {
            "coords": coords,
            "in": coords[self.canaries["included"]],
            "scores": torch.zeros(len(coords), dtype=torch.float64),
            "root": dpcore.make_randomness(self.cfg.seed),
            "value": self.cfg.clip_norm * (1.0 - dpcore.clipping.CLIP_MARGIN),
        }
        if checkpoint is not None:
            with checkpoint.as_directory() as d:
                audit["scores"] = torch.load(Path(d) / AUDIT_FILE)
        return audit

    def train_step(self, step: int) -> None:
        """One private step: a Poisson lot of this rank's shard, clipped, summed, released."""
        opt, audit = self.private.optimizer, self.audit
        lot = self.private.sampler.sample()
        opt.accumulate(self.train.batch(lot), self.train.labels(lot))
        if audit is not None:  # canaries in the data join the lot at rate q, like every example
            draw = audit["root"].spawn("audit-sampling", step).uniform(len(audit["in"]))
            opt.add_coordinate_examples(
                audit["in"][dpcore.sampling.included(draw, self.plan.sample_rate)], audit["value"]
            )
        opt.step()
        if self.replay_log is not None:  # a queue entry here; checksummed and written by its own thread
            self.replay_log.append(step + 1, opt.released_update())
        if audit is not None:  # white-box score: the released (noised) gradient along each canary
            released = torch.cat([p.grad.reshape(-1) for p in opt.params.values()])
            audit["scores"] += released[audit["coords"].to(released.device)].double().cpu()
        if self.ema is not None:
            self.ema.update()

    def maybe_fail(self, step: int) -> None:
        """The crash tests' hook (:class:`pipelines.faults.FaultInjection`): die once, hard."""
        if self.faults is not None:
            self.faults.maybe_fail(self.plan.run_dir, self.rank, step, self.plan.journal, self.replay_log)

    def report(self, step: int, rate: float) -> bool:
        """Metrics and a checkpoint; True if the run was pruned."""
        if self.rank == 0 and step == self.last_step:
            note_phase(self.plan, "last step done; evaluating on the validation and test splits, saving the checkpoint")
        self.peak_anon = max(self.peak_anon, memory_status().get("rss_anon_mib", 0.0))
        self.reported_releases, pruned = _report(
            self.plan,
            self.cfg,
            self.private,
            self.model,
            self.ema,
            self.rank,
            self.world,
            step,
            self.last_step,
            rate,
            self.tracker,
            self.held_out,
            self.train,
            self.audit,
            self.pruner,
        )
        if self.world > 1:
            # ray.train.report returns once this rank's own part is uploaded; the other ranks' may
            # still be in flight. Rank 0 rotates the replay log (deleting the segment the previous
            # checkpoint needs) only once every rank's part is stored: a rank dying mid-upload
            # left the previous checkpoint the latest complete one, with its segment gone, and
            # its releases were rolled back instead of replayed (helper-39).
            dist.barrier()
        if self.replay_log is not None:  # the checkpoint of `step` is complete: the log starts again after it
            self.replay_log.rotate(step)
        return pruned

    def finish(self, step: int) -> None:
        """Record the memory used; if the run was restored right at its budget (the rolled-back
        releases used it up), the restored state is the final one, but the ledger has grown
        since that checkpoint: report it again."""
        self.peak_anon = max(self.peak_anon, memory_status().get("rss_anon_mib", 0.0))
        record_placement(self.plan, self.rank, {**memory_status(), "peak_rss_anon_mib": self.peak_anon})
        need = self.reported_releases != len(self.ledger) if self.rank == 0 else None
        if self.world > 1:
            box = [need]
            dist.broadcast_object_list(box, src=0)
            need = box[0]
        if need:
            self.report(step, float("nan"))
        if self.replay_log is not None:  # the final checkpoint holds every release: nothing to replay
            self.replay_log.close(remove=True)


def _device(cfg: TrainConfig) -> torch.device:
    if cfg.use_gpu and cfg.in_process:
        return torch.device("cuda", torch.cuda.current_device())
    if cfg.use_gpu:
        from ray.train.torch import get_device

        device = get_device()  # the GPU Ray assigned to this worker
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")

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
   loss, throughput) together with a checkpoint: model, optimizer (with DP-SAT's previous
   released gradient), ledger and, with ``ema_decay``, the EMA state and averaged model from
   rank 0; the sampler, noise-stream and augmentation state of every rank.

Nothing computed on training data leaves the worker except through the noised update, unless
``diagnostics`` is on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .plan import RunPlan

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

from ._trace import trace
from .config import TrainConfig, config_from_dict
from .data import MappedSplit, open_split, sha256_file
from .models import build_run_model, split_public_front

MODEL_FILE = "model.pt"
EMA_MODEL_FILE = "ema_model.pt"
STATE_FILE = "state.pt"
LEDGER_FILE = "ledger.json"
AUDIT_FILE = "audit_scores.pt"
PCA_FILE = "pca.pt"


def step_event(plan: RunPlan) -> dpcore.PrivacyEvent:
    """The privacy event of one training step of the run (Gaussian or Laplace)."""
    return plan.step_event()


def method_options(cfg: TrainConfig, plan: RunPlan, rank: int) -> dict:
    """DPOptimizer's method arguments for the run's config."""
    augment = None
    if cfg.augmentation_multiplicity > 1:
        from .augment import CropFlipMultiplicity

        augment = CropFlipMultiplicity(
            cfg.augmentation_multiplicity, cfg.augment_padding, cfg.augment_flip, seed=cfg.init_seed * 1000 + rank
        )
    return {
        "method": cfg.method,
        "ascent": dpcore.ascent_schedule(
            cfg.resolved_ascent(), cfg.ascent_schedule, plan.steps, cfg.ascent_warmup_fraction
        ),
        "bam_variant": cfg.bam_variant,
        "noise": cfg.noise,
        "clip_norm_type": cfg.clip_norm_type,
        "augment": augment,
        "augmentation_multiplicity": cfg.augmentation_multiplicity,
        "diagnostics": cfg.diagnostics,
    }


def load_pca(plan: RunPlan):
    """The run's DP-PCA components (released by the driver before training), or None."""
    if not plan.pca_path:
        return None
    if not os.path.isfile(plan.pca_path):
        raise dpcore.DPConfigError(
            f"the run's DP-PCA projection {plan.pca_path} does not exist on this node. The driver releases it "
            "before training; storage_path must be storage that every node shares."
        )
    return torch.load(plan.pca_path, map_location="cpu")["components"]


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


class ShardInputs:
    """This rank's training examples as the trained module takes them: rows of the memory-mapped
    shard, normalised per batch on the training device, then (rank 0, black-box audit) the input
    canaries appended after them, already in the module's input space."""

    def __init__(self, shard: MappedSplit, device, extra: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.shard, self.device = shard, device
        self.extra_x = None if extra is None else extra[0].to(device)
        self.y = torch.cat([shard.y, extra[1]]) if extra is not None else shard.y
        self.y = self.y.to(device)

    def __len__(self) -> int:
        return len(self.y)

    def batch(self, idx: torch.Tensor, device=None) -> torch.Tensor:
        idx = torch.as_tensor(idx).cpu()
        n = len(self.shard)
        if self.extra_x is None or not bool((idx >= n).any()):
            return self.shard.batch(idx, self.device)
        inside = idx < n
        out = torch.empty((len(idx),) + tuple(self.extra_x.shape[1:]), dtype=torch.float32, device=self.device)
        out[inside.to(self.device)] = self.shard.batch(idx[inside], self.device)
        out[(~inside).to(self.device)] = self.extra_x[(idx[~inside] - n).to(self.device)]
        return out


@torch.no_grad()
def evaluate(model, split, device=None, batch: int = 2048) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on ``split``: anything with ``batch(idx,
    device)`` and labels ``y`` (a mapped split: read in chunks, never loaded whole), or a pair
    (inputs, labels) of tensors."""
    if isinstance(split, tuple):
        x_all, labels = split
        inputs = lambda idx: x_all[idx]  # noqa: E731
    else:
        labels = split.y
        inputs = lambda idx: split.batch(idx, device)  # noqa: E731
    n = len(labels)
    if n == 0:
        return float("nan"), float("nan")
    model.eval()
    correct, loss = 0, 0.0
    for lo in range(0, n, batch):
        idx = torch.arange(lo, min(n, lo + batch))
        out = model(inputs(idx))
        y = labels[idx.to(labels.device)].to(out.device)
        correct += (out.argmax(1) == y).sum().item()
        loss += F.cross_entropy(out, y, reduction="sum").item()
    model.train()
    return correct / n, loss / n


_JOURNAL_LOCK = None  # the open lock file of this process's journal (rank 0); released when the process dies


def lock_journal(journal: str) -> None:
    """Take the run's exclusive journal lock for this process (rank 0) or fail: two worker
    groups appending to one journal would each check the budget against only their own
    releases. The lock is released by the OS when the process ends, however it ends."""
    import fcntl

    global _JOURNAL_LOCK
    if _JOURNAL_LOCK is not None and _JOURNAL_LOCK.name == journal + ".lock":
        return
    f = open(journal + ".lock", "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise dpcore.DPConfigError(
            f"another process holds the ledger journal {journal} of this run (an earlier driver's workers are "
            "still training?). Stop them first; two trainers on one journal could spend the budget twice."
        ) from None
    _JOURNAL_LOCK = f


def unlock_journal() -> None:
    global _JOURNAL_LOCK
    if _JOURNAL_LOCK is not None:
        _JOURNAL_LOCK.close()  # closing the file releases its flock
        _JOURNAL_LOCK = None


def journal_is_locked(journal: str) -> bool:
    import fcntl

    if not Path(journal + ".lock").exists():
        return False
    with open(journal + ".lock", "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        return False


def open_ledger(
    plan: RunPlan, checkpoint_meta: dict | None, checkpoint_ledger: dict | None, rank: int, world: int
) -> tuple[dpcore.PrivacyLedger, int]:
    """Open the run's ledger and decide how many more steps fit. Returns (ledger, allowance).

    Rank 0 is the only budget authority: it locks and opens the journal that the driver
    created (every release so far), checks it against the checkpoint, marks the releases after
    the checkpoint as rolled back, computes how many more releases fit the budget, and
    broadcasts that number, so that every rank stops at the same step. Ranks ≥ 1 add no noise
    and keep a budget-free ledger only for their optimizer's bookkeeping.
    """
    cfg = plan.config
    allowance = None
    if rank == 0:
        journal = plan.journal
        if not os.path.isfile(journal):
            raise dpcore.DPConfigError(
                f"the ledger journal {journal} does not exist on this node. The driver creates it before training; "
                "storage_path must be storage that every node shares. Refusing to train without the run's ledger."
            )
        lock_journal(journal)
        ledger = dpcore.PrivacyLedger(
            cfg["target_epsilon"],
            cfg["target_delta"],
            cfg["accountant"],
            epsilon_every=plan.epsilon_every,
            journal=journal,
        )
        if checkpoint_ledger is not None and len(ledger) < len(checkpoint_ledger["entries"]):
            raise dpcore.DPConfigError(
                f"the ledger journal {journal} holds {len(ledger)} releases but the checkpoint holds "
                f"{len(checkpoint_ledger['entries'])}: the journal was lost or truncated, so releases after the "
                "checkpoint cannot be accounted for. Refusing to resume."
            )
        if plan.pca_path and not any(e.step == 0 for e in ledger.entries):
            raise dpcore.DPConfigError(
                f"the run uses a DP-PCA projection but its ledger journal {journal} holds no release for it. "
                "Refusing to train on a projection that is not accounted for."
            )
        if plan.max_releases is not None:  # the driver's plan: the budget check need not search again
            prior = (
                [(dpcore.pca.pca_event(cfg["pca_noise_multiplier"], cfg["pca_sample_rate"]), 1)]
                if plan.pca_path
                else []
            )
            ledger.prime_allowance(step_event(plan), prior, plan.max_releases)
        after = checkpoint_meta["step"] if checkpoint_meta is not None else 0
        if any(e.status == COMMITTED and e.step > after for e in ledger.entries):
            ledger.mark_rolled_back(after)
        left = ledger.allowance(step_event(plan))
        allowance = int(min(max(left, 0), plan.steps - after))
    else:
        ledger = dpcore.PrivacyLedger(None, cfg["target_delta"], cfg["accountant"], epsilon_every=10**9)
    if world > 1:
        box = [allowance]
        dist.broadcast_object_list(box, src=0)
        allowance = box[0]
    return ledger, allowance


def _quiet_ray_train_logs() -> None:
    """Ray Train logs every report and checkpoint at INFO (its loggers are named by file path);
    the driver shows progress from the ledger journal instead."""
    import logging

    import ray.train.v2._internal.execution.context as c
    import ray.train.v2._internal.execution.storage as s

    for mod in (c, s):
        for name in (mod.__file__, mod.__name__):
            logging.getLogger(name).setLevel(logging.WARNING)


def _complete(d: Path) -> dict | None:
    """The meta of checkpoint directory ``d`` if every file of every rank is there and matches
    its recorded SHA-256, else None (a checkpoint torn by a crash during upload)."""
    try:
        meta = json.loads((d / "meta.json").read_text())
        for name, digest in meta["files"].items():
            if sha256_file(d / name) != digest:
                return None
        for r in range(meta["world_size"]):
            info = json.loads((d / f"rank-{r}.json").read_text())
            if sha256_file(d / f"rank-{r}.pt") != info["file_sha256"]:
                return None
    except (OSError, ValueError, KeyError):
        return None
    return meta


def complete_checkpoints(run_dir: str, reported=None) -> list[tuple[int, int, str]]:
    """(releases, step, path) of every complete checkpoint of the run, oldest state first:
    the one Ray reported (if any) and every ``checkpoint_*`` directory in the run's (local) storage."""
    candidates = []
    if reported is not None:
        with reported.as_directory() as d:
            meta = _complete(Path(d))
            if meta is not None:
                candidates.append((meta["releases"], meta["step"], str(reported.path)))
    if Path(run_dir).is_dir():
        for d in Path(run_dir).glob("checkpoint_*"):
            meta = _complete(d)
            if meta is not None:
                candidates.append((meta["releases"], meta["step"], str(d)))
    return sorted(candidates)


def persist_checkpoint(src: Path, run_dir: Path, step: int, keep: int = 2) -> Path:
    """Copy a checkpoint folder into ``run_dir/checkpoint_local_<step>`` (written aside, then
    renamed, so a crash leaves no half checkpoint under that name) and keep the last ``keep``."""
    import shutil

    dest = run_dir / f"checkpoint_local_{step:09d}"
    tmp = run_dir / f".checkpoint_local_{step:09d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(dest, ignore_errors=True)
    os.rename(tmp, dest)
    for old in sorted(run_dir.glob("checkpoint_local_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return dest


def find_checkpoint(plan: RunPlan, reported, rank: int, world: int):
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
        candidates = complete_checkpoints(plan.run_dir, reported)
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


def memory_status() -> dict:
    """This process's memory in MiB (Linux /proc): peak and current resident set, and the
    current anonymous (heap) and file-backed (memory-mapped shards) parts of it."""
    keys = {"VmHWM": "peak_rss_mib", "VmRSS": "rss_mib", "RssAnon": "rss_anon_mib", "RssFile": "rss_file_mib"}
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in keys:
                out[keys[name]] = round(int(value.split()[0]) / 1024, 1)
    except OSError:
        pass
    return out


def record_placement(plan: RunPlan, rank: int, memory: dict | None = None) -> None:
    """Where this rank runs (Ray node, host, process), and with ``memory`` its memory use, in
    the run folder; the driver logs it (``ray/placement.json``). A restarted group overwrites
    it with its new placement."""
    import socket

    import ray

    d = Path(plan.run_dir) / "placement"
    d.mkdir(parents=True, exist_ok=True)
    if plan.config.get("in_process") or not ray.is_initialized():
        # Ray Train's local mode: this process is the worker, even where the driver process
        # holds a Ray connection made for something else
        node_id, node_ip = f"in-process:{socket.gethostname()}", "127.0.0.1"
    else:
        node_id, node_ip = ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
    info = {"rank": rank, "node_id": node_id, "node_ip": node_ip, "hostname": socket.gethostname(), "pid": os.getpid()}
    if memory:
        info["memory"] = memory
    tmp = d / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(info))
    os.replace(tmp, d / f"rank{rank}.json")


def read_placement(plan: RunPlan) -> list[dict]:
    d = Path(plan.run_dir) / "placement"
    return [json.loads(f.read_text()) for f in sorted(d.glob("rank*.json"))] if d.is_dir() else []


def train_loop_per_worker(plan: RunPlan, pruner=None) -> None:
    """Ray Train entry point. ``plan`` is built by the driver (:func:`pipelines.plan.plan_run`);
    ``pruner(validation_accuracy, step) -> stop?`` is called by rank 0 at each checkpoint."""
    import ray.train

    from .allocator import keep_freed_memory

    trace("worker entry")
    keep_freed_memory()  # this process is ours: reuse freed memory across steps (DP_MALLOC_TUNE=0: off)
    cfg = config_from_dict(plan.config)
    _quiet_ray_train_logs()
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    record_placement(plan, rank)
    if cfg.use_gpu and cfg.in_process:
        device = torch.device("cuda", torch.cuda.current_device())
    elif cfg.use_gpu:
        from ray.train.torch import get_device

        device = get_device()  # the GPU Ray assigned to this worker
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if cfg.seed is not None:
        import warnings

        warnings.simplefilter("ignore", dpcore.SeededRandomnessWarning)  # the driver already warned and tagged the run

    torch.manual_seed(cfg.init_seed)  # public: identical initial weights on every rank
    model = build_run_model(cfg, tuple(plan.input_shape), plan.num_classes, load_pca(plan)).to(device)
    # With cached features (ScatterNet), the workers read the features and train the rest of the model.
    front, trained = split_public_front(model) if plan.features else (None, model)
    data_dir = plan.train_data_dir or plan.data_dir
    extra = None
    if rank == 0 and plan.audit_path:
        canaries = torch.load(plan.audit_path)
        if (
            canaries["kind"] == "input"
        ):  # black-box canaries in the data: rank 0's shard holds them, sampled like any example
            keep = canaries["included"]
            x_extra = canaries["x"][keep].to(device)
            if front is not None:
                with torch.no_grad():
                    x_extra = front(x_extra)
            extra = (x_extra, canaries["y"][keep])
    trace("model built")
    train = ShardInputs(open_split(data_dir, "train", rank, world), device, extra)
    trace("data opened")
    y_train = train.y
    if rank == 0:
        held_out = {k: open_split(data_dir, k) for k in ("val", "test")}

    optimizer = make_optimizer(cfg, [p for p in model.parameters() if p.requires_grad])

    checkpoint = find_checkpoint(plan, ray.train.get_checkpoint(), rank, world)
    meta, rank_state, ckpt_ledger = None, None, None
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            d = Path(d)
            meta = json.loads((d / "meta.json").read_text())
            if meta["world_size"] != world:
                raise dpcore.DPConfigError(
                    f"the checkpoint {d} was written by {meta['world_size']} workers, not {world}; a run keeps its num_workers."
                )
            model.load_state_dict(torch.load(d / MODEL_FILE, map_location=device))
            shared = torch.load(d / STATE_FILE, map_location=device, weights_only=False)
            rank_state = torch.load(d / f"rank-{rank}.pt", weights_only=False)
            ckpt_ledger = json.loads((d / LEDGER_FILE).read_text())
    start_step = meta["step"] if meta is not None else 0

    trace("checkpoint looked up")
    ledger, allowance = open_ledger(plan, meta, ckpt_ledger, rank, world)
    trace("ledger opened")
    private = dpcore.build_private(
        trained,
        optimizer,
        F.cross_entropy,
        noise_multiplier=plan.noise_multiplier,
        sample_rate=plan.sample_rate,
        steps=plan.steps,
        dataset_size=plan.dataset_size,
        target_epsilon=cfg.target_epsilon if rank == 0 else None,  # rank 0 is the budget authority
        target_delta=cfg.target_delta,
        clip_norm=cfg.clip_norm,
        accountant=cfg.accountant,
        randomness=dpcore.make_randomness(cfg.seed),
        ledger=ledger,
        shard=torch.arange(len(train)),
        rank=rank,
        reduce_fn=allreduce_sum if world > 1 else None,
        physical_batch_size=cfg.physical_batch_size,
        clipping=cfg.clipping,
        **method_options(cfg, plan, rank),
    )
    trace("private built")
    fitted = None
    if cfg.memory_budget_mb > 0:  # probes on random data shaped like this shard's; nothing is released
        n_probe = min(len(train), cfg.physical_batch_size)  # (each rank fits its own; rank 0's is tagged)
        probe = torch.arange(n_probe)
        fitted = private.optimizer.fit_physical_batch_size(
            train.batch(probe), y_train[probe], int(cfg.memory_budget_mb * 2**20)
        )
    ema = dpcore.ParameterEMA(model, cfg.ema_decay) if cfg.ema_decay is not None else None
    if checkpoint is not None:
        private.optimizer.load_state_dict({**shared["optimizer"], "randomness": rank_state["noise"]})
        private.sampler.load_state_dict(rank_state["sampler"])
        if ema is not None:
            ema.load_state_dict(shared["ema"])
        if private.optimizer.augment is not None and "augment" in rank_state:
            private.optimizer.augment.load_state_dict(rank_state["augment"])
    if private.sampler.step != start_step or private.optimizer.steps_taken != start_step:
        raise RuntimeError(
            f"inconsistent checkpoint: sampler at {private.sampler.step}, optimizer at "
            f"{private.optimizer.steps_taken}, meta at {start_step}"
        )

    audit = None
    if rank == 0 and plan.audit_path and canaries["kind"] == "gradient":  # white-box canaries live in rank 0's shard
        audit = {
            "coords": canaries["coords"],
            "in": canaries["coords"][canaries["included"]],
            "scores": torch.zeros(len(canaries["coords"]), dtype=torch.float64),
        }
        if checkpoint is not None:
            with checkpoint.as_directory() as d:
                audit["scores"] = torch.load(Path(d) / AUDIT_FILE)
        audit_root = dpcore.make_randomness(cfg.seed)
        canary_value = cfg.clip_norm * (1.0 - dpcore.clipping.CLIP_MARGIN)

    tracker = _Tracker(plan) if rank == 0 else None
    if tracker is not None:
        # The path clipping="auto" chose from the model and method, before any data was seen.
        # (Whether the first-batch check later fell back to vmap depends on the private data,
        # so it is not logged here: only the workers' warning says so.)
        tracker.tag("clipping.chosen", private.optimizer.clipping)
    if tracker is not None and fitted is not None:
        tracker.tag("physical_batch_size.fitted", str(fitted["physical_batch_size"]))
        if fitted.get("measured"):
            tracker.tag("physical_batch_size.per_example_mib", f"{fitted['per_example_bytes'] / 2**20:.3f}")
    every = plan.checkpoint_every
    last_step = start_step + allowance  # the plan, or fewer if rolled-back releases used up budget
    t_last, step_last = time.monotonic(), start_step
    step = start_step
    reported_releases = meta["releases"] if meta is not None else -1

    def report(rate):  # reads the loop's current ``step``
        return _report(
            plan,
            cfg,
            private,
            model,
            ema,
            rank,
            world,
            step,
            last_step,
            rate,
            tracker,
            held_out if rank == 0 else None,
            train,
            audit,
            pruner,
        )

    trace("loop start")
    peak_anon = 0.0  # the largest anonymous resident set seen at a report (Linux keeps no peak of it)
    while step < last_step:
        if step == start_step + 1:
            trace("first step done")
        lot = private.sampler.sample()
        private.optimizer.accumulate(train.batch(lot), y_train[lot])
        if audit is not None:  # canaries in the data join the lot at rate q, like every example
            sampled = audit["in"][audit_root.spawn("audit-sampling", step).uniform(len(audit["in"])) < plan.sample_rate]
            private.optimizer.add_coordinate_examples(sampled, canary_value)
        private.optimizer.step()
        if audit is not None:  # white-box score: the released (noised) gradient along each canary
            released = torch.cat([p.grad.reshape(-1) for p in private.optimizer.params.values()])
            audit["scores"] += released[audit["coords"].to(released.device)].double().cpu()
        if ema is not None:
            ema.update()
        step += 1
        if cfg.fault_at_step == step and rank == cfg.fault_rank:
            marker = Path(plan.run_dir) / "fault-injected"
            if not marker.exists():
                marker.write_text(f"rank {rank} died after step {step}\n")
                os._exit(17)  # a hard crash: no cleanup, no report
        if step % every == 0 or step == last_step:
            peak_anon = max(peak_anon, memory_status().get("rss_anon_mib", 0.0))
            now = time.monotonic()
            rate = (step - step_last) / max(now - t_last, 1e-9)
            t_last, step_last = now, step
            reported_releases, pruned = report(rate)
            if pruned:  # Optuna's pruner stopped this trial (a sweep); every rank got the decision
                break
    peak_anon = max(peak_anon, memory_status().get("rss_anon_mib", 0.0))
    record_placement(plan, rank, {**memory_status(), "peak_rss_anon_mib": peak_anon})
    # Restored right at the budget (the rolled-back releases used it up): the restored state
    # is the final one, but the ledger has grown since that checkpoint, so report it again.
    need = None
    if rank == 0:
        need = reported_releases != len(ledger)
    if world > 1:
        box = [need]
        dist.broadcast_object_list(box, src=0)
        need = box[0]
    if need:
        report(float("nan"))


def _report(
    plan,
    cfg,
    private,
    model,
    ema,
    rank,
    world,
    step,
    last_step,
    rate,
    tracker,
    held_out,
    train,
    audit=None,
    pruner=None,
) -> int:
    """Metrics (rank 0) and a checkpoint (every rank's part) in one ``ray.train.report``.
    Returns the number of ledger releases the checkpoint holds (rank 0; -1 elsewhere)."""
    import ray.train

    final = step == last_step
    pruned = False
    checksum = param_checksum(model)
    metrics: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        rank_state = {"sampler": private.sampler.state_dict(), "noise": private.optimizer.randomness.state_dict()}
        if private.optimizer.augment is not None:
            rank_state["augment"] = private.optimizer.augment.state_dict()
        torch.save(rank_state, d / f"rank-{rank}.pt")
        info = {"file_sha256": sha256_file(d / f"rank-{rank}.pt"), "param_sha256": checksum, "step": step}
        (d / f"rank-{rank}.json").write_text(json.dumps(info))
        if rank == 0:
            eval_model = model
            if ema is not None:  # De et al.: evaluate (and publish) the averaged parameters
                import copy

                eval_model = copy.deepcopy(model)
                eval_model.load_state_dict(ema.averaged_state_dict())
                torch.save(eval_model.state_dict(), d / EMA_MODEL_FILE)
            if plan.features:  # the held-out splits are features too: evaluate the rest of the model
                eval_model = split_public_front(eval_model)[1]
            device = next(model.parameters()).device
            val_acc, val_loss = evaluate(eval_model, held_out["val"], device)
            test_acc = test_loss = float("nan")  # NaN metrics are not logged
            if final or cfg.test_every_report:
                test_acc, test_loss = evaluate(eval_model, held_out["test"], device)
            if pruner is not None and not final:
                pruned = bool(pruner(val_acc, step))
            metrics = {
                "step": step,
                "epsilon": private.ledger.epsilon(),
                "val_accuracy": val_acc,
                "val_loss": val_loss,
                "test_accuracy": test_acc,
                "test_loss": test_loss,
                "steps_per_second": rate,
                "expected_examples_per_second": rate * plan.sample_rate * plan.dataset_size,
                "committed_steps": len(private.ledger.committed_steps()),
                "releases": len(private.ledger),
                "final": float(final),
            }
            if cfg.diagnostics:  # NON-PRIVATE: computed on rank 0's training shard, not noised
                acc, loss = evaluate(split_public_front(model)[1] if plan.features else model, train)
                first = torch.arange(min(512, len(train)))
                norms = private.optimizer.diagnostics(train.batch(first), train.y[first])["per_sample_norms"]
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
            shared = {"optimizer": {k: v for k, v in opt_state.items() if k != "randomness"}}
            if ema is not None:
                shared["ema"] = ema.state_dict()
            torch.save(shared, d / STATE_FILE)
            (d / LEDGER_FILE).write_text(json.dumps(private.ledger.state_dict()))
            names = (MODEL_FILE, STATE_FILE, LEDGER_FILE) + ((EMA_MODEL_FILE,) if ema is not None else ())
            if audit is not None:
                torch.save(audit["scores"], d / AUDIT_FILE)
                names += (AUDIT_FILE,)
            files = {n: sha256_file(d / n) for n in names}
            meta = {
                "step": step,
                "releases": len(private.ledger),
                "world_size": world,
                "final": final or pruned,
                "pruned": pruned,
                "run_id": plan.run_id,
                "files": files,
            }
            (d / "meta.json").write_text(json.dumps(meta))
        if cfg.in_process:  # Ray Train's local mode keeps no checkpoint: keep it in the run folder ourselves
            persist_checkpoint(d, Path(plan.run_dir), step)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
    if tracker is not None:
        tracker.log(metrics, step)
        if cfg.diagnostics:  # NON-PRIVATE per-step BAM diagnostics (bias, a, c, ascent cosines)
            tracker.log_history(private.optimizer.diagnostics_history)
    private.optimizer.diagnostics_history.clear()  # every rank: only rank 0 logs them
    if pruner is not None and world > 1:
        box = [pruned]
        dist.broadcast_object_list(box, src=0)
        pruned = box[0]
    return (len(private.ledger) if rank == 0 else -1), pruned


class _Tracker:
    """Rank 0 logs each report's metrics to the run's MLflow run as they happen."""

    def __init__(self, plan: RunPlan):
        import threading

        self.run_id = plan.run_id
        self._client = None
        self._pending_tags: dict[str, str] = {}
        # Importing MLflow takes about a second: do it beside the first steps, not before them.
        self._loading = threading.Thread(target=self._connect, args=(plan.tracking_uri,), daemon=True)
        self._loading.start()

    def _connect(self, uri: str) -> None:
        try:
            from mlflow import MlflowClient

            self._client = MlflowClient(uri)
        except BaseException as e:  # raised where the client is first used
            self._client = e

    @property
    def client(self):
        self._loading.join()
        if isinstance(self._client, BaseException):
            raise self._client
        return self._client

    def tag(self, key: str, value: str) -> None:
        """Set a run tag with the next log (MLflow may still be loading)."""
        self._pending_tags[key] = value

    def log(self, metrics: dict, step: int) -> None:
        from mlflow.entities import Metric, RunTag

        client = self.client
        ts = int(time.time() * 1000)
        batch = [Metric(k, float(v), ts, step) for k, v in metrics.items() if k not in ("step", "final") and v == v]
        tags = [RunTag(k, v) for k, v in self._pending_tags.items()]
        client.log_batch(self.run_id, metrics=batch, tags=tags)
        self._pending_tags.clear()

    def log_history(self, records: list[dict]) -> None:
        """One metric per key and step (``diag_<key>``), in batches of at most 1000."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        batch = [
            Metric(f"diag_{k}", float(v), ts, int(r["step"]))
            for r in records
            for k, v in r.items()
            if k != "step" and v == v
        ]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

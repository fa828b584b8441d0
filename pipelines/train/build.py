"""What a worker builds from the run's plan and config, before its first step: the method's
options, the DP-PCA projection, the optimizer and its parameter groups, the one collective of
a step, and the rank's training inputs. Kept apart from the loop (:mod:`.worker`) so that the
driver and the benchmarks can build the same pieces."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..plan import RunPlan

import os

import torch
import torch.distributed as dist

import dpcore

from ..config import TrainConfig
from ..data import MappedSplit


def method_options(cfg: TrainConfig, plan: RunPlan, rank: int) -> dict:
    """DPOptimizer's method arguments for the run's config."""
    augment = None
    if cfg.augmentation_multiplicity > 1:
        from ..augment import CropFlipMultiplicity

        augment = CropFlipMultiplicity(  # secret draws: see pipelines.augment
            cfg.augmentation_multiplicity,
            cfg.augment_padding,
            cfg.augment_flip,
            randomness=dpcore.make_randomness(cfg.seed).spawn("augment", rank),
        )
    options = cfg.method_options()
    return {
        **options,
        "ascent": dpcore.ascent_schedule(
            options["ascent"], cfg.ascent_schedule, plan.steps, cfg.ascent_warmup_fraction
        ),
        "augment": augment,
        "diagnostics": cfg.diagnostics,
    }


def private_arguments(
    cfg: TrainConfig, plan: RunPlan, rank: int, world: int, shard_size: int, ledger: dpcore.PrivacyLedger
) -> dict:
    """``dpcore.build_private``'s arguments for rank ``rank`` of ``world``: the driver's plan (σ,
    q, steps, and N, the whole training split's size: the update is ÷ q·N on every rank), the
    rank's own shard and streams, noise on rank 0 alone, and the all-reduce where there are
    several ranks. Rank 0 is the budget authority (the others' ledgers hold no target)."""
    return dict(
        noise_multiplier=plan.noise_multiplier,
        sample_rate=plan.sample_rate,
        steps=plan.steps,
        dataset_size=plan.dataset_size,
        target_epsilon=cfg.target_epsilon if rank == 0 else None,
        target_delta=cfg.target_delta,
        clip_norm=cfg.clip_norm,
        accountant=cfg.accountant,
        randomness=dpcore.make_randomness(cfg.seed),
        ledger=ledger,
        shard=torch.arange(shard_size),
        rank=rank,
        reduce_fn=allreduce_sum if world > 1 else None,
        physical_batch_size=cfg.physical_batch_size,
        clipping=cfg.clipping,
        autocast=cfg.autocast,
        **method_options(cfg, plan, rank),
    )


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


def make_optimizer(cfg: TrainConfig, module: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer of ``module``'s trainable parameters: one group at ``lr``, or with
    ``head_lr`` (hf: models) the new classification head in a group of its own."""
    params = param_groups(cfg, module)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr)
    return torch.optim.NAdam(params, lr=cfg.lr)


def param_groups(cfg: TrainConfig, module: torch.nn.Module) -> list:
    """The trainable parameters, as the optimizer's groups (the head's, with ``head_lr``, last)."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if getattr(cfg, "head_lr", None) is None:
        return [p for _, p in named]
    from ..text.hf import is_head

    head = [p for n, p in named if is_head(n)]
    if not head:
        raise dpcore.DPConfigError(f"head_lr: no classification head among the trainable parameters of {cfg.model}.")
    body = [p for n, p in named if not is_head(n)]
    return ([{"params": body}] if body else []) + [{"params": head, "lr": cfg.head_lr}]


def allreduce_sum(tensors: list[torch.Tensor]) -> None:
    """The one collective of a step: SUM of every rank's (clipped, rank 0: noised) sums.
    The tensors are flattened into one buffer so that it is a single all-reduce."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    parts = flat.split([t.numel() for t in tensors])
    torch._foreach_copy_(tensors, [p.view_as(t) for p, t in zip(parts, tensors)])


class ShardInputs:
    """This rank's training examples as the trained module takes them: rows of the memory-mapped
    shard, normalised per batch on the training device, then (rank 0, black-box audit) the input
    canaries appended after them, already in the module's input space."""

    def __init__(self, shard: MappedSplit, device, extra: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.shard, self.device = shard, torch.device(device)
        self.extra_x = None if extra is None else extra[0].to(device)
        # Labels stay on the host, where the lot's indices are: indexing device labels with host
        # indices is a blocking copy of the indices (a host sync on a GPU) at every step.
        self.y = (torch.cat([shard.y, extra[1].cpu()]) if extra is not None else shard.y).cpu()

    def __len__(self) -> int:
        return len(self.y)

    def labels(self, idx) -> torch.Tensor:
        """The labels of rows ``idx`` on the training device (pinned, copied without waiting)."""
        y = self.y[torch.as_tensor(idx).cpu()]
        if self.device.type == "cuda":
            return y.pin_memory().to(self.device, non_blocking=True)
        return y.to(self.device)

    def batch(self, idx: torch.Tensor, device=None) -> torch.Tensor:
        idx = torch.as_tensor(idx).cpu()
        n = len(self.shard)
        if self.extra_x is None or not bool((idx >= n).any()):
            return self.shard.batch(idx, self.device)
        inside = idx < n
        out = torch.empty((len(idx),) + tuple(self.extra_x.shape[1:]), dtype=self.extra_x.dtype, device=self.device)
        out[inside.to(self.device)] = self.shard.batch(idx[inside], self.device)
        out[(~inside).to(self.device)] = self.extra_x[(idx[~inside] - n).to(self.device)]
        return out


def check_planned_data(plan: RunPlan, data_dir: str) -> None:
    """The shards a worker is about to train on are those the run was planned on (their
    manifest's digest): a worker started again after a failure, or by ``--resume``, would
    otherwise train on a dataset ingested again in place since (another split seed makes
    examples logged as held out into training examples). Plans made before the digest existed
    carry none and are not checked."""
    from ..data import data_digest, read_manifest

    expected = plan.train_data_digest if data_dir == plan.train_data_dir else plan.data_digest
    if expected is not None and data_digest(plan.storage_path, read_manifest(data_dir)) != expected:
        raise dpcore.DPConfigError(
            f"the dataset {data_dir} was ingested again after this run was planned: its shards differ from the "
            "planned ones. The run stops before training on it; start a new run on the new data."
        )

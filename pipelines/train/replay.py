"""A crash costs no privacy: the workers replay the releases since the last checkpoint.

Rank 0 keeps every released update in the replay log (:mod:`dpcore.ledger.replay`, one
segment per checkpoint, in ``<run>/replay/``). On a restart (a worker group restarted by Ray
Train, or ``--resume`` after the driver died) every rank restores the latest checkpoint of
step c; rank 0 reads the log and finds the longest run of committed releases c+1 … k whose
updates it holds intact; the ledger marks them replayed and rolls back only the releases after
k (paid for, but their updates never reached the log). Every rank then applies the updates of
steps c+1 … k (rank 0 broadcasts them), advancing its sampler, augmentation and noise streams
as the original steps did, and training goes on from step k + 1. A replayed release is counted
once, as what it was: one release.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dpcore.ledger import COMMITTED
from dpcore.ledger.replay import ReplayLogRefused, ReplayWriter, Segment, layout_of, read_segment, segment_path

if TYPE_CHECKING:
    from ..plan import RunPlan

FOLDER = "replay"


def folder(plan: RunPlan) -> Path:
    return Path(plan.run_dir) / FOLDER


def trainable(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters whose updates are released (the optimizer's, in its order)."""
    return {n: p for n, p in module.named_parameters() if p.requires_grad}


def replayable(plan: RunPlan, ledger, after: int, layout: list) -> tuple[Segment | None, int]:
    """Rank 0: the intact log segment after checkpoint ``after`` and the last step ``k`` it can
    carry the restored state to (``after`` itself when it can carry nothing)."""
    committed = {e.step for e in ledger.entries if e.status == COMMITTED and e.step > after}
    if not committed or not plan.config.get("replay_log", True):
        return None, after
    path = segment_path(folder(plan), after)
    try:
        seg = read_segment(path, plan.ray_run_name, after, layout)
    except FileNotFoundError:
        return None, after
    except ReplayLogRefused as e:
        warnings.warn(f"replay log refused: {e}; the releases after step {after} stay counted as spent", stacklevel=2)
        return None, after
    upto = after
    for s in seg.steps:
        if s not in committed:
            break
        upto = s
    if seg.problem is not None and upto < max(committed):
        warnings.warn(
            f"the replay log {path} ends at {seg.problem}: steps {upto + 1}–{max(committed)} are rolled back and stay "
            "counted as spent",
            stacklevel=2,
        )
    return seg, upto


def apply(worker, segment: Segment | None, after: int, upto: int) -> None:
    """Every rank: apply the logged updates of steps ``after + 1 … upto`` to the restored state."""
    opt, params = worker.private.optimizer, worker.private.optimizer.params
    sizes = [p.numel() for p in params.values()]
    for i in range(upto - after):  # the steps after + 1 … upto
        flat = segment.payload(i) if worker.rank == 0 else torch.empty(sum(sizes), dtype=torch.float32)
        if worker.world > 1:
            flat = flat.to(worker.device)
            dist.broadcast(flat, src=0)
        update = [t.view_as(p) for t, p in zip(flat.split(sizes), params.values())]
        lot = worker.private.sampler.sample()  # the sampler's stream moves on as at the original step
        x = worker.train.batch(lot) if opt.augment is not None else None
        opt.replay(update, x)
        if worker.audit is not None:  # the white-box canaries' scores, from the same update
            released = torch.cat([p.grad.reshape(-1) for p in params.values()])
            worker.audit["scores"] += released[worker.audit["coords"].to(released.device)].double().cpu()
        if worker.ema is not None:
            worker.ema.update()


def writer(plan: RunPlan, params: dict, after: int, upto: int, segment: Segment | None) -> ReplayWriter | None:
    """Rank 0's writer, continuing the segment after checkpoint ``after`` past step ``upto``."""
    if not plan.config.get("replay_log", True):
        return None
    keep = upto if segment is not None and upto > after else None
    return ReplayWriter(folder(plan), plan.ray_run_name, layout_of(params), after, keep_until=keep)

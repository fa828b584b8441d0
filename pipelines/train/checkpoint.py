"""A run's checkpoints: what each holds, which are complete, and which one a restart restores.

A checkpoint folder holds, from rank 0, the model (and the EMA's averaged model), the shared
optimizer and EMA state, the ledger's state and ``meta.json`` (step, releases, world size and
the SHA-256 of every file); and from every rank r its sampler, noise-stream and augmentation
state (``rank-r.pt``, hashed in ``rank-r.json``). A folder whose files do not all match their
hashes is torn (a crash during upload) and is never restored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..plan import RunPlan

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch.distributed as dist

from ..data import sha256_file

MODEL_FILE = "model.pt"
EMA_MODEL_FILE = "ema_model.pt"
STATE_FILE = "state.pt"
LEDGER_FILE = "ledger.json"
AUDIT_FILE = "audit_scores.pt"
PCA_FILE = "pca.pt"


# Ray Train's record of a run's reported checkpoints, in the run's folder (ray.train.v2's
# CHECKPOINT_MANAGER_SNAPSHOT_FILENAME).
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"


def set_aside_torn_ray_snapshot(run_dir: str | Path) -> Path | None:
    """Move Ray Train's checkpoint-manager snapshot out of the way when it does not parse.

    Ray writes it in place (the file is truncated, then written), so a driver killed between the
    two leaves it empty or cut short, and the next ``fit()`` of the run fails before any worker
    starts (``CheckpointManagerInitializationError``). The run needs nothing from it: the
    checkpoint a restart restores is found by scanning the run's folder (:func:`find_checkpoint`).
    Returns where the torn file now is (beside it, ``.torn`` added), or None if it was fine or
    absent."""
    path = Path(run_dir) / RAY_SNAPSHOT
    try:
        json.loads(path.read_text())
        return None
    except FileNotFoundError:
        return None
    except ValueError:  # empty, cut short, or not text
        aside = path.with_name(f"{RAY_SNAPSHOT}.torn")
        os.replace(path, aside)
        return aside


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


SCRATCH_PREFIX = "dp-report-"


def _scratch_suffix(plan: RunPlan, rank: int) -> str:
    return f".r{rank}.{plan.ray_run_name}"


def report_scratch(plan: RunPlan, rank: int) -> tempfile.TemporaryDirectory:
    """The private temporary folder (mode 700) one report writes this rank's checkpoint files
    to: ``dp-report-<random>.r<rank>.<the run's Ray name>``, so that :func:`remove_stale_scratch`
    finds it."""
    return tempfile.TemporaryDirectory(prefix=SCRATCH_PREFIX, suffix=_scratch_suffix(plan, rank))


def remove_stale_scratch(plan: RunPlan, rank: int) -> int:
    """Remove the report folders an earlier attempt of this rank of this run left behind, and
    return how many. A rank killed during a report (another rank's crash tears the whole group
    down) never reaches its folder's clean-up, and each folder holds a copy of the model, so
    every restart would leave one more in the temporary directory. Called when a rank starts,
    before its first report; the earlier attempt is gone by then (Ray restarts the whole group).
    The random part of a folder's name has no dot, so no other run's or rank's folder matches."""
    suffix, removed = _scratch_suffix(plan, rank), 0
    with os.scandir(tempfile.gettempdir()) as entries:
        stale = [
            e.path
            for e in entries
            if e.name.startswith(SCRATCH_PREFIX)
            and e.name.endswith(suffix)
            and "." not in e.name[len(SCRATCH_PREFIX) : -len(suffix)]
            and e.is_dir(follow_symlinks=False)
        ]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
        removed += 1
    return removed


def persist_checkpoint(src: Path, run_dir: Path, step: int, keep: int = 2) -> Path:
    """Copy a checkpoint folder into ``run_dir/checkpoint_local_<step>`` (written aside, then
    renamed, so a crash leaves no half checkpoint under that name) and keep the last ``keep``."""
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


def read_checkpoint(checkpoint, rank: int, world: int, device) -> tuple:
    """(meta, shared, rank_state, ledger_state) of ``checkpoint`` for this rank, or four Nones.
    ``shared`` holds the model's state under "model", the optimizer's and the EMA's."""
    import torch

    import dpcore

    if checkpoint is None:
        return None, None, None, None
    with checkpoint.as_directory() as d:
        d = Path(d)
        meta = json.loads((d / "meta.json").read_text())
        if meta["world_size"] != world:
            raise dpcore.DPConfigError(
                f"the checkpoint {d} was written by {meta['world_size']} workers, not {world}; a run keeps its num_workers."
            )
        model = torch.load(d / MODEL_FILE, map_location=device)
        shared = {**torch.load(d / STATE_FILE, map_location=device, weights_only=False), "model": model}
        rank_state = torch.load(d / f"rank-{rank}.pt", weights_only=False)
        ledger_state = json.loads((d / LEDGER_FILE).read_text())
    return meta, shared, rank_state, ledger_state


def final_checkpoint(plan: RunPlan, world: int, reported) -> str:
    """The run's last complete checkpoint (the one with the most releases)."""
    candidates = complete_checkpoints(plan.run_dir, reported)
    if not candidates:
        raise RuntimeError(f"no complete checkpoint under {plan.run_dir}")
    return candidates[-1][2]


def load_final_model(plan: RunPlan, checkpoint_path: str):
    """The run's model from a checkpoint: the EMA average when the run keeps one."""
    import torch

    from ..config import config_from_dict
    from ..models import build_run_model
    from .build import load_pca

    cfg = config_from_dict(plan.config)
    model = build_run_model(cfg, tuple(plan.input_shape), plan.num_classes, load_pca(plan))
    name = EMA_MODEL_FILE if cfg.ema_decay is not None else MODEL_FILE
    model.load_state_dict(torch.load(Path(checkpoint_path) / name, map_location="cpu"))
    return model.eval()

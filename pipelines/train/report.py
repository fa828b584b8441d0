"""What a worker reports: every ``checkpoint_every`` steps, metrics (rank 0: ε, validation and
test accuracy and loss, throughput) together with a checkpoint (every rank's part), through one
``ray.train.report``; rank 0 also writes the metrics to the run's metrics file, which the
driver forwards to MLflow (:mod:`.metrics_relay`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..data import sha256_file
from ..models import split_public_front
from .checkpoint import (
    AUDIT_FILE,
    EMA_MODEL_FILE,
    LEDGER_FILE,
    MODEL_FILE,
    STATE_FILE,
    persist_checkpoint,
    report_scratch,
)


def param_checksum(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in order: equal iff the parameters are bit-identical."""
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()  # no graph: a text model's activations for 2,048 texts would take GiBs
def evaluate(model, split, device=None, batch: int = 2048) -> tuple[float, float, float]:
    """(accuracy, mean cross-entropy, F1 of class 1) of ``model`` on ``split``: anything with
    ``batch(idx, device)`` and labels ``y`` (a mapped split: read in chunks, never loaded whole),
    or a pair (inputs, labels) of tensors. The F1 (of the positive class, e.g. spam) is for
    two-class tasks only, NaN otherwise."""
    if isinstance(split, tuple):
        x_all, labels = split
        inputs = lambda idx: x_all[idx]  # noqa: E731
    else:
        labels = split.y
        inputs = lambda idx: split.batch(idx, device)  # noqa: E731
    n = len(labels)
    if n == 0:
        return float("nan"), float("nan"), float("nan")
    was_training = model.training
    model.eval()
    totals, classes = None, 0  # correct, loss, tp, fp, fn: summed on the device, read once at the end
    for lo in range(0, n, batch):
        idx = torch.arange(lo, min(n, lo + batch))
        out = model(inputs(idx))
        y = labels[idx.to(labels.device)].to(out.device)
        pred = out.argmax(1)
        classes = out.shape[1]
        one, is_one = pred == 1, y == 1
        counts = torch.stack([(pred == y).sum(), (one & is_one).sum(), (one & ~is_one).sum(), (~one & is_one).sum()])
        part = torch.cat([F.cross_entropy(out, y, reduction="sum").double().reshape(1), counts.double()])
        totals = part if totals is None else totals + part
    model.train(was_training)
    loss, correct, tp, fp, fn = totals.tolist()
    f1 = (2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0) if classes == 2 else float("nan")
    return correct / n, loss / n, f1


def eval_batch(cfg) -> int:
    """Examples per evaluation forward: 2,048, or 4 physical batches if fewer (a run's physical
    batch is sized for a training step, which holds more per example than a forward alone)."""
    return min(2048, 4 * cfg.physical_batch_size)


def report(
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
    with report_scratch(plan, rank) as tmp:
        d = Path(tmp)
        rank_state = {
            "sampler": private.sampler.state_dict(),
            "noise": private.optimizer.randomness.state_dict(),
            "physical_batch_size": private.optimizer.physical_batch_size,  # a resumed run sums in the same pieces
        }
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
            val_acc, val_loss, val_f1 = evaluate(eval_model, held_out["val"], device, eval_batch(cfg))
            test_acc = test_loss = test_f1 = float("nan")  # NaN metrics are not logged
            if final or cfg.test_every_report:
                test_acc, test_loss, test_f1 = evaluate(eval_model, held_out["test"], device, eval_batch(cfg))
            if pruner is not None and not final:
                pruned = bool(pruner(val_acc, progress_tenths(step, plan.steps)))
            metrics = {
                "step": step,
                "epsilon": private.ledger.epsilon(),
                "val_accuracy": val_acc,
                "val_loss": val_loss,
                "test_accuracy": test_acc,
                "test_loss": test_loss,
                "val_f1": val_f1,  # two-class tasks: F1 of class 1 (spam)
                "test_f1": test_f1,
                "steps_per_second": rate,
                "expected_examples_per_second": rate * plan.sample_rate * plan.dataset_size,
                "committed_steps": len(private.ledger.committed_steps()),
                "releases": len(private.ledger),
                "final": float(final),
            }
            if cfg.diagnostics:  # NON-PRIVATE: computed on rank 0's training shard, not noised
                acc, loss, _ = evaluate(
                    split_public_front(model)[1] if plan.features else model, train, None, eval_batch(cfg)
                )
                first = torch.arange(min(512, len(train)))
                norms = private.optimizer.diagnostics(train.batch(first), train.labels(first))["per_sample_norms"]
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


def progress_tenths(step: int, planned: int) -> int:
    """Where a pruner compares trials: the tenth of its planned steps a run has reached (1-10),
    not the step number. Optuna's median pruner compares trials only at the same reported step,
    and a sweep that searches the lot size runs trials whose step numbers mean different amounts
    of training (step 118 is 6 epochs at lot 64 and 12 at lot 128 on digits: helper-41), so the
    small lots were pruned for being early, not worse. At the default checkpoint cadence (a
    tenth of the run) every trial reports at 1, 2, ..., 9."""
    return max(1, min(10, round(10 * step / max(1, planned))))

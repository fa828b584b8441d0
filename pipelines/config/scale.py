"""The training config's cluster section: how the work is spread, batched and kept."""

from __future__ import annotations

from dataclasses import dataclass

import dpcore

from .options import Section, check_choice, check_count, check_storage_path, option


@dataclass(frozen=True)
class ScaleConfig(Section):
    """How the work is spread, batched and kept: performance and fault tolerance, never the
    guarantee (like JAX Privacy's PerformanceFlags beside its execution plan)."""

    SECTION = "cluster"

    num_workers: int = option(2, "Ray Train workers (each samples its own shard)")
    use_gpu: bool = option(False, "one GPU per worker, NCCL (default: CPU, gloo)")
    in_process: bool = option(
        False,
        "train in this process with Ray Train's local mode: no Ray cluster and no worker processes, so it starts in "
        "seconds; one worker (num_workers=1), no automatic restarts (--resume still works)",
    )
    physical_batch_size: int = option(256, "examples per per-example-gradient call (memory, not privacy)")
    memory_budget_mb: str | float = option(
        "auto",
        "per-worker memory budget (MiB) for the per-example gradients: the physical batch size becomes the largest "
        "power of two ≤ physical_batch_size that fits, measured at start. auto: half of the worker's share of its "
        "node's memory (shared by the run's workers there, and by a sweep's trials at once; on a GPU, 60 percent of "
        "the GPU's memory); 0: off (a seeded run then sums its lots in the same pieces on any machine)",
    )
    clipping: str = option(
        "auto",
        "per-example clipping: auto (bookkeeping where the model and method allow it, else vmap), vmap (any model), or "
        "bookkeeping (Linear/Conv2d/WSConv2d/GroupNorm/LayerNorm/Embedding models; faster; its formulas verified against "
        "vmap in float64 on the first batch, else vmap)",
    )
    autocast: str = option(
        "none",
        "bf16: the model's forward (and so its backward) in bfloat16 under torch.autocast, on CPU or CUDA; per-example "
        "clipping, the noise and evaluation stay in float32, the lot's sums in float64 (none: float32 throughout, but "
        "the lot's sums)",
    )
    checkpoint_every: int = option(0, "steps between checkpoints and evaluations (0: about 10 per run)")
    max_failures: int = option(2, "worker-group restarts from the last checkpoint before the run fails")
    replay_log: bool = option(
        True,
        "keep the released updates since the last checkpoint (rank 0, off the hot path) and replay them after a "
        "crash, so that a restart or --resume spends no budget again (off: the releases since the checkpoint are "
        "rolled back and stay counted)",
    )
    ray_address: str | None = option(
        None,
        "Ray cluster to join ('auto', ray://...). Default: RAY_ADDRESS, else a local cluster started and stopped here",
    )
    ray_dashboard: bool = option(
        False,
        "start Ray's dashboard (and Jobs API) on 127.0.0.1 with the local cluster a run starts for itself; without it "
        "the cluster is up about a second sooner on 2 cores. A cluster that is joined keeps its own",
    )
    storage_path: str = option(
        "dp_runs",
        "where checkpoints, the ledger journal and ingested data go (shared storage on a cluster; default: "
        "$DP_STORAGE_PATH, else ./dp_runs)",
    )

    def check(self) -> None:
        err = dpcore.DPConfigError
        check_choice(self, "clipping", dpcore.optimizer.CLIPPING_MODES)
        check_choice(self, "autocast", dpcore.precision.AUTOCAST_MODES)
        for name in ("physical_batch_size", "num_workers"):
            dpcore.validation.check_positive_int(getattr(self, name), name)
        self.memory_budget()  # raises on a bad value
        check_count(self, "checkpoint_every", "max_failures")
        check_storage_path(self)
        if self.in_process and self.num_workers != 1:
            raise err(
                f"in_process trains one worker in this process; num_workers={self.num_workers} needs Ray workers: "
                "add --num-workers 1, or drop --in-process."
            )

    def memory_budget(self) -> str | float:
        """``memory_budget_mb`` read: "auto", or MiB (0.0: off). YAML and flags give it as text."""
        value = self.memory_budget_mb
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                value = None
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not (value == 0 or 1 <= value < float("inf"))
        ):
            raise dpcore.DPConfigError(
                f"memory_budget_mb={self.memory_budget_mb!r} is invalid: it must be auto, 0 (off) or a number of "
                "MiB ≥ 1."
            )
        return float(value)

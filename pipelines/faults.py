"""Fault injection for the crash tests: a test hook, never part of a user's config.

:func:`pipelines.train.run` takes ``faults=FaultInjection(at_step=k, rank=r)``: worker ``r``
dies hard (``os._exit``, no cleanup, no report) once, right after step ``k`` and before that
step's report. The marker file ``fault-injected`` in the run folder keeps the restarted group
from dying again. It is carried to the workers beside the plan, not in it, so it is neither
logged to MLflow nor kept for ``--resume``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import dpcore


@dataclass(frozen=True)
class FaultInjection:
    at_step: int
    rank: int = 1

    def check(self, cfg) -> None:
        """Refuse a hook that cannot fire, before anything starts."""
        if cfg.in_process:
            raise dpcore.DPConfigError(
                "fault injection kills a worker process; with in_process the worker is this process. Drop one of them."
            )
        if not (0 <= self.rank < cfg.num_workers):
            raise dpcore.DPConfigError(f"fault rank={self.rank} must be a worker rank in [0, {cfg.num_workers}).")

    def maybe_fail(self, run_dir: str, rank: int, step: int) -> None:
        if step == self.at_step and rank == self.rank:
            marker = Path(run_dir) / "fault-injected"
            if not marker.exists():
                marker.write_text(f"rank {rank} died after step {step}\n")
                os._exit(17)  # a hard crash: no cleanup, no report

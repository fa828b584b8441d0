"""One trial of a sweep: the Ray task that runs the main job as a child MLflow run (sending the
trial's Optuna heartbeat while it runs), the trial's own seed, and the sweep's progress line."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from pathlib import Path

import dpcore

from .pruning import TrialPruner


def trial_task():
    """The Ray remote function that runs one trial (defined on first use: Ray is imported then)."""
    import ray

    @ray.remote(num_cpus=0, max_retries=0)
    def run_trial(
        cfg_dict: dict,
        parent_run_id: str,
        tags: dict,
        pruner: TrialPruner | None,
        heartbeat: dict | None,
        pid_file: str,
        hook=None,
        memory_share: float = 1.0,
    ) -> dict:
        """One trial: the main job as a child run. Sends the trial's heartbeat while it runs
        (first thing, before the heavy imports)."""
        Path(pid_file).write_text(str(os.getpid()))
        stop = threading.Event()
        if heartbeat is not None:
            import optuna

            storage = optuna.storages.RDBStorage(
                heartbeat["storage"], heartbeat_interval=heartbeat["interval"], grace_period=heartbeat["grace"]
            )

            def beat():
                while True:
                    with contextlib.suppress(Exception):
                        storage.record_heartbeat(heartbeat["trial_id"])
                    if stop.wait(heartbeat["interval"]):
                        return

            threading.Thread(target=beat, daemon=True).start()
        import warnings as _w

        from pipelines.config import config_from_dict
        from pipelines.train import run

        try:
            if hook is not None:
                hook(cfg_dict)
            with _w.catch_warnings():
                _w.simplefilter("ignore", dpcore.SeededRandomnessWarning)
                out = run(
                    config_from_dict(cfg_dict),
                    parent_run_id=parent_run_id,
                    extra_tags=tags,
                    pruner=pruner,
                    memory_share=memory_share,
                )
        finally:
            stop.set()
        keys = (
            "run_id",
            "val_accuracy",
            "test_accuracy",
            "epsilon",
            "noise_multiplier",
            "sample_rate",
            "steps",
            "seconds",
            "checkpoint",
            "pruned",
        )
        summary = {k: out[k] for k in keys}
        summary["val_examples"] = out["spec"].split_info.get("val_examples")
        summary["ledger_sigmas"] = sorted({e.noise_multiplier for e in out["ledger"].entries if e.step > 0})
        return summary

    return run_trial


def trial_seed(seed: int | None, number: int) -> int | None:
    """A seeded sweep's trial seed: its own for each trial, so that no two trials draw the same
    noise (the search's bound composes independent trials). None stays None (secure noise)."""
    if seed is None:
        return None
    import hashlib

    return int.from_bytes(hashlib.sha256(f"dp-sweep-trial:{seed}:{number}".encode()).digest()[:4], "little")


class Progress:
    def __init__(self, total: int, enabled: bool, stream=sys.stderr):
        self.total, self.enabled, self.stream = total, enabled, stream
        self.t0 = time.monotonic()

    def show(self, done: int, running: int, best: tuple | None, note: str = "") -> None:
        if not self.enabled:
            return
        b = "–" if best is None else f"{best[1]:.4f} (trial {best[0]})"
        self.stream.write(
            f"[sweep] trials {done}/{self.total} done, {running} running, best validation accuracy {b}, "
            f"{time.monotonic() - self.t0:5.0f}s{('  ' + note) if note else ''}\n"
        )
        self.stream.flush()

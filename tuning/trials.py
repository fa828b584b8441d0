"""One trial of a sweep: the Ray task that runs the main job as a child MLflow run, the heartbeats
the driver sends for its trials while their tasks run, the trial's own seed, and the sweep's
progress line."""

from __future__ import annotations

import logging
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
        pid_file: str,
        hook=None,
        memory_share: float = 1.0,
    ) -> dict:
        """One trial: the main job as a child run. Its heartbeat is the driver's (:class:`Heartbeats`)."""
        Path(pid_file).write_text(str(os.getpid()))
        import warnings as _w

        from pipelines.config import config_from_dict
        from pipelines.train import run

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


class Heartbeats:
    """The Optuna heartbeats of the trials this driver has launched and not yet collected, sent
    from a thread of the driver every ``interval`` seconds, from the launch on.

    The driver, not the trial's task, sends them: a task spends its first seconds (more on a
    loaded machine) in Ray's worker start-up and in importing torch before any code of its own
    could send one, and a trial whose heartbeat is older than the grace period is failed and
    retried while it still runs (its pruner reports then fail: CI at daf4c28). A trial whose
    process dies, or whose driver dies, is beaten for no more, goes stale and is retried, as
    before; its grace period now starts once Ray has told the driver of the death (on a lost
    node, Ray's own timeout later). A task that never starts, or a driver that hangs, keeps its
    trials fresh for as long as the driver waits on them.
    """

    def __init__(self, storage, interval: float):
        self.storage, self.interval = storage, float(interval)
        self._ids: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="optuna-heartbeats", daemon=True)

    def __enter__(self) -> Heartbeats:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval + 5)

    def add(self, trial_id: int) -> None:
        """Beat for this trial from now on (the first beat at once)."""
        self.storage.record_heartbeat(trial_id)
        with self._lock:
            self._ids.add(trial_id)

    def discard(self, trial_id: int) -> None:
        """Its task has returned (or its process died): beat for it no more."""
        with self._lock:
            self._ids.discard(trial_id)

    def _beat(self) -> None:
        failing = False
        while not self._stop.wait(self.interval):
            with self._lock:
                ids = sorted(self._ids)  # one beat may land just after a discard: staleness waits one interval more
            for trial_id in ids:
                if self._stop.is_set():
                    return
                try:
                    self.storage.record_heartbeat(trial_id)
                    failing = False
                except Exception as e:  # noqa: BLE001 - retried next interval; the grace period covers several
                    if not failing:  # once a streak: an unreachable storage would fail the trials as stale
                        logging.getLogger(__name__).warning(
                            "a sweep trial's heartbeat could not be recorded (%s: %s); retrying every %gs",
                            type(e).__name__,
                            str(e).splitlines()[0] if str(e) else "",
                            self.interval,
                        )
                    failing = True


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

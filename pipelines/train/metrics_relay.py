"""Rank 0's metrics reach the run's MLflow run through the driver.

Rank 0 appends each report's metrics (and any run tags) as one JSON line to
``<run dir>/metrics.jsonl`` (:class:`MetricsFile`); the driver, which has MLflow loaded
already, forwards the new lines to MLflow about once a second and once more when the fit
returns (:class:`MetricsForwarder`). So no worker imports MLflow: about a second less before a
Ray worker's first step on 2 cores, and a smaller worker. The file lives beside the ledger
journal, in the run's storage folder, which every node and the driver see.

How far the lines were forwarded is kept in ``metrics.forwarded``: a resumed run's driver goes
on from there, so nothing is logged twice and nothing written before a driver crash is lost.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path

from .progress import _new_lines

METRICS_FILE = "metrics.jsonl"
FORWARDED_FILE = "metrics.forwarded"
MAX_METRICS_PER_BATCH = 1000  # MLflow's log_batch limits
MAX_TAGS_PER_BATCH = 100


class MetricsFile:
    """Rank 0's side: each report's metrics, appended as one line. Keeps the Tracker interface
    the worker uses (``tag``, ``log``, ``log_history``)."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / METRICS_FILE
        self._pending_tags: dict[str, str] = {}

    def tag(self, key: str, value: str) -> None:
        """A run tag, written with the next metrics."""
        self._pending_tags[key] = str(value)

    def log(self, metrics: dict, step: int) -> None:
        values = {k: float(v) for k, v in metrics.items() if k not in ("step", "final") and v == v}
        self._append({"step": int(step), "metrics": values, "tags": self._pending_tags})
        self._pending_tags = {}

    def log_history(self, records: list[dict]) -> None:
        """One metric per key and step (``diag_<key>``)."""
        for r in records:
            values = {f"diag_{k}": float(v) for k, v in r.items() if k != "step" and v == v}
            self._append({"step": int(r["step"]), "metrics": values, "tags": {}})

    def _append(self, record: dict) -> None:
        record["timestamp_ms"] = int(time.time() * 1000)
        with open(self.path, "a", encoding="utf-8") as f:  # one write per line: the reader takes whole lines
            f.write(json.dumps(record) + "\n")


class MetricsForwarder:
    """The driver's side: a thread that logs rank 0's new lines to MLflow; :meth:`drain` logs
    the rest when the fit has returned. An MLflow error in the thread is retried at the next
    poll; :meth:`drain` raises it."""

    def __init__(self, client, run_id: str, run_dir: str | os.PathLike, period: float = 1.0):
        self.client, self.run_id, self.period = client, run_id, period
        self.path = Path(run_dir) / METRICS_FILE
        self._mark = Path(run_dir) / FORWARDED_FILE
        self._offset = 0
        with contextlib.suppress(OSError, ValueError):
            self._offset = int(self._mark.read_text())
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dp-metrics-forwarder", daemon=True)

    def __enter__(self) -> MetricsForwarder:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        with contextlib.suppress(Exception):  # a failed run: what rank 0 wrote still reaches MLflow
            self.forward()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            with contextlib.suppress(Exception):  # retried at the next poll; drain() raises it
                self.forward()

    def drain(self) -> None:
        """Stop the thread and forward every line written so far."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.forward()

    def forward(self) -> int:
        """Log the complete lines written since the last call; returns how many."""
        from mlflow.entities import Metric, RunTag

        with self._lock:
            lines, offset = _new_lines(self.path, self._offset)
            if not lines:
                return 0
            metrics, tags = [], {}
            for line in lines:
                rec = json.loads(line)
                ts, step = rec["timestamp_ms"], rec["step"]
                metrics += [Metric(k, v, ts, step) for k, v in rec["metrics"].items()]
                tags.update(rec["tags"])
            tag_list = [RunTag(k, v) for k, v in tags.items()]
            for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
                self.client.log_batch(self.run_id, metrics=metrics[i : i + MAX_METRICS_PER_BATCH])
            for i in range(0, len(tag_list), MAX_TAGS_PER_BATCH):
                self.client.log_batch(self.run_id, tags=tag_list[i : i + MAX_TAGS_PER_BATCH])
            self._offset = offset
            tmp = self._mark.with_suffix(".tmp")
            tmp.write_text(str(offset))
            os.replace(tmp, self._mark)
            return len(lines)

"""The driver's progress line: it follows the ledger journal that rank 0 fsyncs at every step."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..plan import RunPlan


class JournalProgress:
    """Driver-side progress: follows the ledger journal that rank 0 fsyncs at every step."""

    def __init__(self, plan: RunPlan, enabled: bool, stream=sys.stderr):
        self.path, self.total = Path(plan.journal), plan.steps
        self.enabled, self.stream = enabled, stream
        self.interactive = enabled and stream.isatty()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._offset, self._steps, self._eps, self._rolled = 0, 0, None, 0
        self._start, self._first, self._last = time.monotonic(), None, None

    def __enter__(self):
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.enabled:
            self._thread.join(timeout=5)
            with contextlib.suppress(Exception):  # never hide the real outcome behind a progress error
                self._poll()
                self._print(final=True)

    def _poll(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, encoding="utf-8") as f:
            f.seek(self._offset)
            chunk = f.read()
        lines = chunk.split("\n")
        self._offset += len(chunk) - len(lines[-1])
        for line in lines[:-1]:
            rec = json.loads(line)
            if rec.get("op") == "append":
                if rec.get("epsilon") is not None:
                    self._eps = rec["epsilon"]
                if rec["step"] == 0:  # a release before training (DP-PCA): not a step
                    continue
                self._steps = rec["step"]
                if self._first is None:
                    self._first = (rec["timestamp"], rec["step"])
                self._last = (rec["timestamp"], rec["step"])
            elif rec.get("op") == "rollback":
                self._rolled += 1
                self._steps = rec["after_step"]

    def _print(self, final: bool = False) -> None:
        elapsed = time.monotonic() - self._start
        eta = ""
        if self._first is not None and self._last[1] > self._first[1]:
            rate = (self._last[1] - self._first[1]) / max(self._last[0] - self._first[0], 1e-9)
            eta = f", ETA {max(0.0, (self.total - self._steps) / rate):5.1f}s"
        width = 24
        filled = int(width * min(self._steps, self.total) / self.total)
        eps = "…" if self._eps is None else f"{self._eps:.3f}"
        phase = "starting workers" if self._first is None and not final else f"step {self._steps}/{self.total}"
        extra = f"  restarts: {self._rolled}" if self._rolled else ""
        line = f"[{'#' * filled}{'.' * (width - filled)}] {phase}  ε={eps}  {elapsed:5.1f}s{eta}{extra}"
        self.stream.write(("\r" + line.ljust(100)) if self.interactive else line + "\n")
        if self.interactive and final:
            self.stream.write("\n")
        self.stream.flush()

    def _run(self) -> None:
        period = 1.0 if self.interactive else 10.0
        while not self._stop.wait(period):
            with contextlib.suppress(Exception):
                self._poll()
                self._print()

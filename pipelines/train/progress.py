"""The driver's progress line. It follows the ledger journal that rank 0 fsyncs at every step,
and the run's phase file, where the driver and rank 0 write what start-up and the end of the
run are doing. Before the first step the line names the phase (starting Ray, workers up, data
loaded); after the last step every phase prints a line of its own."""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from dpcore.readout import epsilon_text

if TYPE_CHECKING:
    from ..plan import RunPlan

PHASES_FILE = "phases.log"


def note_phase(plan: RunPlan, text: str) -> None:
    """Write a phase of the run to its phase file, for the driver's progress line (rank 0)."""
    with contextlib.suppress(OSError), open(Path(plan.run_dir) / PHASES_FILE, "a", encoding="utf-8") as f:
        f.write(text.replace("\n", " ") + "\n")


def estimate_eta(records: list[tuple[int, float]], every: int, total: int) -> float | None:
    """Seconds left, from the measured steps: ``records`` are (step, time) of the releases so
    far. A step's time is the median gap between consecutive steps within a checkpoint period;
    a checkpoint's cost (metrics, held-out evaluation, ``ray.train.report``) is the gap across a
    checkpoint less a step. None until both are measured (the warm-up: the first steps, and the
    first checkpoint when more are to come), so the first ETA shown is not a guess."""
    within, across = [], []
    for (s1, t1), (s2, t2) in zip(records, records[1:], strict=False):
        if s2 == s1 + 1:
            (across if s1 % every == 0 else within).append(t2 - t1)
    if len(within) < 2:
        return None
    step = statistics.median(within)
    done = records[-1][0]
    checkpoints_left = sum(1 for k in range(done, total) if k % every == 0)  # a report follows step k
    if checkpoints_left and not across:
        return None
    pause = max(0.0, statistics.median(across) - step) if across else 0.0
    return (total - done) * step + checkpoints_left * pause


def _new_lines(path: Path, offset: int) -> tuple[list[str], int]:
    """The complete lines written to ``path`` after byte ``offset``, and the offset after them
    (a line still being written is left for the next poll)."""
    if not path.exists():
        return [], offset
    with open(path, "rb") as f:
        f.seek(offset)
        chunk = f.read()
    *lines, partial = chunk.split(b"\n")
    return [line.decode("utf-8") for line in lines], offset + len(chunk) - len(partial)


class JournalProgress:
    """Driver-side progress: follows the ledger journal and the phase file of a run."""

    def __init__(self, plan: RunPlan, enabled: bool, stream=sys.stderr, clock=time.monotonic):
        self.path, self.total, self.every = Path(plan.journal), plan.steps, max(1, plan.checkpoint_every)
        self.phases_path = Path(plan.run_dir) / PHASES_FILE
        self.enabled, self.stream, self.clock = enabled, stream, clock
        self.interactive = enabled and stream.isatty()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._offset, self._phase_offset, self._steps, self._eps, self._rolled = 0, 0, 0, None, 0
        self._eps_step = 0  # the step whose ε the line shows (the ledger computes it every k steps)
        self._replayed_just_now = False
        self._records: list[tuple[int, float]] = []
        self._phase, self._bar_done, self._printed_at = "starting", False, None
        with contextlib.suppress(OSError):  # a resumed run's file holds the earlier driver's phases
            self._phase_offset = self.phases_path.stat().st_size
        self._start = clock()

    def __enter__(self):
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.enabled:
            self._thread.join(timeout=5)
            with contextlib.suppress(Exception):  # never hide the real outcome behind a progress error
                self.steps_done()

    # -- what the driver says
    def phase(self, text: str) -> None:
        """A phase of the run: the progress line's label before the first step, a line after the last."""
        if not self.enabled:
            return
        with self._lock:
            self._show_phase(text)

    def steps_done(self) -> None:
        """Training is over (or stopped): the bar's last state on a line of its own."""
        if not self.enabled:
            return
        with self._lock:
            with contextlib.suppress(Exception):  # the last steps and phases, before the driver's own
                self._poll()
            self._finish_bar()

    # -- internals
    def _finish_bar(self) -> None:
        """The bar's final state, once, on a line of its own: what follows are phase lines."""
        if not self._bar_done:
            self._print_bar(final=True)
            self._bar_done = True

    def _show_phase(self, text: str) -> None:
        if self._steps >= self.total:  # the last step came with (or before) this phase
            self._finish_bar()
        if self._bar_done:
            self._write(f"  {text}  ({self.clock() - self._start:.1f}s)\n")
        else:
            self._phase = text
            if not self.interactive:
                self._print_bar()

    def _poll(self) -> None:
        lines, self._offset = _new_lines(self.path, self._offset)
        for line in lines:
            self._record(json.loads(line))
        lines, self._phase_offset = _new_lines(self.phases_path, self._phase_offset)
        for text in lines:
            self._show_phase(text)

    def _record(self, rec: dict) -> None:
        if rec.get("op") == "append":
            if rec.get("epsilon") is not None:
                self._eps, self._eps_step = rec["epsilon"], rec["step"]
            if rec["step"] == 0:  # a release before training (DP-PCA): not a step
                return
            self._steps = rec["step"]
            self._records.append((rec["step"], rec["timestamp"]))
        elif rec.get("op") == "replayed":  # a restart that replayed the logged releases
            self._rolled += 1
            self._steps = rec["upto_step"]
            self._records.clear()  # measure the step time again
            self._replayed_just_now = True
            return
        elif rec.get("op") == "rollback":
            if not self._replayed_just_now:  # the same restart as the replay before it
                self._rolled += 1
            self._steps = rec["after_step"]
            self._records.clear()  # a restart: measure the step time again
        self._replayed_just_now = False

    def _print_bar(self, final: bool = False) -> None:
        elapsed = self.clock() - self._start
        eta_text = ""
        if self._steps and not final:
            eta = estimate_eta(self._records, self.every, self.total)
            eta_text = ", ETA    …" if eta is None else f", ETA {eta:5.1f}s"
        width = 24
        filled = int(width * min(self._steps, self.total) / self.total)
        eps = "…" if self._eps is None else epsilon_text(self._eps, ".3f")
        if self._eps is not None and self._eps_step != self._steps:  # an earlier step's ε: say which
            eps += f" (step {self._eps_step})"
        label = self._phase if self._steps == 0 and not final else f"step {self._steps}/{self.total}"
        extra = f"  restarts: {self._rolled}" if self._rolled else ""
        line = f"[{'#' * filled}{'.' * (width - filled)}] {label}  ε={eps}  {elapsed:5.1f}s{eta_text}{extra}"
        if self.interactive:  # redrawn in place: never wider than the terminal, or it would wrap
            width = shutil.get_terminal_size((100, 24)).columns - 1
            self._write("\r" + line[:width].ljust(width) + ("\n" if final else ""))
        else:
            self._write(line + "\n")
        self._printed_at = self.clock()

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def _run(self) -> None:
        period = 1.0 if self.interactive else 10.0
        while not self._stop.wait(1.0):
            with contextlib.suppress(Exception), self._lock:
                self._poll()
                if self._bar_done:
                    continue
                if self._steps >= self.total:  # the last step: the bar's final line, then the phases
                    self._finish_bar()
                elif self._printed_at is None or self.clock() - self._printed_at >= period - 0.05:
                    self._print_bar()

"""A command's log file. While a command runs, the libraries' own logging (MLflow, Ray,
Alembic, Optuna) and the Python warnings they raise go to ``<storage>/logs/<command>-<time>.log``,
so that the terminal shows the platform's progress and summary. Their errors still reach the
terminal. Warnings that change what a run means (δ too large) are shown when they happen and
kept, so that the summary can repeat them; the summary also names the file and how many
library warnings it holds."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

LIBRARIES = ("mlflow", "ray", "alembic", "optuna")
# Python warnings raised from these packages (or of their own categories) go to the file too.
WARNING_PACKAGES = LIBRARIES + ("sqlalchemy", "pydantic", "torch", "google")


# MLflow's artifact progress bars, and the "View run ... at" links it writes to stdout for a
# tracking server (the summary prints the run's link, in the UI's model-training view).
QUIET_ENV = {"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false", "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}


def meaning_warnings() -> tuple[type[Warning], ...]:
    """The warnings that change what a run means, shown when raised and repeated in the summary:
    δ ≥ 1/N (a weak guarantee) and seeded randomness (predictable noise: research only)."""
    import dpcore

    return (dpcore.DeltaTooLargeWarning, dpcore.SeededRandomnessWarning)


_ACTIVE: list = []  # the open library_logs' handler adjusters, innermost last


def library_imported() -> None:
    """Call after importing a library inside :func:`library_logs` (Ray adds its terminal handler
    when it is first imported; MLflow replaces its logger's handlers): its records then go to the
    file again, and its terminal handlers pass only errors, like the others."""
    if _ACTIVE:
        _ACTIVE[-1]()


def log_path(storage_path: str, command: str) -> Path:
    """Where a command's library log goes: ``<storage>/logs/<command>-<time>.log``."""
    return Path(storage_path).expanduser().resolve() / "logs" / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}.log"


@dataclass
class CommandLog:
    path: Path
    library_warnings: int = 0  # library warnings written to the file
    kept: list[str] = field(default_factory=list)  # warnings that change what the run means, in order

    def __str__(self) -> str:
        return str(self.path)

    def summary(self, what: str) -> str:
        """The summary's line naming the file: ``logs: PATH (MLflow, Ray; 3 warnings there)``."""
        n = self.library_warnings
        return f"logs: {self.path} ({what}" + (f"; {n} warning{'s' * (n != 1)} there" if n else "") + ")"

    def repeat_kept(self) -> list[str]:
        """The kept warnings, once each, for the summary."""
        return [f"warning: {m}" for m in dict.fromkeys(self.kept)]

    def print_report(self, what: str, note: str = "") -> None:
        """The summary's part: the line naming the file (``note`` after it), then the kept warnings."""
        print(self.summary(what) + note)
        for line in self.repeat_kept():
            print(line)


class _Counter(logging.FileHandler):
    def __init__(self, path: Path, log: CommandLog):
        super().__init__(path)
        self.log = log

    def setFormatter(self, fmt) -> None:  # noqa: N802 - logging's name
        # ray.init sets its own format on every handler of the "ray" logger: keep the file's
        # (with the logger's name), whenever Ray starts.
        if self.formatter is None:
            super().setFormatter(fmt)

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno == logging.WARNING:
            self.log.library_warnings += 1
        super().emit(record)


def _from_library(category: type, filename: str) -> bool:
    if category.__module__.split(".")[0] in WARNING_PACKAGES:
        return True
    parts = Path(filename).parts  # .../site-packages/<package>/...
    return any(p in ("site-packages", "dist-packages") and nxt in WARNING_PACKAGES for p, nxt in zip(parts, parts[1:]))


def _route_raylet_warnings(saved: dict) -> None:
    """Once Ray is imported: the warnings its raylets push to every driver of the cluster (printed
    as ``(raylet) WARNING: ...`` on the driver's stdout, outside logging; one says that many worker
    processes started at once, on a loaded node) go to the log file, as records of ``ray.raylet``;
    its other pushed messages (a task killed for memory, say) still reach the terminal. Ray 2.5x-
    2.6x print them with ``ray._private.worker.print_to_stdstream``; without it nothing changes."""
    worker = sys.modules.get("ray._private.worker")
    original = getattr(worker, "print_to_stdstream", None)
    if saved or original is None:
        return
    raylet = logging.getLogger("ray.raylet")

    def print_to_stdstream(data, *args, **kwargs):
        if not isinstance(data, dict) or data.get("pid") != "raylet" or data.get("is_err") or not data.get("lines"):
            return original(data, *args, **kwargs)
        rest = []
        for line in data["lines"]:
            if str(line).lstrip().startswith("WARNING:"):
                raylet.warning(str(line).lstrip()[len("WARNING:") :].strip())
            else:
                rest.append(line)
        if rest:
            return original({**data, "lines": rest}, *args, **kwargs)

    saved["original"] = original
    worker.print_to_stdstream = print_to_stdstream


@contextlib.contextmanager
def library_logs(path: Path, keep: tuple[type[Warning], ...] = ()):
    """While inside: the libraries' records at INFO and above, and the Python warnings raised
    from them, go to ``path``; the libraries' own terminal handlers pass only errors. Python
    warnings of the ``keep`` categories are shown (``warning: <message>``) and kept in the yielded
    :class:`CommandLog`. MLflow's artifact progress bars and "View run" links are off. All
    restored on exit."""
    path.parent.mkdir(parents=True, exist_ok=True)
    log = CommandLog(path)
    handler = _Counter(path, log)
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    saved_levels: dict[logging.Handler, int] = {}
    saved_loggers: list[tuple[logging.Logger, int]] = []

    ray_printer: dict = {}  # Ray's printer of the cluster's pushed messages, while replaced

    def quiet_terminal_handlers() -> None:
        _route_raylet_warnings(ray_printer)
        for name in LIBRARIES:
            lg = logging.getLogger(name)
            if handler not in lg.handlers:  # a library imported since replaced its handlers (MLflow's dictConfig)
                lg.addHandler(handler)
                if lg.level == logging.NOTSET or lg.level > logging.INFO:
                    lg.setLevel(logging.INFO)
            for h in lg.handlers:
                if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                    if h not in saved_levels:
                        saved_levels[h] = h.level
                    h.setLevel(max(h.level, logging.ERROR))

    for name in LIBRARIES:
        lg = logging.getLogger(name)
        saved_loggers.append((lg, lg.level))
        if lg.level == logging.NOTSET or lg.level > logging.INFO:
            lg.setLevel(logging.INFO)
        lg.addHandler(handler)
    quiet_terminal_handlers()
    _ACTIVE.append(quiet_terminal_handlers)
    shown = warnings.showwarning
    py_warnings = logging.getLogger("py.warnings.libraries")

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if keep and issubclass(category, keep):  # our own words, without Python's source line
            log.kept.append(str(message))
            print(f"warning: {message}", file=sys.stderr, flush=True)
            return
        if _from_library(category, filename):  # counted by the file's handler
            py_warnings.handle(
                py_warnings.makeRecord(
                    py_warnings.name, logging.WARNING, filename, lineno, f"{category.__name__}: {message}", None, None
                )
            )
            return
        shown(message, category, filename, lineno, file, line)

    py_warnings.addHandler(handler)
    py_warnings.propagate = False
    warnings.showwarning = showwarning
    saved_env = {k: os.environ.get(k) for k in QUIET_ENV}
    os.environ.update(QUIET_ENV)
    try:
        yield log
    finally:
        _ACTIVE.remove(quiet_terminal_handlers)
        if ray_printer:
            sys.modules["ray._private.worker"].print_to_stdstream = ray_printer["original"]
        warnings.showwarning = shown
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        py_warnings.removeHandler(handler)
        for name in LIBRARIES:
            logging.getLogger(name).removeHandler(handler)
        for h, level in saved_levels.items():
            h.setLevel(level)
        for lg, level in saved_loggers:
            lg.setLevel(level)
        handler.close()

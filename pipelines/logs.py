"""The libraries' own logging (MLflow, Ray, Alembic) goes to a log file during a command, so
that the terminal shows the platform's progress and summary; warnings still reach the terminal."""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

LIBRARIES = ("mlflow", "ray", "alembic", "optuna")


def log_path(storage_path: str, command: str) -> Path:
    """Where a command's library log goes: ``<storage>/logs/<command>-<time>.log``."""
    return Path(storage_path).expanduser().resolve() / "logs" / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}.log"


@contextlib.contextmanager
def library_logs(path: Path):
    """While inside: the libraries' records at INFO and above go to ``path``, and their own
    terminal handlers pass only warnings and errors. Restored on exit."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    saved_levels: list[tuple[logging.Handler, int]] = []
    saved_loggers: list[tuple[logging.Logger, int]] = []
    for name in LIBRARIES:
        lg = logging.getLogger(name)
        saved_loggers.append((lg, lg.level))
        if lg.level == logging.NOTSET or lg.level > logging.INFO:
            lg.setLevel(logging.INFO)
        for h in lg.handlers:
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                saved_levels.append((h, h.level))
                h.setLevel(max(h.level, logging.WARNING))
        lg.addHandler(handler)
    try:
        yield path
    finally:
        for name in LIBRARIES:
            logging.getLogger(name).removeHandler(handler)
        for h, level in saved_levels:
            h.setLevel(level)
        for lg, level in saved_loggers:
            lg.setLevel(level)
        handler.close()

"""The main job: sharded DP training on Ray Train, with the run's ledger and model in MLflow.

* :mod:`.driver`: ``run(cfg)``: plan, the MLflow run, the Ray Train fit, ε from the ledger, logging;
* :mod:`.entry` → :mod:`.worker`: the function every Ray Train worker runs, a short loop over a ``Worker``;
* :mod:`.canaries`: the one-run audit's canaries, drawn before the workers start and scored after;
* :mod:`.checkpoint`, :mod:`.run_ledger`, :mod:`.report`, :mod:`.placement`: the worker's pieces;
* :mod:`.progress`, :mod:`.cli`: the driver's progress line and command line.

This package is imported by Ray Train's controller (to unpickle the training function), so it
imports nothing heavy itself: ``from pipelines.train import run`` loads the driver on first use.
"""

_LAZY = {
    "run": "driver",
    "load_final_model": "checkpoint",
    "ray_cluster": "cluster",
    "open_run_ledger": "driver",
    "final_checkpoint": "checkpoint",
    "RESUME_MAY_CHANGE": "resume",
    "build_parser": "cli",
    "main": "cli",
    "print_summary": "cli",
    "ui_command": "cli",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_LAZY)

"""The libraries' logging goes to the command's log file; their terminal handlers keep only
errors; Python warnings raised from the libraries go to the file as well, while the warnings
that change what a run means are shown and kept for the summary; everything is as it was
afterwards (K, must-show 4)."""

from __future__ import annotations

import io
import logging
import os
import warnings

import dpcore
from pipelines.logs import library_logs, log_path


def test_library_records_go_to_the_file_and_only_errors_reach_the_terminal(tmp_path):
    terminal = io.StringIO()
    lg = logging.getLogger("mlflow.store.db.utils")
    handler = logging.StreamHandler(terminal)
    logging.getLogger("mlflow").addHandler(handler)
    level = logging.getLogger("mlflow").level
    try:
        path = log_path(str(tmp_path), "train")
        with library_logs(path) as logs:
            lg.info("Creating initial MLflow database tables...")
            logging.getLogger("ray.train").warning("Token authentication is enabled")
            lg.warning("disk almost full")
            lg.error("the store is gone")
        text = logs.path.read_text()
        assert "Creating initial MLflow database tables" in text and "Token authentication" in text
        assert "disk almost full" in text and "the store is gone" in text
        assert terminal.getvalue() == "the store is gone\n"  # no warning-level line on the terminal
        assert logs.library_warnings == 2 and "(MLflow, Ray; 2 warnings there)" in logs.summary("MLflow, Ray")
        assert logs.path.parent == tmp_path.resolve() / "logs" and logs.path.name.startswith("train-")
        lg.info("after")  # restored: the terminal handler passes INFO again, the file gets nothing
        assert "after" not in logs.path.read_text()
        assert logging.getLogger("mlflow").level == level and handler.level == logging.NOTSET
    finally:
        logging.getLogger("mlflow").removeHandler(handler)


def test_library_python_warnings_go_to_the_file_and_meaningful_ones_are_kept(tmp_path, capsys):
    import optuna

    with warnings.catch_warnings(record=True) as passed_on:  # what reaches the usual display
        warnings.simplefilter("always")
        shown = warnings.showwarning
        with library_logs(log_path(str(tmp_path), "sweep"), keep=(dpcore.DeltaTooLargeWarning,)) as logs:
            assert os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] == "false"
            assert os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] == "true"
            warnings.warn(
                "RetryHeartbeatStaleTrialCallback is experimental", optuna.exceptions.ExperimentalWarning, stacklevel=1
            )
            warnings.warn_explicit(
                "Heartbeat of storage is supposed to be used with Study.optimize.",
                UserWarning,
                "/venv/lib/python3.11/site-packages/optuna/study/study.py",
                579,
            )
            warnings.warn("target_delta=0.001 is ≥ 1/N", dpcore.DeltaTooLargeWarning, stacklevel=1)
            warnings.warn("a warning of the platform's own", UserWarning, stacklevel=1)
        assert warnings.showwarning is shown
    err = capsys.readouterr().err
    assert "experimental" not in err and "Heartbeat" not in err  # in the file instead
    assert err == "warning: target_delta=0.001 is ≥ 1/N\n"  # our words, without Python's source line
    assert [str(w.message) for w in passed_on] == ["a warning of the platform's own"]
    text = logs.path.read_text()
    assert "ExperimentalWarning: RetryHeartbeatStaleTrialCallback is experimental" in text and "Heartbeat" in text
    assert logs.library_warnings == 2
    assert logs.repeat_kept() == ["warning: target_delta=0.001 is ≥ 1/N"]
    assert "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR" not in os.environ
    assert "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT" not in os.environ


def test_a_library_imported_inside_gets_its_terminal_handler_quieted_too(tmp_path):
    """Ray adds its terminal handler when first imported, which `submit` does inside the log."""
    from pipelines.logs import library_imported

    terminal = io.StringIO()
    late = logging.StreamHandler(terminal)
    ray_logger = logging.getLogger("ray")
    try:
        with library_logs(log_path(str(tmp_path), "submit")) as logs:
            ray_logger.addHandler(late)  # as `import ray` does
            library_imported()
            logging.getLogger("ray.dashboard.modules.job.sdk").warning("Directory '.git' is now ignored")
        assert terminal.getvalue() == "" and "Directory '.git'" in logs.path.read_text()
        assert late.level == logging.NOTSET  # restored
    finally:
        ray_logger.removeHandler(late)
    library_imported()  # outside any command log: nothing to do


def test_mlflow_first_imported_inside_still_logs_to_the_file_when_it_builds_a_database(tmp_path):
    """MLflow's import replaces its logger's handlers (logging.config.dictConfig) with a terminal
    handler at INFO. A run whose first MLflow import is the new database's schema, inside the
    command's log, must still put MLflow's and Alembic's lines in the file and none on the
    terminal. In a fresh interpreter: this one has imported MLflow already."""
    import subprocess
    import sys

    code = """
import sys
from pathlib import Path
from pipelines.logs import library_logs
assert "mlflow" not in sys.modules
with library_logs(Path(sys.argv[1]) / "train.log") as log:
    from pipelines.tracking import sqlite_schema
    assert sqlite_schema.create_if_missing(Path(sys.argv[1]) / "mlflow.db")
    import logging
    logging.getLogger("mlflow.tracking").info("an MLflow line after the build")
print(log.path.read_text())
"""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}  # a cache with no schema yet: it is built here
    (tmp_path / "cache").mkdir(mode=0o700)
    res = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env, timeout=300
    )
    assert res.returncode == 0, res.stderr
    assert res.stderr == "", res.stderr  # nothing on the terminal
    assert "INFO mlflow.store.db.utils: Creating initial MLflow database tables" in res.stdout
    assert "alembic.runtime.migration" in res.stdout and "an MLflow line after the build" in res.stdout


def test_the_features_progress_writes_whole_lines_into_a_log_file(tmp_path):
    """helper-28: the public features' progress redrew itself with \\r into log files (one
    endless line); a stream that is not a terminal gets whole lines, the last with the total."""
    from torch import nn

    from pipelines.data import ingest, load_dataset, verify
    from pipelines.data.features import ensure_features

    ingest(load_dataset("digits"), tmp_path / "ds", num_shards=2)
    log = io.StringIO()
    ensure_features(tmp_path / "ds", verify(tmp_path / "ds"), nn.Flatten(), "flat", tmp_path / "store", stream=log)
    text = log.getvalue()
    assert "\r" not in text and text.endswith("\n")
    assert text.splitlines()[-1].startswith("computing flat features once for digits: 1797/1797 examples")


def test_the_warnings_a_raylet_pushes_to_the_driver_go_to_the_file_and_its_other_messages_stay(tmp_path, capsys):
    """Ray prints what the cluster's raylets push to every driver with print_to_stdstream, outside
    logging: under load a sweep's terminal got "(raylet) WARNING: 14 PYTHON worker processes have
    been started ..." (a CI run with two test processes, 2026-12-01). It goes to the file; a pushed
    message that is not a warning (a task killed for memory) still reaches the terminal."""
    import ray._private.worker as ray_worker

    original = ray_worker.print_to_stdstream
    warning = "WARNING: 14 PYTHON worker processes have been started on node: 98bb with address: 192.0.2.2"
    killed = "Task was killed due to the node running low on memory."
    with library_logs(log_path(str(tmp_path), "sweep")) as logs:
        # what Ray's error listener thread calls, with a pushed message
        ray_worker.print_to_stdstream(
            {"lines": [warning, killed], "pid": "raylet", "is_err": False}, ignore_prefix=False
        )
        on_terminal = capsys.readouterr()
    text = logs.path.read_text()
    assert "WARNING ray.raylet: 14 PYTHON worker processes have been started" in text and killed not in text
    assert "PYTHON worker processes" not in on_terminal.out + on_terminal.err
    assert killed in on_terminal.out and logs.library_warnings == 1
    assert ray_worker.print_to_stdstream is original  # restored

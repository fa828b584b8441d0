"""The libraries' logging goes to the command's log file; their terminal handlers keep only
warnings and errors, and everything is as it was afterwards (K, must-show 4 in part)."""

from __future__ import annotations

import io
import logging

from pipelines.logs import library_logs, log_path


def test_library_info_goes_to_the_file_and_warnings_still_reach_the_terminal(tmp_path):
    terminal = io.StringIO()
    lg = logging.getLogger("mlflow.store.db.utils")
    handler = logging.StreamHandler(terminal)
    logging.getLogger("mlflow").addHandler(handler)
    level = logging.getLogger("mlflow").level
    try:
        path = log_path(str(tmp_path), "train")
        with library_logs(path) as logs:
            lg.info("Creating initial MLflow database tables...")
            logging.getLogger("ray.train").warning("a real warning")
            lg.warning("disk almost full")
        text = logs.read_text()
        assert "Creating initial MLflow database tables" in text and "a real warning" in text
        assert "Creating initial" not in terminal.getvalue() and "disk almost full" in terminal.getvalue()
        assert logs.parent == tmp_path.resolve() / "logs" and logs.name.startswith("train-")
        lg.info("after")  # restored: the terminal handler passes INFO again, the file gets nothing
        assert "after" not in logs.read_text()
        assert logging.getLogger("mlflow").level == level and handler.level == logging.NOTSET
    finally:
        logging.getLogger("mlflow").removeHandler(handler)

"""``dp-platform ui`` checks before it starts anything (K, must-show 6): a taken port is named,
with the stack's MLflow server recognised, and the exit code is non-zero; an unusable store is
refused. (Serving on a free port, and printing the URL once the page answers, is in the main
job's end-to-end test.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

CLI = [sys.executable, "-m", "pipelines.cli", "ui"]


def _listening() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def _ui(tmp_path, *args, stack_port: int | None = None):
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["DP_STACK_DIR"] = str(tmp_path / "stack")
    if stack_port is not None:
        (tmp_path / "stack").mkdir()
        (tmp_path / "stack" / "stack.json").write_text(json.dumps({"ports": {"mlflow": stack_port}}))
    return subprocess.run(CLI + list(args), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


def test_a_taken_port_is_named_and_nothing_starts(tmp_path):
    with _listening() as s:
        port = s.getsockname()[1]
        out = _ui(tmp_path, "--port", str(port))
    assert out.returncode == 2
    assert f"port {port} is taken: another program listens there" in out.stderr
    assert "MLflow UI:" not in out.stdout and "starting" not in out.stdout


def test_the_stacks_mlflow_server_is_recognised(tmp_path):
    with _listening() as s:
        port = s.getsockname()[1]
        out = _ui(tmp_path, "--port", str(port), stack_port=port)
    assert out.returncode == 2
    assert "the platform's stack serves its MLflow server there" in out.stderr and "login" in out.stderr


def test_an_unwritable_store_is_refused_before_anything_starts(tmp_path):
    out = _ui(tmp_path, "--tracking-uri", f"sqlite:///{tmp_path}/no/such/folder/mlflow.db")
    assert out.returncode == 2 and "does not exist or is not writable" in out.stderr
    assert not (tmp_path / "no").exists()


def test_a_tracking_server_is_pointed_at_not_served_again(tmp_path):
    out = _ui(tmp_path, "--tracking-uri", "http://127.0.0.1:5999")
    assert out.returncode == 0 and "serves its own UI" in out.stdout

"""``dp-platform clean`` lists what it would remove, asks (or takes --yes), never touches a
tracking server, and refuses while a run is training (K, must-show 1)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _leftovers(root: Path) -> dict[str, Path]:
    runs = root / "dp_runs" / "digits-mlp-1"
    runs.mkdir(parents=True)
    (runs / "ledger.jsonl").write_text("{}\n")
    (root / "mlflow.db").write_bytes(b"x" * 1000)
    (root / "mlruns" / "1").mkdir(parents=True)
    (root / "mlruns" / "1" / "model.pt").write_bytes(b"y" * 2000)
    cache = root / "cache" / "dp-platform" / "verified"
    cache.mkdir(parents=True)
    (cache / "stamp.json").write_text("{}")
    (root / "optuna.db").write_bytes(b"z" * 500)  # a sweep's trials, with their exact scores
    keep = root / "notes.txt"
    keep.write_text("mine")
    return {
        "optuna": root / "optuna.db",
        "runs": root / "dp_runs",
        "db": root / "mlflow.db",
        "mlruns": root / "mlruns",
        "cache": cache.parent,
        "keep": keep,
    }


def _clean(root: Path, *args: str, stdin: str | None = None, env_extra: dict | None = None):
    env = {
        k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "DP_STORAGE_PATH", "DP_OPTUNA_STORAGE")
    }
    env.update({"XDG_CACHE_HOME": str(root / "cache"), **(env_extra or {})})
    return subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "clean", *args],
        cwd=root,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_clean_lists_everything_and_removes_nothing_without_yes(tmp_path):
    paths = _leftovers(tmp_path)
    out = _clean(tmp_path)  # not a terminal and no --yes: it must not remove anything
    assert out.returncode == 1 and "add --yes" in out.stderr
    for name in ("dp_runs", "mlflow.db", "mlruns", "dp-platform", "optuna.db"):
        assert name in out.stdout
    assert all(p.exists() for p in paths.values())
    dry = _clean(tmp_path, "--dry-run")
    assert dry.returncode == 0 and all(p.exists() for p in paths.values())
    assert "this would remove (nothing is removed)" in dry.stdout and "This removes" not in dry.stdout


def test_clean_yes_removes_the_leftovers_and_nothing_else(tmp_path):
    paths = _leftovers(tmp_path)
    out = _clean(tmp_path, "--yes")
    assert out.returncode == 0, out.stderr
    assert not any(paths[k].exists() for k in ("runs", "db", "mlruns", "cache", "optuna"))
    assert paths["keep"].read_text() == "mine"
    again = _clean(tmp_path, "--yes")
    assert again.returncode == 0 and "nothing to clean" in again.stdout


def test_clean_can_take_one_kind_only(tmp_path):
    paths = _leftovers(tmp_path)
    assert _clean(tmp_path, "--cache", "--yes").returncode == 0
    assert not paths["cache"].exists() and paths["runs"].exists() and paths["db"].exists()
    assert _clean(tmp_path, "--sweeps", "--yes").returncode == 0
    assert not paths["optuna"].exists() and paths["runs"].exists() and paths["db"].exists()
    paths["optuna"].write_bytes(b"z")  # a server's store is never touched; only a sqlite file is removed
    out = _clean(
        tmp_path, "--sweeps", "--yes", env_extra={"DP_OPTUNA_STORAGE": "postgresql://dp@127.0.0.1:5433/optuna"}
    )
    assert "nothing to clean" in out.stdout and paths["optuna"].exists()


def test_a_tracking_server_is_never_touched(tmp_path):
    paths = _leftovers(tmp_path)
    out = _clean(tmp_path, "--tracking", "--yes", env_extra={"MLFLOW_TRACKING_URI": "http://127.0.0.1:5999"})
    assert out.returncode == 0 and "nothing to clean" in out.stdout
    assert paths["db"].exists() and paths["mlruns"].exists()


def test_clean_refuses_while_a_run_holds_its_journal(tmp_path):
    paths = _leftovers(tmp_path)
    lock = paths["runs"] / "digits-mlp-1" / "ledger.jsonl.lock"
    with open(lock, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # as a training worker holds it
        out = _clean(tmp_path, "--yes")
    assert out.returncode == 1 and "still training" in out.stderr
    assert all(p.exists() for p in paths.values())


@pytest.mark.parametrize("answer, removed", [("y\n", True), ("n\n", False), ("\n", False)])
def test_clean_asks_on_a_terminal(tmp_path, answer, removed):
    """The question is asked on a terminal (a pseudo-terminal here) and only 'y' removes."""
    import pty

    paths = _leftovers(tmp_path)
    env = {
        k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "DP_STORAGE_PATH", "DP_OPTUNA_STORAGE")
    }
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    pid, fd = pty.fork()
    if pid == 0:  # the child: stdin and stdout are the terminal
        os.chdir(tmp_path)
        os.execve(sys.executable, [sys.executable, "-m", "pipelines.cli", "clean"], env)
    seen = b""
    while b"[y/N]" not in seen:
        seen += os.read(fd, 1024)
    os.write(fd, answer.encode())
    try:
        while os.read(fd, 1024):
            pass
    except OSError:
        pass  # the terminal closes when the child exits
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert (not paths["db"].exists()) == removed and (not paths["runs"].exists()) == removed

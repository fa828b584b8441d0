"""The MLflow tracking server of the stack: on PostgreSQL, with basic auth, on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from .common import JOBS_USER, StackError, _http, _tail
from .ray_node import _kill_group


def _start_mlflow(state: dict, admin: dict, root: Path) -> int:
    host, port, pg = state["host"], state["ports"]["mlflow"], state["ports"]["postgres"]
    ini = root / "basic_auth.ini"
    ini.write_text(
        "[mlflow]\n"
        "default_permission = READ\n"
        f"database_uri = postgresql+psycopg2://mlflow@{host}:{pg}/mlflow_auth\n"
        "admin_username = admin\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
    )
    env = {
        **os.environ,
        # the server's own secrets: through its environment and a 0600 password file only
        "PGPASSFILE": str(root / "pgpass.server"),
        "MLFLOW_AUTH_CONFIG_PATH": str(ini),
        "MLFLOW_AUTH_ADMIN_PASSWORD": admin["MLFLOW_ADMIN_PASSWORD"],
        "MLFLOW_FLASK_SERVER_SECRET_KEY": admin["MLFLOW_FLASK_SERVER_SECRET_KEY"],
    }
    for k in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        env.pop(k, None)
    log = root / "mlflow.log"
    cmd = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", f"postgresql+psycopg2://mlflow@{host}:{pg}/mlflow",
        "--artifacts-destination", (root / "artifacts").as_uri(),
        "--serve-artifacts",
        "--app-name", "basic-auth",
        "--host", host, "--port", str(port),
        "--workers", "1",
    ]  # fmt: skip
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise StackError(
                    f"the MLflow server exited ({proc.returncode}) while starting. Its log, {log}:\n{_tail(log)}"
                )
            try:
                if _http(url + "/health", timeout=2)[0] == 200:
                    return proc.pid
            except OSError:
                pass
            time.sleep(0.5)
        raise StackError(f"the MLflow server did not answer on {url} within 120 s. Its log, {log}:\n{_tail(log)}")
    except BaseException:
        _kill_group(proc.pid)  # its whole process group, also when only the main process died
        raise


USER_SETUP_TIMEOUT_S = 60.0


def _ensure_jobs_user(state: dict, admin: dict, creds: dict) -> None:
    """The MLflow user that jobs log as (not the admin); its password is set to the one in credentials.env."""
    url = f"http://{state['host']}:{state['ports']['mlflow']}/api/2.0/mlflow/users"
    auth = ("admin", admin["MLFLOW_ADMIN_PASSWORD"])
    user = {"username": JOBS_USER, "password": creds["MLFLOW_TRACKING_PASSWORD"]}
    # The server's first authenticated requests hash passwords and write its auth database: on a
    # loaded 2-core machine they took over the 5 s default (a CI run beside a training job).
    code, body = _http(f"{url}/create", auth=auth, data=user, timeout=USER_SETUP_TIMEOUT_S)
    if code != 200 and "RESOURCE_ALREADY_EXISTS" in body:
        code, body = _http(f"{url}/update-password", auth=auth, data=user, method="PATCH", timeout=USER_SETUP_TIMEOUT_S)
    if code != 200:
        raise StackError(f"could not set up the MLflow user {JOBS_USER} (HTTP {code}): {body[:500]}")

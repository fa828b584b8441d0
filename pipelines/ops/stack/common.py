"""Shared pieces of the local stack: constants, errors, secret files, ports, HTTP, and its state file."""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import socket
import stat
import sys
import urllib.error
import urllib.request
from base64 import b64encode
from pathlib import Path

import dpcore

PROG = "dp-platform stack"
JOBS_USER = "dp-jobs"
DEFAULT_PORTS = {"postgres": 5433, "mlflow": 5000, "gcs": 6379, "dashboard": 8265, "client": 10001}


class StackError(dpcore.DPConfigError):
    """The stack cannot be started, reached or stopped; the message says why and what to do."""


def default_dir() -> Path:
    return Path(os.environ.get("DP_STACK_DIR") or Path.home() / ".dp-platform" / "stack").expanduser()


# ------------------------------------------------------------------------------- small helpers
def _write_secret(path: Path, text: str) -> None:
    """Write ``path`` with mode 0600 from the start: a new file (never following a link) that
    then replaces the old one, so no reader ever sees the secret under looser permissions."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _private_dir(path: Path) -> None:
    """Create ``path`` (mode 0700) or accept it only if it is a real folder owned by this user."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise StackError(
                f"{path} exists but is not a folder owned by this user (uid {os.geteuid()}); refusing to keep secrets or Ray's files there."
            ) from None
    os.chmod(path, 0o700)


def read_env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = " ".join(shlex.split(v.strip()))
    return out


def _env_text(values: dict[str, str], header: str) -> str:
    return "\n".join([f"# {header}", *(f"{k}={shlex.quote(v)}" for k, v in values.items())]) + "\n"


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 12) -> str:
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + t for t in text[-lines:])


def _http(
    url: str,
    auth: tuple[str, str] | None = None,
    bearer: str | None = None,
    data: dict | None = None,
    timeout: float = 5.0,
    method: str | None = None,
):
    """(status, body) of a GET, or of a POST (or ``method``) of ``data`` as JSON. Raises OSError when nothing answers."""
    method = method or ("GET" if data is None else "POST")
    req = urllib.request.Request(url, data=None if data is None else json.dumps(data).encode(), method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if auth is not None:
        req.add_header("Authorization", "Basic " + b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    if bearer is not None:
        req.add_header("Authorization", f"Bearer {bearer}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def _bin(name: str) -> str:
    """An executable of this environment (ray, mlflow), else from PATH."""
    here = Path(sys.executable).with_name(name)
    return str(here) if here.exists() else (shutil.which(name) or name)


# ------------------------------------------------------------------------------- state
def load_state(root: Path) -> dict:
    f = Path(root) / "stack.json"
    if not f.is_file():
        raise StackError(
            f"no stack in {root}: start one with `{PROG} up`"
            + ("" if Path(root) == default_dir() else f" --dir {root}")
            + "."
        )
    return json.loads(f.read_text())


def _secrets(root: Path, state: dict) -> tuple[dict, dict]:
    """admin.env and credentials.env: read if they exist, else generated (mode 0600)."""
    admin_f, creds_f = root / "admin.env", root / "credentials.env"
    admin = (
        read_env_file(admin_f)
        if admin_f.exists()
        else {
            "PG_ADMIN_PASSWORD": secrets.token_urlsafe(24),
            "PG_MLFLOW_PASSWORD": secrets.token_urlsafe(24),
            "PG_OPTUNA_PASSWORD": secrets.token_urlsafe(24),
            "MLFLOW_ADMIN_PASSWORD": secrets.token_urlsafe(24),
            "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(32),
        }
    )
    _write_secret(
        admin_f, _env_text(admin, "dp-platform stack: administrator secrets (read by `dp-platform stack` only)")
    )
    old = read_env_file(creds_f) if creds_f.exists() else {}
    host, p = state["host"], state["ports"]
    token = root / "ray_auth_token"
    _write_secret(token, token.read_text().strip() if token.exists() else secrets.token_hex(32))
    creds = {
        "MLFLOW_TRACKING_URI": f"http://{host}:{p['mlflow']}",
        "MLFLOW_TRACKING_USERNAME": JOBS_USER,
        "MLFLOW_TRACKING_PASSWORD": old.get("MLFLOW_TRACKING_PASSWORD") or secrets.token_urlsafe(24),
        "DP_RAY_JOBS_ADDRESS": f"http://{host}:{p['dashboard']}",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        "PGPASSFILE": str(root / "pgpass"),
        "DP_OPTUNA_STORAGE": f"postgresql+psycopg2://optuna@{host}:{p['postgres']}/optuna",
        "DP_STORAGE_PATH": str(root / "runs"),
    }
    _write_secret(
        creds_f, _env_text(creds, "dp-platform stack: job credentials. Load with: set -a; . THIS_FILE; set +a")
    )
    # libpq reads passwords from these (mode 0600), so no URL carries one
    _write_secret(root / "pgpass", f"{host}:{p['postgres']}:optuna:optuna:{admin['PG_OPTUNA_PASSWORD']}\n")
    _write_secret(root / "pgpass.server", f"{host}:{p['postgres']}:*:mlflow:{admin['PG_MLFLOW_PASSWORD']}\n")
    return admin, creds

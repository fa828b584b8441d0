"""The stack's commands: up, down, check, and what it runs and listens on."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from .common import (
    DEFAULT_PORTS,
    PROG,
    StackError,
    _http,
    _private_dir,
    _secrets,
    default_dir,
    load_state,
    port_in_use,
    read_env_file,
)
from .mlflow_server import _ensure_jobs_user, _start_mlflow
from .postgres import _as_postgres_user, _pg_base, _pg_is_up, _provision_databases, _start_postgres, ensure_postgres
from .ray_node import _ray_processes, _start_ray_head, _stop_processes


def up(
    root: Path | None = None,
    host: str = "127.0.0.1",
    ports: dict | None = None,
    num_cpus: int | None = None,
    resources: dict | None = None,
    install: bool = True,
    log=print,
    cleartext_network: bool = False,
) -> dict:
    """Start PostgreSQL, MLflow and a Ray head; returns the state (also in ``stack.json``).
    On any failure the services already started are stopped again and StackError says why.
    A ``host`` other than loopback needs ``cleartext_network``: nothing here speaks TLS."""
    root = Path(root or default_dir()).expanduser().resolve()
    if (root / "stack.json").exists():
        state = load_state(root)
        down_services = [k for k, v in check(root).items() if not v["ok"]]
        if not down_services:
            log(f"the stack in {root} is already up.")
            return state
        raise StackError(
            f"the stack in {root} is partly up ({', '.join(down_services)} down). Run `{PROG} down"
            + ("" if root == default_dir() else f" --dir {root}") + "` first, then up again."
        )  # fmt: skip
    ports = {**DEFAULT_PORTS, **(ports or {})}
    if host not in ("127.0.0.1", "localhost", "::1"):
        if not cleartext_network:
            raise StackError(
                f"--host {host} would make the services reachable from the network, and basic auth's passwords and the "
                "Ray token would travel in clear text over HTTP (nothing here speaks TLS). Keep 127.0.0.1 and tunnel "
                "(ssh -L), or add --cleartext-network to accept that, with TLS put in front. Nothing was started."
            )
        log(f"warning: --host {host}: the services will be reachable from the network, and basic auth and the Ray token travel "
            "in clear text over HTTP. Put TLS in front of them, or keep 127.0.0.1 and tunnel.")  # fmt: skip
    for name, port in ports.items():
        if port_in_use(host, port):
            raise StackError(f"port {port} on {host} (for {name}) is already in use; pick another with --{name}-port.")
    bindir = ensure_postgres(install)
    _private_dir(root)
    (root / "artifacts").mkdir(exist_ok=True)
    (root / "runs").mkdir(exist_ok=True)
    state = {
        "root": str(root),
        "host": host,
        "ports": ports,
        "pg_base": str(_pg_base(root)),
        "pg_bindir": str(bindir),
        "ray_temp": f"/tmp/dp-stack-{hashlib.sha256(str(root).encode()).hexdigest()[:10]}",
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    _private_dir(Path(state["ray_temp"]))
    admin, creds = _secrets(root, state)
    started = []  # each service is listed before it starts, so a half-started one is stopped too
    try:
        log(f"PostgreSQL   starting on {host}:{ports['postgres']} ...")
        started.append("postgres")
        _start_postgres(state, admin, bindir)
        try:
            _provision_databases(state, admin)
        except Exception as e:  # psycopg2's errors: a damaged or foreign database cluster
            raise StackError(
                f"PostgreSQL on {host}:{ports['postgres']} refused the stack's set-up: {str(e).strip()}"
            ) from None
        log(f"MLflow       starting on http://{host}:{ports['mlflow']} (PostgreSQL backend, basic auth) ...")
        state["mlflow_pid"] = _start_mlflow(state, admin, root)
        started.append("mlflow")
        _ensure_jobs_user(state, admin, creds)
        log(
            f"Ray head     starting on {host}:{ports['gcs']} (token auth; Jobs API http://{host}:{ports['dashboard']}) ..."
        )
        (root / "stack.json").write_text(json.dumps(state, indent=2))
        started.append("ray")
        _start_ray_head(root, state, num_cpus, resources)
    except BaseException:
        (root / "stack.json").unlink(missing_ok=True)
        _stop(state, started)
        raise
    return state


def _stop(state: dict, which=("ray", "mlflow", "postgres")) -> list[str]:
    """Stop the stack's services: Ray's and MLflow's processes together (SIGTERM, then SIGKILL
    after 5 s), then PostgreSQL (a fast shutdown)."""
    said, procs = [], []
    groups = stack_processes(state)
    if "ray" in which:
        procs += groups["ray"]
        said.append(f"Ray: stopped {len(groups['ray'])} process(es)")
    if "mlflow" in which and state.get("mlflow_pid"):
        procs += groups["mlflow"]
        said.append("MLflow: stopped" if groups["mlflow"] else "MLflow: was not running")
    _stop_processes(procs)
    if "ray" in which:
        shutil.rmtree(state["ray_temp"], ignore_errors=True)
    if "postgres" in which:
        data = Path(state["pg_base"]) / "data"
        r = subprocess.run(
            _as_postgres_user([str(Path(state["pg_bindir"]) / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"]),
            capture_output=True,
            text=True,
        )
        said.append("PostgreSQL: stopped" if r.returncode == 0 else "PostgreSQL: was not running")
    return said


def _postmaster_alive(pg_base: Path) -> int | None:
    """The pid of a PostgreSQL server still running on the data in ``pg_base``, if any."""
    try:
        pid = int((pg_base / "data" / "postmaster.pid").read_text().split()[0])
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError, IndexError):
        return None


def _purge_stopped(root: Path) -> list[str]:
    """``down --purge`` after a plain ``down``: no service runs, the data and secrets remain."""
    pg = _pg_base(root)
    if not root.exists() and not pg.exists():
        load_state(root)  # raises: there is no stack here at all
    pid = _postmaster_alive(pg)
    if pid is not None:
        raise StackError(f"PostgreSQL (pid {pid}) still runs on {pg}/data; stop it before purging its data.")
    shutil.rmtree(pg, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    return [f"no service was running; removed {root} and {pg}"]


def down(root: Path | None = None, purge: bool = False) -> list[str]:
    root = Path(root or default_dir()).expanduser().resolve()
    if purge and not (root / "stack.json").exists():
        return _purge_stopped(root)
    state = load_state(root)
    said = _stop(state)
    (root / "stack.json").unlink(missing_ok=True)
    if purge:
        shutil.rmtree(state["pg_base"], ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
        said.append(f"removed {root} and {state['pg_base']}")
    else:
        said.append(f"data and secrets stay in {root} and {state['pg_base']} (`{PROG} down --purge` removes them)")
    return said


def check(root: Path | None = None) -> dict[str, dict]:
    """Each service: {"ok": bool, "where": address, "detail": why not}."""
    root = Path(root or default_dir()).expanduser().resolve()
    state = load_state(root)
    missing = [f for f in ("admin.env", "ray_auth_token") if not (root / f).is_file()]
    if missing:
        raise StackError(
            f"the stack in {root} is missing {', '.join(missing)}; stop it (`{PROG} down`) and start it again."
        )
    admin = read_env_file(root / "admin.env")
    host, p = state["host"], state["ports"]
    out = {}
    why = _pg_is_up(state, admin)
    out["postgres"] = {"ok": why is None, "where": f"{host}:{p['postgres']}", "detail": why or "accepting connections"}
    try:
        code, _ = _http(f"http://{host}:{p['mlflow']}/health", timeout=3)
        out["mlflow"] = {"ok": code == 200, "where": f"http://{host}:{p['mlflow']}", "detail": f"HTTP {code}"}
    except OSError as e:
        out["mlflow"] = {"ok": False, "where": f"http://{host}:{p['mlflow']}", "detail": str(getattr(e, "reason", e))}
    token = (root / "ray_auth_token").read_text().strip()
    try:
        code, body = _http(f"http://{host}:{p['dashboard']}/api/cluster_status", bearer=token, timeout=3)
        out["ray"] = {
            "ok": code == 200,
            "where": f"{host}:{p['gcs']} (Jobs API http://{host}:{p['dashboard']})",
            "detail": f"HTTP {code}",
        }
    except OSError as e:
        out["ray"] = {"ok": False, "where": f"{host}:{p['gcs']}", "detail": str(getattr(e, "reason", e))}
    return out


def stack_processes(state: dict) -> dict[str, list]:
    """The stack's processes by service (psutil.Process objects)."""
    import psutil

    out: dict[str, list] = {
        "postgres": [],
        "mlflow": [],
        "ray": _ray_processes(state["ray_temp"], state["ports"]["client"]),
    }
    pidfile = Path(state["pg_base"]) / "data" / "postmaster.pid"
    try:
        master = psutil.Process(int(pidfile.read_text().split()[0]))
        out["postgres"] = [master, *master.children(recursive=True)]
    except (OSError, ValueError, IndexError, psutil.NoSuchProcess):
        pass
    if state.get("mlflow_pid"):
        for proc in psutil.process_iter(["pid", "cmdline"]):
            try:
                # the server's process group, and only processes that are MLflow's (a reused pid is not)
                if os.getpgid(proc.pid) == state["mlflow_pid"] and any(
                    "mlflow" in part or "uvicorn" in part or "gunicorn" in part for part in proc.info["cmdline"] or []
                ):
                    out["mlflow"].append(proc)
            except (ProcessLookupError, psutil.NoSuchProcess, psutil.AccessDenied):
                continue
    return out


def listening_sockets(root: Path | None = None) -> list[dict]:
    """Every TCP socket the stack's processes listen on: service, process, address, port.
    Measured, not assumed: Ray binds some of its internal ports on all interfaces whatever
    --node-ip-address says (see deploy/README.md)."""
    import psutil

    state = load_state(Path(root or default_dir()).expanduser().resolve())
    rows = []
    for service, procs in stack_processes(state).items():
        for proc in procs:
            try:
                conns, name = proc.net_connections(kind="tcp"), proc.name()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            for c in conns:
                if c.status == psutil.CONN_LISTEN:
                    rows.append(
                        {"service": service, "process": name, "pid": proc.pid, "ip": c.laddr.ip, "port": c.laddr.port}
                    )
    return sorted(rows, key=lambda r: (r["service"], r["port"], r["ip"]))

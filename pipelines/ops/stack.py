"""``dp-platform stack``: the platform's services on this machine. PostgreSQL, MLflow and the
Ray Jobs API listen on 127.0.0.1; Ray itself listens on some internal ports on every interface
whatever it is told (`stack status --ports` lists them; see deploy/README.md), and those need
the token.

    dp-platform stack up        PostgreSQL (installed from Debian's packages if missing), an
                                MLflow server on it with basic auth, a Ray head with token auth
    dp-platform stack add-node  one more Ray node (``ray start --address``) joining the head
    dp-platform stack status    what runs, where
    dp-platform stack down      stop everything (the databases and artifacts stay; --purge removes them)

Secrets are generated here, written only to files of mode 0600 in the stack folder, and passed
to the services through their environment (never on a command line, which ``ps`` shows):

* ``credentials.env``: what a user or a job needs (the MLflow address and the ``dp-jobs``
  user, the Ray Jobs address and token file, the Optuna storage URL without its password,
  the PostgreSQL password file). ``set -a; . credentials.env; set +a`` loads it in a shell.
* ``admin.env``: the PostgreSQL roles' passwords, the MLflow admin's, and the MLflow server's
  Flask key. Only ``stack`` reads it, but jobs run as the user who started the stack, so
  whoever can submit a job can read this folder: on this machine the Ray token is admin access.

Ray nodes are started with the job credentials in their environment, so a job submitted
through the Jobs API inherits them from the node: no credential travels in a job's
runtime_env, its entrypoint, or MLflow's params and tags.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
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


# ------------------------------------------------------------------------------- PostgreSQL
def find_postgres_bindir() -> Path | None:
    """The folder of ``initdb`` and ``pg_ctl``: Debian keeps them in /usr/lib/postgresql/N/bin."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(found).resolve().parent
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    return versions[-1].parent if versions else None


def ensure_postgres(install: bool = True) -> Path:
    """PostgreSQL's binaries; installs Debian's ``postgresql`` package when they are missing."""
    bindir = find_postgres_bindir()
    if bindir is not None:
        return bindir
    how = "apt-get update && apt-get install -y postgresql"
    if not install:
        raise StackError(f"PostgreSQL is not installed (no initdb found). Install it ({how}) or drop --no-install.")
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise StackError(
            f"PostgreSQL is not installed, and this command installs it only as root on Debian or Ubuntu. Run: sudo sh -c '{how}'"
        )
    print(
        "PostgreSQL is not installed: installing Debian's postgresql package (apt-get update; apt-get install -y postgresql) ...",
        flush=True,
    )
    # No default cluster: the stack makes its own, on loopback; Debian's would listen on 5432.
    drop_in = Path("/etc/postgresql-common/createcluster.d/dp-platform.conf")
    drop_in.parent.mkdir(parents=True, exist_ok=True)
    drop_in.write_text("create_main_cluster = false\n")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = [
        "apt-get",
        "install",
        "-y",
        "--no-install-recommends",
        "-o",
        "Dpkg::Options::=--force-confold",
        "postgresql",
    ]
    for cmd in (["apt-get", "update"], install):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            raise StackError(
                f"installing PostgreSQL failed: {' '.join(cmd)} exited {r.returncode}:\n{r.stderr[-2000:]}"
            )
    bindir = find_postgres_bindir()
    if bindir is None:
        raise StackError("apt-get installed postgresql but no initdb was found under /usr/lib/postgresql.")
    return bindir


def _as_postgres_user(cmd: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root; as root, run its programs as the 'postgres' user."""
    if os.geteuid() != 0:
        return cmd
    try:
        import pwd

        pwd.getpwnam("postgres")
    except KeyError:
        raise StackError(
            "running as root, PostgreSQL needs a 'postgres' system user (Debian's package creates it): useradd --system postgres"
        ) from None
    return ["runuser", "-u", "postgres", "--", *cmd]


def _pg_base(root: Path) -> Path:
    """Where the database cluster lives. As root it goes under the postgres user's home, which
    that user can reach (the stack folder under /root is not)."""
    if os.geteuid() != 0:
        return root / "postgres"
    import pwd

    home = Path(pwd.getpwnam("postgres").pw_dir)
    return home / "dp-stack" / hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]


def _chown_to_postgres(path: Path) -> None:
    if os.geteuid() == 0:
        shutil.chown(path, "postgres", "postgres")


def _pg_connect(state: dict, admin: dict, dbname: str = "postgres", timeout: int = 5):
    import psycopg2

    return psycopg2.connect(
        host=state["host"],
        port=state["ports"]["postgres"],
        user="dpadmin",
        password=admin["PG_ADMIN_PASSWORD"],
        dbname=dbname,
        connect_timeout=timeout,
    )


def _start_postgres(state: dict, admin: dict, bindir: Path) -> None:
    base, host, port = Path(state["pg_base"]), state["host"], state["ports"]["postgres"]
    data, log = base / "data", base / "postgres.log"
    if not (data / "PG_VERSION").exists():
        base.mkdir(parents=True, exist_ok=True)
        os.chmod(base, 0o700)
        _chown_to_postgres(base)
        pwfile = base / "initdb.pw"
        _write_secret(pwfile, admin["PG_ADMIN_PASSWORD"] + "\n")
        _chown_to_postgres(pwfile)
        try:
            r = subprocess.run(
                _as_postgres_user(
                    [
                        str(bindir / "initdb"),
                        "-D",
                        str(data),
                        "-U",
                        "dpadmin",
                        f"--pwfile={pwfile}",
                        "--auth=scram-sha-256",
                        "-E",
                        "UTF8",
                        "--locale=C",
                    ]
                ),
                capture_output=True,
                text=True,
            )
        finally:
            pwfile.unlink(missing_ok=True)
        if r.returncode != 0:
            raise StackError(f"initdb failed ({r.returncode}):\n{r.stderr[-2000:]}")
    # listen on the stack's interface only; the unix socket sits in the private folder
    opts = f"-c listen_addresses={host} -p {port} -c unix_socket_directories={base}"
    r = subprocess.run(
        _as_postgres_user(
            [str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-o", opts, "-w", "-t", "30", "start"]
        ),
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise StackError(
            f"PostgreSQL did not start on {host}:{port} (pg_ctl exited {r.returncode}). Its log, {log}:\n{_tail(log)}"
        )


def _pg_is_up(state: dict, admin: dict) -> str | None:
    """None when PostgreSQL accepts the admin's connection, else the reason."""
    try:
        _pg_connect(state, admin, timeout=3).close()
        return None
    except Exception as e:  # psycopg2.OperationalError: refused, auth, ...
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _provision_databases(state: dict, admin: dict) -> None:
    """Roles mlflow and optuna with their own passwords; databases mlflow and mlflow_auth (owned
    by mlflow) and optuna (owned by optuna); no role may connect to another's database."""
    from psycopg2 import sql
    from psycopg2.extensions import encrypt_password

    conn = _pg_connect(state, admin)
    conn.autocommit = True
    with conn.cursor() as cur:
        for role, password in (("mlflow", admin["PG_MLFLOW_PASSWORD"]), ("optuna", admin["PG_OPTUNA_PASSWORD"])):
            cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,))
            verb = "ALTER" if cur.fetchone() else "CREATE"
            # the SCRAM verifier, not the password, goes into the statement (statements can reach the log)
            verifier = encrypt_password(password, role, conn, "scram-sha-256")
            cur.execute(sql.SQL(verb + " ROLE {} LOGIN PASSWORD %s").format(sql.Identifier(role)), (verifier,))
        for db, owner in (("mlflow", "mlflow"), ("mlflow_auth", "mlflow"), ("optuna", "optuna")):
            cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (db,))
            if not cur.fetchone():
                cur.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(db), sql.Identifier(owner)))
        for db in ("mlflow", "mlflow_auth", "optuna", "postgres"):
            cur.execute(sql.SQL("REVOKE ALL ON DATABASE {} FROM PUBLIC").format(sql.Identifier(db)))
    conn.close()


# ------------------------------------------------------------------------------- MLflow
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


def _ensure_jobs_user(state: dict, admin: dict, creds: dict) -> None:
    """The MLflow user that jobs log as (not the admin); its password is set to the one in credentials.env."""
    url = f"http://{state['host']}:{state['ports']['mlflow']}/api/2.0/mlflow/users"
    auth = ("admin", admin["MLFLOW_ADMIN_PASSWORD"])
    user = {"username": JOBS_USER, "password": creds["MLFLOW_TRACKING_PASSWORD"]}
    code, body = _http(f"{url}/create", auth=auth, data=user)
    if code != 200 and "RESOURCE_ALREADY_EXISTS" in body:
        code, body = _http(f"{url}/update-password", auth=auth, data=user, method="PATCH")
    if code != 200:
        raise StackError(f"could not set up the MLflow user {JOBS_USER} (HTTP {code}): {body[:500]}")


# ------------------------------------------------------------------------------- Ray
def node_env(root: Path) -> dict[str, str]:
    """The environment of a Ray node: token auth, and the job credentials that jobs inherit."""
    env = {**os.environ, **read_env_file(root / "credentials.env")}
    # a job's `python` is this environment's, as in an activated virtualenv
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.pop("RAY_ADDRESS", None)  # a caller's Jobs URL must not reach `ray start` as a GCS address
    env.pop("RAY_AUTH_TOKEN", None)
    return env


def _ray_start(args: list[str], env: dict, what: str) -> None:
    r = subprocess.run([_bin("ray"), "start", *args], env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise StackError(f"{what} did not start (`ray start` exited {r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")


def _ray_common_args(
    state: dict, num_cpus: int | None, resources: dict | None, temp_dir: str | None = None
) -> list[str]:
    # Ray makes its temp folder world-writable (0777); it sits inside the stack's private one (0700)
    args = [
        "--node-ip-address",
        state["host"],
        "--temp-dir",
        temp_dir or f"{state['ray_temp']}/head",
        "--disable-usage-stats",
    ]
    args += [
        "--dashboard-agent-listen-port",
        str(free_port(state["host"])),
        "--metrics-export-port",
        str(free_port(state["host"])),
    ]
    if num_cpus is not None:
        args += ["--num-cpus", str(num_cpus)]
    args += ["--num-gpus", "0"] if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "" else []
    if resources:
        args += ["--resources", json.dumps(resources)]
    return args


def _start_ray_head(root: Path, state: dict, num_cpus: int | None, resources: dict | None) -> None:
    p = state["ports"]
    args = [
        "--head",
        "--port",
        str(p["gcs"]),
        "--dashboard-host",
        state["host"],
        "--dashboard-port",
        str(p["dashboard"]),
    ]
    args += ["--ray-client-server-port", str(p["client"]), "--include-dashboard", "true"]
    _ray_start(args + _ray_common_args(state, num_cpus, resources), node_env(root), "the Ray head")


def add_node(root: Path | None = None, num_cpus: int | None = None, resources: dict | None = None) -> str:
    """``ray start --address`` of one more node on this machine, with the stack's token and
    credentials. Returns the GCS address it joined."""
    root = Path(root or default_dir())
    state = load_state(root)
    gcs = f"{state['host']}:{state['ports']['gcs']}"
    # Each node its own temp folder (inside the stack's, so that `down` finds it): nodes sharing
    # one would unpack a job's package into the same place, and one node's re-extraction pulls
    # the working directory from under a job driver on another.
    temp = f"{state['ray_temp']}/node-{secrets.token_hex(3)}"
    _ray_start(
        ["--address", gcs] + _ray_common_args(state, num_cpus, resources, temp),
        node_env(root),
        f"the Ray node joining {gcs}",
    )
    return gcs


def _ray_processes(temp_dir: str, client_port: int):
    """The stack's Ray processes: those naming its temp folder, the Ray Client server on its
    port (whose command line does not name the folder), and all their descendants."""
    import psutil

    found = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = proc.info["cmdline"] or []
            ours = any(temp_dir in part for part in cmd) and _is_ray_process(proc, cmd)
            if ours or ("ray.util.client.server" in cmd and f"--port={client_port}" in cmd):
                found[proc.pid] = proc
                for child in proc.children(recursive=True):
                    found[child.pid] = child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return list(found.values())


def _is_ray_process(proc, cmd: list[str]) -> bool:
    """Ray's daemons and workers (not, say, a `tail -f` of one of its logs)."""
    name = proc.name()
    return name in ("raylet", "gcs_server") or name.startswith(("ray::", "python")) or "python" in Path(cmd[0]).name


def _stop_processes(procs, timeout: float = 5.0) -> int:
    import psutil

    for p in procs:
        try:
            p.terminate()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        try:
            p.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    psutil.wait_procs(alive, timeout=5)
    return len(procs)


def _kill_group(pid: int, timeout: float = 15.0) -> bool:
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return True


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


# ------------------------------------------------------------------------------- commands
def up(
    root: Path | None = None,
    host: str = "127.0.0.1",
    ports: dict | None = None,
    num_cpus: int | None = None,
    resources: dict | None = None,
    install: bool = True,
    log=print,
) -> dict:
    """Start PostgreSQL, MLflow and a Ray head; returns the state (also in ``stack.json``).
    On any failure the services already started are stopped again and StackError says why."""
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


def down(root: Path | None = None, purge: bool = False) -> list[str]:
    root = Path(root or default_dir()).expanduser().resolve()
    state = load_state(root)
    said = _stop(state)
    (root / "stack.json").unlink(missing_ok=True)
    if purge:
        shutil.rmtree(state["pg_base"], ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
        said.append(f"removed {root} and {state['pg_base']}")
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


# ------------------------------------------------------------------------------- CLI
def _ports_from(a) -> dict:
    return {k: getattr(a, f"{k}_port") for k in DEFAULT_PORTS if getattr(a, f"{k}_port") is not None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="The platform's services on this machine: PostgreSQL, MLflow (basic auth) and a Ray head (token "
        "auth), on 127.0.0.1 (Ray's internal ports excepted: see status --ports).",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    dir_help = (
        f"the stack's folder: state, secrets (mode 0600), artifacts, logs (default: $DP_STACK_DIR or {default_dir()})"
    )
    u = sub.add_parser("up", help="start PostgreSQL, MLflow and the Ray head")
    u.add_argument("--dir", type=Path, help=dir_help)
    u.add_argument(
        "--host", default="127.0.0.1", help="the interface every service binds (default 127.0.0.1: this machine only)"
    )
    for k, v in DEFAULT_PORTS.items():
        u.add_argument(f"--{k}-port", type=int, help=f"port of {k} (default {v})")
    u.add_argument("--num-cpus", type=int, help="CPUs the Ray head offers (default: all)")
    u.add_argument(
        "--resources", type=json.loads, help="custom Ray resources of the head, as JSON, e.g. '{\"head_node\": 1}'"
    )
    u.add_argument("--no-install", action="store_true", help="do not install PostgreSQL if it is missing")
    n = sub.add_parser(
        "add-node", help="start one more Ray node on this machine that joins the head (ray start --address)"
    )
    n.add_argument("--dir", type=Path, help=dir_help)
    n.add_argument("--num-cpus", type=int, help="CPUs this node offers")
    n.add_argument(
        "--resources", type=json.loads, help="custom Ray resources of this node, as JSON, e.g. '{\"worker_node\": 1}'"
    )
    s = sub.add_parser("status", help="is each service up, and where")
    s.add_argument("--dir", type=Path, help=dir_help)
    s.add_argument(
        "--ports",
        action="store_true",
        help="also list every TCP port the stack's processes listen on, and on which address",
    )
    d = sub.add_parser("down", help="stop the services (data stays)")
    d.add_argument("--dir", type=Path, help=dir_help)
    d.add_argument("--purge", action="store_true", help="also delete the databases, artifacts and secrets")
    a = p.parse_args(argv)
    root = Path(a.dir or default_dir()).expanduser().resolve()
    try:
        if a.cmd == "up":
            state = up(
                root,
                host=a.host,
                ports=_ports_from(a),
                num_cpus=a.num_cpus,
                resources=a.resources,
                install=not a.no_install,
            )
            _print_up(root, state)
        elif a.cmd == "add-node":
            gcs = add_node(root, num_cpus=a.num_cpus, resources=a.resources)
            print(f"a Ray node joined {gcs} (token auth). Nodes stop with `{PROG} down`.")
        elif a.cmd == "status":
            bad = 0
            for name, v in check(root).items():
                bad += not v["ok"]
                print(f"{name:<9} {'up' if v['ok'] else 'DOWN':<5} {v['where']}  ({v['detail']})")
            if a.ports:
                print(f"\n{'service':<9} {'process':<22} {'address':<16} port")
                for r in listening_sockets(root):
                    where = "all interfaces" if r["ip"] in ("0.0.0.0", "::") else r["ip"].replace("::ffff:", "")
                    print(f"{r['service']:<9} {r['process'][:22]:<22} {where:<16} {r['port']}")
            return 1 if bad else 0
        else:
            for line in down(root, purge=a.purge):
                print(line)
    except StackError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _print_up(root: Path, state: dict) -> None:
    creds = root / "credentials.env"
    host, p = state["host"], state["ports"]
    print(
        f"the stack is up ({root}):\n"
        f"  PostgreSQL  {host}:{p['postgres']}   databases mlflow, mlflow_auth, optuna   log {Path(state['pg_base']) / 'postgres.log'}\n"
        f"  MLflow      http://{host}:{p['mlflow']}   PostgreSQL backend, basic auth (user {JOBS_USER})   log {root / 'mlflow.log'}\n"
        f"  Ray head    {host}:{p['gcs']}   Jobs API and dashboard http://{host}:{p['dashboard']}   token auth\n"
        f"credentials: {creds} (mode 0600; the admin passwords are in {root / 'admin.env'})\n"
        f"  load them in a shell:  set -a; . {creds}; set +a\n"
        f"submit a job:            dp-platform submit configs/digits.yaml\n"
        f"note: Ray listens on some internal ports (GCS, raylet, agents) on every interface whatever --host says; they need\n"
        f"  the token, but firewall them on a shared network. `{PROG} status --ports` lists them (deploy/README.md).\n"
        f"stop:                    {PROG} down"
    )

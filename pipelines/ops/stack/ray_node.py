"""Ray nodes of the stack: the head (token auth) and added nodes, started with the job credentials in their environment."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from .common import StackError, _bin, default_dir, free_port, load_state, port_in_use, read_env_file


def node_env(root: Path) -> dict[str, str]:
    """The environment of a Ray node: token auth, and the job credentials that jobs inherit."""
    env = {**os.environ, **read_env_file(root / "credentials.env")}
    # a job's `python` is this environment's, as in an activated virtualenv
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.pop("RAY_ADDRESS", None)  # a caller's Jobs URL must not reach `ray start` as a GCS address
    env.pop("RAY_AUTH_TOKEN", None)
    return env


RAY_START_TIMEOUT_S = 180  # `ray start` of one node here takes 3-10 s


def _ray_start(args: list[str], env: dict, what: str) -> None:
    # In a session of its own: Ray's daemons must not get the SIGHUP of the terminal `stack up` ran
    # in when that terminal closes (PostgreSQL and MLflow are detached the same way).
    try:
        r = subprocess.run(
            [_bin("ray"), "start", *args],
            env=env,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            timeout=RAY_START_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        said = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""))[-2000:]
        raise StackError(
            f"{what} did not start within {RAY_START_TIMEOUT_S} s (`ray start` was stopped):\n{said}"
        ) from None
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
    if not port_in_use(state["host"], int(state["ports"]["gcs"])):  # else `ray start` waits minutes for it
        raise StackError(
            f"the stack's Ray head ({gcs}) is not running, so no node can join it. Restart the stack: "
            "`dp-platform stack down`, then `dp-platform stack up`."
        )
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

"""``dp-platform ui``: the MLflow UI on this machine, against the same tracking store as
``train``. It checks the store and the port first (the stack's MLflow server, or another
program, may hold 5000: then a free port), prints the runs table's link once the page answers
(in MLflow 3's model-training view), and stops the server with itself."""

from __future__ import annotations

import os
import subprocess
import sys

from ..config.options import Parser


def ui_argv(tracking_uri: str, host: str, port: int) -> list[str]:
    """``mlflow ui`` for one person's browser: one server process, not MLflow's default 4, each of
    which imports MLflow before the page answers (on 2 cores, 8–12 s to /health in place of about
    20 s, 2026-12-01; the stack's server runs one too)."""
    return [
        sys.executable,
        "-m",
        "mlflow",
        "ui",
        "--backend-store-uri",
        tracking_uri,
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        "1",
    ]


def _stack_mlflow_port() -> int | None:
    """The port of the local stack's MLflow server, if a stack is up on this machine."""
    from .stack.common import default_dir

    state = default_dir() / "stack.json"
    try:
        import json

        return int(json.loads(state.read_text())["ports"]["mlflow"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _wait_for_page(proc: subprocess.Popen, url: str, timeout: float = 180.0) -> bool:
    """Poll ``url`` until it answers 200 (True), the server exits, or ``timeout`` passes (False)."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            time.sleep(0.25)
    return False


def _experiment_links(url: str) -> list[tuple[str, str]]:
    """(name, link to its runs table) for the store's experiments, the one with the newest run
    first, from the REST API the UI itself calls; the empty Default experiment is left out.

    An experiment's ``last_update_time`` does not move when a run is added to it (MLflow 3.17),
    so the order comes from the runs' start times; experiments without runs follow, newest first.
    """
    import json
    import urllib.request

    from ..tracking import ui_link

    def call(path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"{url}/api/2.0/mlflow/{path}", data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    try:
        exps = call("experiments/search?max_results=100").get("experiments", [])
    except (OSError, ValueError):
        return []
    try:  # the newest 1,000 runs order the experiments that have one; a failure leaves the experiments' order
        ids = [e["experiment_id"] for e in exps]
        body = {"experiment_ids": ids, "max_results": 1000, "order_by": ["attributes.start_time DESC"]}
        runs = call("runs/search", body).get("runs", []) if ids else []
    except (OSError, ValueError):
        runs = []
    newest: dict[str, int] = {}
    for r in runs:
        info = r.get("info", {})
        newest.setdefault(info.get("experiment_id"), int(info.get("start_time", 0)))
    exps.sort(key=lambda e: (-newest.get(e["experiment_id"], 0), -int(e.get("last_update_time", 0))))
    named = [e for e in exps if e["name"] != "Default"] or exps
    return [(e["name"], ui_link(url, e["experiment_id"])) for e in named]


def main(argv: list[str], prog: str = "dp-platform ui") -> int:
    p = Parser(
        prog=prog,
        description="Start the MLflow UI on 127.0.0.1 against the same tracking store as train. It prints the URL "
        "once the page answers.",
    )
    p.add_argument(
        "--tracking-uri",
        default=os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db",
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else ./mlflow.db)",
    )
    p.add_argument("--port", type=int, help="port (default: 5000, or a free one if 5000 is taken)")
    p.add_argument("--host", default="127.0.0.1", help="interface (default 127.0.0.1: this machine only)")
    a = p.parse_args(argv)
    from ..tracking import TrackingError, check_tracking_uri, open_store, redact, resolve_tracking_uri, sqlite_file
    from .stack.common import free_port, port_in_use

    uri = resolve_tracking_uri(a.tracking_uri)
    if uri.startswith(("http://", "https://")):
        print(f"{redact(uri)} is a tracking server: it serves its own UI there (log in if it asks).")
        return 0
    db = sqlite_file(uri)
    new_store = db is not None and not db.is_file()
    try:
        check_tracking_uri(uri)
    except TrackingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if new_store:
        print(f"note: {db} does not exist yet: the UI is empty until a run logs to it.", flush=True)
    stack_port = _stack_mlflow_port()
    port = a.port if a.port is not None else 5000
    if port_in_use(a.host, port):
        holder = (
            f"the platform's stack serves its MLflow server there (http://{a.host}:{port}, with login; its runs are "
            "the stack's, not this store's)"
            if port == stack_port
            else "another program listens there"
        )
        if a.port is not None:
            print(f"error: port {port} is taken: {holder}. Give another --port, or leave it out.", file=sys.stderr)
            return 2
        port = free_port(a.host)
        print(f"port 5000 is taken ({holder}); this UI uses port {port}.", flush=True)
    url = f"http://{a.host}:{port}"
    open_store(uri)  # a new SQLite store's empty database, from the cached schema; not before the port is had
    from .clean import cache_dir

    log = cache_dir() / "logs" / f"ui-{port}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"starting the MLflow UI for {redact(uri)} … (its log: {log})", flush=True)
    import signal

    for sig in (signal.SIGTERM, signal.SIGHUP):  # stop the server with this process, whatever stops it
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ui_argv(uri, a.host, port), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        if not _wait_for_page(proc, url + "/health"):
            code = proc.poll()
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            print(
                f"error: the MLflow UI did not come up on {url}"
                + (f" (it exited with code {code})" if code is not None else " in 180 s")
                + f"; the end of its log ({log}):\n{tail}",
                file=sys.stderr,
            )
            return 1
        links = _experiment_links(url)
        if links:  # the runs table in the model-training view: the plain URL opens the GenAI overview
            print(f"MLflow UI: {links[0][1]}  (experiment {links[0][0]}; Ctrl-C stops it)", flush=True)
            for name, link in links[1:5]:
                print(f"  experiment {name}: {link}", flush=True)
        else:
            print(f"MLflow UI: {url}/#/?workflowType=machine_learning  (Ctrl-C stops it)", flush=True)
        while True:  # in short waits: a SIGTERM that lands just before a wait, or on another thread,
            try:  # runs its handler only once the main thread is back in Python (CI at e0d4dec hung)
                return proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                continue
    except KeyboardInterrupt:
        return 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)

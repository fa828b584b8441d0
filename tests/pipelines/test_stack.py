"""Issue F: the platform as a platform. One real stack per module, started and stopped here:
PostgreSQL (Debian's), an MLflow server on it with basic auth, a Ray head with token auth
and a second Ray node (``ray start --address``) with different resources, all on loopback.
Jobs go through the Ray Jobs API with ``dp-platform submit`` (and once with plain
``ray job submit``); a headless Chromium reads the MLflow UI.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dpcore.readout import epsilon_text
from pipelines import tracking
from pipelines.ops import stack as stk
from pipelines.ops.stack import commands as stk_commands
from pipelines.ops.stack import postgres as stk_postgres

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
FAST = ["--checkpoint-every", "1000"]  # one checkpoint at the end: each report costs Ray Train ~2 s


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_", "DP_", "PG"))}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def cli(*args, env=None, timeout=600, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipelines.cli", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def cli_on_a_terminal(*args, env) -> tuple[int, str]:
    """Run the CLI as a user does, in a terminal (a pseudo-terminal whose session it leads),
    and then close that terminal: the kernel hangs up the session's foreground process group,
    as when a user closes the window `stack up` was typed in."""
    import pty

    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(REPO)
        os.execve(sys.executable, [sys.executable, "-m", "pipelines.cli", *args], env)
    out = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the child closed its side
            break
        if not chunk:
            break
        out += chunk
    _, status = os.waitpid(pid, 0)
    os.close(fd)  # the terminal goes away
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace")


def http(url, auth=None, bearer=None):
    req = urllib.request.Request(url)
    if auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    if bearer:
        req.add_header("Authorization", f"Bearer {bearer}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Stack:
    def __init__(self, root: Path):
        self.root = root
        self.env = _clean_env(DP_STACK_DIR=str(root))
        self.state = stk.load_state(root)
        self.creds = stk.read_env_file(root / "credentials.env")
        self.admin = stk.read_env_file(root / "admin.env")
        self.token = (root / "ray_auth_token").read_text().strip()
        p = self.state["ports"]
        self.mlflow = f"http://127.0.0.1:{p['mlflow']}"
        self.jobs = f"http://127.0.0.1:{p['dashboard']}"
        self.results: dict = {}

    def secrets(self) -> list[str]:
        vals = [self.token, *self.admin.values(), self.creds["MLFLOW_TRACKING_PASSWORD"]]
        return [v for v in vals if len(v) >= 16]

    def mlflow_client(self):
        """An MlflowClient logged in as the jobs user (credentials set only while used)."""
        from mlflow import MlflowClient

        os.environ["MLFLOW_TRACKING_USERNAME"] = self.creds["MLFLOW_TRACKING_USERNAME"]
        os.environ["MLFLOW_TRACKING_PASSWORD"] = self.creds["MLFLOW_TRACKING_PASSWORD"]
        return MlflowClient(self.mlflow)

    def pg(self, db: str):
        import psycopg2

        return psycopg2.connect(
            host="127.0.0.1",
            port=self.state["ports"]["postgres"],
            user="dpadmin",
            password=self.admin["PG_ADMIN_PASSWORD"],
            dbname=db,
        )

    def nodes(self) -> dict[str, dict]:
        code, body = http(f"{self.jobs}/api/v0/nodes?limit=100&detail=1", bearer=self.token)
        assert code == 200, body[:300]
        return {n["node_id"]: n for n in json.loads(body)["data"]["result"]["result"] if n["state"] == "ALIVE"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("stack") / "s"
    # Distinct free ports: every socket is held until all are picked (one at a time, the kernel
    # can hand out the same port twice).
    held = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in stk.DEFAULT_PORTS]
    for sock in held:
        sock.bind(("127.0.0.1", 0))
    ports = {k: sock.getsockname()[1] for k, sock in zip(stk.DEFAULT_PORTS, held)}
    for sock in held:
        sock.close()
    env = _clean_env(DP_STACK_DIR=str(root))
    code, up_out = cli_on_a_terminal(
        "stack",
        "up",
        *[f"--{k}-port={v}" for k, v in ports.items()],
        "--num-cpus",
        "1",
        "--resources",
        '{"head_node": 1}',
        env=env,
    )
    assert code == 0, up_out
    up_state = (root / "stack.json").read_text()  # the full state (MLflow's pid included), for the teardown
    try:
        assert "the stack is up" in up_out and "credentials:" in up_out, up_out
        time.sleep(2)  # the hang-up of the closed terminal has been delivered by now
        node = cli("stack", "add-node", "--num-cpus", "1", "--resources", '{"worker_node": 1}', env=env)
        assert node.returncode == 0, node.stdout + node.stderr
        s = Stack(root)
        deadline = time.time() + 60
        while len(s.nodes()) < 2 and time.time() < deadline:
            time.sleep(1)
        yield s
    finally:
        os.environ.pop("MLFLOW_TRACKING_USERNAME", None)
        os.environ.pop("MLFLOW_TRACKING_PASSWORD", None)
        if (root / "stack.json").exists():  # a plain down, then a purge of what it left
            down = cli("stack", "down", env=env)
            assert down.returncode == 0 and "data and secrets stay" in down.stdout, down.stdout + down.stderr
            purge = cli("stack", "down", "--purge", env=env)
            assert purge.returncode == 0 and not root.exists(), purge.stdout + purge.stderr
            assert not stk_postgres._pg_base(root.resolve()).exists()
        else:  # a test stopped it (or failed midway): stop whatever is left, then remove the data
            stk_commands._stop(json.loads(up_state))
        shutil.rmtree(stk_postgres._pg_base(root.resolve()), ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


def test_the_stack_survives_the_terminal_it_was_started_from(stack):
    """`stack up` ran in a terminal that was closed right after: every service is still up, and
    none of its processes is in that terminal's session."""
    assert all(v["ok"] for v in stk.check(stack.root).values()), stk.check(stack.root)
    groups = stk.stack_processes(stack.state)
    assert groups["ray"] and groups["mlflow"]
    sessions = {os.getsid(p.pid) for g in groups.values() for p in g if p.is_running()}
    assert os.getsid(0) not in sessions


# ------------------------------------------------------------------------------ secure defaults
def test_secrets_are_0600_and_services_bind_loopback(stack):
    assert stat.S_IMODE(stack.root.stat().st_mode) == 0o700
    assert (
        stat.S_IMODE(Path(stack.state["ray_temp"]).stat().st_mode) == 0o700
    )  # Ray's sessions, job packages and sockets
    for name in ("ray_auth_token", "credentials.env", "admin.env", "pgpass", "pgpass.server"):
        assert stat.S_IMODE((stack.root / name).stat().st_mode) == 0o600, name
    rows = stk.listening_sockets(stack.root)
    p = stack.state["ports"]
    # PostgreSQL, MLflow and the Jobs API (dashboard) listen on 127.0.0.1 and nowhere else
    for service, port in (("postgres", p["postgres"]), ("mlflow", p["mlflow"]), ("ray", p["dashboard"])):
        ips = {r["ip"] for r in rows if r["port"] == port}
        assert ips == {"127.0.0.1"}, (service, port, ips)
    assert {r["service"] for r in rows} == {"postgres", "mlflow", "ray"}
    # no secret on any command line of the stack (ps shows them to every user)
    procs = [pr for group in stk.stack_processes(stack.state).values() for pr in group]
    cmdlines = " ".join(" ".join(pr.cmdline()) for pr in procs if pr.is_running())
    assert procs and not [s for s in stack.secrets() if s in cmdlines]


def test_unauthenticated_requests_get_401(stack):
    jobs, ml = f"{stack.jobs}/api/jobs/", f"{stack.mlflow}/api/2.0/mlflow/experiments/search?max_results=5"
    assert http(jobs)[0] == 401
    assert http(jobs, bearer="0" * 64)[0] == 403  # a wrong token: authenticated as nobody
    assert http(jobs, bearer=stack.token)[0] == 200
    user = (stack.creds["MLFLOW_TRACKING_USERNAME"], stack.creds["MLFLOW_TRACKING_PASSWORD"])
    assert http(ml)[0] == 401
    assert http(ml, auth=(user[0], "wrong-password"))[0] == 401
    assert http(ml, auth=user)[0] == 200
    assert http(f"{stack.mlflow}/")[0] == 401  # the UI too
    assert http(f"{stack.mlflow}/health")[0] == 200  # liveness only


def test_ray_gcs_refuses_a_wrong_token(stack):
    """The GCS listens on every interface (Ray 2.60 ignores --node-ip-address for it), so the
    token is what protects it: a driver with a wrong token is refused, the right one joins."""
    gcs = f"127.0.0.1:{stack.state['ports']['gcs']}"
    code = f"import ray; ray.init(address={gcs!r}, logging_level='ERROR'); print('nodes', len([n for n in ray.nodes() if n['Alive']]))"
    # (RAY_NUM_REDIS_GET_RETRIES: give up after 2 refusals instead of Ray's 20, one a second)
    bad_env = _clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="f" * 64, RAY_NUM_REDIS_GET_RETRIES="2")
    bad = subprocess.run([sys.executable, "-c", code], env=bad_env, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "nodes" not in bad.stdout
    assert "Unauthenticated" in bad.stderr and "InvalidAuthToken" in bad.stderr, bad.stderr[-2000:]
    good = subprocess.run(
        [sys.executable, "-c", code],
        env=_clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(stack.root / "ray_auth_token")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert good.returncode == 0 and "nodes 2" in good.stdout, good.stdout + good.stderr[-2000:]


# ------------------------------------------------------------------------------ jobs
def test_training_job_runs_on_both_nodes_and_tracks_to_postgres(stack, tmp_path):
    r = cli(
        "submit",
        "configs/digits.yaml",
        "--",
        "--epochs",
        "2",
        *FAST,
        "--registered-model",
        "dp-stack-digits",
        env=stack.env,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    job = next(line.split()[2] for line in out.splitlines() if line.startswith("submitted job "))
    run_id = next(
        line.split()[1] for line in out.splitlines() if line.startswith("run ") and "workers=2 on 2 node(s)" in line
    )
    st = cli("status", job, env=stack.env)
    assert st.returncode == 0 and "SUCCEEDED" in st.stdout, st.stdout + st.stderr
    logs = cli("logs", job, env=stack.env)
    assert logs.returncode == 0 and f"run {run_id}" in logs.stdout
    # K, must-show 4, through the Jobs API: the job's output holds the platform's progress and
    # summary, not MLflow's "View run" links nor a library warning or error (the log file has them)
    assert "View run" not in out and not re.search(r"\b(WARNING|ERROR)\b", out), out[-4000:]
    assert re.search(
        rf"^open the UI: http://\S+/#/experiments/\d+/runs/{run_id}\?workflowType=machine_learning$", out, re.M
    )
    stack.results["train"] = {"run_id": run_id, "job": job, "logs": logs.stdout + out}

    client = stack.mlflow_client()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    # ran on both nodes: the placement the workers wrote names the head and the worker node
    import mlflow

    placement = tracking.read_json_artifact(stack.mlflow, run_id, "ray/placement.json")
    nodes = stack.nodes()
    used = {p["node_id"] for p in placement}
    assert len(placement) == 2 and used == set(nodes), (used, set(nodes))
    assert {k for n in nodes.values() for k in n["resources_total"]} >= {"head_node", "worker_node"}
    assert run.data.tags["ray.nodes"] == "2"
    # the ledger and the model
    import pyarrow.parquet as pq

    ledger = pq.read_table(
        mlflow.artifacts.download_artifacts(
            run_id=run_id, artifact_path="ledger/ledger.parquet", tracking_uri=stack.mlflow, dst_path=tmp_path
        )
    ).to_pylist()
    assert ledger and all(e["status"] == "committed" for e in ledger)
    assert abs(ledger[-1]["epsilon"] - float(run.data.tags["dp.epsilon"])) < 1e-5 * float(run.data.tags["dp.epsilon"])
    assert float(run.data.tags["dp.epsilon"]) <= 2.0
    versions = client.search_model_versions("name = 'dp-stack-digits'")
    assert [v.run_id for v in versions] == [run_id]
    # the run is in PostgreSQL (MLflow's backend store), not in a local file
    with stack.pg("mlflow") as conn, conn.cursor() as cur:
        cur.execute("SELECT status FROM runs WHERE run_uuid = %s", (run_id,))
        assert cur.fetchone() == ("FINISHED",)
        cur.execute(
            "SELECT value FROM metrics WHERE run_uuid = %s AND key = 'epsilon' ORDER BY step DESC LIMIT 1", (run_id,)
        )
        assert abs(cur.fetchone()[0] - float(run.data.tags["dp.epsilon"])) < 1e-4
    # no credential in params, tags, the logged config/spec, or the job's logs
    text = json.dumps([run.data.params, run.data.tags]) + stack.results["train"]["logs"]
    for name in ("spec.json", "config.json"):
        text += Path(
            mlflow.artifacts.download_artifacts(
                run_id=run_id, artifact_path=name, tracking_uri=stack.mlflow, dst_path=tmp_path
            )
        ).read_text()
    assert run.data.params["tracking_uri"] == stack.mlflow
    code, info = http(f"{stack.jobs}/api/jobs/{job}", bearer=stack.token)  # what the Jobs API keeps of the job
    assert code == 200 and job in info
    text += info
    # and none in any log of the services (MLflow's, PostgreSQL's, every Ray log on both nodes)
    logs = [stack.root / "mlflow.log", Path(stack.state["pg_base"]) / "postgres.log"]
    logs += [
        f for f in Path(stack.state["ray_temp"]).rglob("*") if f.is_file() and f.suffix in (".log", ".out", ".err")
    ]
    assert len(logs) > 10
    text += "".join(f.read_text(errors="replace") for f in logs)
    assert not [s for s in stack.secrets() if s in text]


def test_sweep_on_the_cluster_with_its_study_in_postgres(stack):
    import optuna

    r = cli(
        "submit", "--sweep", "configs/digits.yaml", "--", "--study", "stack-sweep", "--n-trials", "2", "--max-concurrent", "2",
        "--epochs", "1", *FAST, "--registered-model", "none", env=stack.env,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "study stack-sweep: 2 complete of 2 trials" in out
    os.environ["PGPASSFILE"] = str(stack.root / "pgpass")  # the optuna role's password, as the nodes have it
    try:
        study = optuna.load_study(
            study_name="stack-sweep", storage=optuna.storages.RDBStorage(stack.creds["DP_OPTUNA_STORAGE"])
        )
        trials = study.get_trials()
    finally:
        os.environ.pop("PGPASSFILE")
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 2
    with stack.pg("optuna") as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM trials t JOIN studies s USING (study_id) WHERE s.study_name = 'stack-sweep' AND t.state = 'COMPLETE'"
        )
        assert cur.fetchone() == (2,)
    # each trial trained on the cluster's nodes, and its run is in MLflow with the storage URL (no password)

    client, nodes = stack.mlflow_client(), stack.nodes()
    for t in trials:
        run_id = t.user_attrs["run_id"]
        placement = tracking.read_json_artifact(stack.mlflow, run_id, "ray/placement.json")
        assert {p["node_id"] for p in placement} <= set(nodes)
        parent = client.get_run(client.get_run(run_id).data.tags["mlflow.parentRunId"])
        assert parent.data.tags["sweep.storage"] == stack.creds["DP_OPTUNA_STORAGE"]
    stack.results["sweep"] = parent.info.run_id


def test_invalid_job_config_fails_fast_with_the_reason(stack):
    # refused before upload by `dp-platform submit`
    before = cli("status", env=stack.env).stdout
    r = cli("submit", "configs/digits.yaml", "--", "--target-epsilon", "-1", env=stack.env)
    assert r.returncode == 2 and "error:" in r.stderr and "epsilon" in r.stderr, r.stderr
    assert "submitted job" not in r.stdout and cli("status", env=stack.env).stdout == before
    # submitted anyway with the plain `ray job submit` line: the job fails in seconds, and says why
    env = {**stack.env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(stack.root / "ray_auth_token")}
    sub = subprocess.run(
        [str(Path(sys.executable).with_name("ray")), "job", "submit", "--address", stack.jobs, "--no-wait", "--working-dir", ".",
         "--", "python", "-m", "pipelines.train", "configs/digits.yaml", "--target-epsilon", "-1"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job = re.search(r"raysubmit_[A-Za-z0-9]+", sub.stdout + sub.stderr).group(0)
    deadline = time.time() + 90
    while time.time() < deadline:
        st = cli("status", job, env=stack.env)
        if "FAILED" in st.stdout or "SUCCEEDED" in st.stdout:
            break
        time.sleep(1)
    assert st.returncode == 1 and "FAILED" in st.stdout, st.stdout
    reason = "\n".join(
        st.stdout.splitlines()[1:]
    )  # the job's message, below the status line (which shows the entrypoint)
    assert "error: target_epsilon=-1.0 is invalid: ε must be a finite number > 0" in reason, st.stdout
    took = float(st.stdout.split("(")[1].split("s)")[0])
    assert took < 30, st.stdout  # fails before Ray Train, MLflow or the journal start
    logs = cli("logs", job, env=stack.env)
    assert "error: target_epsilon=-1.0 is invalid" in logs.stdout and "Traceback" not in logs.stdout, logs.stdout


def test_wrong_address_missing_token_missing_credentials(stack, tmp_path):
    free = stk.free_port()
    r = cli("status", "--address", f"http://127.0.0.1:{free}", env=stack.env)
    assert r.returncode == 2 and "cannot reach the Ray Jobs API" in r.stderr, r.stderr
    # no token anywhere (no stack folder, an empty home): the cluster's 401 becomes a clear message
    bare = _clean_env(DP_STACK_DIR=str(tmp_path / "none"), HOME=str(tmp_path))
    r = cli("status", "--address", stack.jobs, env=bare)
    assert r.returncode == 2 and "401" in r.stderr and "token" in r.stderr, r.stderr
    r = cli("submit", "configs/digits.yaml", "--address", stack.jobs, "--no-wait", env=bare)
    assert r.returncode == 2 and "401" in r.stderr
    # MLflow without credentials: refused before any training starts
    r = cli("train", "--tracking-uri", stack.mlflow, "--epochs", "1", env=bare, timeout=300)
    assert r.returncode == 2 and "HTTP 401" in r.stderr and "MLFLOW_TRACKING_USERNAME" in r.stderr, r.stderr


# ------------------------------------------------------------------------------ the UI in a browser
def test_browser_tells_the_privacy_story_without_a_click(stack):
    """K, must-show 3, on the stack's MLflow server (PostgreSQL, basic auth): the experiment's
    link opens on the runs table, whose names start with ε (and accuracy); a run's page shows ε
    rounded in its description, the full value in its metrics, no test hooks among its
    parameters; the sweep's parent says the ε every trial met and what the choice cost."""
    from selenium.webdriver.common.by import By

    from pipelines.tracking import UI_VIEW, ui_link

    from ..browser import browser, screenshot, scroll_to, wait_for_text

    assert "train" in stack.results and "sweep" in stack.results, "needs the training job's and the sweep's runs"
    client = stack.mlflow_client()
    run = client.get_run(stack.results["train"]["run_id"])
    parent = client.get_run(stack.results["sweep"])
    exp = run.info.experiment_id
    eps = run.data.metrics["epsilon"]
    assert run.info.run_name.startswith(f"ε={epsilon_text(eps, '.2f')} · ") and parent.info.run_name.startswith(
        "ε≤2 each · sweep-"
    )
    user = f"{stack.creds['MLFLOW_TRACKING_USERNAME']}:{stack.creds['MLFLOW_TRACKING_PASSWORD']}"
    with browser(base64.b64encode(user.encode()).decode()) as d:
        d.get(ui_link(stack.mlflow, exp))  # the link `train` prints for a tracking server, less the run
        text = wait_for_text(d, "Run Name", f"ε={epsilon_text(eps, '.2f')} · ", "ε≤2 each · ")
        assert "No data available" not in text and "Overview" not in text.split("Run Name")[0]
        screenshot(d, "mlflow_runs_table.png")

        d.get(ui_link(stack.mlflow, exp, run.info.run_id))
        text = wait_for_text(d, "Description", "Parameters")
        assert (
            f"ε = {epsilon_text(eps, '.2f')} at δ = 1e-05 (pld) · test accuracy" in text
        )  # rounded where people read it
        lines = text.splitlines()
        assert abs(float(lines[lines.index("epsilon") + 1]) - eps) < 1e-9  # the full value, in the metric
        assert not re.search(r"(?m)^fault", text), "a test hook among the user's parameters"
        scroll_to(d, "Description")
        screenshot(d, "mlflow_run_page.png")

        d.get(ui_link(stack.mlflow, exp, parent.info.run_id))
        text = wait_for_text(d, "Description", "every trial ε ≤ 2 at δ = 1e-05")
        assert "choosing the best trial on validation data is not accounted" in text
        scroll_to(d, "Description")
        screenshot(d, "mlflow_sweep_parent.png")

        d.get(f"{stack.mlflow}/#/experiments/{exp}/runs/{run.info.run_id}/artifacts{UI_VIEW}")
        wait_for_text(d, "ledger")
        d.find_element(By.XPATH, "//*[text()='ledger']").click()
        wait_for_text(d, "ledger.json", "ledger.parquet", timeout=60)
        d.find_element(By.XPATH, "//*[text()='ledger.json']").click()
        wait_for_text(d, "noise_multiplier", timeout=60)
        screenshot(d, "mlflow_run_ledger.png")


# ------------------------------------------------------------------------------ PostgreSQL down (last: stops the stack)
def test_postgres_down_when_the_stack_starts(stack):
    down = cli("stack", "down", env=stack.env)
    assert down.returncode == 0 and "PostgreSQL: stopped" in down.stdout, down.stdout + down.stderr
    # a sweep pointed at the stopped database says so before anything runs
    r = cli(
        "sweep",
        "configs/digits.yaml",
        "--storage",
        stack.creds["DP_OPTUNA_STORAGE"],
        "--n-trials",
        "1",
        env={**stack.env, "PGPASSFILE": str(stack.root / "pgpass")},
    )
    assert r.returncode == 2 and "Optuna storage" in r.stderr and "unreachable" in r.stderr, r.stderr
    # PostgreSQL cannot start (its data folder is damaged): `stack up` names it, shows its log, starts nothing else
    version = Path(stack.state["pg_base"]) / "data" / "PG_VERSION"
    good = version.read_text()
    version.write_text("7\n")
    try:
        p = stack.state["ports"]
        r = cli("stack", "up", *[f"--{k}-port={v}" for k, v in p.items()], env=stack.env)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "PostgreSQL did not start" in r.stderr and "postgres.log" in r.stderr, r.stderr
        assert not (stack.root / "stack.json").exists()
        assert not any(stk.port_in_use("127.0.0.1", p[k]) for k in ("postgres", "mlflow", "gcs", "dashboard"))
    finally:
        version.write_text(good)

"""Issue H, must-show 3 (start-up): what the driver does to reach the first step sooner, kept
honest. Rank 0's metrics reach MLflow through the driver (no worker imports MLflow), and the
local Ray cluster starts while the driver plans, but never before the data and model are
checked, and it is stopped when the plan then fails. It starts without Ray's dashboard unless
asked."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import mlflow
import pytest

from pipelines.train.metrics_relay import FORWARDED_FILE, METRICS_FILE, MetricsFile, MetricsForwarder


@pytest.fixture
def mlflow_run(tmp_path):
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.create_experiment("relay")
    return client, client.create_run(exp).info.run_id


def _history(client, run_id, key):
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_rank_zeros_metrics_and_tags_reach_mlflow_through_the_driver(tmp_path, mlflow_run):
    client, run_id = mlflow_run
    out = MetricsFile(tmp_path)
    out.tag("clipping.chosen", "bookkeeping")
    out.log({"step": 5, "final": 0.0, "epsilon": 0.5, "val_accuracy": 0.8, "test_accuracy": float("nan")}, 5)
    out.log({"step": 10, "final": 1.0, "epsilon": 0.9, "val_accuracy": 0.85}, 10)
    forwarder = MetricsForwarder(client, run_id, tmp_path)
    assert forwarder.forward() == 2
    assert forwarder.forward() == 0  # nothing is logged twice
    assert _history(client, run_id, "epsilon") == [(5, 0.5), (10, 0.9)]
    assert _history(client, run_id, "val_accuracy") == [(5, 0.8), (10, 0.85)]
    run = client.get_run(run_id)
    assert "test_accuracy" not in run.data.metrics  # NaN: not logged, as before
    assert "step" not in run.data.metrics and "final" not in run.data.metrics
    assert run.data.tags["clipping.chosen"] == "bookkeeping"


def test_a_line_still_being_written_waits_and_a_resumed_driver_goes_on_where_the_last_stopped(tmp_path, mlflow_run):
    client, run_id = mlflow_run
    MetricsFile(tmp_path).log({"epsilon": 0.1}, 1)
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"step": 2, "metrics": {"epsilon": 0.2}')  # torn: no newline yet
    assert MetricsForwarder(client, run_id, tmp_path).forward() == 1
    assert (tmp_path / FORWARDED_FILE).is_file()
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write(', "tags": {}, "timestamp_ms": 1}\n')
    # a new driver (a resumed run) forwards only what the last one did not
    assert MetricsForwarder(client, run_id, tmp_path).forward() == 1
    assert _history(client, run_id, "epsilon") == [(1, 0.1), (2, 0.2)]


def test_more_metrics_than_one_mlflow_batch_takes_are_all_logged(tmp_path, mlflow_run):
    client, run_id = mlflow_run
    MetricsFile(tmp_path).log_history([{"step": s, "bias": s / 10, "cos": 1.0} for s in range(1, 701)])
    with MetricsForwarder(client, run_id, tmp_path, period=0.05) as forwarder:
        forwarder.drain()
    assert len(_history(client, run_id, "diag_bias")) == 700 and len(_history(client, run_id, "diag_cos")) == 700


def test_drain_raises_what_mlflow_raised(tmp_path):
    class Down:
        def log_batch(self, *a, **k):
            raise ConnectionError("tracking server down")

    MetricsFile(tmp_path).log({"epsilon": 0.1}, 1)
    forwarder = MetricsForwarder(Down(), "run", tmp_path, period=0.01)
    with forwarder, pytest.raises(ConnectionError, match="tracking server down"):
        forwarder.drain()
    assert not (tmp_path / FORWARDED_FILE).exists()  # still to forward: a resumed driver will


def test_the_worker_module_does_not_import_mlflow_or_dp_accounting():
    """dp_accounting (scipy.stats and scipy.signal: about 0.55 s) is imported when ε is first
    composed, not on the worker's way to its first step; an event still composes through it."""
    code = (
        "import sys, pipelines.train.worker, pipelines.train.entry; "
        "print('mlflow' in sys.modules, 'dp_accounting' in sys.modules); "
        "import dpcore; e = dpcore.PrivacyEvent.dpsgd_step(1.0, 0.01); "
        "print(type(e.to_dp_event()).__name__, 'dp_accounting' in sys.modules)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split("\n")[:2] == ["False False", "PoissonSampledDpEvent True"]


@pytest.mark.parametrize("dashboard", [False, True])
def test_a_runs_own_cluster_starts_rays_dashboard_only_when_asked(tmp_path, dashboard):
    """Ray's dashboard (ten more Python processes on 2 cores: about a second of the start-up) is
    off on the local cluster a run starts for itself unless ``ray_dashboard`` is set; the
    cluster's processes are looked up by name under a fresh cluster of the run's own."""
    code = textwrap.dedent(
        f"""
        import json, os, ray
        from pipelines.config import TrainConfig
        from pipelines.train.cluster import _start_local
        cfg = TrainConfig(num_workers=1, ray_dashboard={dashboard!r}) if {dashboard!r} else TrainConfig(num_workers=1)
        _start_local(cfg, prestart=False)
        procs = {{}}  # pid -> (parent pid, name), for this cluster's processes only: those under this one
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{{pid}}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            procs[int(pid)] = (int(stat.rsplit(")", 1)[1].split()[1]), stat[stat.index("(") + 1 : stat.rindex(")")])
        def under_me(pid):
            while pid > 1:
                if pid == os.getpid():
                    return True
                pid = procs.get(pid, (0, ""))[0]
            return False
        names = [name for pid, (_, name) in procs.items() if under_me(pid)]
        url = ray._private.worker.global_worker.node.address_info.get("webui_url")
        ray.shutdown()
        print(json.dumps({{"heads": sorted(n for n in names if n.startswith("ray-dashboard-")), "url": url}}))
        """
    )
    env = {**os.environ, "RAY_ADDRESS": ""}  # a cluster of its own, not the tests' shared one
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if dashboard:
        assert out["url"] and out["url"].startswith("127.0.0.1:"), out
        assert len(out["heads"]) >= 5, out  # the dashboard's module processes (9 with Ray 2.60)
    else:
        assert not out["url"], out
        assert out["heads"] == [], out


@pytest.mark.slow
def test_a_plan_that_fails_after_the_cluster_began_stops_it_and_says_why(tmp_path):
    """The cluster begins once the config, data and model pass their checks; σ calibration
    then fails (DP-PCA's release alone spends more than the target). The error is the plan's,
    raised before any worker or budget, and the early cluster is shut down with nothing left
    running."""
    code = textwrap.dedent(
        f"""
        import json, os, ray, dpcore
        from pipelines.config import TrainConfig
        from pipelines.train import run
        from pipelines.train import cluster
        began = []
        real = cluster.EarlyCluster.begin
        def begin(self, cfg):
            real(self, cfg)
            began.append(self.began)
        cluster.EarlyCluster.begin = begin
        cfg = TrainConfig(pca_components=4, pca_noise_multiplier=0.3, epochs=1, num_workers=1, quiet=True,
                          storage_path={str(tmp_path / "runs")!r}, tracking_uri="sqlite:///{tmp_path}/mlflow.db")
        try:
            run(cfg)
        except dpcore.DPConfigError as e:
            error = str(e)
        def parent(pid):  # None once the process has exited (it is then not a child left running)
            try:
                with open(f"/proc/{{pid}}/stat") as f:
                    return f.read().rsplit(")", 1)[1].split()[1]
            except (FileNotFoundError, ProcessLookupError):
                return None
        children = [p for p in os.listdir("/proc") if p.isdigit() and parent(p) == str(os.getpid())]
        print(json.dumps({{"began": began, "error": error, "initialized": ray.is_initialized(), "children": children}}))
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["began"] == [True]  # the cluster had begun when the plan failed
    assert "(DP-PCA) alone spend" in out["error"], out["error"]
    assert not out["initialized"] and out["children"] == []
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("ledger.journal.jsonl"))


@pytest.mark.slow
def test_on_its_own_cluster_the_controller_runs_in_the_driver_and_a_killed_worker_still_resumes(tmp_path):
    """On a cluster the run starts itself, Ray Train's controller loop runs in the driver (no
    controller actor: its process cost about 4 s of start-up), and keeps its work: rank 0 is
    killed after step 5, and the worker group is restarted from the step-3 checkpoint, with the
    releases after it rolled back in the ledger. A cluster that `ray start` left running on the
    machine is not joined (plain ``ray.init()`` would, and fail on ``num_cpus``): the run starts
    its own beside it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray_tmp = tempfile.mkdtemp(prefix="r", dir="/tmp")  # short: Ray's socket paths live under it
    env = {**os.environ, "RAY_TMPDIR": ray_tmp}
    other = subprocess.Popen(
        [str(Path(sys.executable).with_name("ray")), "start", "--head", "--port", str(port), "--num-cpus", "1"]
        + ["--include-dashboard", "false", "--block"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        _own_cluster_beside(tmp_path, env, Path(ray_tmp) / "ray" / "ray_current_cluster")
    finally:
        os.killpg(other.pid, signal.SIGTERM)
        other.wait(timeout=60)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _own_cluster_beside(tmp_path, env, address_file):
    deadline = time.monotonic() + 60
    while not address_file.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert address_file.exists(), "ray start did not come up"
    code = textwrap.dedent(
        f"""
        import json, time, ray
        from ray.util.state import list_actors
        from pipelines.config import TrainConfig
        from pipelines.faults import FaultInjection
        from pipelines.train import lean, run
        seen = {{}}
        real = lean.run_controller_here
        def here(**kwargs):
            result = real(**kwargs)
            # Ray Train ends its workers with ray.kill, which returns before the GCS marks them
            # DEAD: wait for that (up to 30 s), then take what is there.
            deadline = time.time() + 30
            while True:
                actors = list_actors(address=ray.get_runtime_context().gcs_address, detail=True)  # (not the tests' cluster)
                workers = sorted(a.state for a in actors if a.class_name == "RayTrainWorker")
                if set(workers) <= {{"DEAD"}} or time.time() > deadline:
                    break
                time.sleep(0.2)
            seen["classes"] = sorted(a.class_name for a in actors)
            seen["workers"] = workers
            return result
        lean.run_controller_here = here
        cfg = TrainConfig(epochs=5, target_epsilon=3.0, checkpoint_every=3, max_failures=1, num_workers=1,
                          replay_log=False, quiet=True, registered_model="none", log_model=False,
                          ray_dashboard=True,  # Ray's state API, which lists the actors, is the dashboard's
                          storage_path={str(tmp_path / "runs")!r}, tracking_uri="sqlite:///{tmp_path}/mlflow.db")
        assert not ray.is_initialized()
        out = run(cfg, faults=FaultInjection(at_step=5, rank=0))
        statuses = [(e.step, e.status) for e in out["ledger"].entries]
        print(json.dumps({{**seen, "statuses": statuses, "steps": out["spec"].steps}}))
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert "TrainController" not in out["classes"] and "RayTrainWorker" in out["classes"], out["classes"]
    assert out["workers"] == ["DEAD", "DEAD"]  # the killed worker, and its replacement, ended with the fit
    committed = [s for s, status in out["statuses"] if status == "committed"]
    rolled = [s for s, status in out["statuses"] if status == "rolled_back"]
    assert committed == list(range(1, len(committed) + 1)) and rolled[:2] == [4, 5]

"""Fast checks of the stack and job commands' own logic (the services themselves are started in
tests/pipelines/test_stack.py): redaction, defaults from the environment, addresses, local checks."""

from __future__ import annotations

import os
import stat

import pytest

import dpcore
from pipelines.config import load_config
from pipelines.ops import jobs, stack
from pipelines.ops.stack import common as stack_common
from pipelines.tracking import redact

from ..helpers import small_plan


@pytest.mark.parametrize(
    "url, expected",
    [
        (
            "postgresql+psycopg2://optuna:s3cr%40t@127.0.0.1:5433/optuna",
            "postgresql+psycopg2://optuna:***@127.0.0.1:5433/optuna",
        ),
        ("http://user:pw@host:5000", "http://user:***@host:5000"),
        ("postgresql://optuna@127.0.0.1:5433/optuna", "postgresql://optuna@127.0.0.1:5433/optuna"),
        ("sqlite:///mlflow.db", "sqlite:///mlflow.db"),
        ("see https://a:b@c/d and http://e:f@g", "see https://a:***@c/d and http://e:***@g"),
    ],
)
def test_redact_removes_passwords_from_urls(url, expected):
    assert redact(url) == expected


def test_params_and_json_artifacts_are_redacted(tmp_path):
    from pipelines import tracking

    cfg = load_config(overrides={"tracking_uri": "http://u:hunter2hunter2@127.0.0.1:1"})
    plan = small_plan(noise_multiplier=1.0, sample_rate=0.1, steps=3, dataset_size=10, checkpoint_every=1)
    assert "hunter2" not in str(tracking.params_of(cfg, plan))

    class Client:
        def log_artifact(self, run_id, path, artifact_path=None):
            self.text = open(path).read()

    c = Client()
    tracking.write_json_artifact(
        c, "r", "spec.json", {"optuna": {"storage": "postgresql://o:hunter2hunter2@h/db"}, "n": [1, "x://a:b@c"]}
    )
    assert "hunter2" not in c.text and "***" in c.text and "x://a:***@c" in c.text


def test_tracking_and_storage_default_from_the_environment(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("DP_STORAGE_PATH", raising=False)
    assert load_config().tracking_uri == "sqlite:///mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    monkeypatch.setenv("DP_STORAGE_PATH", "/shared/runs")
    cfg = load_config()
    assert (cfg.tracking_uri, cfg.storage_path) == ("http://127.0.0.1:5999", "/shared/runs")
    # a flag (or YAML key) still wins, in either spelling
    assert load_config(overrides={"tracking-uri": "sqlite:///x.db"}).tracking_uri == "sqlite:///x.db"


def test_sweep_storage_defaults_from_the_environment(monkeypatch):
    from tuning.cli import load_sweep_config

    monkeypatch.delenv("DP_OPTUNA_STORAGE", raising=False)
    assert load_sweep_config(None, {})[0].storage == "sqlite:///optuna.db"
    monkeypatch.setenv("DP_OPTUNA_STORAGE", "postgresql+psycopg2://optuna@127.0.0.1:5433/optuna")
    assert load_sweep_config(None, {})[0].storage.startswith("postgresql+psycopg2://optuna@")
    assert load_sweep_config(None, {"storage": "sqlite:///b.db"})[0].storage == "sqlite:///b.db"


def test_write_secret_is_0600_from_the_start(tmp_path):
    f = tmp_path / "d" / "secret"
    old = os.umask(0)
    try:
        stack_common._write_secret(f, "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(f.stat().st_mode) == 0o600 and f.read_text() == "x"
    # an existing, world-readable file is replaced by a new 0600 file, never rewritten in place
    f.chmod(0o644)
    inode = f.stat().st_ino
    stack_common._write_secret(f, "y")
    assert stat.S_IMODE(f.stat().st_mode) == 0o600 and f.read_text() == "y" and f.stat().st_ino != inode
    # a link planted where a secret goes is replaced, not followed
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    (tmp_path / "d" / "link").symlink_to(target)
    stack_common._write_secret(tmp_path / "d" / "link", "z")
    assert target.read_text() == "keep" and not (tmp_path / "d" / "link").is_symlink()
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["link", "secret"]  # no temporary files left


def test_private_dir_refuses_a_foreign_or_linked_folder(tmp_path):
    d = tmp_path / "mine"
    stack_common._private_dir(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    (tmp_path / "link").symlink_to(d)
    with pytest.raises(stack.StackError, match="not a folder owned by this user"):
        stack_common._private_dir(tmp_path / "link")


def test_env_file_round_trip_and_shell_safety(tmp_path):
    import subprocess

    values = {"A": "1", "B": "x=y", "C": "/a path/with spaces; touch pwned"}
    f = tmp_path / "c.env"
    f.write_text(stack_common._env_text(values, "header"))
    assert stack.read_env_file(f) == values
    # sourced by a shell, as the docs say, it sets the values and runs nothing
    out = subprocess.run(
        ["bash", "-c", f'set -a; . {f}; set +a; printf %s "$C"'], cwd=tmp_path, capture_output=True, text=True
    )
    assert out.stdout == values["C"] and not (tmp_path / "pwned").exists()


def test_resolve_cluster_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # restored afterwards: resolve_cluster sets it for Ray
    with pytest.raises(jobs.JobError, match="no cluster to submit to"):
        jobs.resolve_cluster(None, tmp_path)
    with pytest.raises(jobs.JobError, match="Ray Client address"):
        jobs.resolve_cluster("ray://127.0.0.1:10001", tmp_path)
    assert jobs.resolve_cluster("127.0.0.1:8265", tmp_path) == "http://127.0.0.1:8265"


def test_submit_checks_the_config_before_anything_is_uploaded(tmp_path):
    with pytest.raises(dpcore.DPConfigError, match="epsilon"):
        jobs.submit("configs/digits.yaml", ["--target-epsilon", "-1"], address="http://127.0.0.1:1", stack_dir=tmp_path)
    with pytest.raises(jobs.JobError, match="does not exist"):
        jobs.submit("configs/nope.yaml", [], address="http://127.0.0.1:1", stack_dir=tmp_path)
    from tuning.cli import check_args  # what the CLI hands to submit for a sweep

    with pytest.raises(jobs.JobError, match="arguments are invalid"):
        jobs.check_locally("configs/digits.yaml", True, ["--n-trials", "many"], check_args)
    with pytest.raises(jobs.JobError, match="no checker"):
        jobs.check_locally("configs/digits.yaml", True, [])
    bad = tmp_path / "bad.yaml"
    bad.write_text("dataset: digits\nepohcs: 3\n")
    for sweep in (False, True):
        with pytest.raises(dpcore.DPConfigError, match="unknown config key 'epohcs'"):
            jobs.check_locally(str(bad), sweep, [], check_args)
    # a valid config passes, and the job runs the documented command
    jobs.check_locally("configs/digits.yaml", False, ["--epochs", "2"])
    assert jobs.entrypoint("configs/digits.yaml", False, ["--epochs", "2"]) == [
        "python",
        "-m",
        "pipelines.train",
        "configs/digits.yaml",
        "--epochs",
        "2",
    ]
    assert jobs.entrypoint("c.yaml", True, []) == ["python", "-m", "pipelines.cli", "sweep", "c.yaml"]


def test_a_jobs_api_address_is_not_joined_as_a_cluster(monkeypatch):
    """credentials.env names the Jobs API DP_RAY_JOBS_ADDRESS; an http:// RAY_ADDRESS given to a
    driver is refused with the fix instead of failing inside ray.init."""
    import ray

    from pipelines.config import TrainConfig
    from pipelines.train import ray_cluster

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    with pytest.raises(dpcore.DPConfigError, match="Jobs API address"):
        with ray_cluster(TrainConfig()):
            pass


def test_the_ray_token_that_ray_init_leaves_world_readable_is_made_private(tmp_path, monkeypatch):
    from pipelines.train.cluster import keep_token_private

    token = tmp_path / "auth_token"
    token.write_text("f" * 64)
    token.chmod(0o644)  # as ray.init writes it
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    keep_token_private()
    assert token.stat().st_mode & 0o777 == 0o600
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "absent"))
    keep_token_private()  # nothing to do, no error


def test_a_new_local_clusters_token_is_written_private_before_ray_reads_it(tmp_path, monkeypatch):
    """Where no token exists, ray.init would write one readable by everyone (folder 755, file
    644) and start the cluster; the platform writes it first, 600 in a 700 folder, and Ray then
    finds it (so writes none of its own)."""
    import re
    import subprocess
    import sys

    from pipelines.train.cluster import write_token_first

    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert write_token_first()
    token = tmp_path / ".ray" / "auth_token"
    assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700 and stat.S_IMODE(token.stat().st_mode) == 0o600
    first = token.read_text()
    assert re.fullmatch(r"[0-9a-f]{64}", first) and sorted(token.parent.iterdir()) == [token]
    assert not write_token_first() and token.read_text() == first  # an existing token is kept
    finds = (
        "from ray._raylet import AuthenticationTokenLoader as L; print(L.instance().has_token(ignore_auth_mode=True))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    out = subprocess.run(
        [sys.executable, "-c", finds], env={**env, "HOME": str(tmp_path)}, capture_output=True, text=True
    )
    assert out.stdout.strip() == "True", out.stderr[-2000:]
    out = subprocess.run(
        [sys.executable, "-c", finds], env={**env, "HOME": str(tmp_path / "new")}, capture_output=True, text=True
    )
    assert out.stdout.strip() == "False", out.stderr[-2000:]  # the probe can fail: no token there
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "elsewhere" / "token"))  # where Ray will read it
    assert write_token_first() and stat.S_IMODE((tmp_path / "elsewhere" / "token").stat().st_mode) == 0o600
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "none"))
    for name, value in (("RAY_AUTH_MODE", "disabled"), ("RAY_AUTH_TOKEN", "f" * 64)):
        with monkeypatch.context() as m:
            m.setenv(name, value)
            assert not write_token_first() and not (tmp_path / "none").exists()


def test_purge_after_a_plain_down_removes_the_data_and_secrets(tmp_path, monkeypatch):
    """`stack down` keeps the data; `stack down --purge` afterwards (no stack.json any more)
    still finds and removes it, unless PostgreSQL still runs on it."""
    from pipelines.ops.stack import commands

    root, pg = tmp_path / "stack", tmp_path / "pg"
    (pg / "data").mkdir(parents=True)
    root.mkdir()
    (root / "credentials.env").write_text("secret")
    monkeypatch.setattr(commands, "_pg_base", lambda r: pg)
    (pg / "data" / "postmaster.pid").write_text(f"{os.getpid()}\n")  # a live server on that data
    with pytest.raises(stack.StackError, match="still runs"):
        commands.down(root, purge=True)
    assert root.exists() and pg.exists()
    (pg / "data" / "postmaster.pid").unlink()
    said = commands.down(root, purge=True)
    assert not root.exists() and not pg.exists() and "removed" in said[0]
    with pytest.raises(stack.StackError, match="no stack"):
        commands.down(root, purge=True)  # nothing left at all


def test_add_node_says_the_head_is_gone_at_once(tmp_path):
    """`stack add-node` when the head is not running: a message and the fix, not minutes of
    `ray start` waiting for a GCS that is not there."""
    import json
    import time

    (tmp_path / "stack.json").write_text(
        json.dumps({"host": "127.0.0.1", "ports": {"gcs": stack_common.free_port()}, "ray_temp": str(tmp_path / "ray")})
    )
    t0 = time.monotonic()
    with pytest.raises(stack.StackError, match=r"Ray head \(127\.0\.0\.1:\d+\) is not running.*stack down.*stack up"):
        stack.add_node(tmp_path)
    assert time.monotonic() - t0 < 5


def test_a_stack_on_a_network_address_needs_an_explicit_opt_in(tmp_path, capsys):
    """Nothing in the stack speaks TLS: on an address others can reach, basic auth's passwords
    and the Ray token would cross the network in clear. `up` refuses before it starts or writes
    anything, and says how to go on."""
    from pipelines.ops.stack.cli import main

    root = tmp_path / "stack"
    with pytest.raises(stack.StackError, match=r"--host 0\.0\.0\.0 .*clear text.*--cleartext-network"):
        stack.up(root, host="0.0.0.0", install=False)
    assert main(["up", "--dir", str(root), "--host", "192.0.2.2", "--no-install"]) == 2
    assert "--cleartext-network" in capsys.readouterr().err
    assert not root.exists()


def test_a_delta_of_at_least_one_over_n_is_tagged_on_the_run(tmp_path):
    """δ ≥ 1/N trains (with a warning) and the run says so in MLflow, where its name alone
    looked like any other run's (helper-28)."""
    from pipelines.config import TrainConfig
    from pipelines.tracking import dp_tags

    plan = small_plan(dataset_size=1000)
    weak = dp_tags(TrainConfig(target_delta=0.5), plan)
    assert weak["dp.warning"].startswith("δ=0.5 is ≥ 1/N = 1/1000")
    assert "dp.warning" not in dp_tags(TrainConfig(target_delta=1e-5), plan)
    assert "dp.warning" in dp_tags(TrainConfig(target_delta=1e-3), plan)  # exactly 1/N

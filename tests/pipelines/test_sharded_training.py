"""Issue B, must-show 1: two Ray Train workers train on digits end to end.

One run (module fixture) is checked from several sides: parameters bit-identical on both
ranks (each rank writes its own checksum into the final checkpoint), the MLflow run's ledger
artifact, metrics and tags, the ledger's ε against an independent dp_accounting computation,
and the logged model loading and predicting.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import mlflow
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from dp_accounting import pld

from dpcore.readout import epsilon_text
from pipelines import tracking
from pipelines.config import TrainConfig
from pipelines.data import open_split
from pipelines.train import load_final_model, run
from pipelines.train.report import param_checksum

pytestmark = pytest.mark.slow


def _folder(path: Path) -> str:
    """A new folder for a model MLflow downloads (its default is a fresh one under /tmp, never removed)."""
    path.mkdir()
    return str(path)


def dp_accounting_epsilon(groups, delta):
    """Independent reference: dp_accounting's PLD accountant on the ledger's events."""
    import dp_accounting

    acc = pld.PLDAccountant()
    for (q, sigma), count in groups.items():
        acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), count)
    return acc.get_epsilon(delta)


@pytest.fixture(scope="module")
def e2e(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    cfg = TrainConfig(
        epochs=4,
        target_epsilon=3.0,
        checkpoint_every=4,
        storage_path=str(root / "runs"),
        tracking_uri=f"sqlite:///{root}/mlflow.db",
        registered_model="dp-e2e-test",
        quiet=True,
        audit_canaries=100,  # black-box input canaries (issue G): the run is audited as it trains
        audit_kind="input",
    )
    return run(cfg)


def test_parameters_are_bit_identical_on_every_rank(e2e):
    ckpt = Path(e2e["checkpoint"])
    sums = {p.name: json.loads(p.read_text())["param_sha256"] for p in ckpt.glob("rank-*.json")}
    assert set(sums) == {"rank-0.json", "rank-1.json"}
    assert len(set(sums.values())) == 1, sums
    # And they are the checksum of the model the driver logged (from rank 0's checkpoint).
    assert param_checksum(load_final_model(e2e["spec"], e2e["checkpoint"])) == sums["rank-0.json"]


def test_mlflow_run_has_ledger_epsilon_metric_and_tags(e2e):
    client = mlflow.MlflowClient(e2e["tracking_uri"])
    run = client.get_run(e2e["run_id"])
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert tags["dp.level"] == "example" and tags["dp.sampling"] == "poisson"
    assert tags["dp.accountant"] == "pld" and float(tags["dp.delta"]) == 1e-5
    assert math.isclose(float(tags["dp.epsilon"]), e2e["epsilon"], rel_tol=1e-5)
    assert "dp.diagnostics" not in tags
    eps_history = client.get_metric_history(e2e["run_id"], "epsilon")
    assert len(eps_history) >= 2 and sorted(m.step for m in eps_history)[-1] == e2e["steps"]
    assert [m.value for m in sorted(eps_history, key=lambda m: m.step)] == sorted(m.value for m in eps_history)
    for key in ("val_accuracy", "test_accuracy", "val_loss", "test_loss", "steps_per_second"):
        assert key in run.data.metrics
    # Invariant 7: nothing computed on training data is logged outside diagnostics mode.
    assert not [k for k in run.data.metrics if "train" in k or "clip" in k or k.startswith("diag")]
    artifacts = {a.path for a in client.list_artifacts(e2e["run_id"])} | {
        a.path for d in ("ledger", "plots") for a in client.list_artifacts(e2e["run_id"], d)
    }
    for a in (
        "config.json",
        "split.json",
        "ledger/ledger.parquet",
        "ledger/ledger.json",
        "plots/epsilon_vs_step.png",
        "plots/accuracy_vs_epsilon.png",
    ):
        assert a in artifacts, a
    # The whole config is in the params.
    assert run.data.params["lot_size"] == "512" and run.data.params["target_epsilon"] == "3.0"


def test_ledger_artifact_matches_an_independent_accountant(e2e, tmp_path):
    path = mlflow.artifacts.download_artifacts(
        run_id=e2e["run_id"], artifact_path="ledger/ledger.parquet", tracking_uri=e2e["tracking_uri"], dst_path=tmp_path
    )
    t = pq.read_table(path).to_pylist()
    assert [r["step"] for r in t] == list(range(1, e2e["steps"] + 1))
    assert all(r["status"] == "committed" for r in t)
    groups = {}
    for r in t:
        groups[(r["sample_rate"], r["noise_multiplier"])] = groups.get((r["sample_rate"], r["noise_multiplier"]), 0) + 1
    reference = dp_accounting_epsilon(groups, 1e-5)
    assert e2e["epsilon"] <= 3.0
    assert math.isclose(e2e["epsilon"], reference, rel_tol=1e-6), (e2e["epsilon"], reference)
    assert math.isclose(t[-1]["epsilon"], e2e["epsilon"], rel_tol=1e-9)
    # The table the UI shows: one row for this run's one run of identical releases.
    ui = tracking.read_json_artifact(e2e["tracking_uri"], e2e["run_id"], "ledger/ledger.json")
    rows = [dict(zip(ui["columns"], r)) for r in ui["data"]]
    assert [(r["count"], r["first_step"], r["last_step"], r["status"]) for r in rows] == [
        (e2e["steps"], 1, e2e["steps"], "committed")
    ]
    assert math.isclose(rows[0]["epsilon_after"], e2e["epsilon"], rel_tol=1e-9)  # (the UI table keeps 10 decimals)
    assert math.isclose(rows[0]["noise_multiplier"], t[0]["noise_multiplier"], rel_tol=1e-9)


def test_logged_model_loads_and_predicts_like_the_checkpoint(e2e, tmp_path):
    client = mlflow.MlflowClient(e2e["tracking_uri"])
    version = client.get_model_version("dp-e2e-test", "1")
    assert math.isclose(float(version.tags["dp.epsilon"]), e2e["epsilon"], rel_tol=1e-5)
    assert float(version.tags["dp.delta"]) == 1e-5
    mlflow.set_tracking_uri(e2e["tracking_uri"])
    split = open_split(e2e["spec"].data_dir, "test")
    test = SimpleNamespace(x=split.batch(torch.arange(len(split))), y=split.y)
    loaded = mlflow.pytorch.load_model("models:/dp-e2e-test/1", dst_path=_folder(tmp_path / "torch"))
    ours = load_final_model(e2e["spec"], e2e["checkpoint"])
    with torch.no_grad():
        assert torch.allclose(loaded(test.x), ours(test.x), atol=1e-5)
    # the environment it states is pinned to what trained it, stated rather than inferred (no
    # incidental imports such as tqdm)
    from importlib.metadata import version

    stated = Path(mlflow.pyfunc.get_model_dependencies("models:/dp-e2e-test/1")).read_text().split()
    assert sorted(stated) == sorted(f"{p}=={version(p)}" for p in ("mlflow", "torch", "numpy", "pandas", "cloudpickle"))
    pyfunc = mlflow.pyfunc.load_model(f"runs:/{e2e['run_id']}/model", dst_path=_folder(tmp_path / "pyfunc"))
    pred = np.asarray(pyfunc.predict(test.x[:7].numpy()))
    assert pred.shape == (7, 10)
    with torch.no_grad():  # the served model predicts what the checkpoint's model predicts
        assert torch.equal(torch.as_tensor(pred).argmax(1), ours(test.x[:7]).argmax(1))
    assert e2e["test_accuracy"] > 0.5  # 10 classes: chance is 0.1


def test_ledger_command_prints_the_runs_ledger(e2e):
    res = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "ledger", e2e["run_id"][:8], "--tracking-uri", e2e["tracking_uri"]],
        capture_output=True,
        text=True,
        timeout=120,
    )  # the 8 characters the UI shows name the run
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"run {e2e['run_id']} (")
    assert f"{e2e['steps']} releases: {e2e['steps']} committed, 0 rolled back" in res.stdout
    assert "poisson_gaussian" in res.stdout
    assert epsilon_text(e2e["epsilon"], ".4f") in res.stdout  # rounded up


def test_the_ledger_command_makes_no_store_where_there_is_none(tmp_path):
    """Run from a folder without mlflow.db, the read-only command says where it looked and what
    to give; MLflow would have made an empty store there and said 'not found'."""
    res = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "ledger", "0123456789abcdef0123456789abcdef"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"},
    )
    assert res.returncode == 2 and f"no MLflow store at {tmp_path}/mlflow.db: give --tracking-uri" in res.stderr
    assert list(tmp_path.iterdir()) == []


def test_black_box_input_canary_audit_is_scored_and_logged(e2e):
    """The e2e run carries 100 out-of-distribution input canaries with random labels, each in
    the data with probability ½: scored by the final model's loss, bounded, and logged."""
    a = e2e["audit"]
    assert a["kind"] == "input" and a["canaries"] == 100 and a["guesses"] == 100 and 20 < a["included"] < 80
    assert 0.0 <= a["epsilon_lower_bound"] <= e2e["epsilon"]
    assert (a["scores"] <= 0).all()  # minus a cross-entropy
    client = mlflow.MlflowClient(e2e["tracking_uri"])
    run = client.get_run(e2e["run_id"])
    assert run.data.metrics["audit.canaries"] == 100 and "black-box input canaries" in run.data.tags["audit.method"]
    assert run.data.tags["audit.check"] == "ε_lb ≤ ε"
    assert len(e2e["ledger"]) == e2e["planned_steps"]  # the canaries cost no extra releases

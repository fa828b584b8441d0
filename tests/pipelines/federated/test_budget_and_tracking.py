"""Issue E: a DP-FedAvg run's privacy budget and what MLflow records of it (pipelines/federated/,
the CLI's federated command): the ledger's ε and δ equal dp_accounting's; a run planned past its
budget stops at the budget without sampling again; Geyer's rule stops at the last round with δ below
Q; the logs carry no per-round time; a model trained without a guarantee is registered without an ε;
and the CLI's run on Ray is tracked at client level (tags, ledger, plots, and a registered model whose
input example is no private row)."""

import re
import subprocess
import sys

import dp_accounting
import mlflow
import pytest
import torch

import dpcore
from dpcore.federated import ClientLevelDP
from dpcore.readout import epsilon_text
from dpcore.sampling import PoissonSampler
from pipelines.federated import run_federated

from ...helpers import assert_input_example_is_no_private_row
from ._common import DIGITS, _cfg


# ------------------------------------------------------------------------------------------
# Accounting: the ledger's ε equals dp_accounting's; Geyer's rule stops at the right round.
def test_ledger_epsilon_equals_dp_accounting(tmp_path):
    out = run_federated(_cfg(tmp_path, rounds=6, target_epsilon=5.0, target_delta=1e-3))
    q, z = out["sample_rate"], out["noise_multiplier"]
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    pld = dp_accounting.pld.PLDAccountant()
    pld.compose(event, 6)
    assert out["epsilon"] == pytest.approx(pld.get_epsilon(1e-3), rel=1e-6)
    assert out["epsilon"] <= 5.0
    assert out["delta_at_target_epsilon"] == pytest.approx(pld.get_delta(5.0), rel=1e-6)
    rdp = dp_accounting.rdp.RdpAccountant()
    rdp.compose(event, 6)
    assert dpcore.epsilon(out["ledger"].groups(), 1e-3, "rdp") == pytest.approx(rdp.get_epsilon(1e-3), rel=1e-9)
    entries = out["ledger"].entries
    assert [e.step for e in entries] == [1, 2, 3, 4, 5, 6] and {e.kind for e in entries} == {"poisson_gaussian"}


def test_a_runs_logs_carry_no_per_round_time(tmp_path):
    """A round takes longer the more clients it sampled, and that count is not released: every
    round's metrics carry one time (the rounds' start), the throughput is logged once for the
    run, and the ledger table in MLflow has no per-release time."""
    import mlflow
    import pyarrow.parquet as pq

    out = run_federated(_cfg(tmp_path, rounds=4, target_epsilon=5.0, target_delta=1e-3))
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run_id = out["run_id"]
    for key in ("clip_norm", "epsilon", "test_accuracy"):
        history = client.get_metric_history(run_id, key)
        assert [m.step for m in history] == [1, 2, 3, 4]
        assert len({m.timestamp for m in history}) == 1, key
    assert len(client.get_metric_history(run_id, "rounds_per_second")) == 1
    table = pq.read_table(client.download_artifacts(run_id, "ledger/ledger.parquet", str(tmp_path)))
    assert "timestamp" not in table.column_names and table.num_rows == 4


def test_a_run_planned_past_its_budget_stops_at_the_budget_without_sampling_again(tmp_path, monkeypatch):
    """The plan caps the rounds at what the budget allows; should it ever plan more (here it is
    made to), the round loop stops where the ledger's check refuses the next round, before that
    round's clients are sampled, with ε within the target; and a seedless run's sampler and
    noise are the secure ones."""
    from pipelines.federated import rounds as rounds_module

    real_plan, sampled = rounds_module.plan_federated, []

    def planned_past_the_budget(cfg):
        plan = real_plan(cfg)
        sampled.append(plan["rounds"])
        return {**plan, "rounds": plan["rounds"] + 3}

    monkeypatch.setattr(rounds_module, "plan_federated", planned_past_the_budget)
    draws = []
    real_sample = PoissonSampler.sample

    def counted(self):  # the client sampler's draws, and their source
        draws.append(type(self.randomness).__name__)
        return real_sample(self)

    monkeypatch.setattr(PoissonSampler, "sample", counted)
    noise = []
    real_release = ClientLevelDP.release

    def noise_source(self, *args, **kwargs):
        noise.append(type(self._noise).__name__)
        return real_release(self, *args, **kwargs)

    monkeypatch.setattr(ClientLevelDP, "release", noise_source)
    cfg = _cfg(tmp_path, seed=None, noise_multiplier=1.7, rounds=40, target_epsilon=2.0, target_delta=1e-3)
    out = run_federated(cfg)
    fits = sampled[0]
    assert 0 < fits < 40 and out["planned_rounds"] == fits + 3  # budget-limited, and planned past it
    assert out["rounds"] == fits and len(out["ledger"].entries) == fits
    assert len(draws) == fits and set(draws) == {"SecureRandomness"}  # the refused round sampled nobody
    assert len(noise) == fits and set(noise) == {"SecureRandomness"}
    assert out["epsilon"] <= 2.0
    event = out["ledger"].entries[0].event
    assert out["ledger"].allowance(event) == 0
    tags = mlflow.MlflowClient(cfg.tracking_uri).get_run(out["run_id"]).data.tags
    assert tags["dp.randomness"] == "secure"


def test_a_model_trained_without_a_guarantee_is_registered_without_an_epsilon(tmp_path):
    """Geyer et al.'s non-private median clip (diagnostics only): the run says it holds no
    guarantee, and so do its registered model version and the model itself; a private run's
    version carries ε, δ and the accountant."""
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    for policy, name in (("median_nonprivate", "fed-median"), ("fixed", "fed-fixed")):
        out = run_federated(
            _cfg(tmp_path, rounds=2, clip_policy=policy, diagnostics=True, log_model=True, registered_model=name)
        )
        version = client.get_model_version(name, "1")
        model_tags = client.get_logged_model(version.source.removeprefix("models:/")).tags  # the logged model itself
        run_tags = client.get_run(out["run_id"]).data.tags
        if policy == "median_nonprivate":
            assert run_tags["dp.guarantee"].startswith("NONE: ")
            assert version.tags == {"dp.epsilon": "none", "dp.guarantee": run_tags["dp.guarantee"][len("NONE: ") :]}
            assert version.description.startswith("No differential-privacy guarantee: S is the non-private median")
            assert model_tags.get("dp.epsilon") == "none"
        else:
            assert version.tags["dp.epsilon"] == epsilon_text(out["epsilon"]) and version.tags["dp.accountant"] == "pld"
            assert "dp.guarantee" not in version.tags and version.description.startswith("Trained with (ε=")


def test_geyer_stopping_rule_stops_at_the_last_round_with_delta_below_Q(tmp_path):
    K, m, z, eps, Q = 100, 30, 1.4, 3.0, 1e-4
    out = run_federated(
        _cfg(
            tmp_path,
            num_clients=K,
            clients_per_round=m,
            noise_multiplier=z,
            rounds=0,
            stopping="delta",
            target_epsilon=eps,
            target_delta=Q,
            eval_every=100,
        )
    )
    # Independently: compose one round at a time with dp_accounting and find the first round whose δ(ε) > Q.
    acc = dp_accounting.pld.PLDAccountant()
    event = dp_accounting.PoissonSampledDpEvent(m / K, dp_accounting.GaussianDpEvent(z))
    t = 0
    while True:
        acc.compose(event)
        if acc.get_delta(eps) > Q:
            break
        t += 1
    assert 3 <= t and out["rounds"] == t
    assert out["delta_at_target_epsilon"] <= Q < acc.get_delta(eps)


# ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_runs_on_ray_and_tracks_the_run_at_client_level(tmp_path, ray_env):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipelines.cli",
            "federated",
            "--rounds",
            "4",
            "--seed",
            "1",
            "--clip-policy",
            "adaptive",
            "--tracking-uri",
            uri,
            "--storage-path",
            str(tmp_path / "runs"),
            "--eval-every",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=ray_env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "round 4/4" in proc.stderr and "ε=" in proc.stderr and "test acc=" in proc.stderr
    err = proc.stderr.splitlines()
    assert err[0].startswith("warning: ") and "seed" in err[0]  # --seed 1: predictable noise, said plainly
    assert sum(line.startswith("warning: ") and "seed" in line for line in proc.stdout.splitlines()) == 1  # and again
    phases = [line.split("  (")[0].strip() for line in err if line.startswith("  ")]
    assert phases[:3] == ["connecting to Ray", "starting 2 client actor(s)", "actors up; the first round"], phases
    assert phases[3] == "4 round(s) done" and phases[4].startswith("ε = ") and "logging the model" in phases[5]
    assert "client-level" in proc.stdout
    log = re.search(r"^logs: (\S+) \(MLflow, Ray(; \d+ warnings? there)?\)$", proc.stdout, re.M).group(
        1
    )  # libraries' log
    assert not re.search(r"\b(WARNING|ERROR)\b", proc.stderr + proc.stdout), proc.stderr  # K, must-show 4
    # MLflow's set-up lines are in the file (its schema check, run by Alembic: a new store is
    # copied from the cached schema, so MLflow builds none), none on the terminal
    assert log.startswith(str(tmp_path / "runs" / "logs" / "federated-")) and "INFO alembic.runtime" in open(log).read()
    assert "Creating initial MLflow database tables" not in proc.stderr and "alembic" not in proc.stderr
    client = mlflow.MlflowClient(uri)
    run = client.search_runs([client.get_experiment_by_name("dp-federated").experiment_id])[0]
    tags = run.data.tags
    assert tags["dp.level"] == "client" and tags["dp.clip_policy"] == "adaptive" and float(tags["dp.epsilon"]) <= 8.0
    assert "dp.diagnostics" not in tags and "diag_clients" not in run.data.metrics
    names = {a.path for d in ("", "ledger", "plots") for a in client.list_artifacts(run.info.run_id, d or None)}
    assert {"config.json", "ledger/ledger.parquet", "ledger/ledger.json", "plots/federated.png"} <= names
    from pipelines.cli import fetch_ledger

    assert fetch_ledger(run.info.run_id, uri).num_rows == 4
    version = client.get_latest_versions("dp-fedavg-digits-mlp")[0]
    assert version.run_id == run.info.run_id and version.tags["dp.epsilon"] == tags["dp.epsilon"]
    rows = torch.cat([DIGITS.inputs(s) for s in ("train", "val", "test")])
    mlflow.set_tracking_uri(uri)
    assert_input_example_is_no_private_row(f"models:/dp-fedavg-digits-mlp/{version.version}", rows, tmp_path)

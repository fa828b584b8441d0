"""Issue C in the sharded Ray training of issue B: each method is a config choice, runs on two
Ray Train workers, and is recorded in the same ledger.

Three runs:
* BAM (SAM form) with DP-PCA, parameter EMA and the non-private diagnostics, on an MLP;
* DP-SAT with augmentation multiplicity K=2 on a small CNN;
* the Laplace form.
"""

import json
import math
from pathlib import Path

import mlflow
import pytest
import torch

import dpcore
from dpcore.accounting import GAUSSIAN, POISSON_GAUSSIAN, POISSON_LAPLACE
from pipelines import tracking
from pipelines.config import TrainConfig
from pipelines.faults import FaultInjection
from pipelines.train import load_final_model, run

pytestmark = pytest.mark.slow


def _cfg(root, **over):
    # one checkpoint, at the end (each Ray Train report costs ~2 s); the restart test sets its own
    base = dict(epochs=2, lot_size=256, target_epsilon=3.0, seed=3, checkpoint_every=1000)
    return TrainConfig(
        storage_path=str(root / "runs"),
        tracking_uri=f"sqlite:///{root}/mlflow.db",
        registered_model="none",
        quiet=True,
        **{**base, **over},
    )


@pytest.fixture(scope="module")
def bam_pca(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("bam")
    return run(
        _cfg(
            root,
            method="bam",
            ascent=0.05,
            ascent_schedule="warmup",
            pca_components=16,
            pca_noise_multiplier=6.0,
            ema_decay=0.9,
            diagnostics=True,
        )
    )


def test_bam_with_dp_pca_ledgers_the_projection_and_composes_it(bam_pca):
    entries = bam_pca["ledger"].entries
    assert (entries[0].kind, entries[0].step, entries[0].noise_multiplier) == (GAUSSIAN, 0, 6.0)
    steps = entries[1:]
    assert {e.kind for e in steps} == {POISSON_GAUSSIAN} and [e.step for e in steps] == list(range(1, len(steps) + 1))
    # ε of the run = DP-PCA's Gaussian release composed with the steps, by dp_accounting itself.
    import dp_accounting

    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(6.0))
    acc.compose(
        dp_accounting.PoissonSampledDpEvent(
            bam_pca["sample_rate"], dp_accounting.GaussianDpEvent(bam_pca["noise_multiplier"])
        ),
        len(steps),
    )
    assert bam_pca["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-3)
    assert bam_pca["epsilon"] <= 3.0


def test_bam_run_model_has_the_frozen_projection_and_ema_weights(bam_pca):
    spec = bam_pca["spec"]
    model = load_final_model(spec, bam_pca["checkpoint"])
    comps = torch.load(spec.pca_path)["components"]
    assert isinstance(model[0], dpcore.PCAProjection) and torch.equal(model[0].components, comps)
    raw = torch.load(Path(bam_pca["checkpoint"]) / "model.pt")
    ema = torch.load(Path(bam_pca["checkpoint"]) / "ema_model.pt")
    assert any(not torch.equal(raw[k], ema[k]) for k in raw if not k.endswith("components"))
    assert all(torch.equal(model.state_dict()[k], ema[k]) for k in ema)


def test_bam_run_is_tagged_and_logs_diagnostics_per_step(bam_pca):
    client = mlflow.MlflowClient(bam_pca["tracking_uri"])
    run = client.get_run(bam_pca["run_id"])
    assert run.data.tags["dp.method"] == "bam-sam" and run.data.tags["dp.diagnostics"] == "non-private"
    assert "· digits-mlp-bam-" in run.info.run_name  # the runs list tells a BAM run from DP-SGD's
    assert run.data.tags["dp.pca"].startswith("k=16")
    hist = client.get_metric_history(bam_pca["run_id"], "diag_bias")
    assert sorted(m.step for m in hist) == list(range(1, bam_pca["steps"] + 1))
    assert all(m.value >= 0 for m in hist)
    assert client.get_metric_history(bam_pca["run_id"], "diag_magnitude_error_a")
    assert "plots/diagnostics.png" in [f.path for f in client.list_artifacts(bam_pca["run_id"], "plots")]


@pytest.fixture(scope="module")
def sat_aug(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("sat")
    return run(
        _cfg(
            root,
            method="dpsat",
            ascent=0.1,
            model="small_cnn",
            augmentation_multiplicity=2,
            augment_padding=1,
            epochs=3,
        )
    )


def test_dpsat_with_augmentation_writes_dpsgd_events_and_trains(sat_aug):
    entries = sat_aug["ledger"].entries
    assert {(e.kind, e.sample_rate, e.noise_multiplier) for e in entries} == {
        (POISSON_GAUSSIAN, sat_aug["sample_rate"], sat_aug["noise_multiplier"])
    }
    assert sat_aug["epsilon"] <= 3.0
    assert sat_aug["test_accuracy"] > 0.2  # 10 classes: twice chance after 15 noisy steps
    client = mlflow.MlflowClient(sat_aug["tracking_uri"])
    tags = client.get_run(sat_aug["run_id"]).data.tags
    assert tags["dp.method"] == "dpsat" and "dp.diagnostics" not in tags
    assert not [k for k in client.get_run(sat_aug["run_id"]).data.metrics if k.startswith("diag")]
    # the checkpoint carries DP-SAT's previous private gradient for a restart
    state = torch.load(Path(sat_aug["checkpoint"]) / "state.pt", weights_only=False)
    assert state["optimizer"]["previous_private_gradient"] is not None


def test_laplace_form_runs_on_ray_and_is_ledgered_as_laplace(ray_cluster, tmp_path):
    out = run(_cfg(tmp_path, noise="laplace", clip_norm_type="l1", epochs=1, target_epsilon=8.0))
    assert {e.kind for e in out["ledger"].entries} == {POISSON_LAPLACE}
    import dp_accounting

    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(
        dp_accounting.PoissonSampledDpEvent(out["sample_rate"], dp_accounting.LaplaceDpEvent(out["noise_multiplier"])),
        out["steps"],
    )
    assert out["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-3) and out["epsilon"] <= 8.0


def test_a_killed_worker_restarts_a_dpsat_ema_pca_augmented_run(ray_cluster, tmp_path):
    """Issue B's fault injection with issue C's state: DP-SAT's previous released gradient,
    the EMA, the augmentation streams and the DP-PCA projection all come back from the
    checkpoint; the PCA release stays committed at step 0, the steps after the checkpoint are
    replayed from the replay log (issue L) or, for a release in flight when the group died,
    rolled back, and every release is in ε, once. The run also carries issue G's one-run audit
    (600 white-box gradient canaries), whose scores come back from the checkpoint too."""
    out = run(
        _cfg(
            tmp_path,
            method="dpsat",
            ascent=0.1,
            ema_decay=0.9,
            pca_components=12,
            augmentation_multiplicity=2,
            augment_padding=1,
            epochs=5,
            checkpoint_every=3,
            max_failures=1,
            audit_canaries=600,
            audit_guesses=100,
        ),
        faults=FaultInjection(at_step=5, rank=1),
    )
    spec = out["spec"]
    assert (Path(spec.run_dir) / "fault-injected").exists()
    entries = out["ledger"].entries
    assert (entries[0].step, entries[0].kind, entries[0].status) == (0, GAUSSIAN, "committed")
    rolled = [e.step for e in entries if e.status == "rolled_back"]
    replayed = [e.step for e in entries if e.replayed]
    committed = [e.step for e in entries[1:] if e.status == "committed"]
    # The checkpoint is at step 3; rank 1 died after step 5. Rank 0's log held 4 and 5, or 4 alone
    # when the group was stopped before it wrote 5: those are replayed, the rest rolled back.
    assert replayed == [4, 5][: len(replayed)] and rolled == [4, 5][len(replayed) :]
    assert committed == list(range(1, len(committed) + 1)) and out["steps"] == len(committed)
    assert out["replayed"] == len(replayed) and out["rolled_back"] == len(rolled)
    import dp_accounting

    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(8.0))
    acc.compose(
        dp_accounting.PoissonSampledDpEvent(out["sample_rate"], dp_accounting.GaussianDpEvent(out["noise_multiplier"])),
        len(entries) - 1,
    )
    assert out["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-3) and out["epsilon"] <= 3.0
    state = torch.load(Path(out["checkpoint"]) / "state.pt", weights_only=False)
    assert state["ema"]["updates"] == out["steps"]  # the EMA continued from the checkpoint, not from scratch
    rank1 = torch.load(Path(out["checkpoint"]) / "rank-1.pt", weights_only=False)
    assert "augment" in rank1
    # The audit (issue G): valid, logged beside ε, and with signal (canaries in the data score higher).
    a = out["audit"]
    assert a["kind"] == "gradient" and a["canaries"] == 600 and a["guesses"] == 100 and 240 < a["included"] < 360
    assert 0.0 <= a["epsilon_lower_bound"] <= out["epsilon"]
    scores, inside = a["scores"], a["membership"]
    gap = float(scores[inside].mean() - scores[~inside].mean())
    assert gap > 4 * float(scores.std()) / math.sqrt(len(scores) / 4)  # in > out by over 4 standard errors
    meta = json.loads((Path(out["checkpoint"]) / "meta.json").read_text())
    assert "audit_scores.pt" in meta["files"]  # checkpointed with its SHA-256, restored on restart
    assert {(e.noise_multiplier, e.sample_rate) for e in entries[1:]} == {(out["noise_multiplier"], out["sample_rate"])}
    client = mlflow.MlflowClient(out["tracking_uri"])
    r = client.get_run(out["run_id"])
    assert r.data.metrics["audit.epsilon_lower_bound"] == pytest.approx(a["epsilon_lower_bound"])
    assert r.data.metrics["audit.correct"] == a["correct"] and r.data.metrics["audit.guesses"] == 100
    assert r.data.tags["audit.check"] == "ε_lb ≤ ε" and "white-box gradient canaries" in r.data.tags["audit.method"]
    logged = tracking.read_json_artifact(out["tracking_uri"], out["run_id"], "audit/canaries.json")
    assert logged["correct"] == a["correct"] and len(logged["scores"]) == 600

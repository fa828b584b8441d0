"""Issue B, must-show 4: a bad config to the main job (pipelines/train/, the CLI's train command)
fails with a clear message before any worker starts and before any budget is spent (no Ray, no MLflow
run, no ledger journal): unknown or impossible settings, mistyped config keys, a refused storage path
or resume flag; and the ledger journal refuses what would spend the budget twice: a second trainer on
a locked journal (a lock held for an instant is waited for), a restart's steps past its rolled-back
releases, a PCA projection that is not in the ledger."""

import subprocess
import sys

import pytest

import dpcore
from pipelines.config import TrainConfig, load_config
from pipelines.train import run

from ..helpers import small_plan
from ._bad_input_common import _cfg, _nothing_started


@pytest.mark.parametrize(
    "over, message",
    [
        (dict(dataset="nope"), "dataset='nope' is unknown; available: digits, mnist"),
        (dict(dataset="mnist", data_dir=None), "mnist was not found: no IDX files"),
        (dict(dataset="mnist", data_dir="/nonexistent/mnist"), "data_dir='/nonexistent/mnist' does not exist"),
        (dict(model="tv:resnet18"), "BatchNorm"),
        (dict(lot_size=100_000), "lot_size=100000 is larger than the dataset"),
        (dict(target_epsilon=0.01), "target_epsilon=0.01 cannot be reached in 60 epochs"),
        (dict(noise_multiplier=0.5, target_epsilon=0.05), "cannot take even one step"),
        (dict(noise_multiplier=0.0), "Leave --noise-multiplier unset to calibrate σ from --target-epsilon"),
        (dict(noise_multiplier=float("nan")), "noise_multiplier=nan is invalid"),
        (dict(tracking_uri="http://127.0.0.1:9"), "MLflow tracking server http://127.0.0.1:9 is unreachable"),
        (dict(model="resnet99"), "model='resnet99' is unknown"),
        (dict(num_workers=0), "num_workers=0 is invalid"),
        # issue C, must-show 5
        (dict(method="bam", ascent=-0.01), "lambda (BAM) = -0.01 is negative"),
        (dict(method="dpsat", ascent=-0.5), "rho (DP-SAT) = -0.5 is negative"),
        (dict(augmentation_multiplicity=0), "augmentation_multiplicity=0 is invalid"),
        (dict(pca_components=65), "pca_components=65 is invalid for inputs of dimension 64"),
        (dict(pca_components=-1), "pca_components=-1 is invalid"),
        (dict(noise="laplace"), "noise='laplace' needs clip_norm_type='l1'"),
        (dict(noise="laplace", clip_norm_type="l1", accountant="rdp"), "accounted by PLD only"),
        (dict(pca_components=10, pca_noise_multiplier=0.5, target_epsilon=1.0), "nothing is left for training"),
        (dict(bam_variant="exact"), "bam_variant='exact' has no effect with method='dpsgd'"),
        (dict(pca_components=10, model="small_cnn"), "only model='mlp' takes"),
        # the model section's optimizer checks (unreachable from 13d7b08 until 2026-11-25)
        (dict(optimizer="adamw"), "optimizer='adamw' is unknown; available: sgd, adam, nadam"),
        (dict(lr=-0.1), "lr=-0.1 is invalid: it must be a finite number > 0"),
        (dict(optimizer="sgd", momentum=1.0), "momentum=1.0 is invalid: it must lie in [0, 1)"),
        (dict(init_seed=-1), "init_seed=-1 is invalid"),
    ],
)
def test_bad_input_fails_before_anything_starts(tmp_path, over, message):
    import ray

    ray_was_up = ray.is_initialized()
    if "tracking_uri" in over:
        cfg = TrainConfig(storage_path=str(tmp_path / "runs"), quiet=True, **over)
    else:
        cfg = _cfg(tmp_path, **over)
    with pytest.raises(dpcore.DPError) as err:
        run(cfg)
    assert message in str(err.value)
    _nothing_started(tmp_path, ray_was_up)


def test_batchnorm_message_names_the_layer_and_the_fix(tmp_path):
    with pytest.raises(dpcore.UnsupportedModuleError) as err:
        run(_cfg(tmp_path, model="tv:resnet18"))
    msg = str(err.value)
    assert "'bn1' (BatchNorm2d)" in msg and "GroupNorm" in msg


def test_unknown_and_mistyped_config_keys(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("lot_sise: 128\n")
    with pytest.raises(dpcore.DPConfigError, match="unknown config key 'lot_sise'. Did you mean lot_size"):
        load_config(bad)
    bad.write_text("lot_size: lots\n")
    with pytest.raises(dpcore.DPConfigError, match="lot_size='lots' has the wrong type"):
        load_config(bad)
    good = tmp_path / "good.yaml"
    good.write_text("lot-size: 128\ntarget_epsilon: 8\n")
    cfg = load_config(good, {"target_epsilon": 4.0})
    assert cfg.lot_size == 128 and cfg.target_epsilon == 4.0  # flags override the file


def test_cli_exit_code_and_message(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "train", "--lot-size", "100000", "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert res.returncode == 2
    assert "error: lot_size=100000 is larger than the dataset" in res.stderr
    assert "Traceback" not in res.stderr
    assert not list((tmp_path / "dp_runs").glob("*/ledger.journal.jsonl"))


@pytest.mark.parametrize("command", ["train", "federated"])
def test_a_refused_storage_path_leaves_nothing_on_disk(tmp_path, command):
    """A URL as --storage-path is refused before anything is made: its log folder (a folder
    named 's3:' in the working directory) was created first (helper-28)."""
    res = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", command, "--storage-path", "s3://bucket/x", "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert res.returncode == 2 and "only filesystem paths are supported" in res.stderr, res.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_resume_keeps_the_runs_config(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "train", "--resume", "0123abcd", "--lr", "0.1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert res.returncode == 2
    assert "--resume continues a run with the config it started with" in res.stderr and "--lr" in res.stderr


def test_a_locked_journal_refuses_a_second_trainer(tmp_path):
    """Two worker groups on one journal would each check the budget against only their own
    releases; the journal lock (held by rank 0 for its lifetime) prevents it."""
    from pipelines.train.run_ledger import journal_is_locked, open_ledger

    journal = str(tmp_path / "ledger.journal.jsonl")
    spec = small_plan(
        **{
            "config": {"target_epsilon": 2.0, "target_delta": 1e-5, "accountant": "pld"},
            "journal": journal,
            "epsilon_every": 1,
            "noise_multiplier": 5.0,
            "sample_rate": 0.1,
            "steps": 10,
        }
    )
    with pytest.raises(dpcore.DPConfigError, match="does not exist on this node"):
        open_ledger(spec, None, None, rank=0, world=1, layout=[])  # the driver creates it; never start a fresh one
    dpcore.PrivacyLedger(2.0, 1e-5, journal=journal)  # as the driver does
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import fcntl, time; f = open({journal + '.lock'!r}, 'a+'); fcntl.flock(f, fcntl.LOCK_EX); print('held', "
            "flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert journal_is_locked(journal)
        with pytest.raises(dpcore.DPConfigError, match="another process holds the ledger journal"):
            open_ledger(spec, None, None, rank=0, world=1, layout=[])
    finally:
        holder.kill()
        holder.wait()
    assert not journal_is_locked(journal)
    ledger, allowance, _, _ = open_ledger(spec, None, None, rank=0, world=1, layout=[])
    assert allowance == 10 and len(ledger) == 0


def test_a_lock_held_for_an_instant_is_waited_for_not_refused(tmp_path):
    """journal_is_locked (a resume's check, from another process) takes the lock for an instant;
    a restarting rank 0 that met it failed and used up one of max_failures (helper-39)."""
    import fcntl
    import threading

    from pipelines.train.run_ledger import LOCK_WAIT_S, lock_journal, unlock_journal

    journal = str(tmp_path / "ledger.journal.jsonl")
    other = open(journal + ".lock", "a+")  # another open file: flock conflicts even in one process
    fcntl.flock(other.fileno(), fcntl.LOCK_EX)
    threading.Timer(0.2, lambda: fcntl.flock(other.fileno(), fcntl.LOCK_UN)).start()
    lock_journal(journal)  # waited 0.2 s
    unlock_journal()
    fcntl.flock(other.fileno(), fcntl.LOCK_EX)
    with pytest.raises(dpcore.DPConfigError, match="another process holds the ledger journal"):
        lock_journal(journal)  # held past the wait (LOCK_WAIT_S): refused
    other.close()
    assert LOCK_WAIT_S <= 2.0  # a true second trainer is still refused promptly


def test_a_restart_allows_only_what_the_budget_has_left_after_rolled_back_releases(tmp_path):
    """Rolled-back releases stay spent: a restart without a checkpoint trains only as many steps
    as the budget still allows, fewer than the plan's (helper-32: an allowance of plan.steps −
    upto went unseen by every fast test; the release-level check would then have stopped the run
    with an error in place of its planned end)."""
    from pipelines.train.run_ledger import open_ledger, unlock_journal

    journal = str(tmp_path / "ledger.journal.jsonl")
    event = dpcore.PrivacyEvent.dpsgd_step(5.0, 0.1)
    total = dpcore.accountants.calibration.max_steps(5.0, 0.1, 0.5, 1e-5)  # 45 releases fit ε = 0.5
    spec = small_plan(
        config={"target_epsilon": 0.5, "target_delta": 1e-5, "accountant": "pld"}, journal=journal,
        epsilon_every=10**9, noise_multiplier=5.0, sample_rate=0.1, steps=10, max_releases=total,
    )  # fmt: skip
    before = dpcore.PrivacyLedger(0.5, 1e-5, journal=journal)
    for s in range(1, total - 3 + 1):  # a first attempt's releases, then it died before any checkpoint
        before.append(event, step=s, clip_norm=1.0)
    ledger, allowance, upto, _ = open_ledger(spec, None, None, rank=0, world=1, layout=[])
    assert upto == 0 and all(e.status == "rolled_back" for e in ledger.entries)
    assert allowance == 3 == ledger.allowance(event) < spec.steps
    unlock_journal()


def test_a_worker_refuses_a_pca_projection_that_is_not_in_the_ledger(tmp_path):
    """The driver ledgers DP-PCA before it saves the components; a worker that finds a
    projection but no step-0 release refuses to train on it."""
    from pipelines.train.run_ledger import open_ledger

    journal = str(tmp_path / "ledger.journal.jsonl")
    spec = small_plan(
        **{
            "config": {"target_epsilon": 2.0, "target_delta": 1e-5, "accountant": "pld"},
            "journal": journal,
            "epsilon_every": 1,
            "noise_multiplier": 5.0,
            "sample_rate": 0.1,
            "steps": 10,
            "pca_path": str(tmp_path / "pca.pt"),
        }
    )
    dpcore.PrivacyLedger(2.0, 1e-5, journal=journal)
    with pytest.raises(dpcore.DPConfigError, match="holds no release for it"):
        open_ledger(spec, None, None, rank=0, world=1, layout=[])
    from pipelines.train.run_ledger import unlock_journal

    unlock_journal()
    ledger = dpcore.PrivacyLedger(2.0, 1e-5, journal=journal)
    ledger.append(dpcore.PrivacyEvent("gaussian", 8.0), step=0, clip_norm=1.0)  # as ensure_pca does
    ledger2, allowance, _, _ = open_ledger(spec, None, None, rank=0, world=1, layout=[])
    assert allowance == 10 and len(ledger2) == 1
    unlock_journal()

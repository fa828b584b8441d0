"""Issue B, must-show 4: bad input to the main job fails with a clear message before any
worker starts and before any budget is spent (no Ray, no MLflow run, no ledger journal)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import dpcore
from pipelines.config import TrainConfig, load_config
from pipelines.data import ingest, load_digits
from pipelines.train import run

from ..helpers import small_plan


def _nothing_started(tmp_path: Path, ray_was_up: bool):
    import ray

    assert ray.is_initialized() == ray_was_up  # run() did not start (or join) a cluster
    assert not list((tmp_path / "runs").glob("*/ledger.journal.jsonl"))
    db = tmp_path / "mlflow.db"
    if db.exists():
        import mlflow

        assert (
            mlflow.MlflowClient(f"sqlite:///{db}").search_runs(
                [e.experiment_id for e in mlflow.MlflowClient(f"sqlite:///{db}").search_experiments()]
            )
            == []
        )


def _cfg(tmp_path, **over):
    return TrainConfig(
        storage_path=str(tmp_path / "runs"), tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", quiet=True, **over
    )


@pytest.fixture(scope="module")
def corrupt_dataset(tmp_path_factory):
    d = tmp_path_factory.mktemp("corrupt")
    ingest(load_digits(), d, num_shards=2)
    shard = d / "train-00001-of-00002.arrow"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte in the middle of the shard
    shard.write_bytes(bytes(raw))
    return d


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


def test_corrupt_shard_is_named_before_training(tmp_path, corrupt_dataset):
    import ray

    ray_was_up = ray.is_initialized()
    with pytest.raises(dpcore.DPConfigError) as err:
        run(_cfg(tmp_path, data_dir=str(corrupt_dataset)))
    assert "train-00001-of-00002.arrow is corrupt" in str(err.value)
    _nothing_started(tmp_path, ray_was_up)


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


def _idx(path, array):
    import gzip
    import struct

    import numpy as np

    data = (
        struct.pack(">BBBB", 0, 0, 0x08, array.ndim)
        + struct.pack(f">{array.ndim}I", *array.shape)
        + array.astype(np.uint8).tobytes()
    )
    path.write_bytes(gzip.compress(data))


def _idx_folder(root, n_train=40, n_labels=40, test=True, train=True):
    import numpy as np

    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    if train:
        _idx(root / "train-images-idx3-ubyte.gz", rng.integers(0, 256, (n_train, 28, 28)))
        _idx(root / "train-labels-idx1-ubyte.gz", rng.integers(0, 10, n_labels))
    if test:
        _idx(root / "t10k-images-idx3-ubyte.gz", rng.integers(0, 256, (10, 28, 28)))
        _idx(root / "t10k-labels-idx1-ubyte.gz", rng.integers(0, 10, 10))
    return root


def _mixed_sizes(root):
    import numpy as np
    from PIL import Image

    for c, size in (("a", 8), ("b", 12)):
        (root / c).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(np.zeros((size, size, 3), np.uint8)).save(root / c / f"{i}.png")
    return root


def _one_class_tree(root):
    import numpy as np
    from PIL import Image

    (root / "train" / "only").mkdir(parents=True)
    for i in range(3):
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(root / "train" / "only" / f"{i}.png")
    return root


def _one_class_ingested(root):
    import dataclasses

    from pipelines.data import Split

    ds = load_digits()
    zero = {k: Split(getattr(ds, k).x, getattr(ds, k).y * 0) for k in ("train", "val", "test")}
    return ingest(dataclasses.replace(ds, num_classes=1, **zero), root, num_shards=2)


@pytest.mark.parametrize(
    "make, over, message",
    [
        (_one_class_tree, dict(dataset="imagefolder"), "1 class folder(s) (only)"),
        (_one_class_ingested, dict(dataset="digits"), "1 class(es): a classifier needs two or more"),
        (
            lambda d: _idx_folder(d, train=False),
            dict(dataset="fashion-mnist"),
            "holds only part of fashion-mnist: train-images-idx3-ubyte[.gz]",
        ),
        (lambda d: _idx_folder(d, n_labels=39), dict(dataset="fashion-mnist"), "holds 39 labels but"),
        (_mixed_sizes, dict(dataset="imagefolder"), "have different sizes"),
        (
            lambda d: (d.mkdir(parents=True), (d / "f.txt").write_text("x"), d / "f.txt")[2],
            dict(dataset="fashion-mnist"),
            "is a file, not a folder",
        ),
        (lambda d: d / "nowhere", dict(dataset="digits"), "does not read data_dir"),
    ],
    ids=[
        "imagefolder-one-class",
        "ingested-one-class",
        "only-test-files",
        "label-count",
        "imagefolder-mixed-sizes",
        "data-dir-is-a-file",
        "unused-data-dir",
    ],
)
def test_bad_real_data_fails_before_anything_starts(tmp_path, make, over, message):
    """Issue H's bad input: each gets a clear error; no cluster, no MLflow run, no ledger."""
    import ray

    ray_was_up = ray.is_initialized()
    data_dir = make(tmp_path / "data")
    with pytest.raises(dpcore.DPError) as err:
        run(_cfg(tmp_path, data_dir=str(data_dir), **over))
    assert message in str(err.value)
    _nothing_started(tmp_path, ray_was_up)


def test_an_ingested_dataset_of_another_name_is_refused(tmp_path, corrupt_dataset):
    import ray

    ray_was_up = ray.is_initialized()
    with pytest.raises(dpcore.DPConfigError, match="is an ingested 'digits' dataset, but dataset='fashion-mnist'"):
        run(_cfg(tmp_path, dataset="fashion-mnist", data_dir=str(corrupt_dataset)))
    _nothing_started(tmp_path, ray_was_up)


def test_ingest_writes_a_dataset_from_the_command_line(tmp_path):
    """`dp-platform ingest` runs (it failed on the text options it did not define)."""
    out = tmp_path / "digits"
    done = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "ingest", "digits", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "manifest.json").is_file() and "wrote digits" in done.stdout


def test_ingest_writes_a_text_table_from_the_command_line(tmp_path, minilm_folder):
    """The text options reach the check and the loader (the model's tokenizer runs at ingest)."""
    table = tmp_path / "t.csv"
    table.write_text("text,label\n" + "".join(f"text number {i},{'pos' if i % 2 else 'neg'}\n" for i in range(12)))
    out = tmp_path / "ingested"
    args = ["ingest", "text", str(out), "--data-dir", str(table), "--model", f"hf:{minilm_folder}"]
    args += ["--max-length", "16", "--text-classes", "neg,pos"]
    done = subprocess.run([sys.executable, "-m", "pipelines.cli", *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["classes"] == ["neg", "pos"] and manifest["input_shape"] == [16]


def test_ingest_verify_rehashes_everything_and_exits_nonzero_on_corruption(tmp_path, corrupt_dataset):
    good = tmp_path / "good"
    ingest(load_digits(), good, num_shards=2)
    ok = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "ingest", "--verify", str(good)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0 and "every SHA-256 matches" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "ingest", "--verify", str(corrupt_dataset)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 1 and "train-00001-of-00002.arrow is corrupt" in bad.stderr

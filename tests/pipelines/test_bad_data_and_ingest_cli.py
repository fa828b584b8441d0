"""Issues B and H: bad data fails with a clear message before anything starts (no cluster, no
MLflow run, no ledger journal): a corrupt ingested shard is named, as are a folder with one class,
part of the IDX files, a label count that does not match, images of mixed sizes, a file or an unused
path as data_dir, and an ingested dataset of another name; and the CLI's ingest command writes image
and text datasets, and its --verify rehashes every shard and exits non-zero on corruption."""

import json
import subprocess
import sys

import pytest

import dpcore
from pipelines.data import ingest, load_digits
from pipelines.train import run

from ._bad_input_common import _cfg, _nothing_started


@pytest.fixture(scope="module")
def corrupt_dataset(tmp_path_factory):
    d = tmp_path_factory.mktemp("corrupt")
    ingest(load_digits(), d, num_shards=2)
    shard = d / "train-00001-of-00002.arrow"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte in the middle of the shard
    shard.write_bytes(bytes(raw))
    return d


def test_corrupt_shard_is_named_before_training(tmp_path, corrupt_dataset):
    import ray

    ray_was_up = ray.is_initialized()
    with pytest.raises(dpcore.DPConfigError) as err:
        run(_cfg(tmp_path, data_dir=str(corrupt_dataset)))
    assert "train-00001-of-00002.arrow is corrupt" in str(err.value)
    _nothing_started(tmp_path, ray_was_up)


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

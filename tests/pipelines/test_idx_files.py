"""Issue H, must-show 1: MNIST-format datasets read as their distributors ship them (IDX files,
gzipped or not, flat or in torchvision's layout), with clear errors for everything else."""

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import dpcore
from pipelines.data import find_idx_files, load_dataset
from pipelines.data.idx import IDX_DATASETS

FMNIST = Path(IDX_DATASETS["fashion-mnist"][1])


def _idx_bytes(array: np.ndarray) -> bytes:
    """IDX: two zero bytes, the type (0x08 = uint8), the number of dims, big-endian sizes, data."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def _write(folder: Path, gz: bool, n_train=50, n_test=20, seed=0, skip=()):
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28)),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28)),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test),
    }
    folder.mkdir(parents=True, exist_ok=True)
    for stem, a in arrays.items():
        if stem in skip:
            continue
        data = _idx_bytes(a)
        if gz:
            (folder / f"{stem}.gz").write_bytes(gzip.compress(data))
        else:
            (folder / stem).write_bytes(data)
    return arrays


@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize("layout", ["flat", "torchvision"])
def test_idx_files_load_gzipped_or_not_flat_or_in_torchvisions_layout(tmp_path, gz, layout):
    folder = tmp_path if layout == "flat" else tmp_path / "FashionMNIST" / "raw"
    arrays = _write(folder, gz)
    ds = load_dataset("fashion-mnist", data_dir=str(tmp_path), val_fraction=0.2)
    assert ds.input_shape == (1, 28, 28) and ds.train.x.dtype == torch.uint8
    assert (len(ds.train), len(ds.val), len(ds.test)) == (40, 10, 20)
    # Every image arrives exactly (the test split in order; train+val as a permutation of the file).
    assert torch.equal(ds.test.x[:, 0], torch.from_numpy(arrays["t10k-images-idx3-ubyte"].astype(np.uint8)))
    assert torch.equal(ds.test.y, torch.from_numpy(arrays["t10k-labels-idx1-ubyte"]).long())
    pool = torch.cat([ds.train.x, ds.val.x])[:, 0].flatten(1)
    ref = torch.from_numpy(arrays["train-images-idx3-ubyte"].astype(np.uint8)).flatten(1)
    assert torch.equal(torch.sort(pool.sum(1).long()).values, torch.sort(ref.sum(1).long()).values)
    assert ds.source["files"]["train"][0].endswith("train-images-idx3-ubyte" + (".gz" if gz else ""))


def test_without_data_dir_the_standard_install_path_is_used_and_named_when_missing(tmp_path, monkeypatch):
    monkeypatch.setitem(IDX_DATASETS, "fashion-mnist", ("FashionMNIST", str(tmp_path / "std"), "dataset-fashion-mnist"))
    with pytest.raises(dpcore.DPConfigError) as err:
        load_dataset("fashion-mnist")
    msg = str(err.value)
    assert (
        "fashion-mnist was not found" in msg
        and str(tmp_path / "std") in msg
        and str(tmp_path / "std" / "FashionMNIST" / "raw") in msg
    )
    assert "apt-get install dataset-fashion-mnist" in msg and "--download" in msg
    _write(tmp_path / "std", gz=True)
    assert len(load_dataset("fashion-mnist").test) == 20


def test_an_empty_data_dir_lists_every_folder_it_searched(tmp_path):
    with pytest.raises(dpcore.DPConfigError) as err:
        find_idx_files("mnist", str(tmp_path))
    msg = str(err.value)
    for folder in (tmp_path, tmp_path / "MNIST" / "raw", tmp_path / "raw"):
        assert str(folder) in msg


def test_a_folder_with_only_the_test_files_names_the_missing_ones(tmp_path):
    _write(tmp_path, gz=True, skip=("train-images-idx3-ubyte", "train-labels-idx1-ubyte"))
    with pytest.raises(
        dpcore.DPConfigError,
        match=r"holds only part of fashion-mnist: train-images-idx3-ubyte\[.gz\], train-labels-idx1-ubyte\[.gz\] are missing",
    ):
        load_dataset("fashion-mnist", data_dir=str(tmp_path))


def test_label_count_that_does_not_match_the_images_names_both_files(tmp_path):
    _write(tmp_path, gz=False)
    rng = np.random.default_rng(1)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(_idx_bytes(rng.integers(0, 10, 49)))
    with pytest.raises(
        dpcore.DPConfigError,
        match=r"train-labels-idx1-ubyte holds 49 labels but .*train-images-idx3-ubyte holds 50 images",
    ):
        load_dataset("fashion-mnist", data_dir=str(tmp_path))


@pytest.mark.parametrize("gz", [True, False])
def test_a_truncated_file_is_named(tmp_path, gz):
    _write(tmp_path, gz=gz)
    name = "train-images-idx3-ubyte" + (".gz" if gz else "")
    path = tmp_path / name
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) - 500])
    with pytest.raises(
        dpcore.DPConfigError, match=f"{name} is not a (complete gzip|valid IDX) file.*truncated or corrupt"
    ):
        load_dataset("fashion-mnist", data_dir=str(tmp_path))


def test_a_corrupt_header_is_named(tmp_path):
    _write(tmp_path, gz=False)
    path = tmp_path / "t10k-labels-idx1-ubyte"
    data = bytearray(path.read_bytes())
    data[2] = 0x42  # an unknown element type
    path.write_bytes(bytes(data))
    with pytest.raises(dpcore.DPConfigError, match="t10k-labels-idx1-ubyte is not a valid IDX file"):
        load_dataset("fashion-mnist", data_dir=str(tmp_path))


def test_labels_out_of_range_are_refused(tmp_path):
    _write(tmp_path, gz=False)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(_idx_bytes(np.full(20, 12)))
    with pytest.raises(dpcore.DPConfigError, match="holds the label 12"):
        load_dataset("fashion-mnist", data_dir=str(tmp_path))


def test_data_dir_pointing_at_a_file_is_refused(tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(dpcore.DPConfigError, match="is a file, not a folder"):
        load_dataset("fashion-mnist", data_dir=str(f))
    with pytest.raises(dpcore.DPConfigError, match="is a file, not a folder"):
        load_dataset("imagefolder", data_dir=str(f))


@pytest.mark.skipif(
    not FMNIST.is_dir(), reason="the real Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)"
)
def test_the_real_fashion_mnist_as_debian_ships_it():
    ds = load_dataset("fashion-mnist", val_fraction=0.1)  # no data_dir: the standard install path
    assert (len(ds.train), len(ds.val), len(ds.test)) == (54_000, 6_000, 10_000)
    assert ds.train.x.dtype == torch.uint8 and ds.input_shape == (1, 28, 28)
    counts = torch.bincount(torch.cat([ds.train.y, ds.val.y]), minlength=10)
    assert counts.tolist() == [6000] * 10  # the published class balance of the training set
    assert torch.bincount(ds.test.y, minlength=10).tolist() == [1000] * 10
    # The published statistics of the training pixels (mean 0.2860, std 0.3530 in [0, 1]).
    pixels = torch.cat([ds.train.x, ds.val.x]).double() / 255
    assert abs(pixels.mean().item() - 0.2860) < 5e-4 and abs(pixels.std().item() - 0.3530) < 5e-4

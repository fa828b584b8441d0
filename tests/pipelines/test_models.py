"""The pipeline's datasets and models: torchvision/ImageFolder loaders on files in their real
formats (written here: no network), the generated set, and the BAM paper's models under
dpcore (validation, and per-example gradients equal to an explicit loop)."""

import struct

import numpy as np
import pytest
import torch

import dpcore
from dpcore.clipping import clipped_sum
from dpcore.grad_sample import PerSampleGradients
from pipelines.data import load_dataset
from pipelines.models import build_model, resnet9, wide_resnet

from ..helpers import ce, loop_clipped_sum


def _write_idx(path, array: np.ndarray):
    """MNIST's IDX format: magic (0x08 = uint8, number of dims), big-endian sizes, raw bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def test_mnist_loader_reads_torchvision_files_and_carves_validation_from_train(tmp_path):
    rng = np.random.default_rng(0)
    raw = tmp_path / "MNIST" / "raw"
    _write_idx(raw / "train-images-idx3-ubyte", rng.integers(0, 256, (100, 28, 28)))
    _write_idx(raw / "train-labels-idx1-ubyte", rng.integers(0, 10, 100))
    _write_idx(raw / "t10k-images-idx3-ubyte", rng.integers(0, 256, (20, 28, 28)))
    _write_idx(raw / "t10k-labels-idx1-ubyte", rng.integers(0, 10, 20))
    ds = load_dataset("mnist", data_dir=str(tmp_path), val_fraction=0.1)
    assert ds.input_shape == (1, 28, 28) and ds.num_classes == 10
    assert (len(ds.train), len(ds.val), len(ds.test)) == (90, 10, 20)
    assert ds.split_info["source"] == "official train/test" and ds.split_info["val_examples"] == 10
    assert ds.train.x.dtype == torch.uint8  # stored as shipped
    # Standardised with MNIST's published mean/std: pixel 0 maps to -0.1307/0.3081, 255 to (1-0.1307)/0.3081.
    inputs = torch.cat([ds.inputs("train"), ds.inputs("val")])
    assert torch.isclose(inputs.min(), torch.tensor(-0.1307 / 0.3081), atol=1e-5)
    assert torch.isclose(inputs.max(), torch.tensor((1 - 0.1307) / 0.3081), atol=1e-5)
    # Validation rows come out of the training set only, never from test.
    assert not any(torch.equal(v, t) for v in ds.val.x for t in ds.test.x)


def test_missing_torchvision_files_say_where_they_were_looked_for(tmp_path):
    with pytest.raises(dpcore.DPConfigError, match="cifar10 was not found under data_dir"):
        load_dataset("cifar10", data_dir=str(tmp_path))


def _png_tree(root, classes=("ant", "bee", "cat"), per_class=6, size=10):
    from PIL import Image

    rng = np.random.default_rng(1)
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(root / c / f"{i}.png")


def test_imagefolder_one_tree_is_split_and_a_train_test_tree_is_respected(tmp_path):
    _png_tree(tmp_path / "one")
    ds = load_dataset("imagefolder", data_dir=str(tmp_path / "one"), test_fraction=0.2, val_fraction=0.1)
    assert ds.input_shape == (3, 10, 10) and ds.num_classes == 3
    assert len(ds.train) + len(ds.val) + len(ds.test) == 18 and len(ds.test) == 4
    _png_tree(tmp_path / "two" / "train")
    _png_tree(tmp_path / "two" / "test", per_class=2)
    ds = load_dataset("imagefolder", data_dir=str(tmp_path / "two"), image_size=8, val_fraction=0.2)
    assert ds.input_shape == (3, 8, 8) and len(ds.test) == 6 and len(ds.train) + len(ds.val) == 18


def test_imagefolder_train_alone_and_train_val_test_trees(tmp_path, caplog):
    """train/ alone was read as a tree whose one class was 'train' (helper-36: loss 0, accuracy
    100 %); a val/ beside test/ was ignored. The folder names are public, and said so."""
    _png_tree(tmp_path / "alone" / "train")
    with caplog.at_level("WARNING", logger="pipelines.data.sources"):
        ds = load_dataset("imagefolder", data_dir=str(tmp_path / "alone"), test_fraction=0.2, val_fraction=0.1)
    assert ds.num_classes == 3 and sorted(set(ds.train.y.tolist())) == [0, 1, 2]
    assert len(ds.train) + len(ds.val) + len(ds.test) == 18 and len(ds.test) == 4
    assert "treated as public" in caplog.text
    for split, per_class in (("train", 6), ("val", 3), ("test", 2)):
        _png_tree(tmp_path / "three" / split, per_class=per_class)
    ds = load_dataset("imagefolder", data_dir=str(tmp_path / "three"), val_fraction=0.5)
    assert (len(ds.train), len(ds.val), len(ds.test)) == (18, 9, 6)
    assert "train/, val/ and test/" in ds.split_info["source"]
    _png_tree(tmp_path / "odd" / "train")
    _png_tree(tmp_path / "odd" / "val", classes=("ant", "bee"))
    _png_tree(tmp_path / "odd" / "test")
    with pytest.raises(dpcore.DPConfigError, match="different class folders"):
        load_dataset("imagefolder", data_dir=str(tmp_path / "odd"))


def test_an_imagefolder_class_named_train_is_a_class_and_split_folders_need_train(tmp_path):
    """helper-38: a class named 'train' (CIFAR-100 has one) made the tree read as split folders."""
    _png_tree(tmp_path / "vehicles", classes=("bus", "car", "train"))
    ds = load_dataset("imagefolder", data_dir=str(tmp_path / "vehicles"))
    assert ds.num_classes == 3 and len(ds.train) + len(ds.val) + len(ds.test) == 18
    _png_tree(tmp_path / "held-out-only" / "val")
    _png_tree(tmp_path / "held-out-only" / "test")
    with pytest.raises(dpcore.DPConfigError, match="has val/ and test/ but no train/ folder"):
        load_dataset("imagefolder", data_dir=str(tmp_path / "held-out-only"))


def test_imagefolder_says_which_files_it_leaves_out(tmp_path, caplog):
    """torchvision's ImageFolder drops files of extensions it does not read, silently (helper-36):
    a class folder of phone photos (.heic) beside .jpg ones trains on part of the data. The
    loader counts them by extension; hidden files are not counted."""
    _png_tree(tmp_path / "t")
    for name in ("a.HEIC", "b.heic", "notes.txt", "README"):
        (tmp_path / "t" / "bee" / name).write_bytes(b"not an image")
    (tmp_path / "t" / "cat" / "deep").mkdir()
    (tmp_path / "t" / "cat" / "deep" / "c.heic").write_bytes(b"not an image")
    (tmp_path / "t" / "ant" / ".DS_Store").write_bytes(b"finder")
    with caplog.at_level("WARNING", logger="pipelines.data.sources"):
        ds = load_dataset("imagefolder", data_dir=str(tmp_path / "t"))
    assert len(ds.train) + len(ds.val) + len(ds.test) == 18  # the PNGs only
    left_out = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(left_out) == 1 and "5 file(s)" in left_out[0], caplog.text
    assert "(.heic: 3, (none): 1, .txt: 1)" in left_out[0], left_out[0]
    _png_tree(tmp_path / "clean")
    caplog.clear()
    with caplog.at_level("WARNING", logger="pipelines.data.sources"):
        load_dataset("imagefolder", data_dir=str(tmp_path / "clean"))
    assert "left out" not in caplog.text


def test_an_imagefolder_tree_with_one_class_is_refused(tmp_path):
    _png_tree(tmp_path / "one", classes=("ant",))
    with pytest.raises(dpcore.DPConfigError, match=r"1 class folder\(s\) \(ant\).*two or more"):
        load_dataset("imagefolder", data_dir=str(tmp_path / "one"))


def test_generated_dataset_has_the_requested_size_and_is_learnable_signal():
    ds = load_dataset("generated", generated_size=500)
    assert len(ds.train) + len(ds.val) + len(ds.test) == 500 and ds.input_shape == (1, 8, 8)
    # Class means differ (a real signal): nearest-class-mean on train beats chance on test.
    assert ds.train.x.dtype == torch.uint8
    x_train, x_test = ds.inputs("train"), ds.inputs("test")
    means = torch.stack([x_train[ds.train.y == c].mean(0) for c in range(10)])
    pred = ((x_test[:, None] - means[None]) ** 2).flatten(2).sum(-1).argmin(1)
    assert (pred == ds.test.y).float().mean() > 0.5


@pytest.mark.parametrize(
    "name, shape",
    [
        ("mlp", (1, 8, 8)),
        ("small_cnn", (1, 8, 8)),
        ("cnn", (1, 28, 28)),
        ("resnet9", (3, 32, 32)),
        ("wrn16_4", (3, 32, 32)),
    ],
)
def test_every_model_passes_dpcore_validation_and_runs(name, shape):
    torch.manual_seed(0)
    model = build_model(name, shape, 10)
    dpcore.validate_model(model)
    assert model(torch.randn(2, *shape)).shape == (2, 10)
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def test_the_mnist_cnn_refuses_tiny_images_with_the_alternative():
    with pytest.raises(dpcore.DPConfigError, match="use model='small_cnn'"):
        build_model("cnn", (1, 8, 8), 10)


@pytest.mark.parametrize(
    "make", [lambda: resnet9((3, 8, 8), 4, width=4), lambda: wide_resnet((3, 8, 8), 4, depth=10, widen=1)]
)
def test_weight_standardised_groupnorm_nets_get_exact_per_example_gradients(make):
    """Weight standardisation makes the effective weight a function of the parameters; the
    vmap'd per-example gradient must still equal one backward per example."""
    torch.manual_seed(5)
    model = make().double()
    x = torch.randn(6, 3, 8, 8, dtype=torch.float64)
    y = torch.randint(0, 4, (6,))
    sums, _ = clipped_sum(PerSampleGradients(model, ce)(x, y), 0.5)
    ref = loop_clipped_sum(model, ce, x, y, 0.5)
    for (name, _), r in zip(model.named_parameters(), ref):
        # float64 throughout (the reference clips with dpcore's margin too).
        assert torch.allclose(sums[name], r, atol=1e-12, rtol=2e-6), name


def test_torchvision_models_need_their_batchnorm_replaced():
    with pytest.raises(dpcore.UnsupportedModuleError, match="BatchNorm"):
        dpcore.validate_model(build_model("tv:resnet18", (3, 32, 32), 10))
    dpcore.validate_model(build_model("tv:resnet18", (3, 32, 32), 10, replace_batchnorm=True))

"""Datasets as their distributors ship them.

* ``digits``: scikit-learn's bundled handwritten digits (1,797 real 8×8 images, 10 classes).
  It needs no network and is the embedded default.
* ``fashion-mnist``, ``mnist``: the IDX files, gzipped or not, from a flat folder (Debian's
  ``dataset-fashion-mnist`` installs them in ``/usr/share/datasets/fashion-mnist``) or from
  torchvision's layout (``ROOT/FashionMNIST/raw``). With no ``data_dir``, the standard install
  path is searched. ``download=True`` fetches them with torchvision where a network exists.
* ``cifar10``, ``cifar100``: the real ``torchvision.datasets`` loaders, read from ``data_dir``
  (the folder torchvision would download into), or downloaded there with ``download=True``.
* ``imagefolder``: any ``torchvision.datasets.ImageFolder`` tree under ``data_dir`` (one folder
  per class), e.g. ImageNet32-style data. Where every sub-folder is ``train/``, ``val/`` or
  ``test/``, they are the splits: with ``train/`` and one of the other two, that one is the test
  split and validation is carved out of ``train/``; with ``train/`` alone, or a tree of class
  folders (a class may be named ``train``), every split is carved out of the one tree. The
  class folders' names are treated as public (a warning says so).
* ``generated``: class-conditional Gaussian images of any size (``generated_size``), for scale
  tests. Drawn from a fixed public seed: synthetic, not private.

Images keep their own dtype (uint8 for every image dataset here; digits as uint8 counts 0–16).
They are turned into float32 and standardised per batch, on the training device, by the
dataset's :class:`Normalization` (the published per-channel mean and std where one exists).
These constants are public: nothing is computed from the private data.

The train/validation/test split is drawn once with a fixed, public seed (a data-independent
permutation, so it costs no privacy). The validation split is carved out of the training part
and never trained on.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch

from dpcore import DPConfigError

from ..catalog import DATASETS, TEXT_DATASETS
from .dataset import (
    Dataset,
    Normalization,
    Split,
    published_normalization,
    split_dataset,
    split_sizes,
    train_test_dataset,
    with_sizes,
)
from .idx import IDX_DATASETS, find_idx_files, read_idx_split

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------
def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits: (images [1797, 8, 8] of counts 0..16, labels), read from the
    package's ``datasets/data/digits.csv.gz`` as ``sklearn.datasets.load_digits`` reads it, but
    without importing scikit-learn (1.1 s of every digits run's start on 2 cores, for one file);
    through ``load_digits`` where the file is not found there."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")  # a top-level package: located, not imported
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz" if spec else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits as sk_load_digits

        raw = sk_load_digits()
        return raw.images, raw.target
    data = np.loadtxt(path, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


def load_digits(test_fraction: float = 0.2, val_fraction: float = 0.1, split_seed: int = 0, **_) -> Dataset:
    images, target = digits_arrays()
    x = torch.tensor(images, dtype=torch.uint8).unsqueeze(1)  # [N, 1, 8, 8], counts 0..16
    y = torch.tensor(target, dtype=torch.long)
    return split_dataset(
        "digits", x, y, 10, test_fraction, val_fraction, split_seed, normalization=Normalization(1.0 / 16.0)
    )


GENERATED_SEED = 1234
_GENERATED_CHUNK = 65_536
_GENERATED_GAIN = 24.0  # uint8 value = 128 + 24·(prototype + 1.5·noise), rounded and clamped


def load_generated(
    generated_size: int = 10_000,
    num_classes: int = 10,
    image_shape: tuple[int, ...] = (1, 8, 8),
    test_fraction: float = 0.2,
    val_fraction: float = 0.1,
    split_seed: int = 0,
    image_size: int | None = None,
    generated_channels: int = 1,
    **_,
) -> Dataset:
    """``generated_size`` uint8 images: a random prototype per class plus Gaussian noise, from a
    fixed public seed. ``image_size`` makes them C×S×S (default 1×8×8; ``generated_channels``
    sets C). The examples are i.i.d., so the splits are consecutive ranges; they are drawn in
    chunks straight into uint8, so a million 3×32×32 images take 3 GB, not 12."""
    if image_size:
        image_shape = (int(generated_channels), int(image_size), int(image_size))
    if isinstance(generated_size, bool) or not isinstance(generated_size, int) or generated_size < 10:
        raise DPConfigError(f"generated_size={generated_size!r} is invalid: it must be an integer ≥ 10.")
    n_train, n_val, n_test = split_sizes("generated", generated_size, test_fraction, val_fraction)
    g = torch.Generator().manual_seed(GENERATED_SEED)
    shape = tuple(int(s) for s in image_shape)
    prototypes = torch.randn((num_classes,) + shape, generator=g)
    y = torch.randint(0, num_classes, (generated_size,), generator=g)
    x = torch.empty((generated_size,) + shape, dtype=torch.uint8)
    for lo in range(0, generated_size, _GENERATED_CHUNK):
        hi = min(lo + _GENERATED_CHUNK, generated_size)
        noise = torch.randn((hi - lo,) + shape, generator=g)
        x[lo:hi] = (
            (128.0 + _GENERATED_GAIN * (prototypes[y[lo:hi]] + 1.5 * noise)).round_().clamp_(0, 255).to(torch.uint8)
        )
    info = {
        "source": "generated (i.i.d.)",
        "test_fraction": test_fraction,
        "val_fraction": val_fraction,
        "seed": GENERATED_SEED,
    }
    cut = (slice(0, n_train), slice(n_train, n_train + n_val), slice(n_train + n_val, generated_size))
    return Dataset(
        "generated",
        *(Split(x[s], y[s]) for s in cut),
        num_classes,
        shape,
        with_sizes(info, n_train, n_val, n_test),
        Normalization(1.0 / 255.0, (128.0 / 255.0,), (_GENERATED_GAIN / 255.0,)),  # back to prototype + noise
    )


def _require_dir(name: str, data_dir: str | None, download: bool) -> Path:
    if not data_dir:
        raise DPConfigError(
            f"dataset={name!r} needs data_dir: the folder that holds it (torchvision's layout), "
            f"e.g. --data-dir ~/data; add --download to fetch it there where a network exists."
        )
    path = Path(os.path.expanduser(data_dir))
    if download:
        path.mkdir(parents=True, exist_ok=True)
    elif path.exists() and not path.is_dir():
        raise DPConfigError(
            f"data_dir={data_dir!r} is a file, not a folder. Point --data-dir to the folder that holds {name}."
        )
    elif not path.is_dir():
        raise DPConfigError(
            f"data_dir={data_dir!r} does not exist. Point --data-dir to the folder that holds {name} "
            "(torchvision's layout), or add --download to fetch it there."
        )
    return path


_TORCHVISION = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST", "cifar10": "CIFAR10", "cifar100": "CIFAR100"}


def load_idx(
    name: str, data_dir: str | None = None, download: bool = False, val_fraction: float = 0.1, split_seed: int = 0, **_
) -> Dataset:
    """MNIST or Fashion-MNIST from IDX files as shipped (see :mod:`pipelines.data.idx`)."""
    if download:
        import torchvision

        root = _require_dir(name, data_dir, download=True)
        getattr(torchvision.datasets, _TORCHVISION[name])(root=str(root), train=True, download=True)
        getattr(torchvision.datasets, _TORCHVISION[name])(root=str(root), train=False, download=True)
    files = find_idx_files(name, data_dir)
    train, test = read_idx_split(*files["train"]), read_idx_split(*files["test"])
    if train[0].shape[1:] != test[0].shape[1:]:
        raise DPConfigError(
            f"{files['train'][0]} holds images of {tuple(train[0].shape[2:])} but {files['test'][0]} of "
            f"{tuple(test[0].shape[2:])}."
        )
    source = {"files": {split: [str(p) for p in pair] for split, pair in files.items()}}
    norm = published_normalization(name)
    return train_test_dataset(name, train, test, 10, val_fraction, split_seed, normalization=norm, source=source)


def load_torchvision(
    name: str, data_dir: str | None = None, download: bool = False, val_fraction: float = 0.1, split_seed: int = 0, **_
) -> Dataset:
    import torchvision

    root = _require_dir(name, data_dir, download)
    cls = getattr(torchvision.datasets, _TORCHVISION[name])
    try:
        train = cls(root=str(root), train=True, download=download)
        test = cls(root=str(root), train=False, download=download)
    except RuntimeError as e:  # torchvision: "Dataset not found or corrupted. You can use download=True ..."
        raise DPConfigError(
            f"{name} was not found under data_dir={str(root)!r} ({e}). Put torchvision's files there, or add --download."
        ) from None

    def tensors(ds):
        data = ds.data if isinstance(ds.data, torch.Tensor) else torch.from_numpy(np.asarray(ds.data))
        x = data.to(torch.uint8)
        x = x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2)  # [N,H,W] or [N,H,W,C] -> [N,C,H,W]
        return x.contiguous(), torch.as_tensor(np.asarray(ds.targets), dtype=torch.long)

    norm = published_normalization(name)
    return train_test_dataset(
        name, tensors(train), tensors(test), len(train.classes), val_fraction, split_seed, normalization=norm
    )


def load_imagefolder(
    data_dir: str | None = None,
    image_size: int | None = None,
    test_fraction: float = 0.2,
    val_fraction: float = 0.1,
    split_seed: int = 0,
    **_,
) -> Dataset:
    import torchvision
    from torchvision.transforms import v2

    root = _require_dir("imagefolder", data_dir, download=False)
    steps = [v2.Resize((image_size, image_size), antialias=True)] if image_size else []
    tf = v2.Compose([v2.PILToTensor(), *steps])  # uint8 [C, H, W]

    def load(folder: Path):
        try:
            ds = torchvision.datasets.ImageFolder(str(folder), transform=tf)
        except (FileNotFoundError, RuntimeError) as e:
            raise DPConfigError(
                f"{folder} is not an ImageFolder tree (one sub-folder of images per class): {e}"
            ) from None
        _warn_skipped_files(folder, ds.classes)
        xs, ys = zip(*(ds[i] for i in range(len(ds))))
        shapes = {tuple(x.shape) for x in xs}
        if len(shapes) > 1:
            raise DPConfigError(
                f"images under {folder} have different sizes {sorted(shapes)[:3]}…; pass --image-size to resize them."
            )
        return torch.stack(xs), torch.tensor(ys, dtype=torch.long), ds.classes

    norm = Normalization(1.0 / 255.0)  # pixels to [0, 1]: a fixed public scale, no statistic of the private images
    # Split folders only where every sub-folder is one (a tree of classes may have a class 'train').
    subfolders = {d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")}
    found = {d: root / d for d in SPLIT_FOLDERS if d in subfolders} if subfolders <= set(SPLIT_FOLDERS) else {}
    if found and "train" not in found:
        raise DPConfigError(
            f"{root} has {' and '.join(f'{d}/' for d in found)} but no train/ folder: give the training images in "
            "train/ (one sub-folder per class), or a tree of class folders without split folders."
        )
    if not found:  # one tree, one sub-folder per class: every split is carved out of it
        x, y, classes = _classes_checked(root, *load(root))
        return split_dataset(
            "imagefolder", x, y, len(classes), test_fraction, val_fraction, split_seed, normalization=norm
        )
    *train, classes = _classes_checked(found["train"], *load(found["train"]))

    def same_classes(folder: Path):
        *xy, other = load(folder)
        if other != classes:
            raise DPConfigError(f"{found['train']} and {folder} have different class folders.")
        return xy

    if "val" in found and "test" in found:  # the tree's own three splits, as given
        (x_tr, y_tr), (x_va, y_va), (x_te, y_te) = train, same_classes(found["val"]), same_classes(found["test"])
        info = {"source": "the tree's train/, val/ and test/ folders"}
        return Dataset(
            "imagefolder",
            Split(x_tr, y_tr),
            Split(x_va, y_va),
            Split(x_te, y_te),
            len(classes),
            tuple(x_tr.shape[1:]),
            with_sizes(info, len(y_tr), len(y_va), len(y_te)),
            normalization=norm,
        )
    if "val" in found or "test" in found:  # train/ and one held-out folder: its test split; validation from train/
        test = same_classes(found.get("test", found.get("val")))
        return train_test_dataset(
            "imagefolder", train, test, len(classes), val_fraction, split_seed, normalization=norm
        )
    # train/ alone: it is the one tree (its class folders are the classes, not 'train' itself)
    return split_dataset(
        "imagefolder", *train, len(classes), test_fraction, val_fraction, split_seed, normalization=norm
    )


SPLIT_FOLDERS = ("train", "val", "test")
IMAGE_FOLDER_NAMES = (
    "the class list is the tree's sub-folder names, treated as public: their number sets the model's head, which "
    "is logged with the model. If the folders were made from the labels (one per label found), one rare example "
    "can add a class."
)


def _warn_skipped_files(folder: Path, classes: list[str]) -> dict[str, int]:
    """Say how many files under the class folders torchvision's ImageFolder leaves out (an
    extension it does not read as an image: ``.heic``, ``.txt``, ``.webm``...), which it does
    without a word; hidden files (``.DS_Store``) are not counted. Returns {extension: count}."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    skipped: dict[str, int] = {}
    for name in classes:
        for _, dirnames, files in os.walk(folder / name, followlinks=True):  # as ImageFolder walks
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for f in files:
                if not f.startswith(".") and not f.lower().endswith(IMG_EXTENSIONS):
                    ext = os.path.splitext(f)[1].lower() or "(none)"
                    skipped[ext] = skipped.get(ext, 0) + 1
    if skipped:
        listed = ", ".join(f"{ext}: {n}" for ext, n in sorted(skipped.items(), key=lambda kv: (-kv[1], kv[0])))
        log.warning(
            "%s: %d file(s) in the class folders are not images that torchvision reads, and are left out of the "
            "dataset (%s). Convert them (readable: %s) or remove them to silence this.",
            folder,
            sum(skipped.values()),
            listed,
            " ".join(IMG_EXTENSIONS),
        )
    return skipped


def _classes_checked(folder: Path, x, y, classes: list[str]):
    if len(classes) < 2:
        raise DPConfigError(
            f"{folder} has {len(classes)} class folder(s) ({', '.join(classes) or 'none'}); an ImageFolder tree needs "
            "one sub-folder of images per class, two or more (train/ and test/ folders may hold them)."
        )
    log.warning("%s: %s", folder, IMAGE_FOLDER_NAMES)
    return x, y, classes


def load_dataset(name: str, **kwargs) -> Dataset:
    """Load ``name`` (see :data:`DATASETS`). Raises :class:`DPConfigError` with a fix on bad input."""
    if name == "digits":
        return load_digits(**kwargs)
    if name == "generated":
        return load_generated(**kwargs)
    if name in IDX_DATASETS:
        return load_idx(name, **kwargs)
    if name in _TORCHVISION:
        return load_torchvision(name, **kwargs)
    if name == "imagefolder":
        return load_imagefolder(**kwargs)
    if name in TEXT_DATASETS:
        from ..text.sources import load_text_dataset

        return load_text_dataset(name, **kwargs)
    raise DPConfigError(f"dataset={name!r} is unknown; available: {', '.join(DATASETS)}.")


SOURCE_OPTIONS = (
    "data_dir", "download", "image_size", "generated_size", "val_fraction", "test_fraction", "split_seed", "max_length",
    "email_view", "text_classes",
)  # fmt: skip


def load_configured(cfg) -> Dataset:
    """:func:`load_dataset` for a run's config (any object with ``dataset`` and the
    :data:`SOURCE_OPTIONS` as attributes: a training or a federated config)."""
    return load_dataset(cfg.dataset, model=getattr(cfg, "model", ""), **{k: getattr(cfg, k) for k in SOURCE_OPTIONS})

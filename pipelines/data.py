"""Datasets for the training job.

* ``digits``: scikit-learn's bundled handwritten digits (1,797 real 8×8 images, 10 classes).
  It needs no network and is the embedded default.
* ``mnist``, ``fashion-mnist``, ``cifar10``, ``cifar100``: the real ``torchvision.datasets``
  loaders, read from ``data_dir`` (the folder torchvision would download into), or
  downloaded there when ``download=True`` and a network exists.
* ``imagefolder``: any ``torchvision.datasets.ImageFolder`` tree under ``data_dir`` (one
  folder per class), e.g. ImageNet32-style data. If ``data_dir`` has ``train/`` and
  ``test/`` (or ``val/``) subfolders those are used as the split; otherwise the test split is
  carved out of the one tree.
* ``generated``: class-conditional Gaussian images of any size (``generated_size``) for
  scale tests. Drawn from a fixed public seed; it is synthetic, not private.

Images become float32 tensors [N, C, H, W], scaled to [0, 1] and standardised per channel
with the dataset's published mean and std (where one exists). The train/validation/test
split is drawn once with a fixed, public seed (a data-independent permutation, so it costs
no privacy). The validation split is carved out of the training part and never trained on.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dpcore import DPConfigError

DATASETS = ("digits", "mnist", "fashion-mnist", "cifar10", "cifar100", "imagefolder", "generated")
NEEDS_DATA_DIR = ("mnist", "fashion-mnist", "cifar10", "cifar100", "imagefolder")

# (mean, std) per channel of the training images in [0, 1]: the commonly published values.
_NORMALISATION = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}


@dataclass(frozen=True)
class Split:
    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return int(self.x.shape[0])


@dataclass(frozen=True)
class Dataset:
    name: str
    train: Split
    val: Split
    test: Split
    num_classes: int
    input_shape: tuple[int, ...]
    split_info: dict = field(default_factory=dict)  # how the splits were made (logged to MLflow)


def _check_fractions(test_fraction: float, val_fraction: float) -> None:
    for v, n in ((test_fraction, "test_fraction"), (val_fraction, "val_fraction")):
        if not (0.0 <= v < 1.0):
            raise DPConfigError(f"{n}={v!r} is invalid: it must lie in [0, 1).")
    if test_fraction + val_fraction >= 1.0:
        raise DPConfigError(
            f"test_fraction + val_fraction = {test_fraction + val_fraction} leaves no training data; keep the sum below 1."
        )


def _permutation(n: int, split_seed: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(split_seed))


def _split(name, x, y, num_classes, test_fraction, val_fraction, split_seed) -> Dataset:
    """One pool of labelled data → train/val/test by a public permutation."""
    _check_fractions(test_fraction, val_fraction)
    n = x.shape[0]
    perm = _permutation(n, split_seed)
    n_test = int(round(n * test_fraction))
    n_val = int(round(n * val_fraction))
    test_idx, val_idx, train_idx = perm[:n_test], perm[n_test : n_test + n_val], perm[n_test + n_val :]
    if len(train_idx) == 0:
        raise DPConfigError(f"the dataset {name!r} has no training examples after the split (N={n}).")
    info = {"source": "one pool", "test_fraction": test_fraction, "val_fraction": val_fraction, "split_seed": split_seed}
    return Dataset(
        name,
        Split(x[train_idx], y[train_idx]),
        Split(x[val_idx], y[val_idx]),
        Split(x[test_idx], y[test_idx]),
        num_classes,
        tuple(x.shape[1:]),
        _with_sizes(info, len(train_idx), len(val_idx), len(test_idx)),
    )


def _train_test(name, x_tr, y_tr, x_te, y_te, num_classes, val_fraction, split_seed) -> Dataset:
    """A dataset with its own test set: validation is carved out of the training set."""
    _check_fractions(0.0, val_fraction)
    n = x_tr.shape[0]
    perm = _permutation(n, split_seed)
    n_val = int(round(n * val_fraction))
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    info = {"source": "official train/test", "val_fraction": val_fraction, "split_seed": split_seed}
    return Dataset(
        name,
        Split(x_tr[train_idx], y_tr[train_idx]),
        Split(x_tr[val_idx], y_tr[val_idx]),
        Split(x_te, y_te),
        num_classes,
        tuple(x_tr.shape[1:]),
        _with_sizes(info, len(train_idx), len(val_idx), int(x_te.shape[0])),
    )


def _with_sizes(info: dict, n_train: int, n_val: int, n_test: int) -> dict:
    return {**info, "train_examples": n_train, "val_examples": n_val, "test_examples": n_test}


def _standardise(x: torch.Tensor, name: str) -> torch.Tensor:
    if name not in _NORMALISATION:
        return x
    mean, std = (torch.tensor(v, dtype=torch.float32).view(1, -1, 1, 1) for v in _NORMALISATION[name])
    return (x - mean) / std


# ------------------------------------------------------------------------------------------
def load_digits(test_fraction: float = 0.2, val_fraction: float = 0.1, split_seed: int = 0, **_) -> Dataset:
    from sklearn.datasets import load_digits as sk_load_digits

    raw = sk_load_digits()
    x = torch.tensor(raw.images / 16.0, dtype=torch.float32).unsqueeze(1)  # [N, 1, 8, 8] in [0, 1]
    y = torch.tensor(raw.target, dtype=torch.long)
    return _split("digits", x, y, 10, test_fraction, val_fraction, split_seed)


def load_generated(
    generated_size: int = 10_000,
    num_classes: int = 10,
    image_shape: tuple[int, ...] = (1, 8, 8),
    test_fraction: float = 0.2,
    val_fraction: float = 0.1,
    split_seed: int = 0,
    image_size: int | None = None,
    **_,
) -> Dataset:
    """``generated_size`` images: a random prototype per class plus Gaussian noise (public seed).
    ``image_size`` makes them 1×S×S (default 1×8×8)."""
    if image_size:
        image_shape = (1, int(image_size), int(image_size))
    if isinstance(generated_size, bool) or not isinstance(generated_size, int) or generated_size < 10:
        raise DPConfigError(f"generated_size={generated_size!r} is invalid: it must be an integer ≥ 10.")
    g = torch.Generator().manual_seed(1234)
    shape = tuple(int(s) for s in image_shape)
    prototypes = torch.randn((num_classes,) + shape, generator=g)
    y = torch.randint(0, num_classes, (generated_size,), generator=g)
    x = prototypes[y] + 1.5 * torch.randn((generated_size,) + shape, generator=g)
    return _split("generated", x.float(), y, num_classes, test_fraction, val_fraction, split_seed)


def _require_dir(name: str, data_dir: str | None, download: bool) -> Path:
    if not data_dir:
        raise DPConfigError(
            f"dataset={name!r} needs data_dir: the folder that holds it (torchvision's layout), "
            f"e.g. --data-dir ~/data; add --download to fetch it there where a network exists."
        )
    path = Path(os.path.expanduser(data_dir))
    if download:
        path.mkdir(parents=True, exist_ok=True)
    elif not path.is_dir():
        raise DPConfigError(
            f"data_dir={data_dir!r} does not exist. Point --data-dir to the folder that holds {name} "
            "(torchvision's layout), or add --download to fetch it there."
        )
    return path


_TORCHVISION = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST", "cifar10": "CIFAR10", "cifar100": "CIFAR100"}


def load_torchvision(name: str, data_dir: str | None = None, download: bool = False, val_fraction: float = 0.1, split_seed: int = 0, **_) -> Dataset:
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
        x = data.float().div(255.0)
        x = x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2)  # MNIST [N,H,W]; CIFAR [N,H,W,C]
        return _standardise(x.contiguous(), name), torch.as_tensor(np.asarray(ds.targets), dtype=torch.long)

    x_tr, y_tr = tensors(train)
    x_te, y_te = tensors(test)
    return _train_test(name, x_tr, y_tr, x_te, y_te, len(train.classes), val_fraction, split_seed)


def load_imagefolder(
    data_dir: str | None = None, image_size: int | None = None, test_fraction: float = 0.2, val_fraction: float = 0.1, split_seed: int = 0, **_
) -> Dataset:
    import torchvision
    from torchvision import transforms

    root = _require_dir("imagefolder", data_dir, download=False)
    steps = [transforms.Resize((image_size, image_size))] if image_size else []
    tf = transforms.Compose(steps + [transforms.ToTensor()])

    def load(folder: Path):
        try:
            ds = torchvision.datasets.ImageFolder(str(folder), transform=tf)
        except (FileNotFoundError, RuntimeError) as e:
            raise DPConfigError(f"{folder} is not an ImageFolder tree (one sub-folder of images per class): {e}") from None
        xs, ys = zip(*(ds[i] for i in range(len(ds))))
        shapes = {tuple(x.shape) for x in xs}
        if len(shapes) > 1:
            raise DPConfigError(f"images under {folder} have different sizes {sorted(shapes)[:3]}…; pass --image-size to resize them.")
        return torch.stack(xs), torch.tensor(ys, dtype=torch.long), ds.classes

    test_dir = next((root / d for d in ("test", "val") if (root / d).is_dir()), None)
    if (root / "train").is_dir() and test_dir is not None:
        x_tr, y_tr, classes = load(root / "train")
        x_te, y_te, test_classes = load(test_dir)
        if test_classes != classes:
            raise DPConfigError(f"{root}/train and {test_dir} have different class folders.")
        return _train_test("imagefolder", x_tr, y_tr, x_te, y_te, len(classes), val_fraction, split_seed)
    x, y, classes = load(root)
    return _split("imagefolder", x, y, len(classes), test_fraction, val_fraction, split_seed)


def load_dataset(name: str, **kwargs) -> Dataset:
    """Load ``name`` (see :data:`DATASETS`). Raises :class:`DPConfigError` with a fix on bad input."""
    if name == "digits":
        return load_digits(**kwargs)
    if name == "generated":
        return load_generated(**kwargs)
    if name in _TORCHVISION:
        return load_torchvision(name, **kwargs)
    if name == "imagefolder":
        return load_imagefolder(**kwargs)
    raise DPConfigError(f"dataset={name!r} is unknown; available: {', '.join(DATASETS)}.")

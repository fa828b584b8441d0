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
  per class), e.g. ImageNet32-style data. If ``data_dir`` has ``train/`` and ``test/`` (or
  ``val/``) subfolders those are used as the split; otherwise the test split is carved out of
  the one tree.
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

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dpcore import DPConfigError

from .idx import IDX_DATASETS, find_idx_files, read_idx_split

DATASETS = ("digits", "mnist", "fashion-mnist", "cifar10", "cifar100", "imagefolder", "generated")
NEEDS_DATA_DIR = ("cifar10", "cifar100", "imagefolder")  # mnist and fashion-mnist have a standard path
USES_DATA_DIR = NEEDS_DATA_DIR + tuple(IDX_DATASETS)

# (mean, std) per channel of the training images in [0, 1]: the commonly published values.
_PUBLISHED = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}


@dataclass(frozen=True)
class Normalization:
    """Stored values → model input: ``(x · scale − mean) / std`` per channel, in float32.

    Applied per batch on the training device (one fused multiply-add). Every constant is public
    (a published statistic or a fixed scale), never computed from the private data."""

    scale: float = 1.0
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)

    def coefficients(self, channels: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, b), each of ``channels`` values (1 if the constants are shared), with
        input = x·a + b per channel."""
        mean = torch.tensor(self.mean, dtype=torch.float64)
        std = torch.tensor(self.std, dtype=torch.float64)
        if len(mean) != 1 and len(mean) != channels:
            raise DPConfigError(
                f"the normalization has {len(mean)} channel constants but the data has {channels} channels."
            )
        return (self.scale / std).float().to(device), (-mean / std).float().to(device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The model input for stored values ``x`` [B, C, ...] (any device; a new float32 tensor)."""
        c = x.shape[1] if len(self.mean) > 1 else 1
        a, b = self.coefficients(c, x.device)
        view = (1, c) + (1,) * (x.ndim - 2)
        return torch.addcmul(b.view(view), x.to(torch.float32), a.view(view))

    def to_dict(self) -> dict:
        return {"scale": self.scale, "mean": list(self.mean), "std": list(self.std)}

    @classmethod
    def from_dict(cls, d: dict | None) -> Normalization:
        if not d:
            return cls()
        return cls(float(d["scale"]), tuple(float(v) for v in d["mean"]), tuple(float(v) for v in d["std"]))


@dataclass(frozen=True)
class Split:
    """Stored examples (``x`` in the dataset's own dtype) and int64 labels."""

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
    normalization: Normalization = field(default_factory=Normalization)
    source: dict = field(default_factory=dict)  # where the data came from (files, sizes), for the manifest

    def with_train_subset(self, k: int) -> Dataset:
        """Only the first ``k`` training examples. The training split is already in a public
        random order (a data-independent permutation), so they are a uniform random subset,
        chosen without looking at the data; validation and test are unchanged."""
        if not k or k >= len(self.train):
            return self
        import dataclasses

        info = {**self.split_info, "train_subset": k, "train_examples": k}
        return dataclasses.replace(self, train=Split(self.train.x[:k], self.train.y[:k]), split_info=info)

    def inputs(self, split: str) -> torch.Tensor:
        """The model inputs of a whole split (float32, normalised): for small data and tests."""
        return self.normalization(getattr(self, split).x)


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


def _with_sizes(info: dict, n_train: int, n_val: int, n_test: int) -> dict:
    return {**info, "train_examples": n_train, "val_examples": n_val, "test_examples": n_test}


def _split(name, x, y, num_classes, test_fraction, val_fraction, split_seed, **extra) -> Dataset:
    """One pool of labelled data → train/val/test by a public permutation."""
    _check_fractions(test_fraction, val_fraction)
    n = x.shape[0]
    perm = _permutation(n, split_seed)
    n_test = int(round(n * test_fraction))
    n_val = int(round(n * val_fraction))
    test_idx, val_idx, train_idx = perm[:n_test], perm[n_test : n_test + n_val], perm[n_test + n_val :]
    if len(train_idx) == 0:
        raise DPConfigError(f"the dataset {name!r} has no training examples after the split (N={n}).")
    info = {
        "source": "one pool",
        "test_fraction": test_fraction,
        "val_fraction": val_fraction,
        "split_seed": split_seed,
    }
    return Dataset(
        name,
        Split(x[train_idx], y[train_idx]),
        Split(x[val_idx], y[val_idx]),
        Split(x[test_idx], y[test_idx]),
        num_classes,
        tuple(x.shape[1:]),
        _with_sizes(info, len(train_idx), len(val_idx), len(test_idx)),
        **extra,
    )


def _train_test(name, x_tr, y_tr, x_te, y_te, num_classes, val_fraction, split_seed, **extra) -> Dataset:
    """A dataset with its own test set: validation is carved out of the training set."""
    _check_fractions(0.0, val_fraction)
    n = x_tr.shape[0]
    perm = _permutation(n, split_seed)
    n_val = int(round(n * val_fraction))
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    if len(train_idx) == 0:
        raise DPConfigError(f"the dataset {name!r} has no training examples after carving out validation (N={n}).")
    info = {"source": "official train/test", "val_fraction": val_fraction, "split_seed": split_seed}
    return Dataset(
        name,
        Split(x_tr[train_idx], y_tr[train_idx]),
        Split(x_tr[val_idx], y_tr[val_idx]),
        Split(x_te, y_te),
        num_classes,
        tuple(x_tr.shape[1:]),
        _with_sizes(info, len(train_idx), len(val_idx), int(x_te.shape[0])),
        **extra,
    )


def _published(name: str) -> Normalization:
    mean, std = _PUBLISHED[name]
    return Normalization(1.0 / 255.0, mean, std)


# ------------------------------------------------------------------------------------------
def load_digits(test_fraction: float = 0.2, val_fraction: float = 0.1, split_seed: int = 0, **_) -> Dataset:
    from sklearn.datasets import load_digits as sk_load_digits

    raw = sk_load_digits()
    x = torch.tensor(raw.images, dtype=torch.uint8).unsqueeze(1)  # [N, 1, 8, 8], counts 0..16
    y = torch.tensor(raw.target, dtype=torch.long)
    return _split("digits", x, y, 10, test_fraction, val_fraction, split_seed, normalization=Normalization(1.0 / 16.0))


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
    _check_fractions(test_fraction, val_fraction)
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
    n_test = int(round(generated_size * test_fraction))
    n_val = int(round(generated_size * val_fraction))
    n_train = generated_size - n_test - n_val
    if n_train <= 0:
        raise DPConfigError(f"the dataset 'generated' has no training examples after the split (N={generated_size}).")
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
        _with_sizes(info, n_train, n_val, n_test),
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
    x_tr, y_tr = read_idx_split(*files["train"])
    x_te, y_te = read_idx_split(*files["test"])
    if x_tr.shape[1:] != x_te.shape[1:]:
        raise DPConfigError(
            f"{files['train'][0]} holds images of {tuple(x_tr.shape[2:])} but {files['test'][0]} of {tuple(x_te.shape[2:])}."
        )
    source = {"files": {split: [str(p) for p in pair] for split, pair in files.items()}}
    return _train_test(
        name, x_tr, y_tr, x_te, y_te, 10, val_fraction, split_seed, normalization=_published(name), source=source
    )


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

    x_tr, y_tr = tensors(train)
    x_te, y_te = tensors(test)
    return _train_test(
        name, x_tr, y_tr, x_te, y_te, len(train.classes), val_fraction, split_seed, normalization=_published(name)
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
        xs, ys = zip(*(ds[i] for i in range(len(ds))))
        shapes = {tuple(x.shape) for x in xs}
        if len(shapes) > 1:
            raise DPConfigError(
                f"images under {folder} have different sizes {sorted(shapes)[:3]}…; pass --image-size to resize them."
            )
        return torch.stack(xs), torch.tensor(ys, dtype=torch.long), ds.classes

    norm = Normalization(1.0 / 255.0)  # pixels to [0, 1]: a fixed public scale, no statistic of the private images
    test_dir = next((root / d for d in ("test", "val") if (root / d).is_dir()), None)
    if (root / "train").is_dir() and test_dir is not None:
        x_tr, y_tr, classes = load(root / "train")
        x_te, y_te, test_classes = load(test_dir)
        if test_classes != classes:
            raise DPConfigError(f"{root}/train and {test_dir} have different class folders.")
        return _train_test(
            "imagefolder", x_tr, y_tr, x_te, y_te, len(classes), val_fraction, split_seed, normalization=norm
        )
    x, y, classes = load(root)
    return _split("imagefolder", x, y, len(classes), test_fraction, val_fraction, split_seed, normalization=norm)


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
    raise DPConfigError(f"dataset={name!r} is unknown; available: {', '.join(DATASETS)}.")


SOURCE_OPTIONS = (
    "data_dir", "download", "image_size", "generated_size", "val_fraction", "test_fraction", "split_seed",
)  # fmt: skip


def load_configured(cfg) -> Dataset:
    """:func:`load_dataset` for a run's config (any object with ``dataset`` and the
    :data:`SOURCE_OPTIONS` as attributes: a training or a federated config)."""
    return load_dataset(cfg.dataset, **{k: getattr(cfg, k) for k in SOURCE_OPTIONS})

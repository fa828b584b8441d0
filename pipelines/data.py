"""Datasets for the training job.

``digits`` is scikit-learn's bundled handwritten-digits set (1,797 real 8×8 images, 10
classes). It needs no network and is the embedded default.

The train/validation/test split is drawn once with a fixed, public seed (a data-independent
permutation, so it costs no privacy). The validation split is carved out of the training
part and never trained on.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dpcore import DPConfigError

DATASETS = ("digits",)


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


def load_digits(test_fraction: float = 0.2, val_fraction: float = 0.1, split_seed: int = 0) -> Dataset:
    from sklearn.datasets import load_digits as sk_load_digits

    raw = sk_load_digits()
    x = torch.tensor(raw.images / 16.0, dtype=torch.float32).unsqueeze(1)  # [N, 1, 8, 8] in [0, 1]
    y = torch.tensor(raw.target, dtype=torch.long)
    return _split("digits", x, y, 10, test_fraction, val_fraction, split_seed)


def _split(name, x, y, num_classes, test_fraction, val_fraction, split_seed) -> Dataset:
    for v, n in ((test_fraction, "test_fraction"), (val_fraction, "val_fraction")):
        if not (0.0 <= v < 1.0):
            raise DPConfigError(f"{n}={v!r} is invalid: it must lie in [0, 1).")
    if test_fraction + val_fraction >= 1.0:
        raise DPConfigError(
            f"test_fraction + val_fraction = {test_fraction + val_fraction} leaves no training data; keep the sum below 1."
        )
    n = x.shape[0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(split_seed))
    n_test = int(round(n * test_fraction))
    n_val = int(round(n * val_fraction))
    test_idx, val_idx, train_idx = perm[:n_test], perm[n_test : n_test + n_val], perm[n_test + n_val :]
    if len(train_idx) == 0:
        raise DPConfigError(f"the dataset {name!r} has no training examples after the split (N={n}).")
    return Dataset(
        name,
        Split(x[train_idx], y[train_idx]),
        Split(x[val_idx], y[val_idx]),
        Split(x[test_idx], y[test_idx]),
        num_classes,
        tuple(x.shape[1:]),
    )


def load_dataset(name: str, **kwargs) -> Dataset:
    if name == "digits":
        return load_digits(**kwargs)
    raise DPConfigError(f"dataset={name!r} is unknown; available: {', '.join(DATASETS)}.")

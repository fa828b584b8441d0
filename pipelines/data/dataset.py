"""A loaded dataset: its splits, its public normalisation, and the public split permutation.

The train/validation/test split is drawn once with a fixed, public seed (a data-independent
permutation, so it costs no privacy). The validation split is carved out of the training part
and never trained on. Normalisation constants are public (published per-channel mean and std
where one exists): nothing is computed from the private data.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from dpcore import DPConfigError

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
    tokens: bool = False  # token ids (text): passed on as int64, not scaled

    def coefficients(self, channels: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, b), each of ``channels`` values (1 if the constants are shared), with
        input = x·a + b per channel. Made once per device and kept: built on the host and
        moved at every batch, they were two blocking copies (host syncs on a GPU) a step."""
        return _coefficients(self, channels, None if device is None else torch.device(device))

    def _make_coefficients(self, channels: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        mean = torch.tensor(self.mean, dtype=torch.float64)
        std = torch.tensor(self.std, dtype=torch.float64)
        if len(mean) != 1 and len(mean) != channels:
            raise DPConfigError(
                f"the normalization has {len(mean)} channel constants but the data has {channels} channels."
            )
        return (self.scale / std).float().to(device), (-mean / std).float().to(device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The model input for stored values ``x`` [B, C, ...] (any device; a new float32 tensor;
        token ids as int64)."""
        if self.tokens:
            return x.to(torch.long)
        c = x.shape[1] if len(self.mean) > 1 else 1
        a, b = self.coefficients(c, x.device)
        view = (1, c) + (1,) * (x.ndim - 2)
        return torch.addcmul(b.view(view), x.to(torch.float32), a.view(view))

    def to_dict(self) -> dict:
        d = {"scale": self.scale, "mean": list(self.mean), "std": list(self.std)}
        return {**d, "tokens": True} if self.tokens else d  # image manifests keep their keys

    @classmethod
    def from_dict(cls, d: dict | None) -> Normalization:
        if not d:
            return cls()
        mean, std = tuple(float(v) for v in d["mean"]), tuple(float(v) for v in d["std"])
        return cls(float(d["scale"]), mean, std, bool(d.get("tokens", False)))


@functools.lru_cache(maxsize=64)
def _coefficients(norm: Normalization, channels: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return norm._make_coefficients(channels, device)


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


def check_fractions(test_fraction: float, val_fraction: float) -> None:
    for v, n in ((test_fraction, "test_fraction"), (val_fraction, "val_fraction")):
        if not (0.0 <= v < 1.0):
            raise DPConfigError(f"{n}={v!r} is invalid: it must lie in [0, 1).")
    if test_fraction + val_fraction >= 1.0:
        raise DPConfigError(
            f"test_fraction + val_fraction = {test_fraction + val_fraction} leaves no training data; keep the sum below 1."
        )


def split_permutation(n: int, split_seed: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(split_seed))


def with_sizes(info: dict, n_train: int, n_val: int, n_test: int) -> dict:
    return {**info, "train_examples": n_train, "val_examples": n_val, "test_examples": n_test}


def split_sizes(name: str, n: int, test_fraction: float, val_fraction: float) -> tuple[int, int, int]:
    """(train, validation, test) sizes of a pool of ``n`` examples; an error if no training example is left."""
    check_fractions(test_fraction, val_fraction)
    n_test = int(round(n * test_fraction))
    n_val = int(round(n * val_fraction))
    if n - n_test - n_val <= 0:
        raise DPConfigError(f"the dataset {name!r} has no training examples after the split (N={n}).")
    return n - n_test - n_val, n_val, n_test


def split_dataset(name, x, y, num_classes, test_fraction, val_fraction, split_seed, **extra) -> Dataset:
    """One pool of labelled data → train/val/test by a public permutation."""
    n = x.shape[0]
    _, n_val, n_test = split_sizes(name, n, test_fraction, val_fraction)
    perm = split_permutation(n, split_seed)
    test_idx, val_idx, train_idx = perm[:n_test], perm[n_test : n_test + n_val], perm[n_test + n_val :]
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
        with_sizes(info, len(train_idx), len(val_idx), len(test_idx)),
        **extra,
    )


def train_test_dataset(name, train, test, num_classes, val_fraction, split_seed, **extra) -> Dataset:
    """A dataset with its own test set (``train`` and ``test`` are (x, y) pairs): validation
    is carved out of the training set."""
    (x_tr, y_tr), (x_te, y_te) = train, test
    check_fractions(0.0, val_fraction)
    n = x_tr.shape[0]
    perm = split_permutation(n, split_seed)
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
        with_sizes(info, len(train_idx), len(val_idx), int(x_te.shape[0])),
        **extra,
    )


def published_normalization(name: str) -> Normalization:
    mean, std = _PUBLISHED[name]
    return Normalization(1.0 / 255.0, mean, std)

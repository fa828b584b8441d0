"""MNIST-format (IDX) files as their distributors ship them.

Fashion-MNIST and MNIST come as four IDX files, gzipped or not:
``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte`` and
``t10k-labels-idx1-ubyte`` (each optionally ``.gz``). They may sit

* in a flat folder, as Debian's ``dataset-fashion-mnist`` installs them
  (``/usr/share/datasets/fashion-mnist/*.gz``), or
* in torchvision's layout, ``ROOT/FashionMNIST/raw/`` (``ROOT/MNIST/raw/`` for MNIST).

:func:`find_idx_files` looks in those places (and, with no folder given, in the standard
install path) and :func:`read_idx_split` reads a pair with torchvision's own IDX reader. Every
failure (a file missing, truncated, corrupt, of the wrong type, or a label count that does not
match the image count) raises :class:`~dpcore.DPConfigError` naming the file and the fix.
"""

from __future__ import annotations

import gzip
import os
import tempfile
import zlib
from pathlib import Path

import torch

from dpcore import DPConfigError

from ..catalog import IDX_DATASETS

FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def candidate_folders(name: str, data_dir: str | None) -> list[Path]:
    """Where ``name``'s IDX files may be, in the order they are searched."""
    tv_name, standard, _ = IDX_DATASETS[name]
    roots = [Path(os.path.expanduser(data_dir))] if data_dir else [Path(standard)]
    folders = []
    for root in roots:
        folders += [root, root / tv_name / "raw", root / "raw"]
    return folders


def _file(folder: Path, stem: str) -> Path | None:
    for candidate in (folder / stem, folder / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def find_idx_files(name: str, data_dir: str | None) -> dict[str, tuple[Path, Path]]:
    """{"train": (images, labels), "test": (images, labels)} from the first folder that holds
    any of them; every one of the four must be there. Raises DPConfigError otherwise."""
    if data_dir:
        root = Path(os.path.expanduser(data_dir))
        if root.exists() and not root.is_dir():
            raise DPConfigError(
                f"data_dir={data_dir!r} is a file, not a folder. Point --data-dir to the folder that holds {name}'s "
                f"IDX files ({', '.join(FILES['train'] + FILES['test'])}, gzipped or not)."
            )
        if not root.exists():
            raise DPConfigError(
                f"data_dir={data_dir!r} does not exist. Point --data-dir to the folder that holds {name}'s IDX files "
                f"(flat, or torchvision's layout), leave it out to use {IDX_DATASETS[name][1]}, or add --download."
            )
    folders = candidate_folders(name, data_dir)
    for folder in folders:
        found = {stem: _file(folder, stem) for pair in FILES.values() for stem in pair}
        if not any(found.values()):
            continue
        missing = [stem for stem, path in found.items() if path is None]
        if missing:
            raise DPConfigError(
                f"{folder} holds only part of {name}: {', '.join(m + '[.gz]' for m in missing)} "
                f"{'is' if len(missing) == 1 else 'are'} missing. All four IDX files (training and test images and labels) are needed."
            )
        return {split: (found[images], found[labels]) for split, (images, labels) in FILES.items()}
    _, standard, package = IDX_DATASETS[name]
    how = [f"`apt-get install {package}` (installs it in {standard})"] if package else []
    how.append("--download --data-dir DIR where a network exists (torchvision fetches it)")
    raise DPConfigError(
        f"{name} was not found: no IDX files ({FILES['train'][0]}[.gz] and the others) in "
        f"{', '.join(str(f) for f in folders)}. Get it with {', or '.join(how)}; or point --data-dir to the folder that holds it."
    )


def _read_tensor(path: Path) -> torch.Tensor:
    """One IDX file through torchvision's reader (``strict``: the byte count must match the
    header). A gzipped file is inflated into a private temporary file first."""
    from torchvision.datasets.mnist import read_sn3_pascalvincent_tensor

    try:
        if path.suffix != ".gz":
            return read_sn3_pascalvincent_tensor(str(path), strict=True)
        with gzip.open(path, "rb") as src, tempfile.NamedTemporaryFile(prefix="idx-", suffix=".ubyte") as tmp:
            while chunk := src.read(1 << 22):
                tmp.write(chunk)
            tmp.flush()
            return read_sn3_pascalvincent_tensor(tmp.name, strict=True)
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise DPConfigError(
            f"{path} is not a complete gzip file ({e}): it is truncated or corrupt. Re-install or re-download it."
        ) from None
    except (AssertionError, RuntimeError, KeyError, IndexError, ValueError) as e:
        detail = f" ({e})" if str(e) else ""
        raise DPConfigError(
            f"{path} is not a valid IDX file{detail}: its header or its size is wrong (truncated or corrupt?). "
            "Re-install or re-download it."
        ) from None


def read_idx_split(images_path: Path, labels_path: Path, num_classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """(images uint8 [N, 1, H, W], labels int64 [N]) from an IDX pair, checked."""
    x = _read_tensor(images_path)
    if x.dtype != torch.uint8 or x.ndim != 3:
        raise DPConfigError(
            f"{images_path} holds {x.dtype} data of shape {tuple(x.shape)}; expected uint8 images [N, H, W]."
        )
    y = _read_tensor(labels_path)
    if y.dtype != torch.uint8 or y.ndim != 1:
        raise DPConfigError(f"{labels_path} holds {y.dtype} data of shape {tuple(y.shape)}; expected uint8 labels [N].")
    if len(x) != len(y):
        raise DPConfigError(
            f"{labels_path} holds {len(y)} labels but {images_path} holds {len(x)} images; the counts must match "
            "(a file from another release, or a truncated one?)."
        )
    if len(y) and int(y.max()) >= num_classes:
        raise DPConfigError(f"{labels_path} holds the label {int(y.max())}; labels must lie in [0, {num_classes}).")
    return x.unsqueeze(1).contiguous(), y.long()

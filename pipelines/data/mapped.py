"""A worker's view of an ingested dataset: its own shards, memory-mapped from disk.

The image column of each Arrow file is one contiguous buffer, so it is indexed in place: nothing
is copied in Python, and only the rows of a lot are read. Normalisation to float happens per
batch, on the training device (:meth:`MappedSplit.batch`). Worker ``rank`` of ``world_size``
reads the training shards ``i`` with ``i % world_size == rank`` and nothing else.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from dpcore import DPConfigError

from .dataset import Normalization, Split
from .shards import SPLITS, _check_structure, read_manifest


class MappedImages:
    """The stored examples of one or more shards, memory-mapped. ``x[idx]`` (an index tensor,
    or a slice) gathers just those rows into a new tensor; nothing else is read."""

    def __init__(self, parts: list[torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype):
        self.parts = parts
        self.shape_tail = tuple(shape)
        self.dtype = dtype
        self.starts = np.cumsum([0] + [len(p) for p in parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self),) + self.shape_tail

    def __getitem__(self, idx) -> torch.Tensor:
        if isinstance(idx, slice):
            lo, hi, step = idx.indices(len(self))
            idx = torch.arange(lo, hi, step)
        idx = torch.as_tensor(idx, dtype=torch.long).cpu()
        if len(self.parts) == 1:
            return self.parts[0][idx]
        which = np.searchsorted(self.starts, idx.numpy(), side="right") - 1
        out = torch.empty((len(idx),) + self.shape_tail, dtype=self.dtype)
        for k in np.unique(which):
            rows = torch.from_numpy(np.flatnonzero(which == k))
            out[rows] = self.parts[k][idx[rows] - int(self.starts[k])]
        return out


@dataclass
class MappedSplit:
    """A worker's rows of one split: memory-mapped stored examples, their labels (in memory:
    8 bytes a row) and the dataset's public normalisation."""

    x: MappedImages
    y: torch.Tensor
    normalization: Normalization

    def __len__(self) -> int:
        return len(self.x)

    def batch(self, idx, device=None) -> torch.Tensor:
        """The model inputs of rows ``idx``: gathered from the map, moved to ``device`` as
        stored (uint8: a quarter of float32's bytes), then normalised there."""
        raw = self.x[idx]
        if device is not None and torch.device(device).type != "cpu":
            raw = raw.pin_memory().to(device, non_blocking=True)
        return self.normalization(raw)


def _mapped_tensor(batch: pa.RecordBatch, manifest: dict) -> torch.Tensor:
    col = batch.column("image")
    shape = tuple(manifest["input_shape"])
    dtype = np.dtype(manifest["dtype"])
    raw = np.frombuffer(
        col.buffers()[1], dtype=np.uint8, count=len(col) * col.type.byte_width, offset=col.offset * col.type.byte_width
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable": the map is read-only, and we never write to it
        return torch.from_numpy(raw.view(dtype).reshape((len(col),) + shape))


def _entries(manifest: dict, split: str, rank: int, world_size: int) -> list[dict]:
    if split not in SPLITS:
        raise DPConfigError(f"split={split!r} is unknown; use train, val or test.")
    entries = [e for e in manifest["files"] if e["split"] == split]
    if split == "train":
        if world_size > manifest["num_shards"]:
            raise DPConfigError(
                f"{world_size} workers but only {manifest['num_shards']} training shards: some workers would "
                f"have no data. Re-ingest with num_shards ≥ {world_size} (a multiple of it balances best)."
            )
        entries = [e for e in entries if e["shard"] % world_size == rank]
    return sorted(entries, key=lambda e: e["shard"])


def _stored_dtype(manifest: dict) -> torch.dtype:
    """The torch dtype of the stored examples (the manifest names the numpy one)."""
    return torch.from_numpy(np.zeros(0, np.dtype(manifest["dtype"]))).dtype


def open_split(data_dir: str | Path, split: str, rank: int = 0, world_size: int = 1) -> MappedSplit:
    """The rows of ``split`` that belong to ``rank``, memory-mapped: for ``train``, shards i with
    i % world_size == rank; for ``val``/``test``, the whole split (any rank may evaluate).
    Each file's structure is checked against the manifest; its checksum is the driver's job."""
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    parts, labels = [], []
    for entry in _entries(manifest, split, rank, world_size):
        batch = _check_structure(data_dir / entry["file"], entry, manifest, random_access=split == "train")
        parts.append(_mapped_tensor(batch, manifest))
        labels.append(torch.from_numpy(batch.column("label").to_numpy(zero_copy_only=False).astype(np.int64)))
    dtype = _stored_dtype(manifest)
    y = torch.cat(labels) if labels else torch.empty(0, dtype=torch.long)
    return MappedSplit(
        MappedImages(parts, tuple(manifest["input_shape"]), dtype),
        y,
        Normalization.from_dict(manifest.get("normalization")),
    )


def read_split(data_dir: str | Path, split: str, rank: int = 0, world_size: int = 1) -> Split:
    """Like :func:`open_split`, but copied into memory as a :class:`Split` of stored values
    (for small data, the driver's one-off uses and tests)."""
    m = open_split(data_dir, split, rank, world_size)
    return Split(m.x[:], m.y.clone())


def public_example(
    input_shape, rows: int = 4, stored: torch.dtype = torch.float32, normalization: Normalization | None = None
) -> np.ndarray:
    """``rows`` fixed inputs of ``input_shape`` that depend on nothing but that shape: MLflow's
    input example. The model artifact leaves the trainer with the run, outside the (ε, δ)
    guarantee, so it must never hold a private example (not even one of the test split's).
    Stored values are drawn from a seeded generator (uint8: every byte value; float: standard
    normal; other integers: zeros) and then normalised like the data."""
    g = torch.Generator().manual_seed(0)
    size = (rows, *tuple(input_shape))
    if stored == torch.uint8:
        raw = torch.randint(0, 256, size, generator=g, dtype=torch.uint8)
    elif stored.is_floating_point:
        raw = torch.randn(size, generator=g, dtype=torch.float32)
    else:
        raw = torch.zeros(size, dtype=stored)
    return (normalization or Normalization())(raw).numpy()


def model_example(data_dir: str | Path, rows: int = 4) -> np.ndarray:
    """MLflow's input example for a model of the ingested dataset at ``data_dir``: the shape,
    stored dtype and public normalisation of its inputs, and no row of it
    (:func:`public_example`)."""
    manifest = read_manifest(data_dir)
    norm = Normalization.from_dict(manifest.get("normalization"))
    return public_example(manifest["input_shape"], rows, _stored_dtype(manifest), norm)


def normalization(data_dir: str | Path) -> Normalization:
    return Normalization.from_dict(read_manifest(data_dir).get("normalization"))


def train_size(data_dir: str | Path) -> int:
    """N: the total number of training rows across all shards (from the manifest)."""
    return sum(e["rows"] for e in read_manifest(data_dir)["files"] if e["split"] == "train")

"""Write a dataset once as Parquet shards, and read a worker's own shard back.

Layout of an ingested dataset directory::

    manifest.json                      name, image shape and dtype, classes, files, row counts, sha256
    train-00000-of-00004.parquet       training rows, shard 0 of 4
    ...
    val.parquet                        validation rows (carved out of training data, never trained on)
    test.parquet                       test rows

Each Parquet file has the columns ``index`` (int64, the row's position in its split),
``image`` (fixed-size binary: the image's raw bytes, C-contiguous, dtype and shape from the
manifest), ``label`` (int64) and ``split`` (string). Worker ``rank`` of ``world_size``
reads the training shards ``i`` with ``i % world_size == rank`` and nothing else.

Every file's SHA-256 is in the manifest and is checked when it is read, so a corrupt or
truncated shard fails with a message that names it, before training starts.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from dpcore import DPConfigError

from .data import Dataset, Split

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class CorruptShardError(DPConfigError):
    """A Parquet shard is unreadable or does not match its manifest."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _table(split: Split, name: str) -> pa.Table:
    x = np.ascontiguousarray(split.x.numpy())
    n = x.shape[0]
    width = int(x[0].nbytes) if n else int(np.prod(x.shape[1:]) * x.dtype.itemsize)
    flat = x.reshape(n, -1).view(np.uint8).reshape(-1) if n else np.zeros(0, np.uint8)
    images = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), n, [None, pa.py_buffer(flat.tobytes())])
    return pa.table(
        {
            "index": pa.array(np.arange(n, dtype=np.int64)),
            "image": images,
            "label": pa.array(split.y.numpy().astype(np.int64)),
            "split": pa.array([name] * n, type=pa.string()),
        }
    )


def ingest(dataset: Dataset, out_dir: str | Path, num_shards: int = 2) -> Path:
    """Write ``dataset`` to ``out_dir`` as ``num_shards`` training shards plus val and test."""
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise DPConfigError(f"num_shards={num_shards!r} is invalid: it must be an integer ≥ 1.")
    n_train = len(dataset.train)
    if num_shards > n_train:
        raise DPConfigError(f"num_shards={num_shards} exceeds the {n_train} training examples; use fewer shards.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    bounds = np.linspace(0, n_train, num_shards + 1).round().astype(int)
    for i in range(num_shards):
        lo, hi = bounds[i], bounds[i + 1]
        part = Split(dataset.train.x[lo:hi], dataset.train.y[lo:hi])
        table = _table(part, "train").set_column(0, "index", pa.array(np.arange(lo, hi, dtype=np.int64)))
        files.append(("train", i, f"train-{i:05d}-of-{num_shards:05d}.parquet", table))
    files.append(("val", 0, "val.parquet", _table(dataset.val, "val")))
    files.append(("test", 0, "test.parquet", _table(dataset.test, "test")))
    entries = []
    for split, shard, fname, table in files:
        pq.write_table(table, out / fname)
        entries.append({"split": split, "shard": shard, "file": fname, "rows": table.num_rows, "sha256": sha256_file(out / fname)})
    manifest = {
        "format_version": FORMAT_VERSION,
        "name": dataset.name,
        "input_shape": list(dataset.input_shape),
        "dtype": str(dataset.train.x.numpy().dtype),
        "num_classes": dataset.num_classes,
        "num_shards": num_shards,
        "split_info": dataset.split_info,
        "files": entries,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return out


def read_manifest(data_dir: str | Path) -> dict:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise DPConfigError(
            f"{path} does not exist: {data_dir} is not an ingested dataset. Run the ingest step first "
            "(pipelines.ingest.ingest(dataset, out_dir))."
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CorruptShardError(f"{path} is not valid JSON ({e}); re-run the ingest step.") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DPConfigError(f"{path} has format_version={manifest.get('format_version')!r}; this code reads {FORMAT_VERSION}.")
    return manifest


def _read_file(data_dir: Path, entry: dict, manifest: dict) -> Split:
    path = data_dir / entry["file"]
    if not path.is_file():
        raise CorruptShardError(f"shard {path} listed in the manifest is missing; re-run the ingest step.")
    digest = sha256_file(path)
    if digest != entry["sha256"]:
        raise CorruptShardError(
            f"shard {path} is corrupt: its SHA-256 {digest[:12]}… does not match the manifest's "
            f"{entry['sha256'][:12]}…. Re-run the ingest step to rewrite it."
        )
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise CorruptShardError(f"shard {path} cannot be read as Parquet ({e}); re-run the ingest step.") from None
    if table.num_rows != entry["rows"]:
        raise CorruptShardError(f"shard {path} has {table.num_rows} rows, the manifest says {entry['rows']}.")
    shape = tuple(manifest["input_shape"])
    dtype = np.dtype(manifest["dtype"])
    col = table.column("image").combine_chunks()
    raw = np.frombuffer(col.buffers()[1], dtype=np.uint8, count=len(col) * col.type.byte_width, offset=col.offset * col.type.byte_width)
    x = torch.from_numpy(raw.view(dtype).reshape((len(col),) + shape).copy())
    y = torch.from_numpy(table.column("label").to_numpy().astype(np.int64))
    return Split(x, y)


def _cat(parts: list[Split], manifest: dict) -> Split:
    if not parts:
        shape = tuple(manifest["input_shape"])
        return Split(torch.empty((0,) + shape, dtype=getattr(torch, manifest["dtype"])), torch.empty(0, dtype=torch.long))
    return Split(torch.cat([p.x for p in parts]), torch.cat([p.y for p in parts]))


def read_split(data_dir: str | Path, split: str, rank: int = 0, world_size: int = 1) -> Split:
    """The rows of ``split`` that belong to ``rank``: for ``train``, shards i with
    i % world_size == rank; for ``val``/``test``, the whole split (any rank may evaluate)."""
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    if split not in ("train", "val", "test"):
        raise DPConfigError(f"split={split!r} is unknown; use train, val or test.")
    entries = [e for e in manifest["files"] if e["split"] == split]
    if split == "train":
        if world_size > manifest["num_shards"]:
            raise DPConfigError(
                f"{world_size} workers but only {manifest['num_shards']} training shards: some workers would "
                f"have no data. Re-ingest with num_shards ≥ {world_size} (a multiple of it balances best)."
            )
        entries = [e for e in entries if e["shard"] % world_size == rank]
    return _cat([_read_file(data_dir, e, manifest) for e in sorted(entries, key=lambda e: e["shard"])], manifest)


def train_size(data_dir: str | Path) -> int:
    """N: the total number of training rows across all shards (from the manifest)."""
    return sum(e["rows"] for e in read_manifest(data_dir)["files"] if e["split"] == "train")


def verify(data_dir: str | Path) -> dict:
    """Check every file of an ingested dataset against its manifest (presence, SHA-256, Parquet,
    row count). Returns the manifest. The driver calls this before any worker starts."""
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    for entry in manifest["files"]:
        _read_file(data_dir, entry, manifest)
    return manifest

"""Write a dataset once as Arrow shards, and verify them (reading them back is :mod:`.mapped`).

Layout of an ingested dataset directory::

    manifest.json                      name, image shape and dtype, normalisation, classes, files
    train-00000-of-00004.arrow         training rows, shard 0 of 4
    ...
    val.arrow                          validation rows (carved out of training data, never trained on)
    test.arrow                         test rows

Each file is an uncompressed Arrow IPC file holding one record batch with the columns
``index`` (int64, the row's position in its split), ``image`` (fixed-size binary: the stored
example's raw bytes, C-contiguous, in the dtype and shape the manifest names: uint8 for
images), ``label`` (int64) and ``split`` (string). Because the file is uncompressed and the
image column is one contiguous buffer, a worker memory-maps it and indexes it in place
(:func:`open_split`): nothing is copied in Python, and only the rows of a lot are read.
Normalisation to float happens per batch, on the training device (:class:`MappedSplit.batch`).

Worker ``rank`` of ``world_size`` reads the training shards ``i`` with ``i % world_size == rank``
and nothing else.

Every file's size and SHA-256 are in the manifest. :func:`verify` (the driver, before any
worker starts) hashes every file in full the first time, and records what it verified
(size, modification and change times, inode) in a private stamp under
``~/.cache/dp-platform/verified``; later runs re-hash only the files whose stat changed. A
write to a shard changes its change time (which no user can set), so a corrupt or replaced
shard is still caught before any budget is spent. ``verify(full=True)`` (``dp-platform ingest
--verify``) re-hashes everything regardless.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from dpcore import DPConfigError
from dpcore.native_build import user_cache

from .dataset import Dataset, Normalization

MANIFEST = "manifest.json"
FORMAT_VERSION = 2
SPLITS = ("train", "val", "test")


class CorruptShardError(DPConfigError):
    """A shard is missing, unreadable, or does not match its manifest."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _schema(width: int) -> pa.Schema:
    return pa.schema(
        [("index", pa.int64()), ("image", pa.binary(width)), ("label", pa.int64()), ("split", pa.string())]
    )


def _write_file(path: Path, x: torch.Tensor, y: torch.Tensor, first_index: int, split: str) -> None:
    """One Arrow IPC file, one record batch; the image column is the tensor's own memory (no copy)."""
    arr = np.ascontiguousarray(x.numpy())
    n = arr.shape[0]
    width = int(math.prod(arr.shape[1:])) * arr.dtype.itemsize
    flat = arr.reshape(-1).view(np.uint8) if n else np.zeros(0, np.uint8)
    images = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), n, [None, pa.py_buffer(flat)])
    batch = pa.record_batch(
        [
            pa.array(np.arange(first_index, first_index + n, dtype=np.int64)),
            images,
            pa.array(y.numpy().astype(np.int64)),
            pa.array([split] * n, type=pa.string()),
        ],
        schema=_schema(width),
    )
    tmp = path.with_name(f".{path.name}.tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)
    os.replace(tmp, path)


def ingest(dataset: Dataset, out_dir: str | Path, num_shards: int = 2) -> Path:
    """Write ``dataset`` to ``out_dir`` as ``num_shards`` training shards plus val and test,
    in the examples' own dtype, with a manifest of sizes and checksums."""
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise DPConfigError(f"num_shards={num_shards!r} is invalid: it must be an integer ≥ 1.")
    n_train = len(dataset.train)
    if num_shards > n_train:
        raise DPConfigError(f"num_shards={num_shards} exceeds the {n_train} training examples; use fewer shards.")
    bounds = np.linspace(0, n_train, num_shards + 1).round().astype(int)
    train = [(dataset.train.x[lo:hi], dataset.train.y[lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:])]
    splits = {"train": train, "val": [(dataset.val.x, dataset.val.y)], "test": [(dataset.test.x, dataset.test.y)]}
    out = ingest_arrays(
        splits, out_dir, dataset.name, dataset.num_classes, dataset.normalization, dataset.split_info, dataset.source
    )
    mark_verified(out)  # hashed as it was written: the next run need not hash again
    return out


def ingest_arrays(
    splits: dict[str, list[tuple[torch.Tensor, torch.Tensor]]],
    out_dir: str | Path,
    name: str,
    num_classes: int,
    normalization: Normalization,
    split_info: dict,
    source: dict,
) -> Path:
    """Write ``splits`` ({"train": [(x, y) per shard], "val": [(x, y)], "test": [(x, y)]}) as an
    ingested dataset: one Arrow file per shard, then the manifest (last, atomically)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # a half-written dataset has no manifest
    x0 = splits["train"][0][0]
    num_shards = len(splits["train"])
    entries, first = [], 0
    for split in SPLITS:
        for shard, (x, y) in enumerate(splits[split]):
            fname = f"train-{shard:05d}-of-{num_shards:05d}.arrow" if split == "train" else f"{split}.arrow"
            if tuple(x.shape[1:]) != tuple(x0.shape[1:]) or x.dtype != x0.dtype:
                raise DPConfigError(
                    f"{split} shard {shard} holds {x.dtype} {tuple(x.shape[1:])}, the first training shard {x0.dtype} "
                    f"{tuple(x0.shape[1:])}."
                )
            _write_file(out / fname, x, y, first if split == "train" else 0, split)
            first += len(y) if split == "train" else 0
            entries.append(
                {
                    "split": split,
                    "shard": shard,
                    "file": fname,
                    "rows": int(len(y)),
                    "bytes": (out / fname).stat().st_size,
                    "sha256": sha256_file(out / fname),
                }
            )
    manifest = {
        "format_version": FORMAT_VERSION,
        "name": name,
        "input_shape": list(x0.shape[1:]),
        "dtype": str(x0.numpy().dtype),
        "normalization": normalization.to_dict(),
        "num_classes": num_classes,
        "num_shards": num_shards,
        "split_info": split_info,
        "source": source,
        "files": entries,
    }
    tmp = out / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, out / MANIFEST)
    return out


def mark_verified(data_dir: str | Path) -> None:
    """Record ``data_dir`` as verified as it is now (just written and hashed by this process)."""
    _write_stamp(Path(data_dir), read_manifest(data_dir))


def manifest_digest(manifest: dict) -> str:
    """SHA-256 of what a run trains and evaluates on, from its manifest: every shard (split,
    name, rows, SHA-256), the input shape and dtype, the classes (their count, and their names
    where the manifest keeps them) and the normalisation. A dataset ingested again
    in place with another split seed keeps N, shape and class count but not this. A plain hash
    of the private data: never logged (the plan carries :func:`data_digest`, keyed)."""
    content = {
        "files": sorted((e["split"], e["file"], e["rows"], e["sha256"]) for e in manifest["files"]),
        "input_shape": list(manifest["input_shape"]),
        "dtype": manifest.get("dtype"),
        "num_classes": manifest.get("num_classes"),
        "classes": (manifest.get("source") or {}).get("classes"),  # text datasets name theirs there
        "normalization": manifest.get("normalization"),
    }
    return "v1:" + hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def data_digest(storage_path: str | Path, manifest: dict) -> str:
    """What a run's plan carries of its data (``spec.json``, kept by MLflow): the manifest's
    digest under the storage folder's secret key (:mod:`.cache_names`). A plain hash of the
    shards there would let anyone who reads the plan and knows every other record test whether
    a candidate dataset, with or without one record, is the one trained on."""
    from .cache_names import cache_digest

    return "v1:" + cache_digest(storage_path, manifest_digest(manifest).encode(), 64)


def read_manifest(data_dir: str | Path) -> dict:
    data_dir = Path(data_dir)
    path = data_dir / MANIFEST
    if data_dir.exists() and not data_dir.is_dir():
        raise DPConfigError(f"{data_dir} is a file, not an ingested dataset folder (one with {MANIFEST}).")
    if not path.is_file():
        raise DPConfigError(
            f"{path} does not exist: {data_dir} is not an ingested dataset. Run the ingest step first "
            "(dp-platform ingest DATASET OUT_DIR, or pipelines.data.ingest(dataset, out_dir))."
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CorruptShardError(f"{path} is not valid JSON ({e}); re-run the ingest step.") from None
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        older = " (Parquet shards, written by an earlier version of the platform)" if version == 1 else ""
        raise DPConfigError(
            f"{path} has format_version={version!r}{older}; this code reads {FORMAT_VERSION}. Re-ingest the dataset "
            f"(dp-platform ingest {manifest.get('name', 'DATASET')} {data_dir} --data-dir ...)."
        )
    return manifest


# ------------------------------------------------------------------------------------------
# Verification (driver): full hash once, then only what changed since.
def _stamp_path(data_dir: Path) -> Path | None:
    folder = user_cache() / "verified"
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        if folder.stat().st_uid != os.getuid() or folder.stat().st_mode & 0o022:
            return None  # not ours alone: do not trust stamps kept there
    except OSError:
        return None
    key = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:24]
    return folder / f"{key}.json"


def _stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _read_stamp(data_dir: Path) -> dict:
    path = _stamp_path(data_dir)
    try:
        return json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}


def _write_stamp(data_dir: Path, manifest: dict) -> None:
    path = _stamp_path(data_dir)
    if path is None:
        return
    stamp = {
        "manifest": _stat_key(data_dir / MANIFEST),
        "files": {e["file"]: [*_stat_key(data_dir / e["file"]), e["sha256"]] for e in manifest["files"]},
    }
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".stamp-")
        with os.fdopen(fd, "w") as f:
            json.dump(stamp, f)
        os.replace(tmp, path)
    except OSError:
        pass


def _map(path: Path, random_access: bool) -> pa.Buffer:
    """The file, memory-mapped read-only. With ``random_access`` the kernel is told so
    (``MADV_RANDOM``): a lot's rows are scattered over the file, and each page fault should read
    and map that page, not a read-ahead window around it (on a dataset larger than memory, up to
    hundreds of times the bytes of the rows themselves, and resident memory to match)."""
    import mmap

    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if random_access and hasattr(m, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        m.madvise(mmap.MADV_RANDOM)
    return pa.py_buffer(m)  # holds the map open as long as any tensor over it lives


def _check_structure(path: Path, entry: dict, manifest: dict, random_access: bool = False) -> pa.RecordBatch:
    """Open ``path`` memory-mapped and check it against its manifest entry (cheap: no hashing)."""
    if not path.is_file():
        raise CorruptShardError(f"shard {path} listed in the manifest is missing; re-run the ingest step.")
    if "bytes" in entry and path.stat().st_size != entry["bytes"]:
        raise CorruptShardError(
            f"shard {path} is corrupt: it has {path.stat().st_size} bytes, the manifest says {entry['bytes']} "
            "(truncated or overwritten). Re-run the ingest step to rewrite it."
        )
    try:
        if path.stat().st_size == 0:
            raise ValueError("the file is empty")
        reader = pa.ipc.open_file(_map(path, random_access))
        if reader.num_record_batches != 1:
            raise ValueError(f"{reader.num_record_batches} record batches, expected 1")
        batch = reader.get_batch(0)
    except (pa.ArrowInvalid, pa.ArrowException, OSError, ValueError) as e:
        raise CorruptShardError(
            f"shard {path} cannot be read as an Arrow file ({e}); re-run the ingest step."
        ) from None
    width = int(math.prod(manifest["input_shape"])) * np.dtype(manifest["dtype"]).itemsize
    if batch.schema.field("image").type != pa.binary(width) or batch.num_rows != entry["rows"]:
        raise CorruptShardError(
            f"shard {path} does not match the manifest ({batch.num_rows} rows of {batch.schema.field('image').type}; "
            f"expected {entry['rows']} of fixed_size_binary[{width}]). Re-run the ingest step."
        )
    return batch


def verify(data_dir: str | Path, full: bool = False) -> dict:
    """Check every file of an ingested dataset against its manifest before any worker starts:
    presence, size, Arrow structure and row count always; the SHA-256 of every file whose stat
    changed since it was last verified (every file when ``full``). Returns the manifest."""
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    stamp = {} if full else _read_stamp(data_dir)
    known = stamp.get("files", {}) if stamp.get("manifest") == _stat_key(data_dir / MANIFEST) else {}
    hashed = 0
    for entry in manifest["files"]:
        path = data_dir / entry["file"]
        _check_structure(path, entry, manifest)
        if known.get(entry["file"]) == [*_stat_key(path), entry["sha256"]]:
            continue
        digest = sha256_file(path)
        hashed += 1
        if digest != entry["sha256"]:
            raise CorruptShardError(
                f"shard {path} is corrupt: its SHA-256 {digest[:12]}… does not match the manifest's "
                f"{entry['sha256'][:12]}…. Re-run the ingest step to rewrite it."
            )
    if hashed or full:
        _write_stamp(data_dir, manifest)
    return manifest

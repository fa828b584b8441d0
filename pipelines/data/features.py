"""Public, fixed feature transforms, computed once per dataset and cached as a dataset.

A model may begin with a transform that has no trainable parameters, is fixed before any data
is seen, and acts on each example alone: the scattering transform of Tramèr & Boneh 2021
(:class:`pipelines.models.ScatterNet`) is one. Applying it is post-processing of each example
in isolation, so it costs no privacy, and its output can be computed once instead of at every
step. :func:`ensure_features` does that for an ingested dataset: every file (training shards,
validation, test) goes through the transform in chunks, and the result is written as an
ingested dataset of its own (same shards, same row order, float32 features, identity
normalisation) under ``storage/features/``. Workers then map those shards like any other and
train only the rest of the model. The cache key is the source dataset's checksums plus the
transform's own key, so a changed dataset or transform gets new features.

The features are a deterministic function of each example alone, so DP-SGD on the rest of the
model is exactly DP-SGD on the whole model: the per-example gradients of the trainable
parameters are the same, and so are the clip, the noise and the ledger.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from torch import nn

from dpcore import DPConfigError

from .cache_names import cache_digest
from .dataset import Normalization
from .mapped import open_split
from .shards import MANIFEST, ingest_arrays, mark_verified, verify

CHUNK = 2048


def cache_dir(storage_path: str | Path, manifest: dict, key: str) -> Path:
    """The features' folder, named by a keyed digest of the shards' SHA-256 (:mod:`.cache_names`)."""
    payload = json.dumps([sorted(e["sha256"] for e in manifest["files"]), key]).encode()
    return Path(storage_path).resolve() / "features" / f"{manifest['name']}-{cache_digest(storage_path, payload, 16)}"


@torch.no_grad()
def _transform(
    front: nn.Module, data_dir: Path, split: str, rank: int, world: int, progress
) -> tuple[torch.Tensor, torch.Tensor]:
    part = open_split(data_dir, split, rank, world)
    outs = []
    for lo in range(0, len(part), CHUNK):
        idx = torch.arange(lo, min(lo + CHUNK, len(part)))
        outs.append(front(part.batch(idx)).float().contiguous())
        progress(len(idx))
    if not outs:
        shape = front(part.normalization(torch.zeros((1,) + part.x.shape_tail, dtype=part.x.dtype))).shape[1:]
        return torch.empty((0,) + tuple(shape)), part.y
    return torch.cat(outs), part.y


def ensure_features(
    data_dir: str | Path, manifest: dict, front: nn.Module, key: str, storage_path: str | Path, stream=sys.stderr
) -> tuple[Path, dict]:
    """The ingested dataset of ``front``'s features of ``data_dir`` (computed now if it is not
    cached yet, else verified). Returns (its folder, its manifest)."""
    out = cache_dir(storage_path, manifest, key)
    if (out / MANIFEST).is_file():
        try:
            return out, verify(out)
        except DPConfigError:  # our own cache, damaged: rebuild it
            shutil.rmtree(out, ignore_errors=True)
    elif out.exists():  # a folder without its manifest: an interrupted write
        shutil.rmtree(out, ignore_errors=True)
    total = sum(e["rows"] for e in manifest["files"])
    done, t0, said = [0], time.monotonic(), [-1.0]
    interactive = stream is not None and getattr(stream, "isatty", lambda: False)()

    def progress(n: int) -> None:
        done[0] += n
        if stream is None:
            return
        line = f"computing {key} features once for {manifest['name']}: {done[0]}/{total} examples  {time.monotonic() - t0:4.0f}s"
        if interactive:  # redrawn in place
            stream.write("\r" + line)
        elif time.monotonic() - said[0] >= 10 or done[0] >= total:  # a log file: a line every 10 s, and the last
            stream.write(line + "\n")
            said[0] = time.monotonic()
        stream.flush()

    front = front.eval()
    splits = {}
    for split in ("train", "val", "test"):
        if split == "train":
            shards = [
                _transform(front, Path(data_dir), split, r, manifest["num_shards"], progress)
                for r in range(manifest["num_shards"])
            ]
            splits[split] = shards
        else:
            splits[split] = [_transform(front, Path(data_dir), split, 0, 1, progress)]
    if interactive:
        stream.write("\n")
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    derived = {"features": key, "of": manifest["name"], "source_sha256": sorted(e["sha256"] for e in manifest["files"])}
    ingest_arrays(
        splits,
        tmp,
        name=manifest["name"],
        num_classes=manifest["num_classes"],
        normalization=Normalization(),
        split_info=manifest.get("split_info", {}),
        source=derived,
    )
    try:
        os.rename(tmp, out)
    except OSError:  # another process (a concurrent trial) finished the same features first
        shutil.rmtree(tmp, ignore_errors=True)
        return out, verify(out)
    mark_verified(out)  # hashed as it was written
    return out, verify(out)

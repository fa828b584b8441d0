"""Data: sources as shipped (:mod:`.sources`, :mod:`.idx`), Arrow shards written once and
memory-mapped by workers (:mod:`.shards`), and public fixed feature transforms cached once per
dataset (:mod:`.features`)."""

from ..catalog import DATASETS, IDX_DATASETS, NEEDS_DATA_DIR, USES_DATA_DIR
from .idx import find_idx_files, read_idx_split
from .mapped import MappedSplit, model_example, open_split, public_example, read_split, train_size
from .shards import CorruptShardError, data_digest, ingest, manifest_digest, read_manifest, sha256_file, verify
from .sources import (
    Dataset,
    Normalization,
    Split,
    load_configured,
    load_dataset,
    load_digits,
    load_generated,
)

__all__ = [
    "CorruptShardError",
    "DATASETS",
    "Dataset",
    "IDX_DATASETS",
    "MappedSplit",
    "NEEDS_DATA_DIR",
    "Normalization",
    "Split",
    "data_digest",
    "USES_DATA_DIR",
    "find_idx_files",
    "ingest",
    "load_configured",
    "load_dataset",
    "load_digits",
    "load_generated",
    "manifest_digest",
    "model_example",
    "public_example",
    "open_split",
    "read_idx_split",
    "read_manifest",
    "read_split",
    "sha256_file",
    "train_size",
    "verify",
]

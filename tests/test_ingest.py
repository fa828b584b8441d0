"""Parquet ingest: round trip, sharding by rank, and corrupt shards caught before training."""
import json

import pyarrow.parquet as pq
import pytest
import torch

import dpcore
from pipelines.data import load_digits
from pipelines.ingest import CorruptShardError, ingest, read_manifest, read_split, train_size


@pytest.fixture(scope="module")
def digits():
    return load_digits()


def test_round_trip_and_schema(digits, tmp_path):
    ingest(digits, tmp_path, num_shards=4)
    m = read_manifest(tmp_path)
    assert m["name"] == "digits" and m["input_shape"] == [1, 8, 8] and m["num_shards"] == 4
    assert train_size(tmp_path) == len(digits.train)
    whole = read_split(tmp_path, "train")
    assert torch.equal(whole.x, digits.train.x) and torch.equal(whole.y, digits.train.y)
    for split in ("val", "test"):
        s = read_split(tmp_path, split)
        assert torch.equal(s.x, getattr(digits, split).x) and torch.equal(s.y, getattr(digits, split).y)
    table = pq.read_table(tmp_path / "train-00000-of-00004.parquet")
    assert str(table.schema.field("image").type) == "fixed_size_binary[256]"  # 64 float32 pixels
    assert set(table.column("split").to_pylist()) == {"train"}
    assert table.schema.field("label").type == "int64"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_each_worker_reads_only_its_own_shards_and_together_they_cover_the_data(digits, tmp_path, world):
    ingest(digits, tmp_path, num_shards=4)
    parts = [read_split(tmp_path, "train", rank=r, world_size=world) for r in range(world)]
    assert sum(len(p) for p in parts) == len(digits.train)
    # Disjoint and complete: the concatenation, in shard order, is a permutation of the rows.
    stacked = torch.cat([p.x.flatten(1) for p in parts])
    assert torch.equal(torch.sort(stacked.sum(1)).values, torch.sort(digits.train.x.flatten(1).sum(1)).values)


def test_more_workers_than_shards_is_refused(digits, tmp_path):
    ingest(digits, tmp_path, num_shards=2)
    with pytest.raises(dpcore.DPConfigError, match="3 workers but only 2 training shards"):
        read_split(tmp_path, "train", rank=0, world_size=3)


def test_corrupt_shard_is_named_and_refused(digits, tmp_path):
    ingest(digits, tmp_path, num_shards=2)
    shard = tmp_path / "train-00001-of-00002.parquet"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    read_split(tmp_path, "train", rank=0, world_size=2)  # the other worker's shard is fine
    with pytest.raises(CorruptShardError, match=r"train-00001-of-00002.parquet is corrupt.*Re-run the ingest"):
        read_split(tmp_path, "train", rank=1, world_size=2)


def test_truncated_shard_with_forged_checksum_is_still_refused(digits, tmp_path):
    ingest(digits, tmp_path, num_shards=2)
    shard = tmp_path / "train-00000-of-00002.parquet"
    shard.write_bytes(shard.read_bytes()[:100])
    m = json.loads((tmp_path / "manifest.json").read_text())
    import hashlib

    m["files"][0]["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CorruptShardError, match="cannot be read as Parquet"):
        read_split(tmp_path, "train", rank=0, world_size=2)


def test_missing_directory_says_to_run_ingest(tmp_path):
    with pytest.raises(dpcore.DPConfigError, match="not an ingested dataset. Run the ingest step"):
        read_split(tmp_path / "nope", "train")

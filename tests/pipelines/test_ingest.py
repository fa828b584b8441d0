"""Arrow ingest: round trip, sharding by rank, and corrupt shards caught before training."""

import json
from pathlib import Path

import pyarrow as pa
import pytest
import torch

import dpcore
from pipelines.data import CorruptShardError, ingest, load_digits, read_manifest, read_split, train_size, verify
from pipelines.data.shards import mark_verified


@pytest.fixture(scope="module")
def digits():
    return load_digits()


def test_the_digits_are_scikit_learns_read_without_importing_it():
    import subprocess
    import sys

    from sklearn.datasets import load_digits as sk_load_digits

    from pipelines.data.sources import digits_arrays

    images, target = digits_arrays()
    raw = sk_load_digits()
    assert images.shape == (1797, 8, 8) and torch.equal(torch.tensor(images), torch.tensor(raw.images))
    assert torch.equal(torch.tensor(target), torch.tensor(raw.target))
    code = "import sys; from pipelines.data import load_digits; load_digits(); print('sklearn' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


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
    table = pa.ipc.open_file(str(tmp_path / "train-00000-of-00004.arrow")).read_all()
    assert (
        str(table.schema.field("image").type) == "fixed_size_binary[64]"
    )  # 64 uint8 pixels: stored in their own dtype
    assert m["dtype"] == "uint8" and m["normalization"] == {"scale": 1 / 16, "mean": [0.0], "std": [1.0]}
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


def _flip_one_byte(path, where=None):
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if where is None else where] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_shard_is_named_and_refused_by_verification(digits, tmp_path):
    ingest(digits, tmp_path, num_shards=2)
    verify(tmp_path)  # as ingested: fine
    _flip_one_byte(tmp_path / "train-00001-of-00002.arrow")
    with pytest.raises(CorruptShardError, match=r"train-00001-of-00002.arrow is corrupt.*Re-run the ingest"):
        verify(tmp_path)


def test_verification_rehashes_only_changed_files_and_full_rehashes_all(digits, tmp_path, monkeypatch):
    import pipelines.data.shards as shards

    ingest(digits, tmp_path, num_shards=2)
    hashed = []
    real = shards.sha256_file
    monkeypatch.setattr(shards, "sha256_file", lambda p: hashed.append(p.name) or real(p))
    verify(tmp_path)
    assert hashed == []  # ingest recorded what it wrote and hashed
    shard = tmp_path / "train-00000-of-00002.arrow"
    shard.write_bytes(shard.read_bytes())  # rewritten with the same bytes: its stat changed, so it is hashed again
    verify(tmp_path)
    assert hashed == ["train-00000-of-00002.arrow"]
    hashed.clear()
    verify(tmp_path)
    assert hashed == []
    verify(tmp_path, full=True)
    assert sorted(hashed) == sorted(e["file"] for e in read_manifest(tmp_path)["files"])


def test_a_byte_flipped_in_place_with_its_times_restored_is_caught(digits, tmp_path):
    import os

    ingest(digits, tmp_path, num_shards=2)
    shard = tmp_path / "val.arrow"
    st = shard.stat()
    with open(shard, "r+b") as f:  # in place: same inode and size; then the old times are put back
        f.seek(st.st_size // 2)
        b = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard.stat().st_mtime_ns == st.st_mtime_ns and shard.stat().st_size == st.st_size
    with pytest.raises(CorruptShardError, match="val.arrow is corrupt"):
        verify(tmp_path)  # the change time moved (no user can set it back), so the file is hashed again
    # Bit rot after a verification changes no stat at all: stand it in by stamping the corrupt
    # file as verified. The quick check then trusts the stamp; the full check still hashes.
    mark_verified(tmp_path)
    verify(tmp_path)
    with pytest.raises(CorruptShardError, match="val.arrow is corrupt"):
        verify(tmp_path, full=True)


def test_truncated_shard_with_forged_checksum_is_still_refused(digits, tmp_path):
    ingest(digits, tmp_path, num_shards=2)
    shard = tmp_path / "train-00000-of-00002.arrow"
    shard.write_bytes(shard.read_bytes()[:100])
    m = json.loads((tmp_path / "manifest.json").read_text())
    import hashlib

    m["files"][0]["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
    m["files"][0]["bytes"] = 100
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CorruptShardError, match="cannot be read as an Arrow file"):
        read_split(tmp_path, "train", rank=0, world_size=2)


def test_workers_map_their_shards_instead_of_copying_them(digits, tmp_path):
    from pipelines.data import open_split

    ingest(digits, tmp_path, num_shards=2)
    part = open_split(tmp_path, "train", rank=1, world_size=2)
    mapped = part.x.parts[0]
    assert mapped.dtype == torch.uint8
    # The tensor's memory lies inside this process's mapping of the shard file itself.
    shard = str((tmp_path / "train-00001-of-00002.arrow").resolve())
    spans = []
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[5] == shard:
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            spans.append((lo, hi))
    ptr = mapped.data_ptr()
    assert any(lo <= ptr and ptr + mapped.numel() <= hi for lo, hi in spans), (hex(ptr), spans)
    lot = torch.tensor([3, 0, 7])
    x = part.batch(lot)
    assert x.dtype == torch.float32
    assert torch.equal(x, digits.normalization(read_split(tmp_path, "train", 1, 2).x[lot]))


def _vm_flags(path: Path) -> list[list[str]]:
    """The VmFlags of every mapping of ``path`` in this process (Linux's /proc/self/smaps)."""
    flags, current = [], None
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
            current = fields[5] if len(fields) >= 6 else None
        elif fields[0] == "VmFlags:" and current == str(path):
            flags.append(fields[1:])
    return flags


def test_training_shards_are_mapped_for_random_access(digits, tmp_path):
    """A lot's rows are scattered over the shard: the kernel is told (MADV_RANDOM, 'rr' in
    VmFlags), so a page fault reads that page and not a read-ahead window around it."""
    from pipelines.data import open_split

    ingest(digits, tmp_path, num_shards=1)
    train = open_split(tmp_path, "train")
    test = open_split(tmp_path, "test")
    train_flags = _vm_flags((tmp_path / "train-00000-of-00001.arrow").resolve())
    test_flags = _vm_flags((tmp_path / "test.arrow").resolve())
    assert train_flags and all("rr" in f for f in train_flags), train_flags
    assert test_flags and not any("rr" in f for f in test_flags), test_flags  # evaluation reads in order
    assert train.batch(torch.tensor([5, 1])).shape[0] == 2 and len(test) > 0


def test_missing_directory_says_to_run_ingest(tmp_path):
    with pytest.raises(dpcore.DPConfigError, match="not an ingested dataset. Run the ingest step"):
        read_split(tmp_path / "nope", "train")


_RSS_CHILD = r"""
import sys, torch
from pipelines.data import open_split
from pipelines.train.placement import memory_status
before = memory_status()["rss_anon_mib"]
part = open_split(sys.argv[1], "train", 0, 1)
g = torch.Generator().manual_seed(0)
for _ in range(20):  # twenty Poisson lots of ~512, gathered and normalised as the worker does
    lot = torch.nonzero(torch.rand(len(part), generator=g) < 512 / len(part)).flatten()
    x = part.batch(lot)
after = memory_status()
print(after["rss_anon_mib"] - before, after["rss_file_mib"])
"""


def test_a_workers_heap_does_not_grow_with_the_dataset(tmp_path):
    """Must-show 2: the shard is mapped, not copied. A worker that opens a 150 MiB shard and
    trains on lots from it grows its anonymous memory by about as much as for a shard 10×
    smaller (the lots themselves), while a copy would add the whole shard."""
    import subprocess
    import sys

    from pipelines.data import load_generated

    grew, shard_mib = {}, {}
    for n in (20_000, 200_000):
        ds = load_generated(generated_size=n, image_size=28, val_fraction=0.0, test_fraction=0.0)
        ingest(ds, tmp_path / str(n), num_shards=1)
        shard_mib[n] = (tmp_path / str(n) / "train-00000-of-00001.arrow").stat().st_size / 2**20
        out = subprocess.run(
            [sys.executable, "-c", _RSS_CHILD, str(tmp_path / str(n))], capture_output=True, text=True, check=True
        )
        grew[n] = float(out.stdout.split()[0])
    # Measured: +31 MiB and +35 MiB (torch's own first allocations and the lots); copying the
    # shards instead gives +50 and +181 MiB.
    assert shard_mib[200_000] - shard_mib[20_000] > 130
    assert grew[200_000] - grew[20_000] < 20, grew


def test_a_rank_with_several_shards_gathers_any_lot_across_them(digits, tmp_path):
    """num_shards=4 read by 1 worker: the lot's rows come from four maps, in the lot's order."""
    from pipelines.data import open_split

    ingest(digits, tmp_path, num_shards=4)
    part = open_split(tmp_path, "train", rank=0, world_size=1)
    assert len(part.x.parts) == 4
    lot = torch.tensor([len(digits.train) - 1, 0, 700, 5, 312, 313, 940])
    assert torch.equal(part.x[lot], digits.train.x[lot]) and torch.equal(part.y[lot], digits.train.y[lot])
    assert torch.equal(part.x[2:9], digits.train.x[2:9])


def test_normalization_is_per_channel_and_exact_for_the_published_constants():
    from pipelines.data import Normalization

    norm = Normalization(1 / 255, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    x = torch.randint(0, 256, (5, 3, 4, 4), dtype=torch.uint8)
    ref = (x.double() / 255 - torch.tensor(norm.mean, dtype=torch.float64).view(1, 3, 1, 1)) / torch.tensor(
        norm.std, dtype=torch.float64
    ).view(1, 3, 1, 1)
    out = norm(x)
    assert out.dtype == torch.float32 and torch.allclose(out.double(), ref, atol=1e-5)
    digits = Normalization(1 / 16)  # exact: k/16 is representable
    counts = torch.arange(17, dtype=torch.uint8).view(1, 1, 1, 17)
    assert torch.equal(digits(counts), counts.float() / 16)
    with pytest.raises(dpcore.DPConfigError, match="3 channel constants but the data has 2"):
        norm(torch.zeros(1, 2, 4, 4, dtype=torch.uint8))


def test_the_step_input_path_makes_no_per_step_copies_of_constants_or_labels(digits, tmp_path):
    """helper-37: the normalisation constants were built on the host and moved at every batch,
    and the labels lived on the training device, indexed with the lot's host indices: on a GPU,
    three blocking copies (host syncs) a step. Now the constants are made once per device and
    the labels stay on the host, gathered there and copied without waiting."""
    from pipelines.data import Normalization, open_split
    from pipelines.train.build import ShardInputs

    norm = Normalization(1 / 255, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    first = norm.coefficients(3, "cpu")
    again = norm.coefficients(3, torch.device("cpu"))
    assert all(a is b for a, b in zip(first, again))  # the same tensors: made once
    assert torch.equal(first[0], (1 / 255 / torch.tensor(norm.std, dtype=torch.float64)).float())

    ingest(digits, tmp_path, num_shards=2)
    inputs = ShardInputs(open_split(tmp_path, "train", rank=0, world_size=1), "cpu")
    lot = torch.tensor([5, 0, 700, 5])
    assert inputs.y.device.type == "cpu" and torch.equal(inputs.labels(lot), digits.train.y[lot])
    extra = (torch.zeros(2, 1, 8, 8), torch.tensor([3, 4]))  # input canaries after the shard's rows
    with_canaries = ShardInputs(open_split(tmp_path, "train", rank=0, world_size=1), "cpu", extra)
    n = len(digits.train)
    assert torch.equal(with_canaries.labels(torch.tensor([n + 1, 0, n])), torch.tensor([4, digits.train.y[0], 3]))

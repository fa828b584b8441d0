"""`--resume` continues a run under its own plan, so it must train on the data it was planned on
(helper-31: a dataset ingested again in place was trained on under the old N, q and σ)."""

from __future__ import annotations

import types

import pytest

import dpcore
from pipelines.data import ingest, load_dataset, verify
from pipelines.train.resume import check_same_data


def _plan(data_dir, manifest):
    n = sum(e["rows"] for e in manifest["files"] if e["split"] == "train")
    return types.SimpleNamespace(
        data_dir=str(data_dir), dataset_size=n, input_shape=manifest["input_shape"], num_classes=manifest["num_classes"]
    )


def test_a_resumed_run_refuses_data_that_changed_since_it_was_planned(tmp_path):
    out = tmp_path / "digits"
    digits = load_dataset("digits")
    ingest(digits, out, num_shards=2)
    plan = _plan(out, verify(out))
    check_same_data(plan)  # the same data: accepted
    ingest(digits.with_train_subset(500), out, num_shards=2)  # ingested again in place: it verifies, N differs
    with pytest.raises(
        dpcore.DPConfigError, match=r"changed since the run was planned .*1258, \[1, 8, 8\], 10 then; 500"
    ):
        check_same_data(plan)
    ingest(digits, out, num_shards=2)
    check_same_data(plan)
    shard = next(out.glob("train-*.arrow"))
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(dpcore.DPConfigError, match="does not verify"):
        check_same_data(plan)

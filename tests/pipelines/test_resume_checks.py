"""`--resume` continues a run under its own plan, so it must train on the data it was planned on
(helper-31: a dataset ingested again in place was trained on under the old N, q and σ)."""

from __future__ import annotations

import types

import pytest

import dpcore
from pipelines.data import ingest, load_dataset, manifest_digest, verify
from pipelines.train.build import check_planned_data
from pipelines.train.resume import check_same_data

from ..helpers import small_plan


def _plan(data_dir, manifest):
    n = sum(e["rows"] for e in manifest["files"] if e["split"] == "train")
    return types.SimpleNamespace(
        data_dir=str(data_dir),
        dataset_size=n,
        input_shape=manifest["input_shape"],
        num_classes=manifest["num_classes"],
        train_data_dir=str(data_dir),
        data_digest=manifest_digest(manifest),
        train_data_digest=manifest_digest(manifest),
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


def test_a_dataset_ingested_again_with_another_split_is_refused_by_resume_and_by_the_workers(tmp_path):
    """Same N, shape and classes, another split seed: the examples the run evaluated (and logged)
    as held out would become training examples, and trained ones held out (helper-36)."""
    out = tmp_path / "digits"
    ingest(load_dataset("digits", split_seed=0), out, num_shards=2)
    manifest = verify(out)
    plan = _plan(out, manifest)
    worker_plan = small_plan(
        data_dir=str(out), train_data_dir=str(out), data_digest=plan.data_digest, train_data_digest=plan.data_digest
    )
    check_same_data(plan)
    check_planned_data(worker_plan, str(out))
    ingest(load_dataset("digits", split_seed=1), out, num_shards=2)
    assert verify(out)["num_classes"] == plan.num_classes  # N, shape and classes as planned
    with pytest.raises(dpcore.DPConfigError, match="ingested again since the run was planned: its shards differ"):
        check_same_data(plan)
    with pytest.raises(dpcore.DPConfigError, match="ingested again after this run was planned"):
        check_planned_data(worker_plan, str(out))
    older = small_plan(data_dir=str(out), train_data_dir=str(out))  # a plan from before the digest: not checked
    check_planned_data(older, str(out))


def test_the_digest_covers_every_shard_the_shape_and_the_classes():
    manifest = {
        "files": [
            {"split": "train", "file": "train-0.arrow", "rows": 3, "sha256": "a"},
            {"split": "test", "file": "test-0.arrow", "rows": 1, "sha256": "b"},
        ],
        "input_shape": [1, 8, 8],
        "dtype": "uint8",
        "num_classes": 2,
        "classes": ["ham", "spam"],
    }
    base = manifest_digest(manifest)
    assert manifest_digest({**manifest, "files": manifest["files"][::-1]}) == base  # order of the list: no matter
    changed = [
        {**manifest, "files": [{**manifest["files"][0], "sha256": "c"}, manifest["files"][1]]},
        {**manifest, "files": [{**manifest["files"][0], "split": "val"}, manifest["files"][1]]},
        {**manifest, "input_shape": [1, 8, 9]},
        {**manifest, "dtype": "float32"},
        {**manifest, "classes": ["spam", "ham"]},
    ]
    assert len({manifest_digest(m) for m in changed} | {base}) == len(changed) + 1

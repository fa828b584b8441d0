"""`--resume` continues a run under its own plan, so it must train on the data it was planned on
(helper-31: a dataset ingested again in place was trained on under the old N, q and σ)."""

from __future__ import annotations

import types

import pytest

import dpcore
from pipelines.data import data_digest, ingest, load_dataset, manifest_digest, verify
from pipelines.train.build import check_planned_data
from pipelines.train.resume import check_same_data

from ..helpers import small_plan


def _plan(data_dir, manifest):
    n = sum(e["rows"] for e in manifest["files"] if e["split"] == "train")
    storage = str(data_dir.parent / "runs")
    return types.SimpleNamespace(
        data_dir=str(data_dir),
        dataset_size=n,
        input_shape=manifest["input_shape"],
        num_classes=manifest["num_classes"],
        train_data_dir=str(data_dir),
        storage_path=storage,
        data_digest=data_digest(storage, manifest),
        train_data_digest=data_digest(storage, manifest),
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
        data_dir=str(out),
        train_data_dir=str(out),
        storage_path=plan.storage_path,
        data_digest=plan.data_digest,
        train_data_digest=plan.data_digest,
    )
    check_same_data(plan)
    check_planned_data(worker_plan, str(out))
    ingest(load_dataset("digits", split_seed=1), out, num_shards=2)
    assert verify(out)["num_classes"] == plan.num_classes  # N, shape and classes as planned
    with pytest.raises(dpcore.DPConfigError, match="ingested again since the run was planned: its shards differ"):
        check_same_data(plan)
    with pytest.raises(dpcore.DPConfigError, match="ingested again after this run was planned"):
        check_planned_data(worker_plan, str(out))
    older = small_plan(
        data_dir=str(out), train_data_dir=str(out), storage_path=plan.storage_path
    )  # no digest: unchecked
    check_planned_data(older, str(out))


def test_the_digest_covers_every_shard_the_shape_the_classes_and_the_normalisation(tmp_path):
    """On a real ingest's manifest (helper-38: the first version read the class names from a key
    that ingest does not write)."""
    import copy

    out = tmp_path / "digits"
    ingest(load_dataset("digits"), out, num_shards=2)
    manifest = verify(out)
    manifest.setdefault("source", {})["classes"] = [str(k) for k in range(10)]
    base = manifest_digest(manifest)
    assert base.startswith("v1:") and manifest_digest(copy.deepcopy(manifest)) == base
    reordered = {**manifest, "files": manifest["files"][::-1]}
    assert manifest_digest(reordered) == base  # the list's order does not matter

    def changed(edit):
        m = copy.deepcopy(manifest)
        edit(m)
        return manifest_digest(m)

    edits = [
        lambda m: m["files"][0].update(sha256="0" * 64),
        lambda m: m["files"][0].update(split="val"),
        lambda m: m.update(input_shape=[1, 8, 9]),
        lambda m: m.update(dtype="float32"),
        lambda m: m.update(num_classes=11),
        lambda m: m["source"].update(classes=["1", "0", *map(str, range(2, 10))]),
        lambda m: m["normalization"].update(scale=1.0),
    ]
    digests = [changed(e) for e in edits]
    assert base not in digests and len(set(digests)) == len(edits)


def test_resuming_a_plan_made_before_the_digest_pins_it(tmp_path):
    out = tmp_path / "digits"
    ingest(load_dataset("digits"), out, num_shards=2)
    plan = _plan(out, verify(out))
    plan.data_digest = plan.train_data_digest = None  # as spec.json of an older run
    check_same_data(plan)
    assert plan.data_digest == plan.train_data_digest == data_digest(plan.storage_path, verify(out))


def test_the_plans_digest_is_keyed_not_a_hash_anyone_can_recompute(tmp_path):
    """The plan goes to MLflow (spec.json): a plain hash of the shards would let a reader who
    knows every other record test whether a candidate dataset is the one trained on (the
    reason the cache folders' names are keyed too: pipelines/data/cache_names.py)."""
    import hashlib
    import json

    out = tmp_path / "digits"
    ingest(load_dataset("digits"), out, num_shards=2)
    manifest = verify(out)
    keyed = data_digest(tmp_path / "a", manifest)
    assert keyed == data_digest(tmp_path / "a", manifest)  # stable under one storage folder's key
    assert keyed != data_digest(tmp_path / "b", manifest)  # another key, another digest
    plain = manifest_digest(manifest)
    shas = [e["sha256"] for e in manifest["files"]]
    assert plain[3:] not in keyed and all(sha not in keyed for sha in shas)
    assert hashlib.sha256(json.dumps(shas).encode()).hexdigest() not in keyed


def test_a_resumed_plans_step_bound_is_computed_again_not_trusted(caplog):
    """helper-39: the workers' budget check starts from plan.max_releases, which a resumed plan
    reads from the run's spec.json artifact; raised by 100, a run passed its target ε."""
    from pipelines.config import TrainConfig
    from pipelines.train.resume import recheck_max_releases

    cfg = TrainConfig(target_epsilon=1.0, target_delta=1e-5)
    sigma, q = 2.0, 0.05
    true_max = dpcore.max_steps(sigma, q, 1.0, 1e-5, cfg.accountant, event=dpcore.PrivacyEvent.dpsgd_step(sigma, q))
    plan = small_plan(noise_multiplier=sigma, sample_rate=q, max_releases=true_max + 100)
    with caplog.at_level("WARNING", logger="pipelines.train.resume"):
        recheck_max_releases(plan, cfg)
    assert plan.max_releases == true_max and f"the budget allows {true_max}" in caplog.text
    assert dpcore.epsilon([(plan.step_event(), true_max)], 1e-5, "pld") <= 1.0


def test_resuming_from_a_store_that_is_not_there_names_it_and_makes_none(tmp_path):
    """A resumed run is looked up in its tracking store: a SQLite file that is not there (another
    folder, a mistyped path) is named, and no empty store is left in its place."""
    from pipelines.train.resume import resume_plan

    db = tmp_path / "elsewhere" / "mlflow.db"
    db.parent.mkdir()
    with pytest.raises(dpcore.DPConfigError, match=f"--resume abc: no MLflow store at {db}"):
        resume_plan("abc", f"sqlite:///{db}", {})
    assert not db.exists()


def test_a_resumed_run_logs_to_the_store_it_was_found_in(tmp_path, monkeypatch):
    """The run's spec.json keeps the URI it was started with; a store moved since (and named
    with --tracking-uri) is where the run was found, so the resumed plan logs there (the driver
    opens the plan's store: at the old path it would have made an empty one)."""
    import shutil

    from mlflow import MlflowClient

    from pipelines import tracking
    from pipelines.train import resume

    from ..helpers import small_plan

    monkeypatch.chdir(tmp_path)  # the runs' artifacts: under tmp_path/mlruns, wherever the database goes
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    old, new = tmp_path / "a" / "mlflow.db", tmp_path / "b" / "mlflow.db"
    client = MlflowClient(f"sqlite:///{old}")
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    journal = tmp_path / "journal.jsonl"
    journal.write_text("")
    plan = small_plan(journal=str(journal), tracking_uri=f"sqlite:///{old}", config={})
    tracking.write_json_artifact(client, run_id, "spec.json", plan.to_dict())
    shutil.move(old, new)
    # what this test is not about: the data's and the budget's checks (tested above)
    monkeypatch.setattr(resume, "check_same_data", lambda plan: None)
    monkeypatch.setattr(resume, "recheck_max_releases", lambda plan, cfg: None)
    monkeypatch.setattr(resume, "config_from_dict", lambda d: d)
    got, _ = resume.resume_plan(run_id, f"sqlite:///{new}", {})
    assert got.tracking_uri == f"sqlite:///{new}"

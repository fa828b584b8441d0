"""Issue L, must-shows 2, 3 and 5, over Ray Train: a crash costs no privacy.

A seeded run (research mode) on 2 Ray workers is killed twice, a worker and then the driver,
and resumed. It must end with parameters bit-identical to the same run uninterrupted, and its
ledger must be the uninterrupted run's plus only the releases the replay log never held."""

import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dpcore.ledger.replay import layout_of, read_segment
from pipelines.config import TrainConfig
from pipelines.train import run
from pipelines.train.checkpoint import MODEL_FILE, complete_checkpoints

from .test_main_job import CLI

pytestmark = pytest.mark.slow

SETTINGS = {
    "epochs": 40,  # 98 steps at q≈0.41
    "seed": 11,  # research mode: the sampler's and the noise's streams are seeded
    "noise_multiplier": 2.0,
    "target_epsilon": 14.0,  # ε≈11.1 after 98 releases: room for the releases a crash never logged
    "checkpoint_every": 10,
    "num_workers": 2,
    "max_failures": 2,
    "registered_model": "none",
    "quiet": True,
}

DRIVER = """
import json, sys
from pipelines.config import TrainConfig
from pipelines.faults import FaultInjection
from pipelines.train import run
run(TrainConfig(**json.loads(sys.argv[1])), faults=FaultInjection(at_step=int(sys.argv[2]), rank=0, unlogged=1))
"""


def _final_model(run_dir: str) -> dict:
    (*_, (_, step, path)) = complete_checkpoints(run_dir)
    return torch.load(Path(path) / MODEL_FILE)


def _journal(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(ray_cluster, tmp_path_factory) -> dict:
    """The uninterrupted run, once for both cases below (it is the same seeded run; about a
    minute of the slow suite on a 2-core machine), read and never changed by them."""
    root = tmp_path_factory.mktemp("reference")
    out = run(TrainConfig(**SETTINGS, storage_path=str(root / "ref"), tracking_uri=f"sqlite:///{root}/ref.db"))
    assert out["rolled_back"] == out["replayed"] == 0
    return out


@pytest.mark.parametrize("torn_ray_record", [False, True], ids=["", "torn-ray-record"])
def test_a_worker_and_then_the_driver_killed_end_bit_identical_to_the_uninterrupted_run(
    tmp_path, ray_env, reference, torn_ray_record
):
    """With ``torn_ray_record``, Ray Train's checkpoint-manager snapshot is left empty, as a driver
    killed while Ray rewrites it leaves it (CI hit that once, 2026-11-28: the resume failed before
    any worker started): the resume sets it aside and still lands bit for bit."""
    # The run under test: rank 0 dies after a random step k, with its last release paid for but
    # not in the replay log (k is 2 to 9 steps past a checkpoint); then its driver is killed
    # mid-run, wherever the race puts it.
    k = random.choice([s for s in range(12, 40) if s % 10 >= 2])
    print(f"rank 0 dies after step k={k}")  # shown with a failure, to replay that case
    after_worker = k // 10 * 10
    settings = {**SETTINGS, "storage_path": str(tmp_path / "runs"), "tracking_uri": f"sqlite:///{tmp_path}/runs.db"}
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, json.dumps(settings), str(k)],
        cwd=tmp_path,
        env=ray_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline, journal = time.time() + 400, None
    while time.time() < deadline:
        found = list((tmp_path / "runs").glob("*/ledger.journal.jsonl"))
        if found:
            journal = found[0]
            records = _journal(journal)
            appends = [r["step"] for r in records if r["op"] == "append"]
            # after the worker's restart, and mid-way between two checkpoints (every 10 steps)
            if any(r["op"] == "replayed" for r in records) and len(appends) >= 66 and 3 <= appends[-1] % 10 <= 6:
                break
        assert driver.poll() is None, f"the driver ended before it was killed: {driver.stderr.read()[-3000:]}"
        time.sleep(0.05)
    else:
        pytest.fail("the run did not get past its worker's crash in time")
    driver.send_signal(signal.SIGKILL)  # no cleanup; Ray then stops the job's workers
    driver.wait()
    run_dir = journal.parent
    for _ in range(300):  # until rank 0's process is gone: it held the journal's lock and the log
        from pipelines.train.run_ledger import journal_is_locked

        if not journal_is_locked(str(journal)):
            break
        time.sleep(0.1)
    logged = shutil.copytree(run_dir / "replay", tmp_path / "replay-at-the-kill")
    if torn_ray_record:
        from pipelines.train.checkpoint import RAY_SNAPSHOT

        assert (run_dir / RAY_SNAPSHOT).exists()
        (run_dir / RAY_SNAPSHOT).write_text("")
    at_kill = _journal(journal)

    # The worker's crash: its checkpoint's step c, steps c+1 … k−1 replayed, step k rolled back.
    ops = [r for r in at_kill if r["op"] in ("replayed", "rollback")]
    assert ops[:2] == [
        {"op": "replayed", "after_step": after_worker, "upto_step": k - 1},
        {"op": "rollback", "after_step": k - 1},
    ], f"worker killed after step {k}"

    client_db = f"sqlite:///{tmp_path}/runs.db"
    import mlflow

    client = mlflow.MlflowClient(client_db)
    (mlrun,) = client.search_runs([client.get_experiment_by_name("dp-training").experiment_id])
    res = subprocess.run(
        CLI + ["train", "--resume", mlrun.info.run_id, "--tracking-uri", client_db],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=ray_env,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "replayed" in res.stdout  # the summary says what the restarts replayed
    if torn_ray_record:
        assert (run_dir / f"{RAY_SNAPSHOT}.torn").exists() and "did not parse" in res.stderr

    # Bit-identical parameters.
    mine, theirs = _final_model(str(run_dir)), _final_model(reference["spec"].run_dir)
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name

    # The ledger: the uninterrupted run's releases, each committed once and in order, plus
    # only the releases that never reached the replay log.
    records = _journal(journal)
    entries = [r for r in records if r["op"] == "append"]
    ref_entries = [r for r in _journal(Path(reference["spec"].journal)) if r["op"] == "append"]
    from dpcore import PrivacyLedger

    ledger = PrivacyLedger(14.0, 1e-5, journal=journal)
    committed = [e for e in ledger.entries if e.status == "committed"]
    key = ("step", "kind", "sample_rate", "noise_multiplier", "clip_norm")
    assert [tuple(getattr(e, k) for k in key) for e in committed] == [tuple(r[k] for k in key) for r in ref_entries]
    rolled = [e for e in ledger.entries if e.status == "rolled_back"]
    # The driver's kill: the releases after the last checkpoint that the log did not hold.
    (segment,) = logged.glob("segment-*.bin")
    after = int(segment.stem.split("-")[1])
    params = {k: v for k, v in theirs.items()}
    held = read_segment(segment, Path(run_dir).name, after, layout_of(params)).steps
    killed_after = [r["step"] for r in at_kill if r["op"] == "append"][-1]
    never_logged = [s for s in range(after + 1, killed_after + 1) if s not in held]
    assert [e.step for e in rolled] == [k] + never_logged, f"worker killed after step {k}"
    assert len(never_logged) <= 5  # at most the writer's queue and the release in flight
    assert len(entries) == len(ref_entries) + len(rolled)
    assert sum(e.replayed for e in ledger.entries) > 0
    resumed = [r for r in records if r["op"] == "replayed"][-1]
    assert resumed["after_step"] == after and resumed["upto_step"] == after + len(held) > after
    print(
        f"worker killed after step {k}; driver after step {killed_after}; checkpoint {after}; replayed {len(held)}; "
        f"rolled back {[e.step for e in rolled]}"
    )
    # Every release counted once: ε is the reference's plus only the rolled-back releases.
    assert ledger.epsilon() >= reference["epsilon"]
    if not rolled:
        assert abs(ledger.epsilon() - reference["epsilon"]) < 1e-9
    # The run finished every planned step, and the log is gone with the final checkpoint.
    assert len(committed) == reference["spec"].steps
    assert list((run_dir / "replay").glob("*")) == []

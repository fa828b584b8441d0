"""Issue B, must-shows 2 and 3, over Ray Train: the noise of the aggregated update with 1 and
2 workers, and a worker killed mid-run."""

import hashlib
import json
import math
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

import dpcore
from pipelines.config import TrainConfig
from pipelines.faults import FaultInjection
from pipelines.train import run

from .test_sharded_training import dp_accounting_epsilon

pytestmark = pytest.mark.slow

SIGMA, CLIP, N, Q, STEPS = 1.3, 0.7, 1000, 0.05, 6
D_IN, D_OUT = 64, 200  # 13,000 parameters: 78,000 noise coordinates over the run


@pytest.mark.parametrize("workers", [1, 2])
def test_aggregated_noise_has_std_sigma_C_with_one_or_two_ray_workers(ray_cluster, tmp_path, workers):
    """Gradients are zeroed (the loss is 0·output) so the update is the noise alone. SGD with
    lr=1 makes the parameter change -noise/(qN); its std must be σC, not σC·√2 (noise added
    on every rank) and not σC/√2."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    out_dir = str(tmp_path)

    def loop(config):
        import ray.train
        import torch.nn.functional as F  # noqa: F401

        import dpcore as dc
        from pipelines.train.build import allreduce_sum

        ctx = ray.train.get_context()
        rank, world = ctx.get_world_rank(), ctx.get_world_size()
        torch.manual_seed(0)
        model = torch.nn.Linear(D_IN, D_OUT)
        before = torch.cat([p.detach().clone().reshape(-1) for p in model.parameters()])
        ledger = dc.PrivacyLedger(None, 1e-5)
        shard = dc.shard_indices(N, rank, world)
        private = dc.build_private(
            model,
            torch.optim.SGD(model.parameters(), lr=1.0),
            lambda out, y: (out * 0.0).sum(),
            noise_multiplier=SIGMA,
            sample_rate=Q,
            steps=STEPS,
            dataset_size=N,
            target_epsilon=None,
            target_delta=1e-5,
            clip_norm=CLIP,
            accountant="pld",
            randomness=dc.SeededRandomness(config["seed"], _quiet=True),
            ledger=ledger,
            shard=shard,
            rank=rank,
            reduce_fn=allreduce_sum if world > 1 else None,
        )
        x = torch.randn(N, D_IN)
        y = torch.zeros(N, dtype=torch.long)
        deltas = []
        for lot in private.sampler:
            private.optimizer.accumulate(x[lot], y[lot])
            private.optimizer.step()
            after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            deltas.append((before - after) * (Q * N))  # = the summed noise of this step
            before = after.clone()
        np.save(f"{config['out']}/rank{rank}.npy", torch.stack(deltas).numpy())

    TorchTrainer(
        loop,
        train_loop_config={"out": out_dir, "seed": 11 + workers},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False, resources_per_worker={"CPU": 1}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(name=f"noise-{workers}", storage_path=str(tmp_path / "ray")),
    ).fit()
    noise = np.load(tmp_path / "rank0.npy").astype(np.float64).reshape(-1)
    if workers == 2:  # both ranks applied the very same update
        assert np.array_equal(np.load(tmp_path / "rank1.npy"), np.load(tmp_path / "rank0.npy"))
    n = noise.size
    std = noise.std()
    # The sample std of n Gaussians has standard error ≈ std/√(2n); allow 5 of them.
    tol = 5 * SIGMA * CLIP / math.sqrt(2 * n)
    assert abs(std - SIGMA * CLIP) < tol, (std, SIGMA * CLIP, tol)
    assert abs(noise.mean()) < 5 * SIGMA * CLIP / math.sqrt(n)
    # The alternatives are far outside the tolerance.
    assert SIGMA * CLIP * (math.sqrt(2) - 1) > 10 * tol


def _crash_cfg(tmp_path, **over) -> TrainConfig:
    """The crash tests' run: 2 workers, 12 planned steps at q≈0.41, checkpoints at steps 3, 6, 9
    and 12, one restart allowed (unless ``over`` says otherwise)."""
    settings = {
        "epochs": 5,
        "target_epsilon": 3.0,
        "checkpoint_every": 3,
        "max_failures": 1,
        "storage_path": str(tmp_path / "runs"),
        "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
        "registered_model": "none",
        "quiet": True,
    }
    return TrainConfig(**{**settings, **over})


def test_killed_worker_resumes_from_checkpoint_and_the_ledger_keeps_every_release(ray_cluster, tmp_path):
    cfg = _crash_cfg(
        tmp_path,
        diagnostics=True,  # also checked here: the non-private mode is tagged
        replay_log=False,  # the releases since the checkpoint are rolled back (tests/pipelines/test_replay_after_crash.py: replayed)
    )
    out = run(cfg, faults=FaultInjection(at_step=5, rank=1))  # rank 1 dies hard after step 5; last checkpoint: step 3
    spec = out["spec"]
    assert (Path(spec.run_dir) / "fault-injected").exists()
    ledger = out["ledger"]
    entries = ledger.entries
    committed = [e.step for e in entries if e.status == "committed"]
    rolled = [e.step for e in entries if e.status == "rolled_back"]
    # Every committed step exactly once, in order; the releases after the checkpoint are kept, marked.
    assert committed == list(range(1, len(committed) + 1))
    assert rolled[:2] == [4, 5] and set(rolled) <= {4, 5, 6}
    assert out["rolled_back"] == len(rolled)
    # The rolled-back releases are counted: ε is over every release, and within the budget.
    groups = {}
    for e in entries:
        groups[(e.sample_rate, e.noise_multiplier)] = groups.get((e.sample_rate, e.noise_multiplier), 0) + 1
    assert sum(groups.values()) == len(committed) + len(rolled)
    reference = dp_accounting_epsilon(groups, cfg.target_delta)
    assert out["epsilon"] <= cfg.target_epsilon
    assert math.isclose(out["epsilon"], reference, rel_tol=1e-6)
    # σ was calibrated for 12 releases; the rolled-back ones use up budget, so fewer steps commit.
    assert len(committed) + len(rolled) <= spec.steps + 1
    assert len(committed) < spec.steps
    # One more release would not have fitted.
    assert ledger.allowance(dpcore.PrivacyEvent.dpsgd_step(spec.noise_multiplier, spec.sample_rate)) < 1
    # The journal records the rollback.
    ops = [json.loads(line)["op"] for line in Path(spec.journal).read_text().splitlines()]
    assert ops.count("rollback") == 1
    # Diagnostics mode: training-data statistics are logged, and the run says it is non-private.
    import mlflow

    r = mlflow.MlflowClient(out["tracking_uri"]).get_run(out["run_id"])
    assert r.data.tags["dp.diagnostics"] == "non-private"
    assert 0.0 <= r.data.metrics["diag_train_accuracy"] <= 1.0
    assert 0.0 <= r.data.metrics["diag_clip_fraction"] <= 1.0


def test_a_crash_after_the_last_step_finishes_from_the_checkpoint_at_the_budget(ray_cluster, tmp_path):
    """A fixed σ whose budget allows fewer steps than the epochs ask for: the plan is exactly
    the budget. Rank 1 dies after the last step, before its checkpoint; the releases after the
    last checkpoint are rolled back and use up what is left, so the restarted group can take no
    step at all. It must still finish, from the restored checkpoint, at the budget."""
    sigma, eps = 2.0, 3.0
    _, q, steps = dpcore.plan(
        dataset_size=1258, lot_size=512, epochs=50, target_epsilon=eps, target_delta=1e-5, noise_multiplier=sigma
    )
    assert steps < dpcore.accounting.steps_for_epochs(50, q)  # budget-limited
    cfg = TrainConfig(
        epochs=50,
        noise_multiplier=sigma,
        target_epsilon=eps,
        checkpoint_every=4,
        max_failures=1,
        storage_path=str(tmp_path / "runs"),
        tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
        registered_model="none",
        replay_log=False,  # with the replay log, the releases since the checkpoint would be replayed, not lost
        quiet=True,
    )
    out = run(cfg, faults=FaultInjection(at_step=steps, rank=1))
    assert out["spec"].steps == steps and out["spec"].dataset_size == 1258
    last_ckpt = (steps - 1) // 4 * 4  # the fault comes before the report of step `steps`
    entries = out["ledger"].entries
    assert len(entries) == steps  # every release the budget allowed, and not one more
    assert [e.step for e in entries if e.status == "committed"] == list(range(1, last_ckpt + 1))
    assert [e.step for e in entries if e.status == "rolled_back"] == list(range(last_ckpt + 1, steps + 1))
    assert out["steps"] == last_ckpt and out["epsilon"] <= eps
    # Rank 0 was killed in its last report, which holds a copy of the model in a temporary folder;
    # the restarted rank removed it.
    name = out["spec"].ray_run_name
    assert not [p for p in Path(tempfile.gettempdir()).glob("dp-report-*") if p.name.endswith(f".{name}")]


@pytest.mark.slow
def test_a_worker_dying_in_its_checkpoint_upload_costs_no_replayed_release(ray_cluster, tmp_path):
    """helper-39: rank 0 rotated the replay log (deleting the previous checkpoint's segment) as
    soon as its own part of checkpoint 6 was stored; rank 1 then died uploading its part, the
    latest complete checkpoint was step 3, and its releases 4–6, which the log had held, were
    rolled back. Rank 0 now rotates only after every rank's part is stored."""
    cfg = _crash_cfg(tmp_path)
    out = run(cfg, faults=FaultInjection(at_step=6, rank=1, in_upload=True))
    said = (Path(out["spec"].run_dir) / "fault-injected").read_text()
    assert "died in its upload of step 6; segment there: False" in said
    ops = [json.loads(line) for line in Path(out["spec"].journal).read_text().splitlines()]
    assert not any(o["op"] == "rollback" for o in ops), [o["op"] for o in ops]
    assert out["rolled_back"] == 0 and out["replayed"] == 3 and out["steps"] == out["planned_steps"]


@pytest.mark.slow
def test_rank_0_dying_between_the_all_reduce_and_its_record_leaves_nothing_counted_or_lost(ray_cluster, tmp_path):
    """helper-39's untested window: step 5's noised sum reached both ranks (rank 1 stepped on
    it) but rank 0 died before its ledger recorded it. The group restarts from checkpoint 3 and
    replays step 4 from the log; step 5 is released again, once on record; nothing is rolled
    back, every step is recorded exactly once and ε is that of the planned steps."""
    cfg = _crash_cfg(tmp_path)
    out = run(cfg, faults=FaultInjection(at_step=5, rank=0, before_record=True))
    spec = out["spec"]
    assert "died in step 5 after the all-reduce" in (Path(spec.run_dir) / "fault-injected").read_text()
    ops = [json.loads(line) for line in Path(spec.journal).read_text().splitlines()]
    appended = [o["step"] for o in ops if o["op"] == "append"]
    assert sorted(appended) == list(range(1, spec.steps + 1)), appended  # each step on record once
    assert out["rolled_back"] == 0 and out["replayed"] == 1 and out["steps"] == spec.steps
    groups = {(spec.sample_rate, spec.noise_multiplier): spec.steps}
    assert math.isclose(out["epsilon"], dp_accounting_epsilon(groups, cfg.target_delta), rel_tol=1e-6)


def _entry_groups(entries) -> dict:
    """(q, σ) → how many releases, over every entry (committed and rolled back)."""
    groups = {}
    for e in entries:
        groups[(e.sample_rate, e.noise_multiplier)] = groups.get((e.sample_rate, e.noise_multiplier), 0) + 1
    return groups


@pytest.mark.slow
@pytest.mark.parametrize("then", ["restart", "resume"])
def test_rank_0_killed_half_way_through_a_journal_record_loses_no_recorded_release(ray_cluster, tmp_path, then):
    """helper-40, gap 1: rank 0 dies half-way through writing step 5's journal record, so the
    journal ends in a torn line on disk (half the record, fsynced, no newline). ``restart``: Ray
    Train restarts the group; ``resume``: a run allowed no restart fails, and is resumed. Rank 0
    of the new group must cut the torn line and keep every intact byte before it: steps 1–4 stay
    on record (step 4 is replayed from the log), step 5, whose record never completed, is
    released again and recorded once, on a line of its own; nothing is rolled back and ε is that
    of the planned steps."""
    cfg = _crash_cfg(tmp_path, max_failures=1 if then == "restart" else 0)
    faults = FaultInjection(at_step=5, rank=0, torn_record=True)
    if then == "restart":
        out = run(cfg, faults=faults)
        spec = out["spec"]
        run_dir, journal = Path(spec.run_dir), Path(spec.journal)
    else:
        from ray.train import TrainingFailedError

        with pytest.raises(TrainingFailedError):  # no restart allowed: the run fails
            run(cfg, faults=faults)
        (journal,) = (tmp_path / "runs").glob("*/ledger.journal.jsonl")
        run_dir = journal.parent
    said = (run_dir / "fault-injected").read_text()
    m = re.search(
        r"died writing step 5's journal record: (\d+) of (\d+) bytes on disk after (\d+) intact bytes \(sha256 (\w+)\)",
        said,
    )
    assert m, said
    torn, whole, intact, digest = int(m[1]), int(m[2]), int(m[3]), m[4]
    assert 0 < torn < whole
    if then == "resume":
        # What the killed rank left: the intact records, then half a line.
        raw = journal.read_bytes()
        assert len(raw) == intact + torn and not raw.endswith(b"\n")
        assert [
            e.step for e in dpcore.PrivacyLedger(3.0, cfg.target_delta, journal=journal, read_only=True).entries
        ] == [1, 2, 3, 4]
        import mlflow

        client = mlflow.MlflowClient(cfg.tracking_uri)
        (failed,) = client.search_runs([client.get_experiment_by_name(cfg.experiment).experiment_id])
        out = run(TrainConfig(tracking_uri=cfg.tracking_uri, quiet=True), resume=failed.info.run_id)
        spec = out["spec"]
    raw = journal.read_bytes()
    # Every intact byte is still there, unchanged: no recorded release was lost to the repair.
    assert hashlib.sha256(raw[:intact]).hexdigest() == digest
    assert [json.loads(line)["step"] for line in raw[:intact].splitlines() if b'"append"' in line] == [1, 2, 3, 4]
    # The torn line is gone: every line is whole and parses (the next record did not run into it).
    assert raw.endswith(b"\n")
    ops = [json.loads(line) for line in raw.decode().splitlines()]
    appended = [o["step"] for o in ops if o["op"] == "append"]
    assert appended == list(range(1, spec.steps + 1)), appended  # each step on record once, in order
    assert [o for o in ops if o["op"] == "replayed"] == [{"op": "replayed", "after_step": 3, "upto_step": 4}]
    assert not any(o["op"] == "rollback" for o in ops)
    assert out["rolled_back"] == 0 and out["replayed"] == 1 and out["steps"] == spec.steps
    groups = {(spec.sample_rate, spec.noise_multiplier): spec.steps}
    assert _entry_groups(out["ledger"].entries) == groups
    assert math.isclose(out["epsilon"], dp_accounting_epsilon(groups, cfg.target_delta), rel_tol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("second", [0, 1], ids=["rank0-again", "rank1-again"])
def test_a_second_crash_in_the_replay_after_a_first_counts_every_release_once(ray_cluster, tmp_path, second):
    """helper-40, gap 2: rank 0 dies after step 6 (before its checkpoint) with step 6's release
    paid for but not in the replay log; the restarted group restores checkpoint 3, marks steps 4
    and 5 replayed and step 6 rolled back, and then one of its ranks dies again, mid-replay
    (after applying step 4's update, before step 5's). The third group must restore checkpoint 3
    again, replay steps 4 and 5 again (once more marked replayed, not rolled back: their updates
    are still in the log), keep step 6's first release rolled back and counted, and finish with
    every step committed exactly once and ε that of every release in the ledger."""
    cfg = _crash_cfg(tmp_path, max_failures=2)
    out = run(cfg, faults=FaultInjection(at_step=6, rank=0, unlogged=1, again_in_replay=second))
    spec = out["spec"]
    run_dir = Path(spec.run_dir)
    assert "died after step 6" in (run_dir / "fault-injected").read_text()
    assert f"rank {second} died again in its replay" in (run_dir / "fault-injected-again").read_text()
    ops = [json.loads(line) for line in Path(spec.journal).read_text().splitlines()]
    # Both restarts replayed steps 4–5 from checkpoint 3; step 6 was rolled back once, by the first.
    assert [(o["op"], o["after_step"], o.get("upto_step")) for o in ops if o["op"] in ("replayed", "rollback")] == [
        ("replayed", 3, 5),
        ("rollback", 5, None),
        ("replayed", 3, 5),
    ]
    entries = out["ledger"].entries
    committed = [e.step for e in entries if e.status == "committed"]
    rolled = [e.step for e in entries if e.status == "rolled_back"]
    assert committed == list(range(1, len(committed) + 1))  # every step on record exactly once, in order
    assert rolled == [6]  # nothing that was replayed was rolled back
    assert [e.step for e in entries if e.replayed] == [4, 5]
    assert not any(e.replayed for e in entries if e.status == "rolled_back")
    assert out["rolled_back"] == 1 and out["replayed"] == 2 and out["steps"] == len(committed)
    # ε is that of every release in the ledger, the rolled-back one included, and within the budget:
    # σ was calibrated for 12 releases, so the rolled-back one took the place of the last step.
    groups = _entry_groups(entries)
    assert groups == {(spec.sample_rate, spec.noise_multiplier): len(committed) + 1}
    assert math.isclose(out["epsilon"], dp_accounting_epsilon(groups, cfg.target_delta), rel_tol=1e-6)
    assert out["epsilon"] <= cfg.target_epsilon
    assert len(committed) + len(rolled) <= spec.steps

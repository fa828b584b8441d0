"""Invariant 5 (optimizer state sees only noised gradients), model validation, the GroupNorm
fix, budget refusal at the optimizer, and noise once per lot across real torch.distributed
workers (gloo)."""

import io
import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import dpcore
from dpcore.clipping import clipped_sum
from dpcore.grad_sample import PerSampleGradients

from ..helpers import ce, tiny_mlp


def test_adam_moments_equal_recomputation_from_noised_gradients_alone():
    torch.manual_seed(0)
    model = tiny_mlp()
    q, n, sigma, clip = 0.1, 100, 1.3, 0.7
    adam = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    opt = dpcore.DPOptimizer(
        adam,
        model=model,
        loss_fn=ce,
        noise_multiplier=sigma,
        clip_norm=clip,
        sample_rate=q,
        dataset_size=n,
        randomness=dpcore.SeededRandomness(4).spawn("noise"),
        ledger=dpcore.PrivacyLedger(None, 1e-5),
    )
    replay = dpcore.SeededRandomness(4).spawn("noise")
    m = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
    v = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
    for step in range(4):
        x, y = torch.randn(9 + step, 6), torch.randint(0, 3, (9 + step,))
        # The noised gradient, computed independently of the optimizer, before its step.
        ref_sum, _ = clipped_sum(PerSampleGradients(model, ce)(x, y), clip)
        noised = {
            k: ((ref_sum[k].double() + replay.normal(p.shape, sigma * clip, dtype=torch.float64)) / (q * n)).to(p.dtype)
            for k, p in model.named_parameters()
        }
        opt.accumulate(x, y)
        opt.step()
        for k, p in model.named_parameters():
            m[k] = 0.8 * m[k] + 0.2 * noised[k]
            v[k] = 0.95 * v[k] + 0.05 * noised[k] ** 2
            state = adam.state[p]
            assert torch.allclose(state["exp_avg"], m[k], atol=1e-6, rtol=1e-5)
            assert torch.allclose(state["exp_avg_sq"], v[k], atol=1e-8, rtol=1e-5)


@pytest.mark.parametrize(
    "bn, name",
    [(nn.BatchNorm1d(8), "1"), (nn.SyncBatchNorm(8), "1")],
)
def test_batchnorm_is_rejected_with_layer_name_and_fix(bn, name):
    model = nn.Sequential(nn.Linear(4, 8), bn, nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(dpcore.UnsupportedModuleError) as err:
        dpcore.validate_model(model)
    msg = str(err.value)
    assert f"layer '{name}'" in msg and "GroupNorm" in msg and "convert_batchnorm_to_groupnorm" in msg
    # Rejected in eval mode too (running statistics are non-private), and by the optimizer.
    model.eval()
    with pytest.raises(dpcore.UnsupportedModuleError):
        dpcore.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model=model,
            loss_fn=ce,
            noise_multiplier=1.0,
            clip_norm=1.0,
            sample_rate=0.1,
            dataset_size=10,
            randomness=dpcore.SeededRandomness(0),
            ledger=dpcore.PrivacyLedger(None, 1e-5),
        )


def test_instancenorm_with_running_stats_is_rejected():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.InstanceNorm2d(4, track_running_stats=True))
    with pytest.raises(dpcore.UnsupportedModuleError, match="track_running_stats"):
        dpcore.validate_model(model)


def test_groupnorm_fix_trains():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 2)
    )
    model = dpcore.convert_batchnorm_to_groupnorm(model)
    assert isinstance(model[1], nn.GroupNorm) and model[1].num_channels == 8
    dpcore.validate_model(model)
    # A separable task: class = sign of the mean pixel.
    n = 400
    x = torch.randn(n, 1, 6, 6)
    y = (x.mean(dim=(1, 2, 3)) > 0).long()
    private = dpcore.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
        F.cross_entropy,
        dataset_size=n,
        lot_size=100,
        epochs=15,
        target_epsilon=8.0,
        target_delta=1e-4,
        clip_norm=1.0,
        seed=0,
        epsilon_every=10**6,
    )
    with torch.no_grad():
        before = (model(x).argmax(1) == y).float().mean().item()
    for lot in private.sampler:
        private.optimizer.accumulate(x[lot], y[lot])
        private.optimizer.step()
    with torch.no_grad():
        after = (model(x).argmax(1) == y).float().mean().item()
    assert after > 0.85 and after > before + 0.2
    assert private.ledger.epsilon() <= 8.0


def test_step_over_budget_is_refused_and_changes_nothing():
    torch.manual_seed(0)
    model = tiny_mlp()
    q, sigma, budget = 0.2, 1.0, 4.0
    allowed = dpcore.max_steps(sigma, q, budget, 1e-5)
    assert allowed >= 2
    ledger = dpcore.PrivacyLedger(budget, 1e-5)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = dpcore.DPOptimizer(
        sgd,
        model=model,
        loss_fn=ce,
        noise_multiplier=sigma,
        clip_norm=1.0,
        sample_rate=q,
        dataset_size=50,
        randomness=dpcore.SeededRandomness(0),
        ledger=ledger,
    )
    x, y = torch.randn(10, 6), torch.randint(0, 3, (10,))
    for _ in range(allowed):
        opt.accumulate(x, y)
        opt.step()
    snapshot = [p.detach().clone() for p in model.parameters()]
    momentum = [sgd.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    opt.accumulate(x, y)
    with pytest.raises(dpcore.BudgetExceededError, match="Nothing was released"):
        opt.step()
    assert len(ledger) == allowed
    assert all(torch.equal(a, p) for a, p in zip(snapshot, model.parameters()))
    assert all(torch.equal(m, sgd.state[p]["momentum_buffer"]) for m, p in zip(momentum, model.parameters()))
    assert ledger.epsilon() <= budget


# --------------------------------------------------------------------------------------
# Invariant 2 with real workers: two gloo processes, rank 0 adds the noise, SUM all-reduce.
# --------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = nn.Linear(300, 100)

    def all_reduce(tensors):
        for t in tensors:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)

    q, n = 0.02, 1000
    opt = dpcore.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        model=model,
        loss_fn=ce,
        noise_multiplier=2.0,
        clip_norm=0.5,
        sample_rate=q,
        dataset_size=n,
        randomness=dpcore.SeededRandomness(100).spawn("noise", rank),
        ledger=dpcore.PrivacyLedger(None, 1e-5),
        add_noise=(rank == 0),
        reduce_fn=all_reduce,
    )
    opt.step()  # empty lots everywhere: the update is the aggregated noise alone
    if rank == 0:
        torch.save([p.grad * (q * n) for p in model.parameters()], out_path)
    dist.barrier()  # both ranks done before the group goes (gloo could abort a rank otherwise)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_aggregated_noise_std_is_sigma_C_whatever_the_number_of_workers(world, tmp_path):
    out = tmp_path / "noise.pt"
    mp.start_processes(_worker, args=(world, _free_port(), str(out)), nprocs=world, join=True, start_method="spawn")
    noise = torch.cat([g.flatten() for g in torch.load(out)]).double()
    m, target = noise.numel(), 2.0 * 0.5
    tol = 5 / math.sqrt(2 * (m - 1))  # ≈2.2 % for 30,100 coordinates; √2 off would be 41 %
    assert abs(noise.std().item() / target - 1) < tol


def test_sharded_make_private_noises_on_rank_zero_only_and_samples_its_shard():
    n, world = 103, 2

    def never_called(tensors):  # construction and sampling only: no step is taken here
        raise AssertionError("no step in this test")

    built = []
    for rank in range(world):
        torch.manual_seed(0)
        model = tiny_mlp()
        built.append(
            dpcore.make_private(
                model,
                torch.optim.SGD(model.parameters(), lr=0.1),
                ce,
                dataset_size=n,
                lot_size=20,
                epochs=1,
                target_epsilon=4.0,
                target_delta=1e-5,
                clip_norm=1.0,
                seed=3,
                rank=rank,
                world_size=world,
                reduce_fn=never_called,
            )
        )
    assert [b.optimizer.add_noise for b in built] == [True, False]
    assert [b.optimizer.expected_lot_size for b in built] == [pytest.approx(20.0)] * 2  # q·N of the whole dataset
    lots = [b.sampler.sample() for b in built]
    assert set(lots[0].tolist()) <= set(range(0, 52)) and set(lots[1].tolist()) <= set(range(52, 103))


def test_seeded_run_resumes_reproducibly_from_state_dicts():
    def build():
        torch.manual_seed(0)
        model = tiny_mlp()
        return (
            model,
            dpcore.make_private(
                model,
                torch.optim.Adam(model.parameters(), lr=0.05),
                ce,
                dataset_size=60,
                lot_size=10,
                epochs=2,
                target_epsilon=8.0,
                target_delta=1e-5,
                clip_norm=1.0,
                seed=5,
                epsilon_every=10**6,
                clipping="vmap",  # (with "auto", the resumed run verifies book-keeping on another lot, summed by vmap: last bits differ)
            ),
        )

    x, y = torch.randn(60, 6), torch.randint(0, 3, (60,))
    model_a, a = build()
    for _ in range(4):
        lot = a.sampler.sample()
        a.optimizer.accumulate(x[lot], y[lot])
        a.optimizer.step()
    buf = io.BytesIO()  # serialised as a real checkpoint is (state_dicts hold live tensors)
    torch.save(
        {
            "model": model_a.state_dict(),
            "opt": a.optimizer.state_dict(),
            "sampler": a.sampler.state_dict(),
            "ledger": a.ledger.state_dict(),
        },
        buf,
    )
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    for _ in range(3):
        lot = a.sampler.sample()
        a.optimizer.accumulate(x[lot], y[lot])
        a.optimizer.step()
    model_b, b = build()
    model_b.load_state_dict(ckpt["model"])
    b.optimizer.load_state_dict(ckpt["opt"])
    b.sampler.load_state_dict(ckpt["sampler"])
    b.ledger.load_state_dict(ckpt["ledger"])
    for _ in range(3):
        lot = b.sampler.sample()
        b.optimizer.accumulate(x[lot], y[lot])
        b.optimizer.step()
    for pa_, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa_, pb)
    assert len(b.ledger) == len(a.ledger) == 7


def test_a_worker_without_noise_must_reduce_with_the_noised_rank():
    torch.manual_seed(0)
    model = tiny_mlp()
    with pytest.raises(dpcore.DPConfigError, match="add_noise=False without a reduce_fn"):
        dpcore.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model=model,
            loss_fn=ce,
            noise_multiplier=1.0,
            clip_norm=1.0,
            sample_rate=0.1,
            dataset_size=10,
            randomness=dpcore.SeededRandomness(0),
            ledger=dpcore.PrivacyLedger(None, 1e-5),
            add_noise=False,
        )
    with pytest.raises(dpcore.DPConfigError, match="world_size=2 needs reduce_fn"):
        dpcore.make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            ce,
            dataset_size=100,
            lot_size=10,
            epochs=1,
            target_epsilon=4.0,
            target_delta=1e-5,
            clip_norm=1.0,
            seed=3,
            rank=1,
            world_size=2,
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_parameters_are_rejected(dtype):
    model = tiny_mlp().to(dtype)
    with pytest.raises(dpcore.UnsupportedModuleError, match="float32"):
        dpcore.validate_model(model)


def test_crash_after_checkpoint_keeps_every_release_in_the_journal(tmp_path):
    """Releases made after the last checkpoint survive a crash through the ledger's journal,
    are marked rolled back on resume, and are counted in ε."""
    journal = tmp_path / "ledger.jsonl"
    x, y = torch.randn(60, 6), torch.randint(0, 3, (60,))

    def build():
        torch.manual_seed(0)
        model = tiny_mlp()
        return model, dpcore.make_private(
            model,
            torch.optim.Adam(model.parameters(), lr=0.05),
            ce,
            dataset_size=60,
            lot_size=10,
            epochs=2,
            target_epsilon=8.0,
            target_delta=1e-5,
            clip_norm=1.0,
            epsilon_every=10**6,
            journal=str(journal),
        )

    def steps(p, k):
        for _ in range(k):
            lot = p.sampler.sample()
            p.optimizer.accumulate(x[lot], y[lot])
            p.optimizer.step()

    model_a, a = build()
    steps(a, 4)
    buf = io.BytesIO()
    torch.save(
        {
            "model": model_a.state_dict(),
            "opt": a.optimizer.state_dict(),
            "sampler": a.sampler.state_dict(),
            "ledger": a.ledger.state_dict(),
        },
        buf,
    )
    steps(a, 3)  # released, then the process "crashes" before the next checkpoint
    del model_a, a
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)

    model_b, b = build()  # secure mode: the re-run draws fresh noise
    assert len(b.ledger) == 7  # every release, from the journal
    with pytest.raises(dpcore.DPConfigError, match="would forget releases"):
        b.ledger.load_state_dict(ckpt["ledger"])
    model_b.load_state_dict(ckpt["model"])
    b.optimizer.load_state_dict(ckpt["opt"])
    b.sampler.load_state_dict(ckpt["sampler"])
    assert b.ledger.mark_rolled_back(after_step=ckpt["opt"]["steps_taken"]) == 3
    steps(b, 3)
    assert len(b.ledger) == 10
    assert sorted(b.ledger.committed_steps()) == list(range(1, 8))
    assert sum(e.status == "rolled_back" for e in b.ledger.entries) == 3
    ev = b.optimizer.event
    assert b.ledger.epsilon() == pytest.approx(dpcore.epsilon([(ev, 10)], 1e-5), rel=1e-12)
    # A third process sees the same history, rollback marks included.
    _, c = build()
    assert [(e.step, e.status) for e in c.ledger.entries] == [(e.step, e.status) for e in b.ledger.entries]


def test_journal_of_another_budget_is_refused(tmp_path):
    j = tmp_path / "l.jsonl"
    dpcore.PrivacyLedger(2.0, 1e-5, journal=j).append(dpcore.PrivacyEvent.dpsgd_step(1.0, 0.1), step=1, clip_norm=1.0)
    with pytest.raises(dpcore.DPConfigError, match="different budget"):
        dpcore.PrivacyLedger(3.0, 1e-5, journal=j)


def _two_release_journal(tmp_path):
    """A journal of two releases: (its path, the step event, its bytes)."""
    path = tmp_path / "ledger.journal.jsonl"
    ev = dpcore.PrivacyEvent.dpsgd_step(1.0, 0.01)
    ledger = dpcore.PrivacyLedger(5.0, 1e-5, journal=path)
    ledger.append(ev, step=1, clip_norm=1.0)
    ledger.append(ev, step=2, clip_norm=1.0)
    return path, ev, path.read_bytes()


@pytest.mark.parametrize("tail", [b'{"op": "append", "index": 2, "st', b""])
def test_a_torn_or_unterminated_last_journal_line_is_repaired_and_the_journal_stays_usable(tmp_path, tail):
    path, ev, raw = _two_release_journal(tmp_path)
    # A crash mid-write: either half a record, or a whole record without its newline.
    path.write_bytes(raw + tail if tail else raw[:-1])
    reopened = dpcore.PrivacyLedger(5.0, 1e-5, journal=path)
    assert len(reopened) == 2
    reopened.mark_rolled_back(1)
    reopened.append(ev, step=2, clip_norm=1.0)
    again = dpcore.PrivacyLedger(5.0, 1e-5, journal=path)  # the next record did not merge into the torn line
    assert [(e.step, e.status) for e in again.entries] == [(1, "committed"), (2, "rolled_back"), (2, "committed")]
    assert path.read_bytes().endswith(b"\n")


def test_a_whole_last_journal_line_that_does_not_parse_is_refused_not_dropped(tmp_path):
    """helper-29: a torn write lacks its newline (each record is written with it); a last line
    that has its newline but does not parse is damage, and dropping it could drop a release."""
    path, _, raw = _two_release_journal(tmp_path)
    damaged = raw[:-10] + b"\x00" * 9 + b"\n"  # the last record's end zeroed, its newline kept
    path.write_bytes(damaged)
    with pytest.raises(dpcore.DPConfigError, match="is corrupt at line 3"):
        dpcore.PrivacyLedger(5.0, 1e-5, journal=path)
    assert path.read_bytes() == damaged  # nothing cut


def test_a_read_only_ledger_leaves_a_line_being_written_and_records_nothing(tmp_path):
    """The driver reads the journal that rank 0 may still be writing: it must not cut a last
    line that is not yet complete (rank 0's write would then end in a corrupt line), and it
    records nothing. The writer's next read repairs as before."""
    path = tmp_path / "ledger.journal.jsonl"
    ev = dpcore.PrivacyEvent.dpsgd_step(1.0, 0.01)
    writer = dpcore.PrivacyLedger(5.0, 1e-5, journal=path)
    writer.append(ev, step=1, clip_norm=1.0)
    partial = path.read_bytes() + b'{"op": "append", "index": 1, "st'
    path.write_bytes(partial)  # the next record, half written
    reader = dpcore.PrivacyLedger(5.0, 1e-5, journal=path, read_only=True)
    assert len(reader) == 1 and path.read_bytes() == partial
    with pytest.raises(dpcore.DPConfigError, match="records nothing"):
        reader.append(ev, step=2, clip_norm=1.0)
    with pytest.raises(dpcore.DPConfigError, match="records nothing"):
        reader.mark_rolled_back(0)
    assert path.read_bytes() == partial and len(reader) == 1 and reader.entries[0].status == "committed"
    with pytest.raises(dpcore.DPConfigError, match="needs an existing journal"):
        dpcore.PrivacyLedger(5.0, 1e-5, journal=tmp_path / "none.jsonl", read_only=True)
    assert len(dpcore.PrivacyLedger(5.0, 1e-5, journal=path)) == 1 and path.read_bytes().endswith(b"\n")

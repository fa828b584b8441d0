"""What one DPOptimizer step does and which models it takes (dpcore/optimizer.py, dpcore/validation.py):
invariant 5, the optimizer's state (Adam's moments) sees only noised gradients; a step over budget is
refused and changes nothing; noise is added once per lot across real torch.distributed workers (gloo;
rank 0 noises, the others must reduce with it); and BatchNorm, InstanceNorm with running statistics
and half-precision parameters are rejected, with the GroupNorm fix shown to train."""

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


def test_a_rank_that_adds_no_noise_releases_its_clipped_sum_exactly():
    """Invariant 2 inside the step (helper-6: a step that noised whatever ``add_noise`` said went
    unseen by every fast dpcore test): a rank ≥ 1 hands the all-reduce its clipped sum exactly, and
    its update is that sum ÷ q·N; rank 0's differs from it by the noise."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g)
    steps = {}
    for rank in (0, 1):
        torch.manual_seed(0)
        model = tiny_mlp()
        private = dpcore.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), ce, dataset_size=120, lot_size=12, epochs=1,
            target_epsilon=4.0, target_delta=1e-5, clip_norm=1.0, seed=3, rank=rank, world_size=2,
            reduce_fn=lambda tensors: None,  # the all-reduce of a lone rank: leaves the sums as they are
        )  # fmt: skip
        opt = private.optimizer
        opt.accumulate(x, y)
        clean = {n: t.clone() for n, t in opt.lot.sums.items()}
        opt.step()
        steps[rank] = [(p.grad.double() * opt.expected_lot_size, clean[n]) for n, p in opt.params.items()]
    for released, clean in steps[1]:
        torch.testing.assert_close(released, clean, rtol=1e-6, atol=1e-7)  # ÷ qN, then × qN, in float32
    assert all((released - clean).abs().max() > 0.1 for released, clean in steps[0])  # σ·C = O(1) of noise


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_parameters_are_rejected(dtype):
    model = tiny_mlp().to(dtype)
    with pytest.raises(dpcore.UnsupportedModuleError, match="float32"):
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

"""How each Ray worker builds its private step (`pipelines.train.build.private_arguments`), rank
by rank: noise on rank 0 alone, the update ÷ q·N of the whole training split on every rank, an
all-reduce between ranks, and each rank's own sampling and noise streams. The mutation review
of 2026-11-29 (helper-32) found that no fast test ran this wiring: a worker passing rank 0 on
every rank, or its own shard's size as N, went unseen."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

import dpcore
from pipelines.config import TrainConfig
from pipelines.train.build import allreduce_sum, private_arguments

PLAN = types.SimpleNamespace(noise_multiplier=1.3, sample_rate=0.5, steps=20, dataset_size=1000)


def _private(rank: int, world: int, seed=None, shard_size: int = 500):
    cfg = TrainConfig(target_epsilon=3.0, seed=seed)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    ledger = dpcore.PrivacyLedger(3.0 if rank == 0 else None, cfg.target_delta, cfg.accountant)
    args = private_arguments(cfg, PLAN, rank, world, shard_size, ledger)
    return dpcore.build_private(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, **args)


def test_only_rank_zero_adds_noise_and_every_rank_divides_by_the_whole_splits_q_n():
    ranks = [_private(r, 2) for r in (0, 1)]
    assert [p.optimizer.add_noise for p in ranks] == [True, False]
    for p in ranks:
        assert p.optimizer.expected_lot_size == PLAN.sample_rate * PLAN.dataset_size  # not q·(its shard)
        assert p.optimizer.reduce_fn is allreduce_sum
        assert (
            p.sampler.sample_rate == PLAN.sample_rate == p.optimizer.event.sample_rate
        )  # sampled at what is accounted
        assert len(p.sampler.indices) == 500  # its own shard
    assert ranks[0].ledger.target_epsilon == 3.0 and ranks[1].ledger.target_epsilon is None
    alone = _private(0, 1, shard_size=1000)
    assert alone.optimizer.add_noise and alone.optimizer.reduce_fn is None


def test_each_rank_samples_and_noises_from_its_own_stream():
    with torch.no_grad():
        r0, r1 = (_private(r, 2, seed=3) for r in (0, 1))
        lots = [(r0.sampler.sample(), r1.sampler.sample()) for _ in range(10)]
    assert any(not torch.equal(a, b) for a, b in lots)  # one shared stream would draw the same positions
    n0, n1 = (p.optimizer.randomness.normal((8,), 1.0, dtype=torch.float64) for p in (r0, r1))
    assert not torch.equal(n0, n1)
    assert isinstance(_private(1, 2).optimizer.randomness, dpcore.SecureRandomness)  # no seed: secure on every rank


def test_without_a_seed_every_rank_samples_its_lots_from_os_keyed_bits(monkeypatch):
    """Invariant 9 for sampling, not only for noise (helper-6: a sampler given a fixed seed per rank
    in secure mode went unseen): each rank's lot is drawn from the secure keystream, and its
    positions are exactly those of the 53-bit uniforms that the keystream gives below q."""
    from dpcore import randomness as rnd

    real, drawn = rnd._secure_bytes, []

    def kept(n: int) -> bytearray:
        out = real(n)
        drawn.append(bytes(out))  # a copy: the draw turns the buffer into uniforms in place
        return out

    for rank in (0, 1):
        p = _private(rank, 2)
        assert isinstance(p.sampler.randomness, dpcore.SecureRandomness)
        drawn.clear()
        monkeypatch.setattr(rnd, "_secure_bytes", kept)
        lot = p.sampler.sample()
        monkeypatch.undo()
        assert len(drawn) == 1 and len(drawn[0]) == 8 * len(p.sampler.indices)
        u = rnd._uniform53_(torch.frombuffer(bytearray(drawn[0]), dtype=torch.int64))
        assert torch.equal(lot, p.sampler.indices[dpcore.sampling.included(u, PLAN.sample_rate)])

"""Poisson lots, sharded.

Each example joins a lot independently with probability q. Rank r of W holds its own shard
(a disjoint part of the dataset) and samples only that shard with its own independent
randomness stream; because every example is included independently at rate q no matter
which rank holds it, the union of the ranks' lots is a Poisson sample of the whole dataset
at rate q — the sample the accountant is told about.

A lot may be empty; the training step still happens (noise only). Lots are never padded,
truncated or resampled: any of those would change the sampling distribution.
"""

from __future__ import annotations

import math

import torch

from .randomness import Randomness
from .validation import check_positive_int, check_sample_rate


def shard_indices(dataset_size: int, rank: int, world_size: int) -> torch.Tensor:
    """Contiguous shard of rank ``rank``: sizes differ by at most one; shards are disjoint and
    cover ``range(dataset_size)``."""
    dataset_size = check_positive_int(dataset_size, "dataset_size")
    world_size = check_positive_int(world_size, "world_size")
    if not (0 <= rank < world_size):
        raise ValueError(f"rank={rank} must lie in [0, world_size={world_size}).")
    base, extra = divmod(dataset_size, world_size)
    start = rank * base + min(rank, extra)
    stop = start + base + (1 if rank < extra else 0)
    return torch.arange(start, stop, dtype=torch.long)


def included(u: torch.Tensor, rate: float) -> torch.Tensor:
    """Which of the 53-bit uniforms ``u`` (multiples of 2⁻⁵³ in [0, 1)) fall below ``rate``: each
    is True with probability ⌊rate·2⁵³⌋·2⁻⁵³, the rate rounded down to the uniforms' grid, never
    above it. (``u < rate`` is True with probability ⌈rate·2⁵³⌉·2⁻⁵³, up to 2⁻⁵³ above the rate
    the accountant is told.)"""
    return u < math.floor(rate * 2.0**53) * 2.0**-53


class PoissonSampler:
    """Yields one lot (a LongTensor of indices) per step.

    Args:
        indices: the indices this rank may sample (its shard), or an int N for ``range(N)``.
        sample_rate: q.
        randomness: the stream to draw from (secure or seeded); use a different stream per rank.
        steps: how many lots to yield per iteration (the run's number of steps).
    """

    def __init__(self, indices, sample_rate: float, randomness: Randomness, steps: int):
        if isinstance(indices, int):
            indices = torch.arange(check_positive_int(indices, "dataset_size"), dtype=torch.long)
        self.indices = torch.as_tensor(indices, dtype=torch.long)
        self.sample_rate = check_sample_rate(sample_rate)
        self.randomness = randomness
        self.steps = check_positive_int(steps, "steps")
        self.step = 0  # lots drawn so far

    def sample(self) -> torch.Tensor:
        """Draw the next lot."""
        u = self.randomness.uniform(len(self.indices))
        self.step += 1
        return self.indices[included(u, self.sample_rate)]

    def __iter__(self):
        while self.step < self.steps:
            yield self.sample()

    def __len__(self) -> int:
        return self.steps - self.step

    def state_dict(self) -> dict:
        return {"step": self.step, "randomness": self.randomness.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.randomness.load_state_dict(state["randomness"])

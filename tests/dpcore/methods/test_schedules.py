"""Ascent schedules (``dpcore/methods/schedules.py``): the warm-up and cosine schedules of λ give
the stated values, and a BAM run evaluates its schedule at every step, its warm-up step 0 (λ = 0)
giving DP-SGD's first update bit for bit."""

from __future__ import annotations

import warnings

import pytest
import torch

import dpcore

from ._common import _train

warnings.simplefilter("ignore", dpcore.SeededRandomnessWarning)


def test_bam_lambda_schedule_is_followed_step_by_step():
    sched = dpcore.ascent_schedule(0.1, "warmup", total_steps=10, warmup_fraction=0.5)
    assert [round(sched(t), 6) for t in (0, 1, 5, 9)] == [0.0, 0.02, 0.1, 0.1]
    cos = dpcore.ascent_schedule(0.1, "cosine", total_steps=10)
    assert cos(0) == pytest.approx(0.1) and cos(5) == pytest.approx(0.05) and cos(10) == pytest.approx(0.0)
    seen = []

    class Recording:
        def __call__(self, step):
            seen.append(step)
            return sched(step)

    # Step 0 of a warm-up schedule has λ=0: the first update is DP-SGD's bit for bit, later ones differ.
    ref, _ = _train({}, steps=1)
    bam, _ = _train({"method": "bam", "ascent": Recording()}, steps=1)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), bam.parameters()))
    _train({"method": "bam", "ascent": Recording()}, steps=4)
    assert sorted(set(seen)) == [0, 1, 2, 3]

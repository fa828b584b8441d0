"""Augmentation multiplicity's draws are secret (helper-31's review, 2026-11-29).

The crops and flips are drawn in lot order, so whether an example is in a lot decides which
draws the lot's other examples, and later lots, receive. With the draws public (they came from
a generator seeded with the public ``init_seed``), adding one example moved a lot's clipped sum
by 5.98·C and the next lot's by 5.75·C; the analysis allows C and 0. The draws now come from the
run's own randomness: secure (OS entropy) by default, the run's ``--seed`` stream otherwise.
"""

from __future__ import annotations

import types

import pytest
import torch
from scipy import stats

import dpcore
from pipelines.augment import CropFlipMultiplicity
from pipelines.config import TrainConfig
from pipelines.train.build import method_options


def _augment(**over):
    cfg = TrainConfig(**{"model": "small_cnn", "augmentation_multiplicity": 4, "augment_padding": 2, **over})
    return method_options(cfg, types.SimpleNamespace(steps=10), rank=0)["augment"]


def test_two_secure_runs_with_the_same_public_settings_draw_different_augmentations():
    x = torch.arange(64.0).reshape(1, 1, 8, 8).expand(32, 1, 8, 8)
    a, b = _augment(init_seed=7), _augment(init_seed=7)  # everything public is the same
    assert isinstance(a.randomness, dpcore.SecureRandomness)
    assert not torch.equal(a(x), b(x))  # a public seed made these equal, draw for draw


def test_a_seeded_run_draws_from_its_own_augment_stream_and_is_reproducible():
    with pytest.warns(dpcore.SeededRandomnessWarning):
        a, b = _augment(seed=3), _augment(seed=3)
    x = torch.randn(16, 3, 8, 8)
    assert torch.equal(a(x), b(x))
    noise = dpcore.SeededRandomness(3, _quiet=True).spawn("noise", 0)
    assert not torch.equal(a.randomness.uniform(8), noise.uniform(8))  # not the noise stream's draws
    c = CropFlipMultiplicity(4, 2, randomness=dpcore.SeededRandomness(3, _quiet=True).spawn("augment", 1))
    assert not torch.equal(_augment(seed=3)(x), c(x))  # each rank its own stream


def test_crops_and_flips_are_uniform_and_the_state_round_trips():
    aug = CropFlipMultiplicity(8, padding=1, randomness=dpcore.SeededRandomness(0, _quiet=True))
    x = torch.zeros(500, 1, 3, 3)
    x[:, :, 1, 1] = 1.0  # the centre pixel: where it lands tells the offset
    state = aug.state_dict()
    out = aug(x).reshape(-1, 3, 3)
    where = out.reshape(len(out), -1).argmax(1)
    counts = torch.bincount(where, minlength=9).numpy()  # 3 × 3 offsets (flips mirror them): uniform
    assert stats.chisquare(counts).pvalue > 1e-3, counts
    aug.load_state_dict(state)
    assert torch.equal(aug(x).reshape(-1, 3, 3), out)
    with pytest.raises(dpcore.DPConfigError, match="public generator"):
        aug.load_state_dict({"generator": torch.Generator().get_state()})  # an old checkpoint's


def test_the_flips_are_secret_too_and_follow_the_runs_seed_not_init_seed():
    """helper-32: crops drawn secretly beside flips drawn from a public generator passed the
    tests above (the crops alone made the outputs differ). Without padding only flips vary."""
    x = torch.arange(8.0).reshape(1, 1, 1, 8).expand(64, 1, 1, 8)  # left ≠ right

    def flips(aug):
        return (aug(x)[:, :, 0, 0, 0] == 7.0).flatten()  # which copies were flipped

    a, b = (_augment(init_seed=7, augment_padding=0) for _ in range(2))
    assert not torch.equal(flips(a), flips(b))
    with pytest.warns(dpcore.SeededRandomnessWarning):
        s3, s3b, s4 = (_augment(init_seed=7, augment_padding=0, seed=s) for s in (3, 3, 4))
    assert torch.equal(flips(s3), flips(s3b)) and not torch.equal(flips(s3), flips(s4))

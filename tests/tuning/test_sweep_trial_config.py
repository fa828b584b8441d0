"""What each trial of a sweep is given: a seeded sweep gives every trial a seed of its own, the
same one again when the sweep is resumed; and a trial's config evaluates the test split at its
last report only, whatever the base config asks."""

from __future__ import annotations

from tuning.config import SweepConfig

from ._common import _base


def test_a_seeded_sweep_gives_each_trial_a_seed_of_its_own():
    from tuning.trials import trial_seed

    seeds = [trial_seed(5, n) for n in range(50)]
    assert len(set(seeds)) == 50 and all(isinstance(s, int) and s >= 0 for s in seeds)
    assert seeds == [trial_seed(5, n) for n in range(50)]  # a resumed sweep gives trial n the same seed
    assert trial_seed(6, 0) != trial_seed(5, 0) and trial_seed(None, 3) is None


def test_a_trial_evaluates_the_test_split_at_its_end_only(tmp_path):
    """A trial's reports feed the pruner and the progress line: none of them carries a test
    accuracy; the test split is evaluated at the trial's last report alone (helper-26)."""
    from types import SimpleNamespace

    from tuning.sweep import _trial_args

    base = _base(tmp_path, test_every_report=True)
    sweep = SweepConfig(study="s", storage=f"sqlite:///{tmp_path}/optuna.db", quiet=True)
    cfg = _trial_args(sweep, base, SimpleNamespace(number=3, _trial_id=7), {"lr": 0.02}, "parent")[0]
    assert cfg["test_every_report"] is False and cfg["lr"] == 0.02 and cfg["run_name"] == "s-trial-3"

"""The worker-side half of ``--pruner median``: report to one Optuna trial, and say when to stop.

The sweep hands a :class:`TrialPruner` to :func:`pipelines.train.run` as its ``pruner``: a
callable ``(validation_accuracy, step) -> stop?`` that rank 0 calls at every checkpoint of the
trial's training run. Training knows nothing of Optuna; Ray ships this object to the worker by
reference to this module, which imports Optuna only when first called.
"""

from __future__ import annotations

import warnings


class TrialPruner:
    def __init__(self, storage: str, study: str, trial_id: int, median_pruner: dict | None = None):
        self.storage, self.study, self.trial_id = storage, study, int(trial_id)
        self.median_pruner = dict(median_pruner or {})  # the sweep's pruner (Optuna does not keep it in the storage)
        self._trial = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_trial": None}  # the trial holds a storage connection: reopen it where it lands

    def __repr__(self) -> str:
        return f"TrialPruner(study={self.study!r}, trial_id={self.trial_id})"

    def __call__(self, value: float, step: int) -> bool:
        """Report ``value`` at ``step`` to the trial; True if the pruner says the trial should stop."""
        import optuna

        if self._trial is None:
            study = optuna.load_study(
                study_name=self.study,
                storage=optuna.storages.RDBStorage(self.storage),
                pruner=optuna.pruners.MedianPruner(**self.median_pruner),
            )
            self._trial = optuna.trial.Trial(study, self.trial_id)
        try:
            self._trial.report(float(value), int(step))
        except optuna.exceptions.UpdateFinishedTrialError:
            # The study has already ended this trial: failed as stale (its heartbeat missed the
            # grace period) and queued for a retry, which runs instead. Stop here, rather than
            # raise and have Ray Train restart the run only to fail at its next report.
            warnings.warn(
                f"{self!r} was already finished in the study (failed as stale; its retry runs instead): "
                "stopping this run.",
                stacklevel=2,
            )
            return True
        return bool(self._trial.should_prune())

"""tuning: hyperparameter sweeps under a fixed (ε, δ), with Optuna on Ray and MLflow.

See :mod:`tuning.sweep` (the driver and the ``dp-platform sweep`` command),
:mod:`tuning.space` (the search space) and :mod:`tuning.selection` (the privacy cost of
choosing the best trial).
"""

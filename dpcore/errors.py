"""Errors and warnings raised by dpcore.

Every error raised at a boundary names the offending value and says how to fix it.
All configuration errors subclass both :class:`DPConfigError` and ``ValueError`` so that
callers can catch either.
"""

from __future__ import annotations


class DPError(Exception):
    """Base class of every dpcore error."""


class DPConfigError(DPError, ValueError):
    """A privacy or training parameter is invalid. Raised before any budget is spent."""


class UnsupportedModuleError(DPError, ValueError):
    """The model contains a layer that mixes examples or that per-sample gradients cannot treat."""


class BudgetExceededError(DPError, RuntimeError):
    """A release would take the run's ε past its target. Nothing was released."""


class DeltaTooLargeWarning(UserWarning):
    """δ ≥ 1/N: a mechanism that publishes one random example outright would meet it."""


class SeededRandomnessWarning(UserWarning):
    """Noise or sampling is drawn from a seeded (predictable) generator: tests and research only."""

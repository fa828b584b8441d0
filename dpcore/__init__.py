"""dpcore: the differential-privacy math of the platform, on torch tensors.

Imports only torch, numpy and dp_accounting. See DESIGN.md for the data flow of one step
and the privacy invariants that this package keeps.

Names are loaded on first use (PEP 562): ``import dpcore`` costs nothing, so that command-line
help and config checks that need only ``dpcore.DPConfigError`` do not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# name → the submodule that defines it
_EXPORTS = {
    "ACCOUNTANTS": "accountants",
    "epsilon": "accountants",
    "calibrate_noise_multiplier": "accountants.calibration",
    "dpsgd_epsilon": "accountants.calibration",
    "max_steps": "accountants.calibration",
    "steps_for_epochs": "accountants.calibration",
    "moments_epsilon": "accountants.moments",
    "clipped_sum": "clipping",
    "per_sample_norms": "clipping",
    "ParameterEMA": "ema",
    "PrivateTraining": "engine",
    "build_private": "engine",
    "make_private": "engine",
    "plan": "engine",
    "BudgetExceededError": "errors",
    "DeltaTooLargeWarning": "errors",
    "DPConfigError": "errors",
    "DPError": "errors",
    "SeededRandomnessWarning": "errors",
    "UnsupportedModuleError": "errors",
    "PrivacyEvent": "events",
    "PerSampleGradients": "grad_sample",
    "LedgerEntry": "ledger",
    "PrivacyLedger": "ledger",
    "METHODS": "methods",
    "ascent_schedule": "methods",
    "check_method_options": "methods",
    "DPOptimizer": "optimizer",
    "PCAProjection": "pca",
    "dp_pca": "pca",
    "Randomness": "randomness",
    "SecureRandomness": "randomness",
    "SeededRandomness": "randomness",
    "make_randomness": "randomness",
    "PoissonSampler": "sampling",
    "shard_indices": "sampling",
    "convert_batchnorm_to_groupnorm": "validation",
    "sample_rate_from_lot_size": "validation",
    "validate_model": "validation",
}
_SUBMODULES = ("accountants", "accounting", "audit", "events", "federated")


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    else:
        try:  # a submodule: dpcore.validation, dpcore.optimizer, ...
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))


if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from . import accountants, accounting, audit, events, federated
    from .accountants import ACCOUNTANTS, epsilon
    from .accountants.calibration import calibrate_noise_multiplier, dpsgd_epsilon, max_steps, steps_for_epochs
    from .accountants.moments import moments_epsilon
    from .clipping import clipped_sum, per_sample_norms
    from .ema import ParameterEMA
    from .engine import PrivateTraining, build_private, make_private, plan
    from .errors import (
        BudgetExceededError,
        DeltaTooLargeWarning,
        DPConfigError,
        DPError,
        SeededRandomnessWarning,
        UnsupportedModuleError,
    )
    from .events import PrivacyEvent
    from .grad_sample import PerSampleGradients
    from .ledger import LedgerEntry, PrivacyLedger
    from .methods import METHODS, ascent_schedule, check_method_options
    from .optimizer import DPOptimizer
    from .pca import PCAProjection, dp_pca
    from .randomness import Randomness, SecureRandomness, SeededRandomness, make_randomness
    from .sampling import PoissonSampler, shard_indices
    from .validation import convert_batchnorm_to_groupnorm, sample_rate_from_lot_size, validate_model

__all__ = [
    "accountants",
    "accounting",
    "audit",
    "events",
    "federated",
    "ACCOUNTANTS",
    "BudgetExceededError",
    "DPConfigError",
    "DPError",
    "DPOptimizer",
    "DeltaTooLargeWarning",
    "LedgerEntry",
    "METHODS",
    "PCAProjection",
    "ParameterEMA",
    "PerSampleGradients",
    "PoissonSampler",
    "PrivacyEvent",
    "PrivacyLedger",
    "PrivateTraining",
    "Randomness",
    "SecureRandomness",
    "SeededRandomness",
    "SeededRandomnessWarning",
    "UnsupportedModuleError",
    "ascent_schedule",
    "build_private",
    "check_method_options",
    "calibrate_noise_multiplier",
    "clipped_sum",
    "convert_batchnorm_to_groupnorm",
    "dp_pca",
    "dpsgd_epsilon",
    "epsilon",
    "make_private",
    "make_randomness",
    "max_steps",
    "moments_epsilon",
    "per_sample_norms",
    "plan",
    "sample_rate_from_lot_size",
    "shard_indices",
    "steps_for_epochs",
    "validate_model",
]

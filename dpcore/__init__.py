"""dpcore: the differential-privacy math of the platform, on torch tensors.

Imports only torch, numpy and dp_accounting. See DESIGN.md for the data flow of one step
and the privacy invariants that this package keeps.
"""

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
